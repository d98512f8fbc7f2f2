"""Exponential moving average of the trainable weights, sharded like the parameters it follows.

Each rank averages the tensors it owns, with `torch._foreach_lerp_` after every applied optimizer step (not after a
skipped non-finite window or an fp16 overflow skip), in fp32:
- FSDP2: the local shard of each DTensor parameter (`to_local()`); no gather per step.
- DeepSpeed ZeRO-3: each parameter's own partition `p.ds_tensor` (the flat slice `[rank*part, (rank+1)*part)` of the
  padded parameter that DeepSpeed gathers for every forward and refreshes after every step; the same tensors
  `ParallelEngine.parameters_finite` checks). Its dtype is the training dtype: fp32 under torch_autocast (vtrain's
  default), bf16/fp16 in DeepSpeed's full half modes, where the average then follows the rounded weights. The fp32
  master partitions live in the optimizer's flat groups, which have no stable per-parameter mapping.
- DDP, single process, ZeRO-1/2: the whole parameter (every rank holds it whole, as the module does).

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
import torch.distributed as dist
from torch import nn

from vtrain.dist import rank as dist_rank
from vtrain.engine import checkpoint as ckpt
from vtrain.errors import VtrainError


class WeightEMA:
    def __init__(self, engine: Any, decay: float, warmup: int = 0) -> None:
        """`engine`: a prepared ParallelEngine. The average starts from the current weights."""
        self.engine, self.decay, self.warmup = engine, decay, warmup
        self.kind = engine.plan.kind
        self.zero3 = self.kind == "deepspeed" and engine.plan.zero_stage == 3
        module = engine.model.module if self.kind == "deepspeed" else engine.unwrapped
        self.params: list[tuple[str, nn.Parameter]] = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.ema = [self._local(p).detach().float().clone() for _, p in self.params]
        self.updates = 0

    # ---- the tensors this rank owns ---------------------------------------------------------------------------
    def _local(self, p: nn.Parameter) -> torch.Tensor:
        if self.zero3:
            return p.ds_tensor
        if self.kind == "fsdp":
            return p.to_local()
        return p.data

    def local_fraction(self) -> float:
        """Share of the averaged parameters' elements this rank holds (1/N under FSDP2 and ZeRO-3), for run_info."""
        total = sum(p.ds_numel if self.zero3 else p.numel() for _, p in self.params)
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
            live = self._local(p)
            if live.numel():
                pair = by_device.setdefault(e.device, ([], []))
                pair[0].append(e)
                pair[1].append(live.float() if live.dtype != torch.float32 else live)
        for ema, live in by_device.values():
            torch._foreach_lerp_(ema, live, weight)

    # ---- whole tensors for saving -----------------------------------------------------------------------------
    def _gather(self, i: int) -> torch.Tensor | None:
        """The whole EMA of parameter i on rank 0 (CPU, fp32), None elsewhere. Collective under FSDP2 / ZeRO-3."""
        name, p = self.params[i]
        e = self.ema[i]
        main = self.engine.accelerator.is_main_process
        if self.kind == "fsdp":
            from torch.distributed.tensor import DTensor

            whole = DTensor.from_local(e.to(self.engine.device), p.device_mesh, p.placements, run_check=False,
                                       shape=p.shape, stride=p.stride()).full_tensor()
            return whole.cpu() if main else None
        if self.zero3:
            group = getattr(p, "ds_process_group", None)
            world = dist.get_world_size(group)
            part = e.to(self.engine.device)
            parts = [torch.empty_like(part) for _ in range(world)]
            dist.all_gather(parts, part, group=group)
            return torch.cat(parts)[: p.ds_numel].view(p.ds_shape).cpu() if main else None
        return e.detach().cpu().clone() if main else None

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
                if self.kind == "fsdp":
                    from torch.distributed.tensor import distribute_tensor

                    # src_data_rank=None: every rank slices the copy it read, no communication
                    local = distribute_tensor(whole.to(self.engine.device), p.device_mesh, p.placements,
                                              src_data_rank=None).to_local()
                elif self.zero3:
                    r = dist.get_rank(getattr(p, "ds_process_group", None))
                    flat = whole.reshape(-1)[r * e.numel():(r + 1) * e.numel()]
                    local = torch.zeros(e.numel())
                    local[: flat.numel()] = flat  # the last rank's partition is padded
                else:
                    local = whole
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
        if self.zero3:
            # A gathered ZeRO-3 parameter's forward reads its full `p.data`, not the partition exchanged below:
            # the small "persistent" ones (below stage3_param_persistence_threshold) stay gathered between steps,
            # others may still be after a forward. Release them all (DeepSpeed's public empty_partition_cache;
            # the partitions already hold the values) so every forward gathers from the partitions.
            self.engine.model.empty_partition_cache()
        for e, (_, p) in zip(self.ema, self.params):
            live = self._local(p)
            tmp = live.detach().clone()
            live.copy_(e)
            e.copy_(tmp)
        if self.zero3:
            # as DeepSpeed does after every step: persistent parameters gathered again, now from the new partitions
            persistent = self.engine.model.optimizer.persistent_parameters
            if persistent:
                persistent[0].all_gather(persistent)

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
