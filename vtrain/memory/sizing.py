"""Per-GPU training memory, predicted without a GPU: pure functions, no rendering (tools/memory_table.py draws it).

Three parts (the bare § numbers below are sections of docs/memory_ckpt.md):
- Model states: exact byte counts from the real model built on the meta device, partitioned as in the ZeRO paper
  (§2.1): mixed-precision Adam is 16 bytes/param unsharded: 2 (16-bit params) + 2 (16-bit grads) + 12 (fp32
  master, momentum, variance). vtrain's own engines keep fp32 parameters and gradients (4 + 4 + 8 = 16 bytes too).
  Stage 1 divides the optimizer states by the number of GPUs, stage 2 the gradients too, stage 3 the parameters
  too; FSDP2 is stage 3. Offload moves optimizer states (and with `all`, parameters) to CPU.
- Activations: one traced forward + backward of the real model under fake tensors (trace.py).
- A sharded face head (`--head-parallel sharded`): its rows, gradient and AdamW state per rank (head.py), never
  partitioned or offloaded.
- Buffers that no tracer sees: DeepSpeed's communication buckets (§2.2: with overlap_comm 4.5 x (reduce +
  allgather) bucket elements x 2 bytes) and the CUDA context / library workspaces (a fixed allowance).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from vtrain.memory.head import head_state_bytes, shard_rows
from vtrain.memory.setup import Setup
from vtrain.memory.trace import build_model, trace_step
from vtrain.models.recompute_units import outer_blocks

GiB = 2**30
CUDA_CONTEXT_BYTES = int(0.5 * GiB)  # CUDA context + cuBLAS/cuDNN workspaces + NCCL: an allowance, not traced


@dataclass
class Estimate:
    setup: dict[str, Any]
    params_total: int
    params_trainable: int
    parameters: int  # bytes per GPU
    gradients: int
    optimizer: int
    activations: int
    temporary: int
    overhead: int
    cpu_offloaded: int
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations + self.temporary + self.overhead

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["total"] = self.total
        return d


# ---- model states --------------------------------------------------------------------------------------------
def model_state_bytes(trainable: int, frozen: int, zero: int, fsdp: bool, offload: str, gpus: int,
                      ds_16bit: bool = False) -> dict[str, int]:
    """Per-GPU bytes of parameters, gradients and optimizer states, and what is offloaded to CPU.

    vtrain's engines keep fp32 parameters and gradients and run the forward under autocast (DDP, FSDP2 and
    DeepSpeed's torch_autocast mode): 4 + 4 bytes plus 8 bytes of Adam moments. An explicit DeepSpeed bf16/fp16
    JSON (`ds_16bit`) keeps 16-bit parameters with a 12-byte fp32 master + moments partition and, as DeepSpeed's
    own estimator counts it, 16-bit plus fp32 gradient partitions (2 + 18/N bytes at stage 1/2, 18/N at stage 3).
    Partitioning over N GPUs: stage 1 the optimizer states, stage 2 also the gradients, stage 3 (and FSDP2) also
    the parameters. Offloading the optimizer moves its states and the gradient partitions to CPU; `all` also the
    parameters (stage 3)."""
    n = max(gpus, 1)
    stage = 3 if fsdp else zero
    if ds_16bit and stage:
        params = 2 * (trainable + frozen)
        grads = 6 * trainable if stage < 3 else 4 * trainable
        opt = 12 * trainable
        grads //= n  # DeepSpeed's estimate divides all gradient bytes at stages 1-3
    else:
        params = 4 * (trainable + frozen)
        grads = 4 * trainable
        opt = 8 * trainable
        if stage >= 2:
            grads //= n
    if stage >= 1:
        opt //= n
    if stage >= 3:
        params //= n
    cpu = 0
    if offload in ("optimizer", "all") and stage >= 1:
        cpu += opt + grads
        opt = grads = 0
    if offload == "all" and stage >= 3:
        cpu += params
        params = 0
    return {"parameters": params, "gradients": grads, "optimizer": opt, "cpu": cpu}


def deepspeed_reference(total_params: int, largest_layer: int, zero: int, offload: str, gpus: int) -> int:
    """DeepSpeed's own model-state estimate (GPU bytes) for the same counts; for the tests and the docs."""
    if zero == 3:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

        return estimate_zero3_model_states_mem_needs(total_params, largest_layer, gpus, 1,
                                                     cpu_offload=offload != "none",
                                                     cpu_offload_params=offload == "all")[1]
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    return estimate_zero2_model_states_mem_needs(total_params, gpus, 1, cpu_offload=offload != "none")[1]


def comm_buffer_bytes(zero: int, buckets: tuple[float, float], overlap_comm: bool, precision: str) -> int:
    """DeepSpeed's flat communication buffers (docs/memory_ckpt.md §2.2): with overlap_comm about 4.5 x the reduce +
    allgather bucket sizes (HF's DeepSpeed docs: 5e8 -> 9 GB in 16-bit), else one of each."""
    if zero == 0:
        return 0
    elem = 2 if precision != "no" else 4
    reduce, allgather = buckets
    factor = 4.5 if overlap_comm else 1.0
    return int(factor * (reduce + allgather) * elem)


@dataclass
class ModelFacts:
    trainable: int
    frozen: int
    largest_layer: int  # most parameters held directly by one module (DeepSpeed's "largest layer")
    largest_block: int  # most parameters in one FSDP2 unit (engine/engines/fsdp_units.py shards the outermost blocks)


def model_facts(setup: Setup) -> ModelFacts:
    """Parameter counts of the real model on the meta device (one build; checkpointing and engines do not
    change them)."""
    with torch.device("meta"):
        model = build_model(setup)
    params = list(model.parameters())
    units = outer_blocks(model) or [model]
    return ModelFacts(trainable=sum(p.numel() for p in params if p.requires_grad),
                      frozen=sum(p.numel() for p in params if not p.requires_grad),
                      largest_layer=max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()),
                      largest_block=max(sum(p.numel() for p in u.parameters()) for u in units))


def untraced_temporary(setup: Setup, facts: ModelFacts) -> int:
    """Temporaries no trace sees: FSDP2 gathers one block's full parameters at a time (two with prefetch) in the
    compute dtype; DeepSpeed's communication buckets, and under ZeRO-3 the gathered largest layer, as DeepSpeed's
    estimator counts it."""
    extra = 0
    if setup.fsdp:
        extra += 2 * facts.largest_block * (2 if setup.precision != "no" else 4)
    if setup.zero:
        extra += comm_buffer_bytes(setup.zero, setup.ds_buckets, setup.overlap_comm, setup.precision)
        if setup.zero == 3:
            extra += 4 * facts.largest_layer
    return extra


def estimate(setup: Setup, trace: dict[str, int] | None = None, facts: ModelFacts | None = None) -> Estimate:
    """Assemble the per-GPU estimate; the trace and the parameter counts are computed when not given."""
    facts = facts or model_facts(setup)
    trace = trace if trace is not None else trace_step(setup)
    states = model_state_bytes(facts.trainable, facts.frozen, setup.zero, setup.fsdp, setup.offload, setup.gpus,
                               setup.ds_16bit)
    head = head_state_bytes(setup)  # outside the engine: never partitioned or offloaded (head.py)
    for k in ("parameters", "gradients", "optimizer"):
        states[k] += head[k]
    notes = []
    if setup.sharded_head:
        notes.append(f"sharded head: {setup.num_classes:,} identities over {setup.gpus} GPU(s), {shard_rows(setup):,} "
                     f"rows here ({(head['parameters'] + head['gradients'] + head['optimizer']) / GiB:.2f} GiB of "
                     f"weight, gradient and AdamW state); logits of the global batch of {setup.gpus * setup.batch_size}"
                     f" x {'all' if setup.sample_rate >= 1 else f'{setup.sample_rate:g} of the'} rows traced")
    if setup.task == "dino":
        notes.append("deformable attention traced as " + (
            "the fused Triton op (saves value, locations and weights)" if setup.resolved_msda_impl() == "triton"
            else "the PyTorch grid_sample path (keeps every sampled value)"))
    if setup.zero:
        notes.append(f"DeepSpeed buckets: reduce {setup.ds_buckets[0]:.0e}, allgather {setup.ds_buckets[1]:.0e} "
                     f"elements, overlap_comm {setup.overlap_comm}")
    return Estimate(setup=asdict(setup), params_total=facts.trainable + facts.frozen,
                    params_trainable=facts.trainable, parameters=states["parameters"],
                    gradients=states["gradients"], optimizer=states["optimizer"], activations=trace["Activation"],
                    temporary=untraced_temporary(setup, facts), overhead=CUDA_CONTEXT_BYTES,
                    cpu_offloaded=states["cpu"], notes=notes)


def max_batch_that_fits(est: Estimate, budget_bytes: int) -> int:
    """Largest micro-batch within a budget: activations scale linearly with the batch (from the traced batch),
    model states, temporaries and overhead are taken as fixed. 0 when even one sample does not fit."""
    per_sample = est.activations / est.setup["batch_size"]
    room = budget_bytes - (est.total - est.activations)
    if per_sample <= 0 or room < per_sample:
        return 0
    return int(room // per_sample)
