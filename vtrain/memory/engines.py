"""Where each engine keeps parameters, gradients and optimizer states during a step, as numbers for the
timeline (timeline.py). The bare § numbers are sections of docs/memory_ckpt.md; "measured" means on 2 CPU
processes with gloo, by the allocator's own count (benchmarks/step_memory.py), with the versions of
docs/memory_estimate.md.

- One process and DDP: fp32 parameters; autograd's gradients live from the moment backward makes each one until
  `zero_grad(set_to_none=True)` after the step; AdamW's states (step.py). DDP over N > 1 processes adds its
  reducer's flat buckets, one fp32 element per trainable parameter for the whole run (torch's default
  `gradient_as_bucket_view=False`: each gradient is copied into its bucket for the all-reduce and back).
- DeepSpeed ZeRO-1/2 (stage_1_and_2.py): the trainable parameters flattened into one buffer per group (the
  module's parameters become views of it), an fp32 copy of this rank's partition (1/N, the master weights) and
  AdamW's states on it. In backward each gradient is copied into a reduction buffer of `reduce_bucket_size`
  elements (two with `overlap_comm`, allocated at the first gradient and freed at the end of backward) and the
  autograd gradient dropped; ZeRO-2 then keeps this rank's reduced part (1/N) until the step, ZeRO-1 the whole
  gradient. In the step each group's gradient partition is flattened once more and the updated partitions are
  all-gathered back into the flat buffer.
- DeepSpeed ZeRO-3 (stage3.py): parameters partitioned (1/N) and gathered module by module; gradients reduced
  through one flat buffer of `reduce_bucket_size` elements into this rank's fp32 partition.
- FSDP2 (`fully_shard` per block, engine/engines/fsdp_units.py): each rank holds dim-0 shards of the fp32 parameters; a block's
  parameters are all-gathered (in bf16 under bf16 autocast, fp32 with BatchNorm or fp32) for its forward and
  again for its backward; its unsharded gradients are reduce-scattered in fp32 when its backward ends, leaving
  this rank's fp32 shard until the step.
- Offload (DeepSpeed): the optimizer's states and master weights (and with `all` the parameters) on the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vtrain.memory.head import head_state_bytes
from vtrain.memory.setup import Setup
from vtrain.memory.step import StepCost, optimizer_step
from vtrain.memory.tracker import rounded

KEEP, BUCKET, BLOCK = "keep", "bucket", "block"


@dataclass
class Block:
    """An FSDP2 unit (the root: `prefix` "" and every parameter outside the blocks): what its all-gather makes
    (the compute dtype: bf16 under bf16 autocast unless the block holds BatchNorm; the root fp32), how its
    unsharded gradients compare in size with the traced fp32 ones, and its reduce-scatter's fp32 input and
    output (this rank's shard)."""

    prefix: str
    gathered: int
    grad_scale: float
    reduce: int
    shard: int


@dataclass
class EngineModel:
    """One engine's resident bytes and gradient rules on the device (per GPU), for the timeline."""

    name: str
    parameters: int  # model parameters and buffers (+ a sharded head's weight and row mask)
    optimizer: int  # optimizer states (steady state: made by the first step)
    buffers: int  # the engine's own resident buffers: DDP's buckets, DeepSpeed's flat fp32 master partition
    cpu: int  # what offloading keeps on the host instead
    step: StepCost  # the update's states and temporaries, traced on the tensors this engine steps
    step_extra: int  # the engine's own temporaries in the step (DeepSpeed's flat gradient partition + all-gather)
    grads_at_step: int  # gradient bytes on the device when the step runs
    grad_rule: str  # KEEP: autograd's gradients stay until the step; BUCKET: copied into buckets and dropped;
    # BLOCK: reduce-scattered when their block's backward ends (FSDP2)
    bucket: int = 0  # BUCKET: the reduction buffers, from the first gradient to the end of backward
    partition: int = 0  # BUCKET / BLOCK: the reduced gradient partition, from the first reduction to the step
    bucket_elems: int = 0  # BUCKET: the reduction bucket's elements (the first reduction when they are filled)
    gather: int = 0  # parameters gathered at once during forward and backward (ZeRO-3): a transient
    resident_grads: int = 0  # gradient buffers that exist for the whole run (ZeRO-3's flat partition)
    gather_spike: tuple[int, int] = (0, 0)  # ZeRO-3: the all-gather buffers in flight as forward / backward begin
    blocks: list[Block] = field(default_factory=list)  # BLOCK: the FSDP2 units, the root first
    notes: list[str] = field(default_factory=list)
    # a sharded head stepped after the model's update and its zero_grad (engines/torch_engine.py): its gradient and its own
    # temporaries, with the model's gradients already freed
    head_after: tuple[int, int] = (0, 0)


def _local_rows(shape: tuple[int, ...], n: int) -> tuple[int, ...]:
    """FSDP2's shard of a parameter on rank 0: dim 0 split in N chunks of ceil(dim0 / N) rows (padded)."""
    if not shape:
        return shape
    return (-(-shape[0] // n), *shape[1:])


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def engine_model(setup: Setup, facts) -> EngineModel:
    """The engine of `setup` (DDP, ZeRO-1/2/3 or FSDP2 over `setup.gpus`, or one process) for `facts`
    (sizing.ModelFacts: every parameter's shape, the optimizer's groups, the FSDP2 blocks)."""
    g, n = setup.granularity, max(setup.gpus, 1)
    head = head_state_bytes(setup)  # outside every engine: never partitioned or offloaded (head.py)
    trainable = [facts.shapes[name] for name in facts.trainable_names]
    t_numel = sum(_numel(s) for s in trainable)
    all_params = sum(rounded(4 * _numel(s), g) for s in facts.shapes.values())
    foreach, host_steps = setup.on_gpu, setup.on_gpu
    whole_groups = [[facts.shapes[name] for name in grp] for grp in facts.groups]
    if setup.fsdp:
        groups = [[_local_rows(s, n) for s in grp] for grp in whole_groups]
        step = optimizer_step(groups, foreach=foreach, granularity=g, host_steps=host_steps)
        local = sum(rounded(4 * _numel(_local_rows(s, n)), g) for s in facts.shapes.values())
        grads = sum(rounded(4 * _numel(_local_rows(s, n)), g) for s in trainable)
        return EngineModel("FSDP2", local + facts.buffer_bytes + head["parameters"], step.states + head["optimizer"],
                           0, 0, step, 0, grads + head["gradients"], BLOCK, partition=grads,
                           blocks=_fsdp_blocks(setup, facts), head_after=(head["gradients"], facts.head_step))
    if setup.zero:
        return _deepspeed(setup, facts, whole_groups, t_numel, all_params, head)
    step = optimizer_step(whole_groups, foreach=foreach, granularity=g, host_steps=host_steps)
    grads = sum(rounded(4 * _numel(s), g) for s in trainable)
    bucket = 4 * t_numel if n > 1 else 0
    notes = [f"DDP buckets: {bucket / 2**30:.2f} GiB (one fp32 copy of the gradients for the all-reduce)"] if bucket else []
    return EngineModel("DDP" if n > 1 else "one process", all_params + facts.buffer_bytes + head["parameters"],
                       step.states + head["optimizer"], bucket, 0, step, 0, grads + head["gradients"],
                       KEEP, notes=notes, head_after=(head["gradients"], facts.head_step))


def _fsdp_blocks(setup: Setup, facts) -> list[Block]:
    g, n = setup.granularity, max(setup.gpus, 1)
    trainable = set(facts.trainable_names)
    out = []
    for b, (prefix, batchnorm) in [(-1, ("", True))] + list(enumerate(facts.blocks)):
        names = [name for name, blk in facts.block_of.items() if blk == b]
        low = 4 if batchnorm or setup.precision == "no" else 2  # engine/engines/fsdp_units.py's MixedPrecisionPolicy
        padded = [(n * _numel(_local_rows(facts.shapes[name], n)), name in trainable) for name in names]
        out.append(Block(prefix, sum(rounded(low * p, g) for p, _ in padded), low / 4,
                         rounded(4 * sum(p for p, t in padded if t), g),
                         sum(rounded(4 * p // n, g) for p, t in padded if t)))
    return out


def _zero3(setup: Setup, facts, whole_groups, head: dict) -> EngineModel:
    """ZeRO-3 (stage3.py, partition_parameters.py): every parameter padded to N and partitioned; parameters below
    the persistence threshold stay gathered whole; a flat fp32 buffer of this rank's gradient partitions and one
    reduction bucket, both allocated when the engine is built; the fp32 master partitions and AdamW's states on
    them. In forward and backward each module's parameters are gathered while it runs, with up to
    `stage3_prefetch_bucket_size` elements fetched ahead."""
    g, n = setup.granularity, max(setup.gpus, 1)
    pbytes = 2 if setup.ds_16bit else 4
    part = {name: -(-_numel(s) // n) for name, s in facts.shapes.items()}
    persistent = {name: _numel(s) for name, s in facts.shapes.items() if _numel(s) < setup.ds_persistence}
    params = sum(rounded(pbytes * p, g) for p in part.values()) + sum(rounded(pbytes * p, g)
                                                                     for p in persistent.values())
    trainable = facts.trainable_names
    flat = sum(part[name] for name in trainable)
    groups = [[(sum(part[name] for name in grp),)] for grp in facts.groups]
    step = optimizer_step(groups, foreach=setup.on_gpu, granularity=g, host_steps=setup.on_gpu)
    master, grad_flat = rounded(4 * flat, g), rounded(4 * flat, g)
    bucket = rounded(int(setup.ds_buckets[0]) * 4, g)
    gathered = sum(_numel(s) for name, s in facts.shapes.items() if name not in persistent)
    # When forward begins, DeepSpeed gathers the first module and prefetches ahead: two flat all-gather outputs of
    # up to `stage3_prefetch_bucket_size` elements in flight (one when backward begins), each staged once more by
    # gloo on a CPU (measured: `gloo:all_gather` allocates its own output), before their parameters are copied
    # out; while modules run, the one running is gathered.
    staged = 1 if setup.on_gpu else 2
    spike = (pbytes * min(gathered, 2 * int(setup.ds_prefetch)) * staged,
             pbytes * min(gathered, int(setup.ds_prefetch)) * staged)
    gather = pbytes * facts.largest_layer
    cpu, optimizer = 0, step.states
    if setup.offload in ("optimizer", "all"):
        cpu += optimizer + master + grad_flat
        optimizer = master = grad_flat = 0
    if setup.offload == "all":
        cpu += params
        params = sum(rounded(pbytes * p, g) for p in persistent.values())
    notes = [f"ZeRO-3: reduce bucket {setup.ds_buckets[0]:.0e}, prefetch {setup.ds_prefetch:.0e} elements, "
             f"{len(persistent)} parameters below {setup.ds_persistence:.0e} elements stay gathered"]
    return EngineModel("ZeRO-3", params + facts.buffer_bytes + head["parameters"], optimizer + head["optimizer"],
                       master + bucket, cpu, step, 4 * max((grp[0][0] for grp in groups), default=0) + facts.head_step,
                       grad_flat + head["gradients"], BUCKET, gather=gather, gather_spike=spike,
                       resident_grads=grad_flat, notes=notes)


def _deepspeed(setup: Setup, facts, whole_groups, t_numel: int, all_params: int, head: dict) -> EngineModel:
    g, n = setup.granularity, max(setup.gpus, 1)
    stage = setup.zero
    if stage == 3:
        return _zero3(setup, facts, whole_groups, head)
    pbytes = 2 if setup.ds_16bit else 4
    part_groups = [[(-(-sum(_numel(s) for s in grp) // n),)] for grp in whole_groups]  # one flat partition each
    part = sum(p[0][0] for p in part_groups)
    step = optimizer_step(part_groups, foreach=setup.on_gpu, granularity=g, host_steps=setup.on_gpu)
    frozen = sum(_numel(s) for name, s in facts.shapes.items() if name not in set(facts.trainable_names))
    params = pbytes * (t_numel + frozen) if stage < 3 else pbytes * (-(-(t_numel + frozen) // n))
    master = 4 * part  # DeepSpeed's fp32 copy of this rank's partition
    grad_elem = 4 if not setup.ds_16bit else 2
    reduce_bucket, allgather_bucket = setup.ds_buckets
    bucket = int(reduce_bucket) * grad_elem * (2 if setup.overlap_comm and stage < 3 else 1)
    partition = 4 * part
    largest_group = max((p[0][0] for p in part_groups), default=0)
    # the step flattens each group's gradient partition once more while it updates it (measured: the all-gather
    # of the updated partitions comes after that copy is freed, and needs less)
    step_extra = 4 * largest_group + facts.head_step
    cpu = 0
    optimizer = step.states
    if setup.offload in ("optimizer", "all"):
        cpu += optimizer + master + partition
        optimizer = master = 0
    if setup.offload == "all" and stage == 3:
        cpu += params
        params = 0
    grads_at_step = (partition if stage >= 2 else 4 * t_numel) if setup.offload == "none" else 0
    gather = 4 * facts.largest_layer if stage == 3 else 0
    notes = [f"DeepSpeed buckets: reduce {reduce_bucket:.0e}, allgather {allgather_bucket:.0e} elements, "
             f"overlap_comm {setup.overlap_comm}"]
    return EngineModel(f"ZeRO-{stage}", params + facts.buffer_bytes + head["parameters"], optimizer + head["optimizer"],
                       master, cpu, step, step_extra, grads_at_step + head["gradients"], BUCKET, bucket=bucket,
                       bucket_elems=int(reduce_bucket),
                       partition=partition if setup.offload == "none" else 0, gather=gather, notes=notes)
