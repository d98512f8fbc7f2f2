"""Exponential moving average of the trainable weights, sharded like the parameters it follows.

Each rank averages the tensors it holds, with `torch._foreach_lerp_` after every applied optimizer step (not after a
skipped non-finite window or an fp16 overflow skip), in fp32. What a rank holds of a parameter is the engine's
answer (`engine.local_tensor`, engine/engines/): the local shard of each DTensor under FSDP2 (no gather per step);
under DeepSpeed ZeRO-3 each parameter's own partition `p.ds_tensor`, in the training dtype (fp32 under
torch_autocast, vtrain's default; bf16/fp16 in DeepSpeed's full half modes, where the average then follows the
rounded weights; the fp32 master partitions live in the optimizer's flat groups, which have no stable per-parameter
mapping); the whole parameter under DDP, one process and ZeRO-1/2. The same tensors `engine.parameters_finite`
checks. Saving and loading go through the engine too (`whole_tensor`, `local_part`): no test of the engine here.

Only parameters are averaged; buffers (BatchNorm statistics) and frozen parameters are the model's own, as in
timm's `ModelEmaV3(exclude_buffers=True)`. A checkpoint stores the EMA whole (`ema.safetensors`, gathered on rank 0
at save time, buffers and frozen parameters filled in from the model), so it is a complete model that `vtrain eval`
and `vtrain consolidate` read directly, and `load` re-shards it for any number of processes.

Decay warm-up (`--ema-warmup TAU`): decay_t = D * (1 - exp(-t / TAU)) after t updates, the YOLOX / detrex
(`yolox_mode`, TAU 2000) rule: early averages follow the fast-moving weights instead of the random init.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vtrain.dist import rank as dist_rank
from vtrain.engine.checkpoint import format as ckpt
from vtrain.errors import VtrainError


class WeightEMA:
    def __init__(self, engine: Any, decay: float, warmup: int = 0) -> None:
        """`engine`: a prepared engine (engine/engines/). The average starts from the current weights."""
        self.engine, self.decay, self.warmup = engine, decay, warmup
        self.params: list[tuple[str, nn.Parameter]] = [(n, p) for n, p in engine.module.named_parameters()
                                                       if p.requires_grad]
        self.ema = [engine.local_tensor(p).detach().float().clone() for _, p in self.params]
        self.updates = 0

    def local_fraction(self) -> float:
        """Share of the averaged parameters' elements this rank holds (1/N under FSDP2 and ZeRO-3), for run_info."""
        total = sum(self.engine.full_numel(p) for _, p in self.params)
        return sum(e.numel() for e in self.ema) / max(total, 1)

    def current_decay(self) -> float:
        if self.warmup > 0:
            return self.decay * (1.0 - math.exp(-self.updates / self.warmup))
        return self.decay

    @torch.no_grad()
    def update(self) -> None:
        """After an applied optimizer step: ema <- d * ema + (1 - d) * weights, per device, fused."""
        self.updates += 1
        weight = 1.0 - self.current_decay()
        by_device: dict[torch.device, tuple[list, list]] = {}
        for e, (_, p) in zip(self.ema, self.params):
            live = self.engine.local_tensor(p)
            if live.numel():
                pair = by_device.setdefault(e.device, ([], []))
                pair[0].append(e)
                pair[1].append(live.float() if live.dtype != torch.float32 else live)
        for ema, live in by_device.values():
            torch._foreach_lerp_(ema, live, weight)

    # ---- whole tensors for saving -----------------------------------------------------------------------------
    def _gather(self, i: int) -> torch.Tensor | None:
        """The whole EMA of parameter i on rank 0 (CPU, fp32), None elsewhere. Collective under FSDP2 / ZeRO-3."""
        return self.engine.whole_tensor(self.params[i][1], self.ema[i])

    def full_state_dict(self, model_state: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
        """On rank 0: `model_state` (the model's full state dict) with every trainable parameter replaced by its
        average; None elsewhere. Collective: call on every rank."""
        averaged = {}
        for i, (name, _) in enumerate(self.params):
            whole = self._gather(i)
            if whole is not None:
                averaged[name] = whole.contiguous()
        if model_state is None:
            return None
        missing = set(averaged) - set(model_state)
        if missing:  # a programming error: the names must be the module's own
            raise RuntimeError(f"EMA parameters not in the model's state dict: {sorted(missing)[:3]}")
        return {k: averaged.get(k, v) for k, v in model_state.items()}

    def state(self) -> dict[str, Any]:
        return {"decay": self.decay, "warmup": self.warmup, "updates": self.updates}

    # ---- resume -----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def load(self, path: Path, state: dict[str, Any]) -> None:
        """Take this rank's share of a whole `ema.safetensors` (saved by any number of processes)."""
        from safetensors import safe_open

        rank = dist_rank()
        with safe_open(str(path), "pt") as f:
            keys = set(f.keys())
            missing = [n for n, _ in self.params if n not in keys]
            if missing:
                raise VtrainError(f"--resume: {path} lacks the EMA of {len(missing)} parameters, e.g. {missing[0]}")
            for (name, p), e in zip(self.params, self.ema):
                whole = f.get_tensor(name).float()
                local = self.engine.local_part(p, whole, e)
                if tuple(local.shape) != tuple(e.shape):
                    raise VtrainError(f"--resume: the EMA of {name} in {path} has shape {tuple(whole.shape)}, "
                                      f"this model's is {tuple(p.shape)} (rank {rank})")
                e.copy_(local)
        self.updates = int(state.get("updates", 0))

    # ---- evaluation with the averaged weights -------------------------------------------------------------------
    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        """Run the model with the EMA weights inside the block; the training weights come back bit for bit.
        Tensors are exchanged one at a time (one temporary of the largest local tensor). Collective under ZeRO-3."""
        self._exchange()
        try:
            yield
        finally:
            self._exchange()

    @torch.no_grad()
    def _exchange(self) -> None:
        with self.engine.writing_local_tensors():  # ZeRO-3: gathered copies released before, refreshed after
            for e, (_, p) in zip(self.ema, self.params):
                live = self.engine.local_tensor(p)
                tmp = live.detach().clone()
                live.copy_(e)
                e.copy_(tmp)


def weights_file(checkpoint: Path, weights: str | None, flag: str = "--weights") -> tuple[Path, str]:
    """For eval / consolidate of a vtrain checkpoint: (file, "ema" | "model"). Default: the EMA weights when the
    checkpoint has them (they are what the run evaluated), else the model's."""
    if weights not in (None, "ema", "model"):
        raise VtrainError(f"{flag}: choose ema or model, got {weights!r}")
    ema = Path(checkpoint) / ckpt.EMA
    if weights == "ema" and not ema.is_file():
        raise VtrainError(f"{flag} ema: {checkpoint} has no EMA weights (the run had no --ema-decay)")
    if weights != "model" and ema.is_file():
        return ema, "ema"
    return Path(checkpoint) / ckpt.MODEL, "model"
