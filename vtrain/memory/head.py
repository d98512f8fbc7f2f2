"""The sharded face head (`--head-parallel sharded`, models/partial_fc.py + engine/head_shard.py) in the estimate.

The head lives outside the engine: ZeRO and FSDP2 never partition it, offloading never moves it, and every rank
holds its own class range. Rank 0 holds the most rows (`shard_range`: the first C mod W ranks take one more), so
the estimate counts rank 0. Per rank, exactly as `ShardedHead` allocates them (tested against the real objects):

- parameters: the fp32 weight (rows x dim);
- gradients: with the full softmax the fp32 weight gradient, dense over the shard; with sampling the sampled rows'
  gradient (their own leaf: at most max(int(sample_rate x rows), min(rows, W x B)) rows, the positives of the
  global batch being kept; one micro-batch; the trace counts it as a gradient, not an activation), and under
  `--head-update dense` also the shard-sized gradient buffer its update reads (zero but on the sampled rows);
- optimizer: AdamW's two fp32 moments, allocated for every row, and the per-row int64 step counts.

The activations are traced: the head's real forward and backward run in the traced step on the global batch, as
rank 0 runs them: the embeddings of all W x B samples (the all-gather's W row blocks and their concatenation, made
here by `_GatherRows`' own allocations without the collective), the cosine and logit matrices of W x B rows over
the shard's rows (or the sampled ones: int(sample_rate x rows), at least the positives). The two all-reduce copies
of W x B floats each are not traced (8 KiB at W x B = 1024).

Sampling picks rows by value (`torch.unique`, boolean masks, `nonzero`), whose output sizes a fake tensor does not
know. `upper_bound_shapes` gives them their largest size (every element selected): they only index the W x B
labels, so the bound costs a few KiB and the large tensors keep their exact shapes.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vtrain.config import ModelConfig
from vtrain.memory.setup import Setup
from vtrain.models.partial_fc import PartialFC, shard_range

aten = torch.ops.aten


def shard_rows(setup: Setup) -> int:
    """Rows of the largest shard (rank 0's) of a sharded head over `setup.gpus` ranks."""
    return shard_range(setup.num_classes, 0, setup.gpus)[1]


def head_state_bytes(setup: Setup) -> dict[str, int]:
    """Per-GPU bytes of the sharded head's parameters, gradient and AdamW state (module docstring); zeros without a
    sharded head."""
    if not setup.sharded_head:
        return {"parameters": 0, "gradients": 0, "optimizer": 0}
    rows, dim = shard_rows(setup), setup.embedding_dim
    grad_rows = rows
    if setup.sample_rate < 1:
        grad_rows = max(max(int(setup.sample_rate * rows), 1), min(rows, setup.gpus * setup.batch_size))
        grad_rows += rows if setup.head_update == "dense" else 0
    return {"parameters": 4 * rows * dim, "gradients": 4 * grad_rows * dim, "optimizer": 8 * rows * dim + 8 * rows}


def sharded_head(setup: Setup) -> PartialFC | None:
    """Rank 0's head shard of `setup` (None without a sharded head), with the run's default margin and scale."""
    if not setup.sharded_head:
        return None
    m = ModelConfig(head_parallel="sharded", sample_rate=setup.sample_rate, embedding_dim=setup.embedding_dim)
    return PartialFC(m.embedding_dim, setup.num_classes, m.head, m.margin, m.scale, m.sample_rate, 0, setup.gpus,
                     m.arcface_grad)


class _GatherRows(torch.autograd.Function):
    """models/partial_fc.py's all-gather of row blocks with its allocations and without the collective: W blocks
    (one holding this rank's rows) and their concatenation; backward clones the gradient (the all-reduce works in
    place on the clone) and returns this rank's block times W."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, world: int) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(world)]
        parts[0].copy_(x)
        ctx.rows, ctx.world = x.shape[0], world
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        return grad[: ctx.rows] * ctx.world, None


def head_loss(head: PartialFC, emb: torch.Tensor, labels: torch.Tensor, world: int) -> dict[str, torch.Tensor]:
    """Rank 0's head step on the global batch: the embeddings and labels of `world` ranks gathered as the run
    gathers them, then the head's own forward (which, with no process group here, computes on what it is given)."""
    with torch.autocast(device_type=emb.device.type, enabled=False):
        every = _GatherRows.apply(emb.float(), world)
        labels = torch.cat([labels.clone()] + [torch.zeros_like(labels) for _ in range(world - 1)])
        return head(every, labels)


class _UpperBound(TorchDispatchMode):
    """Ops whose output size depends on values get the largest size they can have (every element selected)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.nonzero.default:
            x = args[0]
            return torch.zeros(x.numel(), x.dim(), dtype=torch.long, device=x.device)
        if func is aten._unique2.default:
            x = args[0]
            flags = {**dict(zip(("sorted", "return_inverse", "return_counts"), args[1:])), **kwargs}
            inverse, counts = flags.get("return_inverse", False), flags.get("return_counts", False)
            values = torch.empty(x.numel(), dtype=x.dtype, device=x.device)
            return (values, torch.zeros(x.shape if inverse else (0,), dtype=torch.long, device=x.device),
                    torch.ones(x.numel() if counts else 0, dtype=torch.long, device=x.device))
        if func is aten.index.Tensor and any(i is not None and i.dtype == torch.bool for i in args[1]):
            x, (mask, *rest) = args[0], args[1]
            if mask is not None and mask.dtype == torch.bool and not rest:
                return torch.empty((mask.numel(), *x.shape[mask.dim():]), dtype=x.dtype, device=x.device)
        return func(*args, **kwargs)


@contextlib.contextmanager
def upper_bound_shapes():
    """Inside: value-dependent sizes at their upper bound (see the module docstring)."""
    with _UpperBound():
        yield
