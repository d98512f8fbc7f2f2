"""Partial FC: the margin-softmax head split by contiguous class ranges over the data-parallel ranks.

Facts from insightface's arcface_torch (docs/face.md §1.1, AF/partial_fc_v2.py): rank r owns
`num_local = C//W + (r < C%W)` class centres starting at `C//W*r + min(r, C%W)`, in fp32; embeddings and labels
of the global batch are all-gathered; the softmax normaliser needs only two numbers per sample (all-reduced max and
sum of exponentials) and the target logit lives on exactly one rank. With `sample_rate` R < 1 each rank keeps every
positive class of the global batch in its range plus random negatives up to int(R * num_local).

The loss equals MarginHead's (models/metric.py) on the whole global batch: the cross-entropy mean over all W*B
samples, identical on every rank. Gradients: the weight shard gets exactly its rows of the unsharded gradient; each
rank's embedding gradient is the sum over ranks' contributions, multiplied by W because every data-parallel engine
(DDP, FSDP2, DeepSpeed) *averages* the backbone gradients over ranks (arcface_torch's AllGather does the same).
On one process the same code runs with one shard and no collectives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from vtrain.dist import all_max_, all_sum, gather_tensors, world_size
from vtrain.models.metric import class_logits, margin_target


def shard_range(num_classes: int, rank: int, world: int) -> tuple[int, int]:
    """(class_start, num_local) of `rank` in arcface_torch's split (docs/face.md §1.1)."""
    base, rest = divmod(num_classes, world)
    return base * rank + min(rank, rest), base + (rank < rest)


class _GatherRows(torch.autograd.Function):
    """All-gather of equal-sized row blocks. Backward: the sum over ranks of the gradient of the gathered tensor
    (each rank holds only its shard's contribution), this rank's block, times W (see the module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        world, rank = dist.get_world_size(), dist.get_rank()
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous())
        ctx.rank, ctx.rows, ctx.world = rank, x.shape[0], world
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad)
        return grad[ctx.rank * ctx.rows:(ctx.rank + 1) * ctx.rows] * ctx.world


class _SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) whose backward is the identity: everything downstream (the loss) is computed identically
    on every rank, so d loss / d (this rank's addend) is the incoming gradient itself."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _gather_rows(x: torch.Tensor) -> torch.Tensor:
    return _GatherRows.apply(x) if world_size() > 1 else x


def _sum_over_ranks(x: torch.Tensor) -> torch.Tensor:
    return _SumOverRanks.apply(x) if world_size() > 1 else x


class PartialFC(nn.Module):
    """This rank's shard of the class centres and the distributed margin softmax over it.

    With sampling (sample_rate < 1) each forward's sampled rows are a leaf of their own (`pending`: (rows, leaf)
    per micro-batch), so their gradient, its norm and what the head's optimizer (engine/head_shard.py) reads of it
    are the size of the sampled rows, never of the shard: a gradient over the whole shard would be zero on every
    other row (arcface_torch's `self.weight[index]` makes that dense gradient, AF/partial_fc_v2.py). With the full
    softmax the gradient is `weight.grad`."""

    def __init__(self, dim: int, num_classes: int, kind: str = "arcface", margin: float = 0.5, scale: float = 64.0,
                 sample_rate: float = 1.0, rank: int = 0, world: int = 1, arcface_grad: str = "straight") -> None:
        super().__init__()
        if num_classes < world:
            raise ValueError(f"{num_classes} classes cannot be split over {world} ranks")
        self.kind, self.margin, self.scale, self.sample_rate = kind, margin, scale, sample_rate
        self.arcface_grad = arcface_grad
        self.num_classes = num_classes
        self.class_start, self.num_local = shard_range(num_classes, rank, world)
        self.weight = nn.Parameter(torch.empty(self.num_local, dim))
        nn.init.normal_(self.weight, std=0.01)  # arcface_torch's init (docs/face.md §1.1)
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # (rows, their leaf) per forward since the step
        self.last_index: torch.Tensor | None = None  # the rows the last forward used (None: all)

    def sample(self, labels: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The rows of this shard to use (None: all) and the labels remapped into them (-1: not on this rank).
        R < 1: every positive class in range, plus random negatives up to int(R * num_local) (at least 1 row so
        the local softmax is never empty). As arcface_torch (AF/partial_fc_v2.py `sample`), the random scores are
        drawn whenever the positives do not outnumber the rows kept, so the same seed picks the same rows."""
        local = labels - self.class_start
        mine = (local >= 0) & (local < self.num_local)
        if self.sample_rate >= 1.0:
            return None, torch.where(mine, local, torch.full_like(local, -1))
        positive = torch.unique(local[mine])  # sorted
        k = max(int(self.sample_rate * self.num_local), 1)
        if k >= positive.numel():
            score = torch.rand(self.num_local, device=labels.device)
            score[positive] = 2.0  # positives first; rand is in [0, 1)
            index = score.topk(k).indices.sort().values
        else:
            index = positive
        remapped = torch.searchsorted(index, local.clamp(0, self.num_local - 1))
        return index, torch.where(mine, remapped, torch.full_like(local, -1))

    def rows(self, index: torch.Tensor | None) -> torch.Tensor:
        """The class centres of `index` (None: all) whose gradient the update reads (see the class docstring)."""
        if index is None:
            return self.weight
        leaf = self.weight.detach().index_select(0, index).requires_grad_(self.weight.requires_grad)
        if torch.is_grad_enabled():
            self.pending.append((index, leaf))
        return leaf

    def forward(self, emb: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        """Loss (mean over the global batch, the same on every rank) and train accuracy over the sampled classes.
        The loss is the exact cross-entropy; arcface_torch reports each sample's loss capped at -log(1e-30)
        (docs/face_head.md §1), with the same gradient."""
        with torch.autocast(device_type=emb.device.type, enabled=False):
            emb = _gather_rows(emb.float())  # the global batch, in rank order (collective)
            labels = torch.cat(gather_tensors(labels.contiguous()))
            index, local = self.sample(labels)
            self.last_index = index
            w = self.rows(index)
            cos = F.linear(F.normalize(emb, dim=1), F.normalize(w, dim=1)).clamp(-1.0, 1.0)
            rows = (local >= 0).nonzero().squeeze(1)
            cols = local[rows]
            target = cos[rows, cols]
            with_margin = margin_target(target, self.kind, self.margin, self.arcface_grad)
            logits = (class_logits(cos, self.kind, self.arcface_grad) * self.scale).index_put(
                (rows, cols), with_margin * self.scale)
            # distributed log-sum-exp: a shared offset (max over all shards; no gradient needed, it cancels)
            top = all_max_(logits.detach().amax(1))
            sum_exp = _sum_over_ranks((logits - top[:, None]).exp().sum(1))
            zero = torch.zeros(len(labels), device=emb.device)
            target_logit = _sum_over_ranks(zero.index_put((rows,), logits[rows, cols]))
            loss = (sum_exp.log() + top - target_logit).mean()
            with torch.no_grad():  # accuracy: the label's cosine is the highest over all (sampled) classes
                best = all_max_(cos.amax(1))
                label_cos = all_sum(zero.index_put((rows,), target.detach()))
                acc = (label_cos >= best).float().mean()
        return {"loss": loss, "train_acc": acc}
