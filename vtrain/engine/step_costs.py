"""What the memory estimator (vtrain/memory/, a layer below the engine) needs to know of a run's optimizer step:
the optimizer's parameter groups and the sharded face head's own update, traced from the engine's real code on
fake tensors (docs/memory_estimate.md, "The step's timeline"). `estimate-memory` and `--grad-ckpt auto` both
pass them down through `facts` (memory/sizing.model_facts), so the two agree.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from vtrain.config import OptimConfig, build_config
from vtrain.engine.head_shard import ShardedHead
from vtrain.engine.optim import param_groups
from vtrain.memory.setup import Setup
from vtrain.memory.sizing import Grouping, ModelFacts, model_facts
from vtrain.memory.tracker import LiveBytes

aten = torch.ops.aten


def optimizer_grouping(optim: OptimConfig) -> Grouping:
    """The optimizer's parameter groups of a run (engine/optim.py): torch's foreach AdamW updates one group at a
    time, so its temporary is the largest group's."""
    return lambda model: [g["params"] for g in param_groups(model, optim)]


class _SampledStep(TorchDispatchMode):
    """The head's update on fake tensors: the finiteness checks pass, and the sampled rows' step counts (all equal
    in a fresh head) are one run of `rows` rows: `_step_rows` reads `torch.unique_consecutive`'s values and counts
    with `.tolist()`, in that order (1, then `rows`)."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.rows, self.scalars = rows, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.unique_consecutive.default:
            self.scalars = [1, self.rows]
            return (torch.ones(1, dtype=args[0].dtype), torch.empty(0, dtype=torch.long),
                    torch.ones(1, dtype=torch.long))
        if func is aten._local_scalar_dense.default:
            return self.scalars.pop(0) if self.scalars else True
        if func is aten.is_nonzero.default:
            return True
        return func(*args, **kwargs)


def head_step_bytes(setup: Setup, optim: OptimConfig | None = None) -> int:
    """The most bytes the sharded head's row-sparse AdamW step (engine/head_shard.py) allocates at once on rank 0,
    for the rows one step touches; 0 without a sharded head."""
    if not setup.sharded_head:
        return 0
    cfg = build_config("metric", overrides={"model": {"embedding_dim": setup.embedding_dim, "head_parallel": "sharded",
                                                      "sample_rate": setup.sample_rate,
                                                      "head_update": setup.head_update}})
    if optim is not None:
        cfg.optim = optim
    # built on the meta device, then materialised under fake tensors (as memory/trace.py does with the model): its
    # parameters, buffers and every tensor it keeps of its own (AdamW's moments, the row step counts, dense's
    # gradient buffer)
    head = ShardedHead(cfg, setup.num_classes, 0, setup.gpus, torch.device("meta"))
    with FakeTensorMode(allow_non_fake_inputs=True):
        head.fc.to_empty(device="cpu")
        for name, t in list(vars(head).items()):
            if isinstance(t, torch.Tensor) and t.is_meta:
                setattr(head, name, torch.zeros(t.shape, dtype=t.dtype))
        existing = [head.fc.weight, head.exp_avg, head.exp_avg_sq, head.row_steps]
        existing += [head._dense_grad] if head._dense_grad is not None else []
        rows = sampled_rows(head.fc.num_local, setup.sample_rate)
        existing += _one_steps_gradient(head, rows, setup.sample_rate >= 1)
        tracker = LiveBytes(existing, granularity=setup.granularity)
        with tracker, _SampledStep(rows):
            head.step(1.0, torch.ones(()), cfg.optim.clip_grad)
    return tracker.peak(set())


def sampled_rows(num_local: int, sample_rate: float) -> int:
    """The rows one step samples of a shard of `num_local` (models/partial_fc.py: int(R x rows), positives included)."""
    return num_local if sample_rate >= 1 else min(num_local, int(sample_rate * num_local))


def _one_steps_gradient(head: ShardedHead, rows: int, full: bool) -> list[torch.Tensor]:
    """The head's gradient as one step leaves it (models/partial_fc.py `rows`): the weight's own (the full
    softmax), else the sampled rows as their own leaf with its gradient; returns those tensors."""
    w = head.fc.weight
    if full:
        w.grad = torch.zeros_like(w)
        return [w.grad]
    index = torch.arange(rows)
    leaf = torch.zeros(rows, w.shape[1], requires_grad=True)
    leaf.grad = torch.zeros(rows, w.shape[1])
    head.fc.pending.append((index, leaf))
    return [index, leaf, leaf.grad]


def run_facts(setup: Setup, optim: OptimConfig | None = None) -> ModelFacts:
    """The model's facts for the estimator with this run's optimizer groups and sharded-head update."""
    optim = optim or OptimConfig(layer_decay=setup.layer_decay)
    facts = model_facts(setup, optimizer_grouping(optim))
    facts.head_step = head_step_bytes(setup, optim)
    return facts
