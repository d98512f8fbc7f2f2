"""Per-GPU training memory, predicted without a GPU: pure functions, no rendering (tools/memory_table.py draws it).

The estimate is the largest point of one steady-state training step's timeline (timeline.py): the traced
forward and backward of the real model under fake tensors (trace.py), each parameter's gradient placed where the
engine keeps it and the model states (engines.py: exact byte counts of the real model built on the meta device,
partitioned as the engine partitions them), the optimizer step traced on the tensors it updates (step.py), a
sharded face head beside the model (head.py), and on a GPU a fixed allowance for the CUDA context and libraries.
`model_state_bytes` keeps the ZeRO paper's closed forms (docs/memory_ckpt.md §2.1), which the tests hold against
DeepSpeed's own estimator.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from vtrain.memory.engines import engine_model
from vtrain.memory.head import shard_rows
from vtrain.memory.setup import Setup
from vtrain.memory.timeline import CUDA_CONTEXT_BYTES, PARTS, Point, Timeline, build
from vtrain.memory.trace import StepTrace, build_model, trace
from vtrain.memory.tracker import rounded
from vtrain.models.recompute_units import outer_blocks

GiB = 2**30
__all__ = ["CUDA_CONTEXT_BYTES", "Estimate", "GiB", "ModelFacts", "estimate", "max_batch_that_fits", "model_facts"]


@dataclass
class Estimate:
    """Per-GPU bytes at the step's peak, by part (they sum to `total`), the point it is, the traced activation
    peak alone, and the whole timeline."""

    setup: dict[str, Any]
    params_total: int
    params_trainable: int
    parameters: int  # bytes per GPU live at the peak
    gradients: int
    optimizer: int
    activations: int
    temporary: int
    overhead: int
    cpu_offloaded: int
    activation_peak: int = 0  # the traced activation peak (gradients left out), wherever it falls
    peak_at: str = ""
    points: list[Point] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations + self.temporary + self.overhead

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["total"] = self.total
        d["points"] = [{"where": p.where, "phase": p.phase, **p.parts, "total": p.total} for p in self.points]
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


@dataclass
class ModelFacts:
    trainable: int
    frozen: int
    largest_layer: int  # most parameters held directly by one module (DeepSpeed's "largest layer")
    largest_block: int  # most parameters in one FSDP2 unit (engine/engines/fsdp_units.py shards the outermost blocks)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # every parameter, by qualified name
    trainable_names: list[str] = field(default_factory=list)
    groups: list[list[str]] = field(default_factory=list)  # the optimizer's parameter groups (trainable names)
    block_of: dict[str, int] = field(default_factory=dict)  # FSDP2 unit of each parameter (-1: the root's)
    blocks: list[tuple[str, bool]] = field(default_factory=list)  # FSDP2 units: qualified name, holds BatchNorm
    buffer_bytes: int = 0  # every buffer of the model, as the target's allocator holds it
    head_step: int = 0  # the sharded head's own update: the most bytes it allocates at once (engine/step_costs.py)


Grouping = Callable[[nn.Module], list[list[nn.Parameter]]]


def model_facts(setup: Setup, grouping: Grouping | None = None) -> ModelFacts:
    """Parameter counts and shapes of the real model on the meta device (one build; checkpointing and engines do
    not change them). `grouping`: the optimizer's parameter groups of a model (a training run's: engine/optim.py
    `param_groups`); without it, one group of every trainable parameter (what torch's foreach AdamW on a GPU
    updates at once is then the whole model: an upper bound)."""
    with torch.device("meta"):
        model = build_model(setup)
    named = list(model.named_parameters())
    params = [p for _, p in named]
    units = outer_blocks(model) or [model]
    module_name = {id(m): n for n, m in model.named_modules()}
    name_of = {id(p): n for n, p in named}
    block_of = {name_of[id(p)]: i for i, u in enumerate(units) for p in u.parameters() if id(p) in name_of}
    trainable = [n for n, p in named if p.requires_grad]
    groups = ([[name_of[id(p)] for p in grp if p.requires_grad] for grp in grouping(model)] if grouping is not None
              else [trainable])
    return ModelFacts(trainable=sum(p.numel() for p in params if p.requires_grad),
                      frozen=sum(p.numel() for p in params if not p.requires_grad),
                      largest_layer=max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()),
                      largest_block=max(sum(p.numel() for p in u.parameters()) for u in units),
                      shapes={n: tuple(p.shape) for n, p in named}, trainable_names=trainable,
                      groups=[g for g in groups if g], block_of={n: block_of.get(n, -1) for n, _ in named},
                      blocks=[(module_name[id(u)], any(isinstance(m, nn.modules.batchnorm._BatchNorm)
                                                       for m in u.modules())) for u in units],
                      buffer_bytes=sum(rounded(b.numel() * b.element_size(), setup.granularity)
                                       for b in model.buffers()))


def estimate(setup: Setup, step: StepTrace | None = None, facts: ModelFacts | None = None) -> Estimate:
    """The per-GPU estimate: the largest point of the step's timeline. The trace and the model's facts are made
    when not given (a trace is engine-independent: one serves every engine of the same model and batch)."""
    facts = facts or model_facts(setup)
    step = step if step is not None else trace(setup)
    em = engine_model(setup, facts)
    tl = build(step, setup, em)
    return _estimate(setup, facts, tl, em.cpu)


def _estimate(setup: Setup, facts: ModelFacts, tl: Timeline, cpu: int) -> Estimate:
    peak = tl.peak
    notes = []
    if setup.sharded_head:
        notes.append(f"sharded head: {setup.num_classes:,} identities over {setup.gpus} GPU(s), {shard_rows(setup):,} "
                     f"rows here; logits of the global batch of {setup.gpus * setup.batch_size} x "
                     f"{'all' if setup.sample_rate >= 1 else f'{setup.sample_rate:g} of the'} rows traced")
    if setup.task == "dino":
        notes.append("deformable attention traced as " + (
            "the fused Triton op (saves value, locations and weights)" if setup.resolved_msda_impl() == "triton"
            else "the PyTorch grid_sample path (keeps every sampled value)"))
    return Estimate(setup=asdict(setup), params_total=facts.trainable + facts.frozen,
                    params_trainable=facts.trainable, cpu_offloaded=cpu, activation_peak=tl.activation_peak,
                    peak_at=peak.where, points=tl.points, notes=notes + tl.notes,
                    **{k: peak.parts[k] for k in PARTS})


def max_batch_that_fits(est: Estimate, budget_bytes: int) -> int:
    """Largest micro-batch within a budget: at every point of the timeline the activations live there scale
    linearly with the batch (from the traced batch), the rest is taken as fixed. 0 when even one sample does not
    fit."""
    b0 = est.setup["batch_size"]
    best = None
    for p in est.points or []:
        act, rest = p.parts.get("activations", 0), p.total - p.parts.get("activations", 0)
        if rest > budget_bytes:
            return 0
        if act > 0:
            fit = int((budget_bytes - rest) // (act / b0))
            best = fit if best is None else min(best, fit)
    return max(best if best is not None else b0, 0)
