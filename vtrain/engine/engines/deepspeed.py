"""DeepSpeed ZeRO-0/1/2/3 through Accelerate (`accelerator.prepare` builds the DeepSpeed engine from the filled JSON).

DeepSpeed owns backward (it divides by the accumulation count), the step (its own clipping, from the filled
`gradient_clipping`), precision (its `torch_autocast` mode, or its full bf16/fp16 modes) and its checkpoint files
(through engine/engines/ds_writes.py). Under ZeRO-3 each rank holds a flat partition of every parameter (`p.ds_tensor`).

vtrain relies on DeepSpeed internals in a few places: the ZeRO optimizer's norm functions (ds_internals.py: one
global clip over backbone and sharded head), the engine's checkpoint writes (engine/engines/ds_writes.py), ZeRO-3's
persistent parameters (the EMA's swap) and the universal checkpoint converter. `check_installed` refuses, in one
line at start-up, a DeepSpeed outside the range they were tested on (ds_internals.TESTED, pyproject.toml's range).
"""

from __future__ import annotations

import contextlib
import io
import os
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from accelerate.utils import DeepSpeedPlugin
from safetensors.torch import load_file
from torch import nn

from vtrain.io import guarded
from vtrain.config import OptimConfig
from vtrain.config.ds_json import bucket_sizes, stage3_sizes, zero_settings
from vtrain.engine.checkpoint import format as ckpt
from vtrain.engine.checkpoint import layout as engine_layout
from vtrain.engine import precision as prec
from vtrain.engine.compile import compiled_blocks
from vtrain.engine.ds_ops import announce_builds, quiet_other_ranks
from vtrain.engine.engines.ds_writes import guarded_save
from vtrain.engine.engines.base import Shared, average_buffers, free_port, persistent_buffers
from vtrain.engine.engines.ds_internals import TESTED, check_version, zero_norm_with_head
from vtrain.engine.engines.plan import Plan
from vtrain.errors import VtrainError
from vtrain.io.safeio import enforce_weights_only

class DeepSpeedEngine(Shared):
    """The engine interface (base.Engine) over DeepSpeed's engine; nothing of the torch engine's step, precision or
    files is inherited."""

    kind, reads = "deepspeed", ("deepspeed",)
    layout = engine_layout.DEEPSPEED

    def __init__(self, plan: Plan, accelerator: Any) -> None:
        super().__init__(plan, accelerator)
        self.scaler = None  # DeepSpeed scales fp16 losses itself (its loss scale is in its own checkpoint)
        self.zero3 = plan.zero_stage == 3
        self.bn_fp32_layers = 0

    # ---- before the engine exists: the launch ---------------------------------------------------------------
    @classmethod
    def check_installed(cls, installed: str | None = None) -> None:
        if installed is None:
            try:
                installed = version("deepspeed")
            except PackageNotFoundError:
                raise VtrainError("--ds-config: DeepSpeed is not installed "
                                  f"(pip install 'deepspeed{TESTED}')") from None
        check_version(installed)

    @classmethod
    def launch_environment(cls, plan: Plan) -> None:
        enforce_weights_only()  # DeepSpeed's checkpoint types admitted (io/safeio.py): only a DeepSpeed run imports it
        announce_builds()  # DeepSpeed's C++ ops compiled on first use: a line before and after (ds_ops.py)
        quiet_other_ranks()  # torch's and DeepSpeed's start-up warnings once, from rank 0
        if "RANK" not in os.environ:
            # A plain `vtrain train --ds-config ...` (or `accelerate launch` with one process) sets no rendezvous;
            # DeepSpeed would then try MPI discovery and fail on "No module named 'mpi4py'".
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(free_port()))

    @classmethod
    def accelerator_options(cls, plan: Plan, cpu_only: bool) -> dict[str, Any]:
        os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)  # the plugin below is the only DeepSpeed source
        # `accelerate launch --config_file` with a deepspeed_config section lists the YAML's keys here, and the
        # plugin then refuses any JSON file ("the following accelerate config variables will be ignored",
        # measured with accelerate 1.15 and accelerate_configs/deepspeed.yaml). The plan has already read
        # what it needs from that YAML, and vtrain fills the JSON from its own flags: one owner per knob.
        os.environ.pop("ACCELERATE_CONFIG_DS_FIELDS", None)
        # DeepSpeed creates a process group even for one process: gloo on CPU. cpu=True would drop DeepSpeed.
        return {"gloo": cpu_only, "cpu": False, "deepspeed_plugin": DeepSpeedPlugin(hf_ds_config=plan.ds_config)}

    def describe(self) -> str:
        """Read from DeepSpeed's engine: its ZeRO stage and what it offloads."""
        model = self.model
        stage = model.zero_optimization_stage()
        off = [n for n, on in (("optimizer", stage and model.zero_offload_optimizer()),
                               ("params", stage == 3 and model.zero_offload_param())) if on]
        return f"DeepSpeed ZeRO-{stage}" + (f" (offload {'+'.join(off)} to CPU)" if off else "")

    def describe_precision(self) -> str:
        """Read from DeepSpeed's engine: which of its precision modes is on (`run_facts`)."""
        return {"torch_autocast": f"{self.plan.precision} autocast, fp32 master weights (DeepSpeed torch_autocast)",
                "bf16": "DeepSpeed full bf16 (BatchNorm kept fp32)", "fp16": "DeepSpeed fp16 + loss scaling",
                "fp32": "fp32"}[self.run_facts()["ds_precision_mode"]]

    @classmethod
    def estimator_fields(cls, plan: Plan) -> dict[str, Any]:
        zero = zero_settings(plan.ds_config)
        prefetch, persistence = stage3_sizes(plan.ds_config)
        return {"fsdp": False, "zero": plan.zero_stage, "ds_buckets": bucket_sizes(plan.ds_config),
                "overlap_comm": zero.overlap_comm, "ds_prefetch": prefetch, "ds_persistence": persistence,
                "offload": "all" if plan.offload_params else ("optimizer" if plan.offload_optimizer else "none"),
                "ds_16bit": plan.ds_precision_mode in ("bf16", "fp16")}

    @classmethod
    def make_optimizer(cls, plan: Plan, groups: list[dict], cfg: OptimConfig) -> torch.optim.Optimizer:
        if plan.offload_optimizer:
            # ZeRO-Offload steps on the CPU and requires DeepSpeed's CPU Adam (compiled once per machine: ds_ops.py)
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            return DeepSpeedCPUAdam(groups, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay,
                                    adamw_mode=True)
        return super().make_optimizer(plan, groups, cfg)

    # ---- build --------------------------------------------------------------------------------------------
    def check_sharded_head(self) -> None:
        if self.plan.ds_precision_mode == "fp16":
            # DeepSpeed's fp16 loss scale is applied inside engine.backward and its overflow check covers only the
            # engine's own partitions; the head would get scaled, unchecked gradients
            raise VtrainError("--head-parallel sharded does not support DeepSpeed fp16 loss scaling; use bf16 or "
                              "torch_autocast in the DeepSpeed config, or --mixed-precision fp16 without DeepSpeed")

    def shard(self, model: nn.Module) -> nn.Module:
        if self.plan.ds_precision_mode in ("bf16", "fp16"):
            self.bn_fp32_layers = prec.keep_batchnorm_fp32(model)
        if self.zero3:
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

    @property
    def module(self) -> nn.Module:
        return self.model.module

    @property
    def input_dtype(self) -> torch.dtype:
        """DeepSpeed's full bf16/fp16 modes need inputs in the parameter dtype; torch_autocast and fp32 take fp32."""
        if self.plan.ds_precision_mode in ("bf16", "fp16"):
            return prec.DTYPES[self.plan.ds_precision_mode]
        return torch.float32

    @property
    def loss_scaled(self) -> bool:
        return self.plan.ds_precision_mode == "fp16"

    # ---- one step -----------------------------------------------------------------------------------------
    def forward_context(self) -> contextlib.AbstractContextManager:
        # DeepSpeed runs its own autocast (torch_autocast mode) inside engine.forward; nesting ours would warn.
        if self.plan.zero_stage == 3 and self.plan.ds_precision_mode == "torch_autocast":
            return prec.no_weight_cast_cache()
        return contextlib.nullcontext()

    def sync_context(self, sync: bool) -> contextlib.AbstractContextManager:
        self.model.set_gradient_accumulation_boundary(is_boundary=sync)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, grad_accum: int) -> None:
        self.model.backward(loss)  # DeepSpeed divides by gradient_accumulation_steps itself

    def _update(self, clip_grad: float) -> tuple[torch.Tensor, bool]:
        """DeepSpeed's own step, clipping from the filled gradient_clipping value. With the sharded head, the head's
        norm is handed to the ZeRO optimizer's own norm for that step (`zero_norm_with_head`), so the norm returned
        (DeepSpeed's: the one it clipped with) is the global one over both."""
        self.norm_parts = {}
        if self.head is None:
            self.model.step()
        else:
            head_norm = self.head.grad_sq_norm().sqrt()  # collective: before the step, on every rank
            with zero_norm_with_head(self.model.optimizer, self.plan.zero_stage, head_norm) as backbone:
                self.model.step()
            if "norm" in backbone:  # the norm was computed (no fp16 overflow, compute_grad_norm on)
                self.norm_parts = {"grad_norm_backbone": backbone["norm"], "grad_norm_head": head_norm}
        norm = self.model.get_global_grad_norm()
        applied = bool(getattr(self.model, "was_step_applied", lambda: True)())
        norm = torch.as_tensor(float("nan") if norm is None else norm, dtype=torch.float32)
        self._step_head(norm, applied, clip_grad)
        return norm, applied

    def _stepping_optimizer(self) -> Any:
        """The ZeRO wrapper: its param_groups are the ones it steps with. It is not always the object the scheduler
        was built on: after a ZeRO-3 checkpoint load it holds new param-group dicts, and LRs written to the client
        optimizer never arrive (measured: a resumed ZeRO-3+offload run kept the LR of its checkpoint step while the
        schedule moved on), so `set_lrs` writes here."""
        return self.model.optimizer

    def zero_grad(self) -> None:
        self.model.zero_grad()
        if self.head is not None:
            self.head.zero_grad()

    # ---- state --------------------------------------------------------------------------------------------
    def sync_buffers(self) -> None:
        """Average floating-point buffers over ranks: DeepSpeed leaves each rank with statistics of its own data and
        its checkpoint keeps one rank's copy. Collective."""
        average_buffers(self.model.module)

    def _gathered_state(self, main: bool) -> dict[str, torch.Tensor]:
        if not self.zero3:
            return super()._gathered_state(main)
        import deepspeed

        sd = {}
        module = self.model.module
        for name, p in module.named_parameters():
            with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                if main:
                    sd[name] = p.detach().float().cpu().clone()
        for name, b in persistent_buffers(module):  # as state_dict: timm's relative_position_index is not
            if main:
                sd[name] = b.detach().cpu().clone()
        return sd

    def save(self, path: Path) -> None:
        """A failed write of DeepSpeed's is raised once every rank has run every collective of the save
        (ds_writes.py). Collective."""
        with guarded_save(self.model, path / ckpt.ACCELERATE, ckpt.DS_TAG) as ds_kwargs:
            self.accelerator.save_state(str(path / ckpt.ACCELERATE), safe_serialization=True, **ds_kwargs)

    def needs_reshard(self, saved_engine: str, saved_world: int) -> bool:
        """A ZeRO checkpoint of another world size: DeepSpeed's own loader refuses it."""
        return self.reads_checkpoint_of(saved_engine) and saved_world != self.accelerator.num_processes

    def use_reshard_route(self) -> None:
        """The engine will load a universal checkpoint. Accelerate hands this dict to deepspeed.initialize in
        prepare."""
        self.accelerator.state.deepspeed_plugin.deepspeed_config.setdefault("checkpoint", {})["load_universal"] = True

    def load_resharded(self, path: Path, work_dir: Path) -> None:
        """Resume a ZeRO checkpoint saved by another number of processes: convert it once to DeepSpeed's universal
        format (rank 0, into `work_dir`, atomically), load that, then restore what the universal load leaves at its
        fresh initialisation: BatchNorm (and other) buffers and frozen parameters (docs/memory_ckpt.md §4), taken
        from the checkpoint's full fp32 model.safetensors. Per-rank RNG states are not restored (there is no
        rank-to-rank mapping); the data position is."""
        import deepspeed

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
            for name, b in persistent_buffers(module):
                b.copy_(full[name].to(b.dtype))
            for name, p in module.named_parameters():
                if p.requires_grad:
                    continue
                if self.zero3:
                    with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                        if self.accelerator.is_main_process:
                            p.copy_(full[name].to(p.dtype))
                else:
                    p.copy_(full[name].to(p.dtype))

    def optimizer_groups(self) -> list[list[tuple[str, torch.Tensor]]]:
        """No Accelerate optimizer file to check before loading (the layout names none): DeepSpeed's partitions
        are checked once loaded (`optimizer_states`)."""
        return []

    def optimizer_states(self) -> list[tuple[str, torch.Tensor, Any]]:
        """DeepSpeed's flat fp32 partitions ("group G" of its base optimizer), as loaded. Empty where DeepSpeed swaps
        the state out to NVMe (not in memory to check)."""
        opt = self._stepping_optimizer()
        if getattr(opt, "swap_optimizer", False):
            return []
        opt = getattr(opt, "optimizer", opt)  # the torch optimizer over the flat partitions
        return [(f"group {i}" + (f" part {j}" if len(g["params"]) > 1 else ""), p, opt.state[p])
                for i, g in enumerate(opt.param_groups) for j, p in enumerate(g["params"]) if p in opt.state]

    def optimizer_file(self, path: Path) -> Path:
        mine = sorted((path / ckpt.ACCELERATE / ckpt.DS_TAG).glob(
            f"*zero_pp_rank_{self.accelerator.process_index}_*optim_states.pt"))
        return mine[0] if mine else path / ckpt.ACCELERATE / ckpt.DS_TAG

    # ---- the tensors this rank holds: under ZeRO-3 each parameter's own partition `p.ds_tensor` -------------------
    # (the flat slice [rank*part, (rank+1)*part) of the padded parameter that DeepSpeed gathers for every forward and
    # refreshes after every step; its dtype is the training dtype). ZeRO-0/1/2: the whole parameter.
    def local_tensor(self, p: nn.Parameter) -> torch.Tensor:
        return p.ds_tensor if self.zero3 else p.data

    def full_numel(self, p: nn.Parameter) -> int:
        return p.ds_numel if self.zero3 else p.numel()

    def whole_tensor(self, p: nn.Parameter, local: torch.Tensor) -> torch.Tensor | None:
        if not self.zero3:
            return local.detach().cpu().clone() if self.accelerator.is_main_process else None
        group = getattr(p, "ds_process_group", None)
        part = local.to(self.device)
        parts = [torch.empty_like(part) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, part, group=group)
        return torch.cat(parts)[: p.ds_numel].view(p.ds_shape).cpu() if self.accelerator.is_main_process else None

    def local_part(self, p: nn.Parameter, whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        if not self.zero3:
            return whole
        r = dist.get_rank(getattr(p, "ds_process_group", None))
        flat = whole.reshape(-1)[r * like.numel():(r + 1) * like.numel()]
        local = torch.zeros(like.numel())
        local[: flat.numel()] = flat  # the last rank's partition is padded
        return local

    @contextlib.contextmanager
    def writing_local_tensors(self):
        if not self.zero3:
            yield
            return
        # A gathered ZeRO-3 parameter's forward reads its full `p.data`, not the partition written: the small
        # "persistent" ones (below stage3_param_persistence_threshold) stay gathered between steps, others may still
        # be after a forward. Release them all (DeepSpeed's public empty_partition_cache; the partitions already
        # hold the values) so every forward gathers from the partitions.
        self.model.empty_partition_cache()
        yield
        # as DeepSpeed does after every step: persistent parameters gathered again, now from the new partitions
        persistent = self.model.optimizer.persistent_parameters
        if persistent:
            persistent[0].all_gather(persistent)

    # ---- what is really active -----------------------------------------------------------------------------
    def partitions(self, p: torch.Tensor) -> bool:
        return hasattr(p, "ds_tensor")  # a ZeRO-3 parameter: its partition is `p.ds_tensor`

    def run_facts(self) -> dict[str, Any]:
        """Read from DeepSpeed's engine: its ZeRO stage and which of its precision modes is on."""
        model = self.model
        mode = ("torch_autocast" if model.torch_autocast_enabled() else "bf16" if model.bfloat16_enabled()
                else "fp16" if model.fp16_enabled() else "fp32")
        return {"engine": self.kind, "zero_stage": model.zero_optimization_stage(), "precision": self.plan.precision,
                "ds_precision_mode": mode}

    def _own_facts(self) -> dict[str, Any]:
        import deepspeed

        model, stage = self.model, self.plan.zero_stage
        info = {"deepspeed_engine": isinstance(model, deepspeed.DeepSpeedEngine),
                "zero_stage": model.zero_optimization_stage(),
                "offload_optimizer": bool(model.zero_offload_optimizer()) if stage else False,
                "offload_params": bool(model.zero_offload_param()) if stage == 3 else False,
                "torch_autocast": bool(model.torch_autocast_enabled())}
        if stage == 3:
            params = list(model.parameters())
            info["local_param_fraction"] = sum(p.ds_tensor.numel() for p in params) / sum(p.ds_numel for p in params)
        return info

    def _own_problems(self, info: dict[str, Any]) -> list[str]:
        p = self.plan
        if not info["deepspeed_engine"]:
            return ["DeepSpeed was requested but the model is not a DeepSpeedEngine"]
        if info["zero_stage"] != p.zero_stage:
            return [f"ZeRO stage {info['zero_stage']} active, {p.zero_stage} requested"]
        if info["offload_optimizer"] != p.offload_optimizer or info["offload_params"] != p.offload_params:
            return ["DeepSpeed offload settings differ from the config"]
        return []
