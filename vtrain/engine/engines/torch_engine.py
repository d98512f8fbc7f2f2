"""The torch engine: one process, DDP (ddp.py) and FSDP2 (fsdp.py) share it.

Its step is torch's own: fp16 GradScaler, `clip_grad_norm_` (one global norm over the backbone and the sharded
head), `optimizer.step()`; its precision is torch autocast with fp32 master weights; its checkpoint is Accelerate's
`save_state` (the DDP layout, which FSDP2 extends with a torch distributed checkpoint). What DDP and FSDP2 add is
how gradients are synchronised over the accumulation window and, for FSDP2, that each rank holds a shard.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from torch import nn
from torch.distributed.tensor import DTensor

from vtrain.engine import precision as prec
from vtrain.engine.checkpoint import format as ckpt
from vtrain.engine.checkpoint import layout as engine_layout
from vtrain.engine.engines.base import Shared
from vtrain.engine.engines.plan import Plan


class TorchEngine(Shared):
    layout = engine_layout.DDP
    """What this engine keeps of its own in a checkpoint (engine/checkpoint/layout.py)."""

    def __init__(self, plan: Plan, accelerator: Accelerator) -> None:
        super().__init__(plan, accelerator)
        # fp16 loss scaling (torch's GradScaler) for the torch step
        self.scaler = torch.amp.GradScaler(self.device.type) if plan.precision == "fp16" else None

    # ---- before the engine exists: the launch ---------------------------------------------------------------
    @classmethod
    def accelerator_options(cls, plan: Plan, cpu_only: bool) -> dict[str, Any]:
        """`gloo`: an explicit gloo process group; `cpu`: Accelerate's cpu flag (on CPU processes DDP needs it: with
        the gloo kwargs alone Accelerate stays at distributed type NO and `prepare` returns the bare model, measured
        with accelerate 1.15); `deepspeed_plugin`."""
        several = cpu_only and plan.world_size > 1
        return {"gloo": several, "cpu": several, "deepspeed_plugin": None}

    def describe(self) -> str:
        """The engine in the run's first log line."""
        return "DDP"

    def describe_precision(self) -> str:
        """The precision in the run's first log line: what `forward_context` applies."""
        return "fp32" if self.plan.precision == "no" else f"{self.plan.precision} autocast, fp32 master weights"

    @classmethod
    def estimator_fields(cls, plan: Plan) -> dict[str, Any]:
        """The memory estimator's Setup fields this engine decides (memory/setup.py), for `--grad-ckpt auto`."""
        return {"fsdp": False}

    # ---- build --------------------------------------------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        """The model's own module, whose parameters and buffers the EMA, `sync_buffers` and the checks read."""
        return self.unwrapped

    @property
    def input_dtype(self) -> torch.dtype:
        """The dtype floating inputs are cast to."""
        return torch.float32

    @property
    def loss_scaled(self) -> bool:
        """Whether fp16 loss scaling may skip an update (the log then counts the overflow skips)."""
        return self.scaler is not None

    # ---- one step -----------------------------------------------------------------------------------------
    def forward_context(self) -> contextlib.AbstractContextManager:
        return prec.autocast(self.device.type, self.plan.precision)

    def sync_context(self, sync: bool) -> contextlib.AbstractContextManager:
        """Gradient synchronisation only on the last micro-batch of an accumulation window."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, grad_accum: int) -> None:
        loss = loss / grad_accum
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward()

    def _update(self, clip_grad: float) -> tuple[torch.Tensor, bool]:
        """Clip, update and zero gradients, the sharded head's included. Returns the global gradient norm (before
        clipping) as a 0-d tensor left on the device (reading it would wait for the step: the loop reads it once
        per log line) and whether the update was applied (False when fp16 loss scaling found an overflow and
        skipped it). With a sharded head the norm is the one global norm over backbone and head, exactly torch's
        clip_grad_norm_ over both, and `self.norm_parts` holds the two shares for the log (empty without one)."""
        self.norm_parts = {}
        head = self.head
        opt = self._stepping_optimizer()
        if self.scaler is not None:
            self.scaler.unscale_(opt)
            if head is not None:
                head.unscale_(self.scaler.get_scale())
        params = [p for p in self.model.parameters() if p.grad is not None]
        if head is None:
            norm = torch.nn.utils.clip_grad_norm_(params, clip_grad if clip_grad > 0 else math.inf)
            if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor
                norm = norm.full_tensor()
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
            if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor
                norm = norm.full_tensor()
            head_norm = head.grad_sq_norm().sqrt().to(norm.device)
            self.norm_parts = {"grad_norm_backbone": norm.float(), "grad_norm_head": head_norm}
            norm = (norm.float() ** 2 + head_norm ** 2).sqrt()
            if clip_grad > 0:
                torch.nn.utils.clip_grads_with_norm_(params, clip_grad, norm)
        applied = True
        if self.scaler is not None:
            scale = self.scaler.get_scale()
            self.scaler.step(opt)
            self.scaler.update()
            applied = self.scaler.get_scale() >= scale  # the scale backs off exactly when the step was skipped
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
        norm = norm.detach()
        self._step_head(norm, applied, clip_grad)
        return norm, applied

    def _stepping_optimizer(self) -> Any:
        """The optimizer that really steps (the torch optimizer inside Accelerate's wrapper)."""
        return self.optimizer.optimizer if hasattr(self.optimizer, "optimizer") else self.optimizer

    def zero_grad(self) -> None:
        """Drop the gradients of a skipped (non-finite) accumulation window, the sharded head's included."""
        self._stepping_optimizer().zero_grad(set_to_none=True)
        if self.head is not None:
            self.head.zero_grad()

    # ---- state --------------------------------------------------------------------------------------------
    def sync_buffers(self) -> None:
        """Make floating-point buffers (BatchNorm running stats) the same on every rank before a save or an
        evaluation. Collective where they differ. DDP broadcasts rank 0's buffers every forward: nothing to do."""

    def save(self, path: Path) -> None:
        """Model + optimizer + per-rank RNG (Accelerate's save_state). Collective where the engine's save is."""
        self.accelerator.save_state(str(path / ckpt.ACCELERATE), safe_serialization=True)

    def needs_reshard(self, saved_engine: str, saved_world: int) -> bool:
        """Whether a checkpoint of `saved_engine` (train_state.json) written by `saved_world` processes is loaded
        through the engine's own reshard route (`load_resharded`) instead of `load`: never, torch's checkpoints
        load on any number of processes."""
        return False

    def use_reshard_route(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no reshard route")

    def load_resharded(self, path: Path, work_dir: Path) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no reshard route")

    def optimizer_groups(self) -> list[list[tuple[str, torch.Tensor]]]:
        """The optimizer's parameters with their names, per group (DDP and one process: what optimizer.bin holds
        the state of, content_state.expect_optimizer)."""
        names = {id(p): n for n, p in self.unwrapped.named_parameters()}
        return [[(names.get(id(p), "?"), p) for p in g["params"]] for g in self._stepping_optimizer().param_groups]

    def optimizer_states(self) -> list[tuple[str, torch.Tensor, Any]]:
        """(name, parameter, state) of every parameter the stepping optimizer holds a state for, as loaded."""
        opt = self._stepping_optimizer()
        names = {id(p): n for n, p in self.unwrapped.named_parameters()}
        return [(names.get(id(p), "?"), p, opt.state[p]) for g in opt.param_groups for p in g["params"]
                if p in opt.state]

    def optimizer_file(self, path: Path) -> Path:
        """Where this rank's optimizer state lies in checkpoint `path` (for messages)."""
        return path / ckpt.ACCELERATE / "optimizer.bin"

    # ---- the tensors this rank holds (the EMA averages them, the finiteness check reads them) -------------------
    def local_tensor(self, p: nn.Parameter) -> torch.Tensor:
        """The part of parameter `p` this rank holds (the whole parameter here)."""
        return p.data

    def full_numel(self, p: nn.Parameter) -> int:
        return p.numel()

    def whole_tensor(self, p: nn.Parameter, local: torch.Tensor) -> torch.Tensor | None:
        """`local` (a tensor shaped like `local_tensor(p)`) made whole, on rank 0 on the CPU (None elsewhere).
        Collective where parameters are partitioned."""
        return local.detach().cpu().clone() if self.accelerator.is_main_process else None

    def local_part(self, p: nn.Parameter, whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """This rank's part of `whole` (a tensor of `p`'s full shape), shaped like `like` where the engine pads."""
        return whole

    @contextlib.contextmanager
    def writing_local_tensors(self):
        """Around in-place writes into `local_tensor`s (the EMA's swap): what the engine must refresh."""
        yield

    # ---- what is really active -----------------------------------------------------------------------------
    def partitions(self, p: torch.Tensor) -> bool:
        return isinstance(p, DTensor)  # torch's sharding (FSDP2's fully_shard) makes a parameter a DTensor

    def run_facts(self) -> dict[str, Any]:
        return {"engine": self.kind, "zero_stage": 0, "precision": self.plan.precision,
                "ds_precision_mode": ""}

    def _own_facts(self) -> dict[str, Any]:
        return {"ddp_wrapped": isinstance(self.model, torch.nn.parallel.DistributedDataParallel)}
