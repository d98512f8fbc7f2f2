"""The memory of one training step on one GPU as a timeline: forward, backward, the optimizer step and, with
gradient accumulation, the later micro-batches of a window. The total is the largest point of it
(docs/memory_estimate.md, "The step's timeline").

What is live at each point:
- resident for the whole step: parameters (and buffers), the optimizer's states (the estimate is for the
  steady state: AdamW makes them in the first step, so from the second step on they exist before the forward),
  the engine's own buffers (engines.py), the batch, and on a GPU the CUDA context allowance;
- the traced step (trace.py): every storage the forward and backward make and free, in order, with each
  parameter's gradient counted from the moment backward makes it, then kept, copied into buckets or
  reduce-scattered as the engine does (engines.py);
- the optimizer step: every gradient the engine keeps for it, plus the clip's and the update's temporaries
  (step.py) and the engine's own (DeepSpeed's flattened partition and all-gather);
- later micro-batches of an accumulation window: the window's gradients are live from the start, and each new
  gradient is added into them (autograd's new tensor lives only until it is added).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vtrain.memory.engines import BLOCK, BUCKET, KEEP, EngineModel
from vtrain.memory.setup import Setup
from vtrain.memory.trace import StepTrace

GiB = 2**30
CUDA_CONTEXT_BYTES = int(0.5 * GiB)  # CUDA context + cuBLAS/cuDNN workspaces + NCCL: an allowance, not traced
PARTS = ("parameters", "gradients", "optimizer", "activations", "temporary", "overhead")
# keys of the engine's own storages in the device events (all negative: never a traced storage's)
ENGINE, GATHER, REDUCE = -2, -3, -4  # reduction buckets and partitions; gathered parameters; a reduce-scatter
_ENGINE_WHAT = {ENGINE: "gradient buckets", GATHER: "parameters being all-gathered", REDUCE: "a reduce-scatter"}


@dataclass
class Point:
    """One point of the step: where it is, and the bytes live there by part (they sum to `total`)."""

    where: str
    phase: str  # forward | backward | optimizer
    parts: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.parts.values())


@dataclass
class Timeline:
    """The step's key points (the largest of forward and of backward, the optimizer step, and the same for a
    later micro-batch when accumulating) and the traced activation peak (gradients left out)."""

    points: list[Point]
    activation_peak: int
    notes: list[str] = field(default_factory=list)

    @property
    def peak(self) -> Point:
        return max(self.points, key=lambda p: p.total)  # the first of equals: the earliest point

    @property
    def total(self) -> int:
        return self.peak.total


def device_events(t: StepTrace, em: EngineModel, later: bool = False) -> list[tuple[int, int, int, str]]:
    """The traced forward and backward as the device sees it under engine `em`: (trace event index, storage key,
    bytes, part) in order, the engine's own storages under key ENGINE. `later`: a later micro-batch of an
    accumulation window (the window's gradients already exist; each new one lives only until it is added)."""
    if em.grad_rule == BLOCK:
        return _fsdp_events(t, em, later)
    out: list[tuple[int, int, int, str]] = []
    first_grad, reduced, filled = True, False, 0
    last = len(t.recording.events) - 1
    last_grad = max((i for i, (k, d) in enumerate(t.recording.events) if k in t.grad_of and d > 0), default=-1)
    if em.gather:  # ZeRO-3: the parameters gathered while modules run, and the buffers of the first gathers
        out.append((0, GATHER, em.gather, "temporary"))
    backward_at = next((i for i, direction, _ in t.recording.marks if direction == 1), last)
    spikes = {0: em.gather_spike[0], backward_at: em.gather_spike[1]} if any(em.gather_spike) else {}
    for i, (key, d) in enumerate(t.recording.events):
        if key < 0:
            continue
        if i in spikes:
            spike = spikes.pop(i)
            out += [(i, GATHER, spike, "temporary"), (i, GATHER, -spike, "temporary")]
        if key not in t.grad_of:
            out.append((i, key, d, "activations"))
            continue
        if d > 0 and em.grad_rule == BUCKET:
            if first_grad:
                first_grad = False
                out.append((i, ENGINE, em.bucket, "temporary"))  # the reduction buffers, at the first gradient
            filled += d // 4  # traced gradients are fp32
            if not reduced and not later and em.partition and (filled > em.bucket_elems or i == last_grad):
                reduced = True  # the first reduction: this rank's part from then on
                out.append((i, ENGINE, em.partition, "gradients"))
        if em.grad_rule == KEEP and not later:
            out.append((i, key, d, "gradients"))
        elif d > 0:  # made, then added into a bucket, a partition or the window's gradients, and dropped
            out += [(i, key, d, "gradients"), (i, key, -d, "gradients")]
    if em.grad_rule == BUCKET and not first_grad:
        out.append((last, ENGINE, -em.bucket, "temporary"))
    if em.gather:
        out.append((last, GATHER, -em.gather, "temporary"))
    return out


def _block_of(name: str, prefixes: list[str]) -> int:
    """Index of the FSDP2 unit holding a module or parameter (0: the root)."""
    for j, p in enumerate(prefixes):
        if j and (name == p or name.startswith(p + ".")):
            return j
    return 0


def _fsdp_events(t: StepTrace, em: EngineModel, later: bool) -> list[tuple[int, int, int, str]]:
    """FSDP2's step (engines.py): each unit's parameters all-gathered for its forward (the root's for the whole
    step) and again for its backward, with the next unit's prefetched; its unsharded gradients (in the compute
    dtype) reduce-scattered into this rank's fp32 shard when its last one is made."""
    rec = t.recording
    prefixes = [b.prefix for b in em.blocks]
    mod_block = [_block_of(name, prefixes) for name in rec.modules]
    label_block = [mod_block[m] for m, _ in rec.labels]
    backward_at = next((i for i, direction, _ in rec.marks if direction == 1), len(rec.events))
    grad_block = {k: _block_of(name, prefixes) for k, name in t.grad_of.items()}
    first_f, last_f, first_b, last_g = {}, {}, {}, {}
    for i, (key, d) in enumerate(rec.events):
        if key < 0 or d <= 0:
            continue
        j = grad_block[key] if key in grad_block else label_block[rec.label_of[key]]
        if i < backward_at:
            first_f.setdefault(j, i)
            last_f[j] = i
        else:
            first_b.setdefault(j, i)
            if key in grad_block:
                last_g[j] = i
    out: list[tuple[int, int, int, str]] = []
    root = em.blocks[0]
    gathered: set[int] = set()
    made = [0] * len(em.blocks)  # unsharded gradient bytes of each unit, until its reduce-scatter
    last = len(rec.events) - 1
    order = sorted((j for j in first_f if j), key=lambda j: first_f[j])  # the units in forward order
    before = {j: order[k - 1] for k, j in enumerate(order) if k}
    release, begins = {}, {}
    for j, at in last_f.items():
        if j:
            release.setdefault(at, []).append(j)
    for j, at in first_b.items():
        if j:
            begins.setdefault(at, []).append(j)
    out.append((0, GATHER, root.gathered, "temporary"))
    for i, (key, d) in enumerate(rec.events):
        if key < 0:
            continue
        if i < backward_at:
            j = label_block[rec.label_of[key]] if key not in grad_block else grad_block[key]
            if j and first_f.get(j) == i:
                out.append((i, GATHER, em.blocks[j].gathered, "temporary"))
        else:
            for j in begins.get(i, ()):
                for unit in (j, before.get(j)):  # its own gather, and the next unit's in backward (prefetch)
                    if unit is not None and unit not in gathered:
                        gathered.add(unit)
                        out.append((i, GATHER, em.blocks[unit].gathered, "temporary"))
        if key in grad_block:
            j = grad_block[key]
            size = round(d * em.blocks[j].grad_scale)
            made[j] += size
            out.append((i, key, size, "gradients"))
            if last_g.get(j) == i and j:
                out += _reduce(i, em.blocks[j], made[j], later)
                made[j] = 0
        else:
            out.append((i, key, d, "activations"))
        for j in release.get(i, ()):
            out.append((i, GATHER, -em.blocks[j].gathered, "temporary"))
    out += _reduce(last, root, made[0], later)
    out.append((last, GATHER, -root.gathered, "temporary"))
    return out


def _reduce(i: int, b, made: int, later: bool) -> list[tuple[int, int, int, str]]:
    """A unit's post-backward: its gradients copied into the fp32 reduce-scatter input, this rank's shard out of
    it, the unsharded gradients and the unit's gathered parameters freed."""
    shard = 0 if later else b.shard  # a later micro-batch adds into the window's shard
    return [(i, REDUCE, b.reduce, "temporary"), (i, REDUCE, -b.reduce, "temporary"), (i, ENGINE, -made, "gradients"),
            (i, ENGINE, shard, "gradients"), (i, GATHER, -b.gathered if b.prefix else 0, "temporary")]


def _where(t: StepTrace, key: int, phase: str) -> str:
    rec = t.recording
    if key < 0 or key >= len(rec.label_of):
        return f"{phase}: {_ENGINE_WHAT.get(key, 'engine buffers')}"
    module, made = rec.labels[rec.label_of[key]]
    return f"{phase} at {rec.modules[module] or '(the model itself)'}" + (" (recomputing)" if made == "recompute" else "")


def resident(t: StepTrace, setup: Setup, em: EngineModel) -> dict[str, int]:
    """What is live for the whole step, by part."""
    return {"parameters": em.parameters, "gradients": em.resident_grads, "optimizer": em.optimizer,
            "temporary": em.buffers + t.input_bytes, "overhead": CUDA_CONTEXT_BYTES if setup.on_gpu else 0}


def window_grads(t: StepTrace, em: EngineModel) -> int:
    """Gradient bytes an accumulation window keeps between its micro-batches."""
    if em.grad_rule != KEEP:
        return em.grads_at_step
    return sum(d for k, d in t.recording.events if k in t.grad_of and d > 0)


def step_point(t: StepTrace, setup: Setup, em: EngineModel) -> Point:
    """The optimizer step: every gradient the engine keeps for it, the clip's and the update's temporaries."""
    parts = dict.fromkeys(PARTS, 0)
    parts.update(resident(t, setup, em))
    head = dict(parts)
    parts["gradients"] = em.grads_at_step
    parts["temporary"] += em.step.temporary + em.step_extra
    head_grads, head_step = em.head_after
    head["gradients"] = head_grads
    head["temporary"] += head_step
    if head_step and sum(head.values()) > sum(parts.values()):
        return Point("optimizer step (the sharded head's update)", "optimizer", head)
    return Point("optimizer step (clip + update)", "optimizer", parts)


def build(t: StepTrace, setup: Setup, em: EngineModel) -> Timeline:
    """The timeline of one steady-state step of `setup` under engine `em`, from its trace `t`."""
    constant = resident(t, setup, em)
    backward_at = next((i for i, direction, _ in t.recording.marks if direction == 1), len(t.recording.events))
    windows = [(False, "")]
    if setup.grad_accum > 1:
        windows.append((True, "later micro-batch: "))
    points = []
    for later, prefix in windows:
        live = dict.fromkeys(PARTS, 0)
        live.update(constant)
        if later:
            live["gradients"] = max(window_grads(t, em), em.resident_grads)
        best = {"forward": None, "backward": None}
        for i, key, d, part in device_events(t, em, later):
            live[part] += d
            phase = "forward" if i < backward_at else "backward"
            total = sum(live.values())
            if best[phase] is None or total > best[phase][0]:
                best[phase] = (total, dict(live), key)
        for phase in ("forward", "backward"):
            if best[phase] is not None:
                _, parts, key = best[phase]
                points.append(Point(prefix + _where(t, key, phase), phase, parts))
    points.append(step_point(t, setup, em))
    return Timeline(points, t.activation, list(em.notes))
