"""Parallelism and precision applied to a built model: the only module that knows DDP, FSDP2 and DeepSpeed.

DDP and DeepSpeed go through Accelerate (`accelerator.prepare`); FSDP2 is applied here with torch's
`fully_shard` because Accelerate skips it on CPU processes. The loop talks to this class only:
`sync_context`, `forward_context`, `backward`, `step`, `zero_grad`, `full_state_dict`, `save`/`load`. The
Accelerator it runs on is built by engine/accelerator.py; what is really active is read by engine/active.py.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from torch import nn

from vtrain import guarded
from vtrain.dist import all_mean_, all_true
from vtrain.engine import checkpoint as ckpt
from vtrain.engine import content_state
from vtrain.engine import precision as prec
from vtrain.engine.active import active_facts, verify_active
from vtrain.engine.compile import compiled_blocks
from vtrain.engine.ds_writes import guarded_save
from vtrain.engine.fsdp import apply_fsdp2
from vtrain.engine.plan import Plan
from vtrain.errors import VtrainError
from vtrain.safeio import check_dcp, dcp_refusals


def _persistent_buffers(module: nn.Module):
    """(name, buffer) pairs that `state_dict()` would hold: buffers registered with persistent=False are left out."""
    for mod_name, mod in module.named_modules():
        for name, b in mod.named_buffers(recurse=False):
            if b is not None and name not in mod._non_persistent_buffers_set:
                yield (f"{mod_name}.{name}" if mod_name else name), b


@contextlib.contextmanager
def _zero_norm_with_head(opt: Any, stage: int, head_norm: torch.Tensor):
    """Make the ZeRO optimizer's next `step()` clip by (and report) the global norm over its partitions AND the
    sharded head outside it, so `--clip-grad` is one global clip under DeepSpeed as under DDP/FSDP2.

    DeepSpeed computes the norm and applies the clip inside one `step()` that takes no outside term, so for that
    one call this shadows the instance's norm function (restored afterwards). It relies on DeepSpeed 0.19.8's
    internals: ZeRO-1/2 `DeepSpeedZeroOptimizer.step()` takes `scaled_global_norm()` (the loss-scaled norm, already
    reduced over ranks) for both `_global_grad_norm` and `unscale_and_clip_grads`; ZeRO-3
    `DeepSpeedZeroOptimizer_Stage3.step()` L2-combines the per-group norms of `_get_norm_groups()` with
    `combine_grad_norm_groups` and uses the result the same way (offload included). The head's norm (the same on
    every rank) enters as one more loss-scaled L2 term. Yields a dict that receives the backbone's unscaled
    norm ("norm") when DeepSpeed computed it."""
    name = {1: "scaled_global_norm", 2: "scaled_global_norm", 3: "_get_norm_groups"}.get(stage)
    if name is None or not callable(getattr(opt, name, None)) or not hasattr(opt, "loss_scale"):
        import deepspeed

        raise VtrainError(f"--head-parallel sharded under DeepSpeed {deepspeed.__version__} ZeRO-{stage}: its "
                          f"optimizer {type(opt).__name__} lacks `{name or 'scaled_global_norm'}`/`loss_scale`, "
                          "which one global clip norm over backbone and sharded head hooks into (written for "
                          "DeepSpeed 0.19.8 ZeRO-1/2/3); use a ZeRO stage 1-3 config or that DeepSpeed version")
    original, shadowed, seen = getattr(opt, name), vars(opt).get(name), {}

    def scaled_with_head(*args, **kwargs):
        out = original(*args, **kwargs)
        scale = float(opt.loss_scale)
        if stage == 3:  # a list of per-group norms (tensors or floats), which DeepSpeed L2-combines
            from deepspeed.runtime.utils import combine_grad_norm_groups

            dev = next((n.device for n in out if torch.is_tensor(n)), head_norm.device)
            seen["norm"] = combine_grad_norm_groups(out).to(dev) / scale if out else torch.zeros((), device=dev)
            return [*out, (head_norm * scale).to(dev)]
        seen["norm"] = out / scale  # the combined loss-scaled norm (an invalid one is inf: combining keeps it)
        return torch.sqrt(out ** 2 + (head_norm * scale).to(out.device) ** 2)

    setattr(opt, name, scaled_with_head)  # an instance attribute shadows the class method for this call
    try:
        yield seen
    finally:
        if shadowed is None:
            delattr(opt, name)
        else:
            setattr(opt, name, shadowed)


class ParallelEngine:
    def __init__(self, plan: Plan, accelerator: Accelerator) -> None:
        self.plan, self.accelerator = plan, accelerator
        self.device = accelerator.device
        self.model: Any = None
        self.optimizer: Any = None
        self.scaler = None
        self.norm_parts: dict[str, torch.Tensor] = {}  # step(): the backbone's and the sharded head's norms
        if plan.kind != "deepspeed" and plan.precision == "fp16":
            self.scaler = torch.amp.GradScaler(self.device.type)
        self.fsdp_units = 0
        self.bn_fp32_layers = 0

    # ---- build --------------------------------------------------------------------------------------------
    def shard(self, model: nn.Module) -> nn.Module:
        """Steps that must happen before the optimizer exists (FSDP2 replaces parameters with DTensors)."""
        if self.plan.kind == "fsdp":
            if not self.plan.fsdp_offload:
                model.to(self.device)
            self.fsdp_units = apply_fsdp2(model, self.plan.precision, self.plan.fsdp_offload,
                                          self.plan.fsdp_reshard_after_forward)
        if self.plan.kind == "deepspeed" and self.plan.ds_precision_mode in ("bf16", "fp16"):
            self.bn_fp32_layers = prec.keep_batchnorm_fp32(model)
        if self.plan.kind == "deepspeed" and self.plan.zero_stage == 3:
            from deepspeed.utils import set_z3_leaf_module

            # --compile under ZeRO-3: each compiled block becomes one ZeRO-3 unit (a "leaf": its own hooks gather
            # all of its parameters, its submodules get none), as each block is one FSDP2 unit. ZeRO-3's hooks on
            # submodules would run inside the compiled forward, where DeepSpeed skips them (a graph break at each)
            # and no longer gathers a parameter read outside its module's forward (the Swin blocks' relative-
            # position table: a size-0 tensor, measured with DeepSpeed 0.19.8). Set before `prepare`, which
            # registers the hooks.
            for block in compiled_blocks(model):
                set_z3_leaf_module(block, True)
        return model

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[Any, Any]:
        if self.plan.kind == "fsdp":
            self.model, self.optimizer = model, optimizer
        else:
            self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        return self.model, self.optimizer

    @property
    def unwrapped(self) -> nn.Module:
        return self.accelerator.unwrap_model(self.model) if self.plan.kind != "fsdp" else self.model

    @property
    def input_dtype(self) -> torch.dtype:
        """DeepSpeed's full bf16/fp16 modes need inputs in the parameter dtype; every other mode takes fp32."""
        if self.plan.kind == "deepspeed" and self.plan.ds_precision_mode in ("bf16", "fp16"):
            return prec.DTYPES[self.plan.ds_precision_mode]
        return torch.float32

    # ---- one step -----------------------------------------------------------------------------------------
    def forward_context(self) -> contextlib.AbstractContextManager:
        # DeepSpeed runs its own autocast (torch_autocast mode) inside engine.forward; nesting ours would warn.
        if self.plan.kind == "deepspeed":
            if self.plan.zero_stage == 3 and self.plan.ds_precision_mode == "torch_autocast":
                return prec.no_weight_cast_cache()
            return contextlib.nullcontext()
        return prec.autocast(self.device.type, self.plan.precision)

    def sync_context(self, sync: bool) -> contextlib.AbstractContextManager:
        """Gradient synchronisation only on the last micro-batch of an accumulation window."""
        if self.plan.kind == "ddp" and not sync:
            return self.model.no_sync()
        if self.plan.kind == "fsdp":
            self.model.set_requires_gradient_sync(sync)
        if self.plan.kind == "deepspeed":
            self.model.set_gradient_accumulation_boundary(is_boundary=sync)
        return contextlib.nullcontext()

    def all_finite(self, loss: torch.Tensor) -> bool:
        """Whether the loss is finite on every rank (all ranks must agree to skip, or collectives hang).

        The loop's one host sync per micro-batch: whether to run backward at all must be known on the host, because
        a backward over a NaN loss cannot be undone everywhere (DeepSpeed ZeRO-1/2 accumulates reduced gradients
        in partition buffers that `zero_grad` leaves alone), so the skip is decided before backward, not after."""
        return all_true(torch.isfinite(loss.detach()))

    def backward(self, loss: torch.Tensor, grad_accum: int) -> None:
        if self.plan.kind == "deepspeed":
            self.model.backward(loss)  # DeepSpeed divides by gradient_accumulation_steps itself
            return
        loss = loss / grad_accum
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward()

    def step(self, clip_grad: float, head: Any = None) -> tuple[torch.Tensor, bool]:
        """Clip, update and zero gradients. Returns the global gradient norm (before clipping) as a 0-d tensor left
        on the device (reading it would wait for the step: the loop reads it once per log line) and whether the
        update was applied (False when fp16 loss scaling found an overflow and skipped it).

        `head`: the sharded face head outside the engine (engine/head_shard.py). The norm returned is then the one
        global norm over backbone and head, and every engine clips the backbone by it: exactly torch's
        clip_grad_norm_ over both (under DeepSpeed ZeRO-1/2/3 by handing the head's norm to the ZeRO optimizer's
        own norm, `_zero_norm_with_head`). The head applies its own update afterwards with that same norm.
        `self.norm_parts` then holds the backbone's and the head's norms for the log (empty without a head)."""
        self.norm_parts = {}
        if self.plan.kind == "deepspeed":
            if head is None:
                self.model.step()  # clipping from the filled gradient_clipping value
            else:
                head_norm = head.grad_sq_norm().sqrt()  # collective: before the step, on every rank
                with _zero_norm_with_head(self.model.optimizer, self.plan.zero_stage, head_norm) as backbone:
                    self.model.step()
                if "norm" in backbone:  # the norm was computed (no fp16 overflow, compute_grad_norm on)
                    self.norm_parts = {"grad_norm_backbone": backbone["norm"], "grad_norm_head": head_norm}
            norm = self.model.get_global_grad_norm()  # DeepSpeed's own: the norm it clipped with
            applied = bool(getattr(self.model, "was_step_applied", lambda: True)())
            norm = torch.as_tensor(float("nan") if norm is None else norm, dtype=torch.float32)
            return norm, applied
        opt = self.optimizer.optimizer if hasattr(self.optimizer, "optimizer") else self.optimizer
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
        return norm.detach(), applied

    def _stepping_optimizer(self) -> Any:
        if self.plan.kind == "deepspeed":
            return self.model.optimizer  # the ZeRO wrapper; its param_groups are the ones it steps with
        return self.optimizer.optimizer if hasattr(self.optimizer, "optimizer") else self.optimizer

    def param_groups(self) -> list[dict]:
        """The parameter groups of the optimizer that really steps (see `set_lrs`)."""
        return self._stepping_optimizer().param_groups

    def set_lrs(self, lrs: list[float]) -> None:
        """Push the schedule's LRs into the optimizer that really steps. Under DeepSpeed that is not always the
        object the scheduler was built on: after a ZeRO-3 checkpoint load the wrapper holds new param-group
        dicts, and LRs written to the client optimizer never arrive (measured: a resumed ZeRO-3+offload run kept
        the LR of its checkpoint step while the schedule moved on)."""
        for group, lr in zip(self._stepping_optimizer().param_groups, lrs):
            group["lr"] = lr

    def current_lr(self) -> float:
        """The LR the optimizer will use next, read from the optimizer that really steps (first group)."""
        return float(self._stepping_optimizer().param_groups[0]["lr"])

    def zero_grad(self) -> None:
        """Drop the gradients of a skipped (non-finite) accumulation window."""
        if self.plan.kind == "deepspeed":
            self.model.zero_grad()
        else:
            (self.optimizer.optimizer if hasattr(self.optimizer, "optimizer") else self.optimizer).zero_grad(
                set_to_none=True)

    # ---- state --------------------------------------------------------------------------------------------
    def sync_buffers(self) -> None:
        """Average floating-point buffers (BatchNorm running stats) over ranks, in place. Collective.

        DDP broadcasts rank 0's buffers every forward; FSDP2 and DeepSpeed leave each rank with statistics of
        its own data, and their checkpoints keep one rank's copy (DCP even picks the writer rank per tensor for
        load balance). Averaging before every save and evaluation gives one consistent model: what is saved
        is what every rank continues with, so a resumed run matches an uninterrupted one."""
        if self.plan.kind not in ("fsdp", "deepspeed"):
            return
        module = self.model.module if self.plan.kind == "deepspeed" else self.model
        for b in module.buffers():
            if b.is_floating_point():
                all_mean_(b.data)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model in fp32 on CPU, on rank 0 (None elsewhere). Collective: call on every rank."""
        main = self.accelerator.is_main_process
        if self.plan.kind == "fsdp":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        elif self.plan.kind == "deepspeed" and self.plan.zero_stage == 3:
            import deepspeed

            sd = {}
            module = self.model.module
            for name, p in module.named_parameters():
                with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                    if main:
                        sd[name] = p.detach().float().cpu().clone()
            for name, b in _persistent_buffers(module):  # as state_dict: timm's relative_position_index is not
                if main:
                    sd[name] = b.detach().cpu().clone()
        else:
            sd = self.unwrapped.state_dict() if main else {}
        if not main:
            return None
        return {k: (v.float() if v.is_floating_point() else v).detach().cpu().contiguous() for k, v in sd.items()}

    def save(self, path: Path) -> None:
        """Model + optimizer + per-rank RNG. Collective; a failed write is raised once every rank has run every
        collective of the save (DeepSpeed's own writes: ds_writes.py; DCP collects every rank's error)."""
        if self.plan.kind == "deepspeed":
            with guarded_save(self.model, path / ckpt.ACCELERATE, ckpt.DS_TAG) as ds_kwargs:
                self.accelerator.save_state(str(path / ckpt.ACCELERATE), safe_serialization=True, **ds_kwargs)
            return
        self.accelerator.save_state(str(path / ckpt.ACCELERATE), safe_serialization=True)
        if self.plan.kind == "fsdp":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict

            msd, osd = get_state_dict(self.model, self.optimizer)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path / ckpt.FSDP))

    def load(self, path: Path) -> None:
        """Model + optimizer + this rank's RNG. The files vtrain can check before they are read were checked by the
        checkpointer (its RNG state, Accelerate's optimizer file: engine/content_state.py); FSDP2's distributed
        checkpoint is checked here against the state it is loaded into. Collective under FSDP2 and DeepSpeed."""
        self.accelerator.load_state(str(path / ckpt.ACCELERATE))
        if self.plan.kind == "fsdp":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

            if not (path / ckpt.FSDP).is_dir():
                raise VtrainError(f"--resume: {path} holds no FSDP state (was it saved by another engine?)")
            check_dcp([path / ckpt.FSDP])  # DCP reads its .metadata with plain pickle.load
            msd, osd = get_state_dict(self.model, self.optimizer)
            state = {"model": msd, "optim": osd}
            # the same metadata on every rank: all ranks stop alike (no collective is left waiting)
            content_state.expect_dcp(path / ckpt.FSDP, state, "--resume")
            with dcp_refusals(path / ckpt.FSDP):
                dcp.load(state, checkpoint_id=str(path / ckpt.FSDP))
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])

    def optimizer_groups(self) -> list[list[tuple[str, torch.Tensor]]]:
        """The optimizer's parameters with their names, per group (DDP and one process: what optimizer.bin holds
        the state of, content_state.expect_optimizer)."""
        names = {id(p): n for n, p in self.unwrapped.named_parameters()}
        return [[(names.get(id(p), "?"), p) for p in g["params"]] for g in self._stepping_optimizer().param_groups]

    def optimizer_states(self) -> list[tuple[str, torch.Tensor, Any]]:
        """(name, parameter, state) of every parameter the stepping optimizer holds a state for, as loaded: the
        model's parameters (DDP, FSDP2: DTensors), DeepSpeed's flat fp32 partitions ("group G" of its base
        optimizer). Empty where DeepSpeed swaps the state out to NVMe (not in memory to check)."""
        opt = self._stepping_optimizer()
        if self.plan.kind == "deepspeed":
            if getattr(opt, "swap_optimizer", False):
                return []
            opt = getattr(opt, "optimizer", opt)  # the torch optimizer over the flat partitions
            return [(f"group {i}" + (f" part {j}" if len(g["params"]) > 1 else ""), p, opt.state[p])
                    for i, g in enumerate(opt.param_groups) for j, p in enumerate(g["params"]) if p in opt.state]
        names = {id(p): n for n, p in self.unwrapped.named_parameters()}
        return [(names.get(id(p), "?"), p, opt.state[p]) for g in opt.param_groups for p in g["params"]
                if p in opt.state]

    def optimizer_file(self, path: Path) -> Path:
        """Where this rank's optimizer state lies in checkpoint `path` (for messages)."""
        if self.plan.kind == "fsdp":
            return path / ckpt.FSDP
        if self.plan.kind == "deepspeed":
            mine = sorted((path / ckpt.ACCELERATE / ckpt.DS_TAG).glob(
                f"*zero_pp_rank_{self.accelerator.process_index}_*optim_states.pt"))
            return mine[0] if mine else path / ckpt.ACCELERATE / ckpt.DS_TAG
        return path / ckpt.ACCELERATE / "optimizer.bin"

    def use_universal_checkpoint(self) -> None:
        """Before prepare: the DeepSpeed engine will load a universal checkpoint (another world size). Accelerate
        hands this dict to deepspeed.initialize in prepare."""
        self.accelerator.state.deepspeed_plugin.deepspeed_config.setdefault("checkpoint", {})["load_universal"] = True

    def parameters_finite(self) -> bool:
        """Whether every parameter (this rank's shard under ZeRO-3 / FSDP2) is finite, on all ranks. Collective."""
        from torch.distributed.tensor import DTensor

        if self.plan.kind == "deepspeed" and self.plan.zero_stage == 3:
            local = [p.ds_tensor for p in self.model.module.parameters()]
        else:
            local = [p.to_local() if isinstance(p, DTensor) else p for p in self.model.parameters()]
        flag = torch.ones((), device=self.device)
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for t in local:
            if t.numel():
                by_device.setdefault(t.device, []).append(t.detach())
        for tensors in by_device.values():
            # max |x| per tensor: inf for an inf, NaN for a NaN; one reduction per tensor, one sync in all
            peaks = torch.stack(torch._foreach_norm(tensors, float("inf")))
            flag = flag * torch.isfinite(peaks).all().to(flag.device)
        return all_true(flag)

    def load_resharded_deepspeed(self, path: Path, work_dir: Path) -> None:
        """Resume a ZeRO checkpoint saved by another number of processes: convert it once to DeepSpeed's universal
        format (rank 0, into `work_dir`, atomically), load that (the engine was built with "load_universal"), then
        restore what the universal load leaves at its fresh initialisation: BatchNorm (and other) buffers and
        frozen parameters (docs/memory_ckpt.md §4), taken from the checkpoint's full fp32 model.safetensors.
        Per-rank RNG states are not restored (there is no rank-to-rank mapping); the data position is."""
        import contextlib
        import io
        from types import SimpleNamespace

        import deepspeed
        from safetensors.torch import load_file

        src = path / ckpt.ACCELERATE / ckpt.DS_TAG
        dst = work_dir / ckpt.UNIVERSAL / path.name
        if not src.is_dir():
            raise VtrainError(f"--resume: {path} holds no DeepSpeed checkpoint ({src} is missing)")
        if self.accelerator.is_main_process and not (dst / "latest_universal").is_file():
            from deepspeed.checkpoint import ds_to_universal

            tmp = dst.with_name(f".tmp-{dst.name}")
            guarded.rmtree(work_dir, tmp)  # a stale conversion of a killed run; never through a link
            args = SimpleNamespace(input_folder=str(src), output_folder=str(tmp / ckpt.DS_TAG),
                                   num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                                   inject_missing_state=True)
            with contextlib.redirect_stdout(io.StringIO()):
                ds_to_universal.main(args)
            (tmp / "latest_universal").write_text(ckpt.DS_TAG)
            tmp.rename(dst)
        self.accelerator.wait_for_everyone()
        self.model.load_checkpoint(str(dst), tag=ckpt.DS_TAG, load_optimizer_states=True,
                                   load_lr_scheduler_states=False)
        full = load_file(str(path / ckpt.MODEL))
        module = self.model.module
        with torch.no_grad():
            for name, b in _persistent_buffers(module):
                b.copy_(full[name].to(b.dtype))
            for name, p in module.named_parameters():
                if p.requires_grad:
                    continue
                if self.plan.zero_stage == 3:
                    with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                        if self.accelerator.is_main_process:
                            p.copy_(full[name].to(p.dtype))
                else:
                    p.copy_(full[name].to(p.dtype))

    # ---- what is really active -----------------------------------------------------------------------------
    def active(self) -> dict[str, Any]:
        """Facts read from the live objects (not from flags), for this rank (engine/active.py)."""
        return active_facts(self.plan, self.accelerator, self.model, self.unwrapped, self.fsdp_units)

    def verify(self, info: dict[str, Any]) -> None:
        """Stop with a clear error if what runs is not what was asked for (engine/active.py)."""
        verify_active(self.plan, info)
