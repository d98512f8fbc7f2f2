"""The interface the Trainer, the checkpointer, the EMA and the sharded head use, and what DDP and FSDP2 share.

An engine applies parallelism and precision to a built model and runs the step on it: `shard` (before the optimizer
exists), `prepare`, then per step `sync_context`, `forward_context`, `all_finite`, `backward`, `step`; `save`/`load`
and `full_state_dict` for checkpoints; `local_tensor`, `whole_tensor`, `local_part` for the EMA, which averages what
this rank holds. One class per engine (ddp.py, fsdp.py, deepspeed.py), chosen once from the plan
(engine/engines/build.py): no method here or in the callers tests which engine runs. The class methods are what the
launch needs before an engine exists (the Accelerator's settings, the optimizer class, the log's first line).

The step of DDP and FSDP2 is torch's own: fp16 GradScaler, `clip_grad_norm_`, `optimizer.step()`. The sharded face
head (engine/head_shard.py) is one more optimizer the engine steps with the rest: its gradient enters the one global
norm every engine clips by, and it takes its update with the same norm and the schedule's multiplier, or drops its
gradients with a skipped update.
"""

from __future__ import annotations

import contextlib
import math
import socket
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from torch import nn

from vtrain.config import OptimConfig
from vtrain.dist import all_mean_, all_true
from vtrain.engine import active as act
from vtrain.engine.checkpoint import format as ckpt
from vtrain.engine.checkpoint import layout as engine_layout
from vtrain.engine import precision as prec
from vtrain.engine.head_shard import ShardedHead, lr_factor
from vtrain.engine.engines.plan import Plan


def free_port() -> int:
    """A free TCP port on this host, for a rendezvous vtrain sets up itself."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def persistent_buffers(module: nn.Module):
    """(name, buffer) pairs that `state_dict()` would hold: buffers registered with persistent=False are left out."""
    for mod_name, mod in module.named_modules():
        for name, b in mod.named_buffers(recurse=False):
            if b is not None and name not in mod._non_persistent_buffers_set:
                yield (f"{mod_name}.{name}" if mod_name else name), b


def average_buffers(module: nn.Module) -> None:
    """Average floating-point buffers (BatchNorm running stats) over ranks, in place. Collective."""
    for b in module.buffers():
        if b.is_floating_point():
            all_mean_(b.data)


class Engine:
    layout: engine_layout.EngineLayout = engine_layout.DDP
    """What this engine keeps of its own in a checkpoint (engine/checkpoint/layout.py)."""

    def __init__(self, plan: Plan, accelerator: Accelerator) -> None:
        self.plan, self.accelerator = plan, accelerator
        self.device = accelerator.device
        self.model: Any = None
        self.optimizer: Any = None
        self.head: ShardedHead | None = None
        self.scheduler: Any = None  # the schedule whose multiplier the sharded head's update takes (`follow`)
        self.norm_parts: dict[str, torch.Tensor] = {}  # step(): the backbone's and the sharded head's norms
        self.scaler = self._grad_scaler()

    def _grad_scaler(self) -> torch.amp.GradScaler | None:
        """fp16 loss scaling (torch's GradScaler) for the torch step."""
        return torch.amp.GradScaler(self.device.type) if self.plan.precision == "fp16" else None

    # ---- before the engine exists: the launch ---------------------------------------------------------------
    @classmethod
    def check_installed(cls) -> None:
        """Refuse, in one line, a library version whose internals this engine relies on and that is untested."""

    @classmethod
    def launch_environment(cls, plan: Plan) -> None:
        """Environment the Accelerator must see when it is built (engine/engines/accelerator.py)."""

    @classmethod
    def accelerator_options(cls, plan: Plan, cpu_only: bool) -> dict[str, Any]:
        """`gloo`: an explicit gloo process group; `cpu`: Accelerate's cpu flag (on CPU processes DDP needs it: with
        the gloo kwargs alone Accelerate stays at distributed type NO and `prepare` returns the bare model, measured
        with accelerate 1.15); `deepspeed_plugin`."""
        several = cpu_only and plan.world_size > 1
        return {"gloo": several, "cpu": several, "deepspeed_plugin": None}

    @classmethod
    def after_accelerator(cls, plan: Plan) -> None:
        """What the engine needs once the Accelerator exists (a process group of one for FSDP2)."""

    @classmethod
    def describe(cls, plan: Plan) -> str:
        """The engine in the run's first log line."""
        return "DDP"

    @classmethod
    def describe_precision(cls, plan: Plan) -> str:
        """The precision in the run's first log line."""
        return "fp32" if plan.precision == "no" else f"{plan.precision} autocast, fp32 master weights"

    @classmethod
    def estimator_fields(cls, plan: Plan) -> dict[str, Any]:
        """The memory estimator's Setup fields this engine decides (memory/setup.py), for `--grad-ckpt auto`."""
        return {"fsdp": False}

    @classmethod
    def make_optimizer(cls, plan: Plan, groups: list[dict], cfg: OptimConfig) -> torch.optim.Optimizer:
        """AdamW over the parameter groups (engine/optim.py)."""
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)

    # ---- build --------------------------------------------------------------------------------------------
    def check_sharded_head(self) -> None:
        """Refuse `--head-parallel sharded` where this engine cannot step it with the rest."""

    def shard(self, model: nn.Module) -> nn.Module:
        """Steps that must happen before the optimizer exists (FSDP2 replaces parameters with DTensors)."""
        return model

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                head: ShardedHead | None = None) -> tuple[Any, Any]:
        """Wrap model and optimizer (Accelerate's `prepare`); `head`: the sharded head stepped with them."""
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        self.head = head
        return self.model, self.optimizer

    def follow(self, scheduler: Any) -> None:
        """The LR schedule: the sharded head's update takes its multiplier (the backbone's groups get their LRs
        through `set_lrs`)."""
        self.scheduler = scheduler

    @property
    def unwrapped(self) -> nn.Module:
        return self.accelerator.unwrap_model(self.model)

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

    def all_finite(self, loss: torch.Tensor) -> bool:
        """Whether the loss is finite on every rank (all ranks must agree to skip, or collectives hang).

        The loop's one host sync per micro-batch: whether to run backward at all must be known on the host, because
        a backward over a NaN loss cannot be undone everywhere (DeepSpeed ZeRO-1/2 accumulates reduced gradients
        in partition buffers that `zero_grad` leaves alone), so the skip is decided before backward, not after."""
        return all_true(torch.isfinite(loss.detach()))

    def backward(self, loss: torch.Tensor, grad_accum: int) -> None:
        loss = loss / grad_accum
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward()

    def step(self, clip_grad: float) -> tuple[torch.Tensor, bool]:
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

    def _step_head(self, norm: torch.Tensor, applied: bool, clip_grad: float) -> None:
        """The sharded head's update after the backbone's, with the same norm, skip decision and LR multiplier."""
        if self.head is None:
            return
        if applied:
            self.head.step(lr_factor(self.scheduler), norm, clip_grad)
        else:
            self.head.zero_grad()

    def _stepping_optimizer(self) -> Any:
        """The optimizer that really steps (the torch optimizer inside Accelerate's wrapper)."""
        return self.optimizer.optimizer if hasattr(self.optimizer, "optimizer") else self.optimizer

    def param_groups(self) -> list[dict]:
        """The parameter groups of the optimizer that really steps (see `set_lrs`)."""
        return self._stepping_optimizer().param_groups

    def set_lrs(self, lrs: list[float]) -> None:
        """Push the schedule's LRs into the optimizer that really steps."""
        for group, lr in zip(self._stepping_optimizer().param_groups, lrs):
            group["lr"] = lr

    def current_lr(self) -> float:
        """The LR the optimizer will use next, read from the optimizer that really steps (first group)."""
        return float(self._stepping_optimizer().param_groups[0]["lr"])

    def zero_grad(self) -> None:
        """Drop the gradients of a skipped (non-finite) accumulation window, the sharded head's included."""
        self._stepping_optimizer().zero_grad(set_to_none=True)
        if self.head is not None:
            self.head.zero_grad()

    # ---- state --------------------------------------------------------------------------------------------
    def sync_buffers(self) -> None:
        """Make floating-point buffers (BatchNorm running stats) the same on every rank before a save or an
        evaluation. Collective where they differ. DDP broadcasts rank 0's buffers every forward: nothing to do."""

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model in fp32 on CPU, on rank 0 (None elsewhere). Collective: call on every rank."""
        main = self.accelerator.is_main_process
        sd = self._gathered_state(main)
        if not main:
            return None
        return {k: (v.float() if v.is_floating_point() else v).detach().cpu().contiguous() for k, v in sd.items()}

    def _gathered_state(self, main: bool) -> dict[str, torch.Tensor]:
        return self.unwrapped.state_dict() if main else {}

    def save(self, path: Path) -> None:
        """Model + optimizer + per-rank RNG (Accelerate's save_state). Collective where the engine's save is."""
        self.accelerator.save_state(str(path / ckpt.ACCELERATE), safe_serialization=True)

    def load(self, path: Path) -> None:
        """Model + optimizer + this rank's RNG. The files vtrain can check before they are read were checked by the
        checkpointer (its RNG state, Accelerate's optimizer file: engine/checkpoint/content_state.py)."""
        self.accelerator.load_state(str(path / ckpt.ACCELERATE))

    def needs_reshard(self, saved_engine: str, saved_world: int) -> bool:
        """Whether a checkpoint of `saved_engine` (train_state.json) written by `saved_world` processes is loaded
        through the engine's own reshard route (`load_resharded`) instead of `load`."""
        return False

    def use_reshard_route(self) -> None:
        """Before `prepare`: configure the reshard route (`needs_reshard`)."""
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

    def parameters_finite(self) -> bool:
        """Whether every parameter (this rank's part) is finite, on all ranks. Collective."""
        flag = torch.ones((), device=self.device)
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for t in (self.local_tensor(p) for p in self.model.parameters()):
            if t.numel():
                by_device.setdefault(t.device, []).append(t.detach())
        for tensors in by_device.values():
            # max |x| per tensor: inf for an inf, NaN for a NaN; one reduction per tensor, one sync in all
            peaks = torch.stack(torch._foreach_norm(tensors, float("inf")))
            flag = flag * torch.isfinite(peaks).all().to(flag.device)
        return all_true(flag)

    # ---- what is really active -----------------------------------------------------------------------------
    def active(self) -> dict[str, Any]:
        """Facts read from the live objects (not from flags), for this rank (engine/active.py)."""
        return {**act.common_facts(self.plan, self.accelerator, self.model, self.module), **self._own_facts()}

    def _own_facts(self) -> dict[str, Any]:
        return {"ddp_wrapped": isinstance(self.model, torch.nn.parallel.DistributedDataParallel)}

    def verify(self, info: dict[str, Any]) -> None:
        """Stop with a clear error if what runs is not what was asked for."""
        act.refuse(act.world_problems(self.plan, info) + self._own_problems(info))

    def _own_problems(self, info: dict[str, Any]) -> list[str]:
        return []
