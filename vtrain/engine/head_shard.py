"""The sharded face head at run time (`--head-parallel sharded`): its row-sparse AdamW, clipping share,
finiteness check and per-rank checkpoint files.

The head (models/partial_fc.py) lives OUTSIDE the module handed to Accelerate / DDP / FSDP2 / DeepSpeed: ZeRO and
FSDP never partition it, DDP never all-reduces it (each rank's rows are its own), and its optimizer state is
sharded by construction. The trainer calls `loss` per micro-batch; the engine steps the head as one more optimizer
(engine/engines/torch_engine.py, deepspeed.py): `grad_sq_norm` before the backbone step (one global clip norm),
`step` after an applied backbone update (or `zero_grad` after a skipped one).

Checkpoints: every rank writes `head/classes_<start>-<end>.safetensors` with its rows of the weight, the AdamW
moments and the per-row step counts, and the class range in the metadata. Loading reads the rows of the new
range from whichever files hold them, so a run resumes on any number of processes (N -> M).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.optim.adamw import adamw

from vtrain.config import RunConfig
from vtrain.dist import all_sum, all_true
from vtrain.engine.checkpoint import format as ckpt
from vtrain.engine.checkpoint.content import ContentError, head_files, head_spec, nonfinite, shard_name
from vtrain.errors import VtrainError
from vtrain.models.partial_fc import PartialFC

EPS = 1e-8  # torch.optim.AdamW's default eps, which the backbone's AdamW uses too (engine/optim.py)


class ShardedHead:
    """This rank's class shard, its AdamW state and per-row step counts (AdamW bias correction per row: a row
    updated in k of the run's steps has taken k steps; under `--head-update dense` every row takes every step)."""

    def __init__(self, cfg: RunConfig, num_classes: int, rank: int, world: int, device: torch.device) -> None:
        m, o = cfg.model, cfg.optim
        if num_classes < world:
            raise VtrainError(f"--head-parallel sharded: {num_classes} identities cannot be split over {world} "
                              "processes")
        self.fc = PartialFC(m.embedding_dim, num_classes, m.head, m.margin, m.scale, m.sample_rate, rank, world,
                            m.arcface_grad).to(device)
        self.update = m.head_update
        self.lr, self.weight_decay, self.betas = o.lr, o.weight_decay, o.betas
        w = self.fc.weight
        self.exp_avg = torch.zeros_like(w, memory_format=torch.contiguous_format)
        self.exp_avg_sq = torch.zeros_like(w, memory_format=torch.contiguous_format)
        self.row_steps = torch.zeros(self.fc.num_local, dtype=torch.int64, device=device)
        self.uniform_step: int | None = 0  # every row's step count when they are all equal (dense), else None
        self._sampled: tuple[torch.Tensor, torch.Tensor] | None = None  # merged (rows, gradient), `sampled`
        # `dense` with sampling: the whole shard's gradient for AdamW, zero but on the rows sampled in a step (they
        # are written in before the update and zeroed after it: the cost of keeping it follows the sampled rows)
        self._dense_grad = torch.zeros_like(w) if self.update == "dense" and m.sample_rate < 1 else None

    # ---- one step ----------------------------------------------------------------------------------------------
    def loss(self, out: dict[str, torch.Tensor], labels: torch.Tensor) -> dict[str, torch.Tensor]:
        """The model's output (embeddings) -> the loss dict the loop sums. Collective."""
        return self.fc(out["embedding"], labels)

    def grad(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The accumulation window's head gradient: (None, gradient of every row) from `weight.grad` (the full
        softmax), or with sampling (rows, their gradient): the union of the micro-batches' sampled rows, sorted, with
        the gradients of a row sampled twice summed (autograd's accumulation, done here on the sampled rows only);
        every other row's gradient is zero. (None, None) without one."""
        fc = self.fc
        if fc.weight.grad is not None:
            return None, fc.weight.grad
        parts = [(rows, leaf.grad) for rows, leaf in fc.pending if leaf.grad is not None]
        fc.pending.clear()
        if self._sampled is not None:
            parts.insert(0, self._sampled)
        if len(parts) > 1:
            rows, inverse = torch.unique(torch.cat([r for r, _ in parts]), return_inverse=True)
            g = torch.cat([g for _, g in parts])
            summed = torch.zeros(len(rows), g.shape[1], dtype=g.dtype, device=g.device)
            parts = [(rows, summed.index_add_(0, inverse, g))]
        self._sampled = parts[0] if parts else None
        return self._sampled or (None, None)

    def unscale_(self, scale: float) -> None:
        """fp16 GradScaler: the head's gradients carry the loss scale too (the scaled loss was backpropagated)."""
        g = self.grad()[1]
        if g is not None:
            g.div_(scale)

    def grad_sq_norm(self) -> torch.Tensor:
        """Squared L2 norm of the whole head's gradient (all shards: disjoint rows, so squares add). Collective."""
        g = self.grad()[1]
        sq = torch.linalg.vector_norm(g, dtype=torch.float32) ** 2 if g is not None \
            else torch.zeros((), device=self.fc.weight.device)
        return all_sum(sq)

    @torch.no_grad()
    def step(self, lr_factor: float, total_norm: torch.Tensor | None, clip_grad: float) -> None:
        """AdamW on every row (`--head-update dense`, or the full softmax) or on the rows sampled in this
        accumulation window (`sampled`: other rows keep weight, moments and step count, no decay). `total_norm` is
        the global norm over backbone and head; the head's gradient is scaled by the same factor as the backbone's,
        torch's `clip_grad_norm_` formula. A non-finite head gradient skips the head's update (a window the
        backbone's checks let through)."""
        rows, g = self.grad()
        # a finite global norm (it sums the head's squares) vouches for every element; else look at each
        known = total_norm is not None and math.isfinite(float(total_norm))
        if g is None or not (known or bool(torch.isfinite(g).all())):
            return self.zero_grad()
        if clip_grad > 0 and total_norm is not None:
            coef = torch.clamp(clip_grad / (total_norm.to(g.device) + 1e-6), max=1.0)
            g.mul_(torch.nan_to_num(coef, nan=1.0))  # no norm known (DeepSpeed reported none): no clipping
        lr, w = self.lr * lr_factor, self.fc.weight.data
        if self.update == "dense" and rows is not None:  # every row steps: the zeros of the rows not sampled
            self._dense_grad.index_copy_(0, rows, g)
            rows, g = None, self._dense_grad
        if rows is None and self.uniform_step is not None:  # the whole shard in place, one step count
            self.uniform_step += 1
            self._adamw([w], [g], [self.exp_avg], [self.exp_avg_sq], [self.uniform_step], lr)
            self.row_steps.add_(1)
        else:  # the sampled rows (or, after `sampled` steps, every row), each at its own step count
            rows = torch.arange(self.fc.num_local, device=w.device) if rows is None else rows
            self._step_rows(rows, g, lr)
            self.uniform_step = None
        self.zero_grad()

    def _step_rows(self, rows: torch.Tensor, g: torch.Tensor, lr: float) -> None:
        """AdamW on `rows` (gradient `g`), each row at its own step count: the rows are gathered in the order of
        their step counts, so that each run of equal counts is one contiguous tensor for torch's kernel, then
        written back. Gathers and scatters of these rows only."""
        steps = self.row_steps.index_select(0, rows) + 1
        order = torch.argsort(steps, stable=True)
        rows, steps = rows.index_select(0, order), steps.index_select(0, order)
        values, counts = (x.tolist() for x in torch.unique_consecutive(steps, return_counts=True))
        states = [t.index_select(0, rows) for t in (self.fc.weight.data, self.exp_avg, self.exp_avg_sq)]
        parts = [list(torch.split(t, counts)) for t in (states[0], g.index_select(0, order), *states[1:])]
        self._adamw(*parts, values, lr)
        for t, new in zip((self.fc.weight.data, self.exp_avg, self.exp_avg_sq, self.row_steps), (*states, steps)):
            t.index_copy_(0, rows, new)

    def _adamw(self, w: list[torch.Tensor], g: list[torch.Tensor], m: list[torch.Tensor], v: list[torch.Tensor],
               steps: list[int], lr: float) -> None:
        """torch's AdamW (its functional form, fused kernel: one pass over each tensor) in place on the tensors `w`
        and their moments, tensor i at step count `steps[i]` (after this step)."""
        b1, b2 = self.betas
        counts = [torch.tensor(float(s - 1), device=w[0].device) for s in steps]  # the kernel counts the step
        adamw(w, g, m, v, [], counts, fused=True, amsgrad=False, beta1=b1, beta2=b2, lr=lr,
              weight_decay=self.weight_decay, eps=EPS, maximize=False)

    def zero_grad(self) -> None:
        if self._dense_grad is not None and self._sampled is not None:
            self._dense_grad.index_fill_(0, self._sampled[0], 0.0)
        self.fc.weight.grad = None
        self.fc.pending.clear()
        self._sampled = None

    def finite(self) -> bool:
        """Whether the head's weights are finite on every rank. Collective."""
        return all_true(torch.isfinite(self.fc.weight.detach()).all())

    def active(self, partitioned: bool) -> dict[str, Any]:
        """What is really active, for run_info.json: the head's rows here and that no engine wraps it
        (`partitioned`: the engine's answer, whether it holds the head's weight in parts)."""
        w = self.fc.weight
        return {"head_parallel": "sharded", "head_class_start": self.fc.class_start,
                "head_num_local": self.fc.num_local, "head_num_classes": self.fc.num_classes,
                "head_sample_rate": self.fc.sample_rate, "head_update": self.update,
                "head_arcface_grad": self.fc.arcface_grad if self.fc.kind == "arcface" else None,
                "head_param_class": type(w).__name__,
                "head_param_dtype": str(w.dtype), "head_partitioned": partitioned}

    # ---- checkpoints -------------------------------------------------------------------------------------------
    def save(self, ckpt_dir: Path) -> None:
        """This rank's rows (weight, moments, step counts) with their class range. Every rank writes its file."""
        start, n = self.fc.class_start, self.fc.num_local
        d = Path(ckpt_dir) / ckpt.HEAD
        d.mkdir(parents=True, exist_ok=True)
        tensors = {"weight": self.fc.weight.detach(), "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq,
                   "row_steps": self.row_steps}
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(d / shard_name(start, n)),
                  metadata={"class_start": str(start), "num_local": str(n),
                            "num_classes": str(self.fc.num_classes)})

    def load(self, ckpt_dir: Path) -> None:
        """Read this rank's class range from the checkpoint's shard files, whatever split they were saved in."""
        start, n = self.fc.class_start, self.fc.num_local
        rows = read_rows(ckpt_dir, start, n, self.fc.num_classes, self.fc.weight.shape[1],
                         ("weight", "exp_avg", "exp_avg_sq", "row_steps"))
        with torch.no_grad():
            self.fc.weight.copy_(rows["weight"])
            self.exp_avg.copy_(rows["exp_avg"])
            self.exp_avg_sq.copy_(rows["exp_avg_sq"])
            self.row_steps.copy_(rows["row_steps"])
        lo, hi = (int(x) for x in self.row_steps.aminmax()) if self.fc.num_local else (0, 0)
        self.uniform_step = lo if lo == hi else None  # a `sampled` run's rows differ: per-row bias correction


    def take_rows(self, sd: dict[str, torch.Tensor], required: bool = False) -> str:
        """Pop a full `head.weight` (a consolidated file) from `sd` and load this rank's rows of it (fresh optimizer
        state). Returns a note for the log; `required`: a missing or misfit head is an error, else a note."""
        full = sd.pop("head.weight", None)
        want = (self.fc.num_classes, self.fc.weight.shape[1])
        if full is None or tuple(full.shape) != want:
            got = "none" if full is None else tuple(full.shape)
            if required:
                raise VtrainError(f"--resume-weights-only: head.weight is {got}, this run's head is {want}")
            return f"; sharded head re-initialised (the file's head.weight: {got}, needed {want})"
        s, n = self.fc.class_start, self.fc.num_local
        with torch.no_grad():
            self.fc.weight.copy_(full[s:s + n].float())
        return f"; sharded head: classes {s}..{s + n} of head.weight loaded"


def read_rows(ckpt_dir: Path, start: int, n: int, num_classes: int | None, dim: int | None,
              names: tuple[str, ...] = ("weight",), finite: bool = True) -> dict[str, torch.Tensor]:
    """Rows [start, start+n) of the named head tensors, stitched from the shard files that hold them (sliced reads:
    only the rows needed are read). The shards are checked first (content.head_files: class ranges that tile,
    shapes and dtypes against their metadata and `dim`), and, with `finite`, the rows read must be finite (and
    second moments >= 0: content.head_spec)."""
    files = head_files(ckpt_dir, dim)
    if not files:
        raise VtrainError(f"{ckpt_dir}: no sharded head ({ckpt.HEAD}/classes_*.safetensors)")
    saved_classes = files[0].classes
    if num_classes is not None and saved_classes != num_classes:
        raise VtrainError(f"{ckpt_dir}: the head has {saved_classes} identities, this run {num_classes}")
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in names}
    for shard in files:
        s, k = shard.start, shard.n
        lo, hi = max(start, s), min(start + n, s + k)
        if lo >= hi:
            continue
        with safe_open(str(shard.file), "pt") as sf:
            for name in names:
                rows = sf.get_slice(name)[lo - s:hi - s]
                problem = nonfinite(name, rows, head_spec(1, 1)[name].low) if finite else None
                if problem:
                    raise ContentError(f"{shard.file}: {problem} in classes {lo}..{hi}")
                parts[name].append(rows)
    return {k: torch.cat(v) for k, v in parts.items()}


def full_weight(ckpt_dir: Path, dim: int | None = None) -> torch.Tensor:
    """The whole head weight (num_classes, dim) in fp32, for `vtrain consolidate`, which scans it for inf/NaN
    itself (its table of offenders, --allow-nonfinite)."""
    files = head_files(ckpt_dir, dim)
    if not files:
        raise VtrainError(f"{ckpt_dir}: no sharded head ({ckpt.HEAD}/classes_*.safetensors)")
    return read_rows(ckpt_dir, 0, files[0].classes, None, dim, finite=False)["weight"].float()


def lr_factor(scheduler, step_index: int | None = None) -> float:
    """The schedule's multiplier for the update about to be applied (LambdaLR: lambda(last_epoch))."""
    f = scheduler.lr_lambdas[0](scheduler.last_epoch if step_index is None else step_index)
    if not math.isfinite(f):
        raise VtrainError(f"LR schedule multiplier is {f}")
    return f


def build(cfg: RunConfig, dataset, rank: int, world: int, device: torch.device, engine: Any) -> ShardedHead | None:
    """The sharded head of a `--head-parallel sharded` run (None otherwise), once `engine` (engine/engines/, which
    will step it with the model's optimizer) has said it can."""
    if cfg.model.head_parallel != "sharded":
        return None
    engine.check_sharded_head()
    return ShardedHead(cfg, dataset.num_classes, rank, world, device)
