"""The engine interface (`Engine`: what the Trainer, the checkpointer, the EMA and the sharded head call) and what
every engine does alike (`Shared`).

An engine applies parallelism and precision to a built model and runs the step on it: `shard` (before the optimizer
exists), `prepare`, then per step `sync_context`, `forward_context`, `all_finite`, `backward`, `step` (or `skip`);
`save`/`load` and `full_state_dict` for checkpoints; `local_tensor`, `whole_tensor`, `local_part` for the EMA, which
averages what this rank holds. Two implementations: the torch engine (engine/engines/torch_engine.py: one process,
DDP and FSDP2, whose step is torch's own) and DeepSpeed (deepspeed.py, whose step, precision and files are
DeepSpeed's). The class is chosen once from the plan (engine/engines/build.py): no method here or in the callers
tests which engine runs. The class methods are what the launch needs before an engine exists (the Accelerator's
settings, the optimizer class, the estimator's fields).

`Shared` holds only what does not depend on how the step runs: the run's objects, Accelerate's prepare and load,
the LR written into the optimizer that really steps, the sharded head's update after the model's, the finiteness
check of the parameters this rank holds, and the check of what is really active. The sharded face head
(engine/head_shard.py) is one more optimizer the engine steps with the rest: its gradient enters the one global
norm every engine clips by, and it takes its update with the same norm and the schedule's multiplier, or drops its
gradients with a skipped update.
"""

from __future__ import annotations

import contextlib
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch
from accelerate import Accelerator
from torch import nn

from vtrain.config import OptimConfig
from vtrain.dist import all_mean_, all_true
from vtrain.engine import active as act
from vtrain.engine.checkpoint import format as ckpt
from vtrain.engine.checkpoint import layout as engine_layout
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


@dataclass(frozen=True)
class Update:
    """What one optimizer step did (`Engine.step`, `Engine.skip`)."""

    grad_norm: torch.Tensor | None
    """The global gradient norm before clipping, a 0-d tensor left on the device (None: a skipped window)."""
    applied: bool
    """Whether the update was applied (False: a skipped window, or fp16 loss scaling found an overflow)."""
    lr: float
    """The LR this step used (first group), read from the optimizer that steps before the schedule moved on: the
    LR in force at this step, the one the log reports."""


class Engine(Protocol):
    """What the rest of a run calls on its engine. The Trainer: the build (`check_sharded_head` through the head's
    builder, `shard`, `prepare`, `follow`, `active`, `verify`), the step (`input_dtype`, `sync_context`,
    `forward_context`, `all_finite`, `backward`, `step` or `skip`, `norm_parts`, `loss_scaled`,
    `parameters_finite`, `sync_buffers`) and what it records of the run, read from the live engine (`run_facts`
    for run_info.json, `describe` and `describe_precision` for the log's first line). The
    checkpointer: `layout`, `scaler`, `save`, `load`, the reshard route, `full_state_dict`, the optimizer's groups,
    states and file, `param_groups`/`set_lrs`. The EMA: `module` and the tensors this rank holds."""

    kind: ClassVar[str]
    """The engine's name (the plan's kind; train_state.json's `engine`)."""
    layout: ClassVar[engine_layout.EngineLayout]
    plan: Plan
    accelerator: Accelerator
    model: Any
    scaler: torch.amp.GradScaler | None
    norm_parts: dict[str, torch.Tensor]

    @classmethod
    def check_installed(cls) -> None: ...
    @classmethod
    def launch_environment(cls, plan: Plan) -> None: ...
    @classmethod
    def accelerator_options(cls, plan: Plan, cpu_only: bool) -> dict[str, Any]: ...
    @classmethod
    def after_accelerator(cls, plan: Plan) -> None: ...
    @classmethod
    def estimator_fields(cls, plan: Plan) -> dict[str, Any]: ...
    @classmethod
    def make_optimizer(cls, plan: Plan, groups: list[dict], cfg: OptimConfig) -> torch.optim.Optimizer: ...

    # build
    def check_sharded_head(self) -> None: ...
    def shard(self, model: nn.Module) -> nn.Module: ...
    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                head: ShardedHead | None = None) -> tuple[Any, Any]: ...
    def follow(self, scheduler: Any) -> None: ...
    @property
    def unwrapped(self) -> nn.Module: ...
    @property
    def module(self) -> nn.Module: ...
    @property
    def input_dtype(self) -> torch.dtype: ...
    @property
    def loss_scaled(self) -> bool: ...

    # one step
    def forward_context(self) -> contextlib.AbstractContextManager: ...
    def sync_context(self, sync: bool) -> contextlib.AbstractContextManager: ...
    def all_finite(self, loss: torch.Tensor) -> bool: ...
    def backward(self, loss: torch.Tensor, grad_accum: int) -> None: ...
    def step(self, clip_grad: float) -> Update: ...
    def skip(self) -> Update: ...
    def param_groups(self) -> list[dict]: ...
    def set_lrs(self, lrs: list[float]) -> None: ...

    # state
    def sync_buffers(self) -> None: ...
    def full_state_dict(self) -> dict[str, torch.Tensor] | None: ...
    def save(self, path: Path) -> None: ...
    def load(self, path: Path) -> None: ...
    def reads_checkpoint_of(self, saved_engine: str) -> bool: ...
    def needs_reshard(self, saved_engine: str, saved_world: int) -> bool: ...
    def use_reshard_route(self) -> None: ...
    def load_resharded(self, path: Path, work_dir: Path) -> None: ...
    def optimizer_groups(self) -> list[list[tuple[str, torch.Tensor]]]: ...
    def optimizer_states(self) -> list[tuple[str, torch.Tensor, Any]]: ...
    def optimizer_file(self, path: Path) -> Path: ...

    # the tensors this rank holds
    def local_tensor(self, p: nn.Parameter) -> torch.Tensor: ...
    def full_numel(self, p: nn.Parameter) -> int: ...
    def whole_tensor(self, p: nn.Parameter, local: torch.Tensor) -> torch.Tensor | None: ...
    def local_part(self, p: nn.Parameter, whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor: ...
    def writing_local_tensors(self) -> contextlib.AbstractContextManager: ...
    def parameters_finite(self) -> bool: ...

    # what is really active
    def active(self) -> dict[str, Any]: ...
    def verify(self, info: dict[str, Any]) -> None: ...
    def run_facts(self) -> dict[str, Any]: ...
    def describe(self) -> str: ...
    def describe_precision(self) -> str: ...


class Shared:
    """What every engine does alike, whatever runs its step (see the module's docstring). Subclasses say how the
    step runs, what they save and which tensors a rank holds."""

    kind: ClassVar[str]
    reads: ClassVar[tuple[str, ...]]
    """The engines (their `kind`) whose checkpoints this one resumes: those that wrote its layout."""

    def __init__(self, plan: Plan, accelerator: Accelerator) -> None:
        self.plan, self.accelerator = plan, accelerator
        self.device = accelerator.device
        self.model: Any = None
        self.optimizer: Any = None
        self.head: ShardedHead | None = None
        self.scheduler: Any = None  # the schedule whose multiplier the sharded head's update takes (`follow`)
        self.norm_parts: dict[str, torch.Tensor] = {}  # step(): the backbone's and the sharded head's norms

    # ---- before the engine exists: the launch ---------------------------------------------------------------
    @classmethod
    def check_installed(cls) -> None:
        """Refuse, in one line, a library version whose internals this engine relies on and that is untested."""

    @classmethod
    def launch_environment(cls, plan: Plan) -> None:
        """Environment the Accelerator must see when it is built (engine/engines/accelerator.py)."""

    @classmethod
    def after_accelerator(cls, plan: Plan) -> None:
        """What the engine needs once the Accelerator exists (a process group of one for FSDP2)."""

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
        """The LR schedule, which `step` advances after every applied update; the sharded head's update takes its
        multiplier, the backbone's groups get its LRs through `set_lrs`."""
        self.scheduler = scheduler

    @property
    def unwrapped(self) -> nn.Module:
        return self.accelerator.unwrap_model(self.model)

    # ---- one step -----------------------------------------------------------------------------------------
    def all_finite(self, loss: torch.Tensor) -> bool:
        """Whether the loss is finite on every rank (all ranks must agree to skip, or collectives hang).

        The loop's one host sync per micro-batch: whether to run backward at all must be known on the host, because
        a backward over a NaN loss cannot be undone everywhere (DeepSpeed ZeRO-1/2 accumulates reduced gradients
        in partition buffers that `zero_grad` leaves alone), so the skip is decided before backward, not after."""
        return all_true(torch.isfinite(loss.detach()))

    def step(self, clip_grad: float) -> Update:
        """Clip, update and zero gradients, the sharded head's included (`_update`: the engine's own step); after an
        applied update the schedule moves on and its LRs go into the optimizer that steps. Returns the step's norm,
        whether it was applied and the LR it used (the schedule and the EMA follow real updates only: an fp16
        overflow skip is none). Without a schedule (`follow` not called: the benchmarks' bare steps) the LRs stay."""
        lr = self.current_lr()
        norm, applied = self._update(clip_grad)
        if applied and self.scheduler is not None:
            self.scheduler.step()
            self.set_lrs(self.scheduler.get_last_lr())
        return Update(norm, applied, lr)

    def skip(self) -> Update:
        """A window with a non-finite loss on some rank: drop its gradients (the sharded head's included), leave the
        schedule where it is. Returns the LR in force, which this step did not use."""
        lr = self.current_lr()
        self.zero_grad()
        return Update(None, False, lr)

    def _update(self, clip_grad: float) -> tuple[torch.Tensor, bool]:
        """The engine's own step: (global gradient norm before clipping, whether the update was applied)."""
        raise NotImplementedError

    def zero_grad(self) -> None:
        """Drop the gradients of a skipped (non-finite) accumulation window, the sharded head's included."""
        raise NotImplementedError

    def _step_head(self, norm: torch.Tensor, applied: bool, clip_grad: float) -> None:
        """The sharded head's update after the backbone's, with the same norm, skip decision and LR multiplier."""
        if self.head is None:
            return
        if applied:
            self.head.step(lr_factor(self.scheduler), norm, clip_grad)
        else:
            self.head.zero_grad()

    def _stepping_optimizer(self) -> Any:
        """The optimizer that really steps (the object whose param_groups the update reads)."""
        raise NotImplementedError

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

    # ---- state --------------------------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model in fp32 on CPU, on rank 0 (None elsewhere). Collective: call on every rank."""
        main = self.accelerator.is_main_process
        sd = self._gathered_state(main)
        if not main:
            return None
        return {k: (v.float() if v.is_floating_point() else v).detach().cpu().contiguous() for k, v in sd.items()}

    def _gathered_state(self, main: bool) -> dict[str, torch.Tensor]:
        return self.unwrapped.state_dict() if main else {}

    def reads_checkpoint_of(self, saved_engine: str) -> bool:
        """Whether this engine resumes a checkpoint train_state.json says `saved_engine` wrote (its own layout)."""
        return saved_engine in self.reads

    def load(self, path: Path) -> None:
        """Model + optimizer + this rank's RNG. The files vtrain can check before they are read were checked by the
        checkpointer (its RNG state, Accelerate's optimizer file: engine/checkpoint/content_state.py)."""
        self.accelerator.load_state(str(path / ckpt.ACCELERATE))

    # ---- the tensors this rank holds ---------------------------------------------------------------------------
    def local_tensor(self, p: nn.Parameter) -> torch.Tensor:
        """The part of parameter `p` this rank holds."""
        raise NotImplementedError

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
        """Facts read from the live objects (not from flags), for this rank (engine/active.py); with a sharded head,
        its own facts and whether this engine holds its weight in parts (it must not: the head is beside the model
        the engine wraps)."""
        info = {**act.common_facts(self.plan, self.accelerator, self.model, self.module), **self._own_facts()}
        if self.head is not None:
            info.update(self.head.active(partitioned=self.partitions(self.head.fc.weight)))
        return info

    def partitions(self, p: torch.Tensor) -> bool:
        """Whether `p` is held in parts by this engine (a rank holds a shard of it)."""
        raise NotImplementedError

    def run_facts(self) -> dict[str, Any]:
        """The run's engine for run_info.json, read from the live engine: its name, ZeRO stage, precision and
        DeepSpeed's precision mode."""
        raise NotImplementedError

    def _own_facts(self) -> dict[str, Any]:
        return {}

    def verify(self, info: dict[str, Any]) -> None:
        """Stop with a clear error if what runs is not what was asked for."""
        act.refuse(act.world_problems(self.plan, info) + self._own_problems(info))

    def _own_problems(self, info: dict[str, Any]) -> list[str]:
        return []
