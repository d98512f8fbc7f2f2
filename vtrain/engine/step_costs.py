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


class _TouchedRows(TorchDispatchMode):
    """The head's update on fake tensors: `touched.nonzero()` gives the rows a step touches (their number is
    known: every row, or with sampling int(R x rows)), and the finiteness checks pass."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.rows = rows

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.nonzero.default:
            return torch.zeros(self.rows, args[0].dim(), dtype=torch.long, device=args[0].device)
        if func in (aten._local_scalar_dense.default, aten.is_nonzero.default):
            return True
        return func(*args, **kwargs)


def head_step_bytes(setup: Setup, optim: OptimConfig | None = None) -> int:
    """The most bytes the sharded head's row-sparse AdamW step (engine/head_shard.py) allocates at once on rank 0,
    for the rows one step touches; 0 without a sharded head."""
    if not setup.sharded_head:
        return 0
    cfg = build_config("metric", overrides={"model": {"embedding_dim": setup.embedding_dim, "head_parallel": "sharded",
                                                      "sample_rate": setup.sample_rate}})
    if optim is not None:
        cfg.optim = optim
    # built on the meta device, then materialised under fake tensors (as memory/trace.py does with the model): its
    # parameters, buffers and every tensor it keeps of its own (AdamW's moments, the row step counts)
    head = ShardedHead(cfg, setup.num_classes, 0, setup.gpus, torch.device("meta"))
    with FakeTensorMode(allow_non_fake_inputs=True):
        head.fc.to_empty(device="cpu")
        for name, t in list(vars(head).items()):
            if isinstance(t, torch.Tensor) and t.is_meta:
                setattr(head, name, torch.zeros(t.shape, dtype=t.dtype))
        w = head.fc.weight
        w.grad = torch.zeros_like(w)
        rows = head.fc.num_local if setup.sample_rate >= 1 else min(head.fc.num_local,
                                                                    int(setup.sample_rate * head.fc.num_local))
        existing = [w, w.grad, head.exp_avg, head.exp_avg_sq, head.row_steps, head.fc.touched]
        tracker = LiveBytes(existing, granularity=setup.granularity)
        with tracker, _TouchedRows(rows):
            head.step(1.0, torch.ones(()), cfg.optim.clip_grad)
    return tracker.peak(set())


def run_facts(setup: Setup, optim: OptimConfig | None = None) -> ModelFacts:
    """The model's facts for the estimator with this run's optimizer groups and sharded-head update."""
    optim = optim or OptimConfig(layer_decay=setup.layer_decay)
    facts = model_facts(setup, optimizer_grouping(optim))
    facts.head_step = head_step_bytes(setup, optim)
    return facts
