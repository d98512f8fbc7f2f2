"""Fill a DeepSpeed JSON from vtrain's config: vtrain owns batch size, accumulation, clipping and precision.

`"auto"` (or absent) values are filled; explicit values must agree with vtrain's, else a one-line error names
both. Precision: unless the JSON explicitly enables DeepSpeed's own full-bf16/fp16 mode, bf16 runs in
DeepSpeed's `torch_autocast` mode (fp32 master weights and buffers, forward under autocast), which trains
BatchNorm models where plain DeepSpeed bf16 fails ('expected scalar type BFloat16 but found Float';
docs/cpu_distributed.md, docs/memory_ckpt.md §4).

ZeRO-3's `memory_efficient_linear` defaults to false here (DeepSpeed's default is true): with it on, DeepSpeed
replaces `F.linear` process-wide by its own function, which adds the bias in place to the matmul output, the very
tensor selective checkpointing (`--grad-ckpt sac:...`) keeps, so the recomputation adds it twice and the gradients
are wrong (docs/recompute.md); torch's own linear also keeps a run's numbers independent of `--grad-ckpt`.
"""

from __future__ import annotations

import copy
import os
from typing import Any

from vtrain import recompute
from vtrain.config import RunConfig
from vtrain.config.ds_json import DS_CONFIG_UNREADABLE, check_structure, enabled, explicit_16bit, read_json, zero_settings
from vtrain.errors import ConfigError


def env_true(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes")


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def ds_config_source(cfg: RunConfig) -> tuple[dict[str, Any] | None, str | None]:
    """The DeepSpeed JSON a run asks for and where it comes from: --ds-config, else the accelerate config's
    (a `deepspeed_config_file`, or its inline ZeRO settings); (None, None) without DeepSpeed."""
    if cfg.parallel.ds_config:  # read once before, by config validation
        return read_json(cfg.parallel.ds_config, DS_CONFIG_UNREADABLE), cfg.parallel.ds_config
    if env_true("ACCELERATE_USE_DEEPSPEED"):
        path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
        if path and path.lower() != "none":
            return read_json(path, "accelerate config deepspeed_config_file {path}: {error}"), path
        # accelerate config with inline deepspeed settings
        stage = int(os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2"))
        zero: dict[str, Any] = {"stage": stage}
        if os.environ.get("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "none") not in ("none", ""):
            zero["offload_optimizer"] = {"device": os.environ["ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"]}
        if os.environ.get("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "none") not in ("none", ""):
            zero["offload_param"] = {"device": os.environ["ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE"]}
        return {"zero_optimization": zero}, "accelerate config"
    return None, None


def _may_be_selective(cfg: RunConfig) -> bool:
    """Whether a unit may run under selective checkpointing: one named `sac:`, or `auto` (the planner may choose
    it)."""
    spec = recompute.parse(cfg.model.grad_ckpt)
    return spec.auto or any(i.mode == "sac" for i in spec.items)


def fill_for(cfg: RunConfig, raw: dict[str, Any], source: str | None, world: int,
             precision: str) -> tuple[dict[str, Any], dict]:
    """`fill_ds_config` with a run's own values."""
    return fill_ds_config(raw, source or "ds config", batch_size=cfg.train.batch_size,
                          grad_accum=cfg.train.grad_accum, world_size=world, clip_grad=cfg.optim.clip_grad,
                          precision=precision, precision_explicit=cfg.parallel.mixed_precision != "auto",
                          selective_recompute=_may_be_selective(cfg))


def check_ds_config(cfg: RunConfig) -> None:
    """The DeepSpeed JSON against the flags, as start-up fills it (engine/engines/plan.py), before torch is imported: a
    contradiction is one line at once. `--mixed-precision auto` is taken as bf16 here (plan.py asks the GPU)."""
    raw, source = ds_config_source(cfg)
    if raw is not None:
        precision = cfg.parallel.mixed_precision
        fill_for(cfg, raw, source, world_size_from_env(), "bf16" if precision == "auto" else precision)


def _is_auto(v: Any) -> bool:
    return v is None or v == "auto"


def fill_ds_config(raw: dict[str, Any], source: str, *, batch_size: int, grad_accum: int, world_size: int,
                   clip_grad: float, precision: str, precision_explicit: bool,
                   selective_recompute: bool = False) -> tuple[dict[str, Any], dict]:
    check_structure(raw, source)
    ds = copy.deepcopy(raw)

    def own(key: str, value: Any, flag: str) -> None:
        if _is_auto(ds.get(key)):
            ds[key] = value
        elif ds[key] != value:
            raise ConfigError(f"--ds-config {source}: {key}={ds[key]} contradicts {flag} (={value}); "
                              f"set it to \"auto\" or change {flag}")

    own("train_micro_batch_size_per_gpu", batch_size, "--batch-size")
    own("gradient_accumulation_steps", grad_accum, "--grad-accum")
    own("train_batch_size", batch_size * grad_accum * world_size, "--batch-size x --grad-accum x processes")
    own("gradient_clipping", float(clip_grad), "--clip-grad")

    zero_json = ds.setdefault("zero_optimization", {})
    zero = zero_settings(ds)
    explicit = explicit_16bit(ds)
    if zero.stage == 3:
        if selective_recompute and zero_json.get("memory_efficient_linear") is True:
            raise ConfigError(f"--ds-config {source}: zero_optimization.memory_efficient_linear=true cannot be "
                              "combined with selective checkpointing (--grad-ckpt sac:..., or auto, which may choose it); "
                              "set it to false")
        zero_json.setdefault("memory_efficient_linear", False)
    autocast_cfg = ds.get("torch_autocast", {})
    if explicit:  # the user asked for DeepSpeed's own full low-precision mode: respect it
        mode = explicit[0]
        if precision_explicit and precision != mode:
            raise ConfigError(f"--ds-config {source}: {mode}.enabled=true contradicts --mixed-precision {precision}")
        precision = mode
        ds.setdefault("torch_autocast", {})["enabled"] = False
    elif enabled(autocast_cfg) is True:
        mode = "torch_autocast"
        dtype = autocast_cfg.get("dtype", "bfloat16")
        precision = {"bfloat16": "bf16", "torch.bfloat16": "bf16", "float16": "fp16"}.get(dtype, "bf16")
    elif precision == "no":
        mode = "fp32"
        ds["torch_autocast"] = {"enabled": False}
    elif precision == "fp16":
        raise ConfigError("--mixed-precision fp16 with DeepSpeed: use bf16 (torch_autocast, fp32 master weights), "
                          "or set \"fp16\": {\"enabled\": true} in the JSON for DeepSpeed's loss-scaled fp16 mode")
    else:
        mode = "torch_autocast"
        ds["torch_autocast"] = {**(autocast_cfg if isinstance(autocast_cfg, dict) else {}),
                                "enabled": True, "dtype": "bfloat16"}
    for name in ("bf16", "fp16"):
        if mode != name:
            ds[name] = {**(ds.get(name) if isinstance(ds.get(name), dict) else {}), "enabled": False}
    info = {"stage": zero.stage, "offload_optimizer": zero.offload_optimizer, "offload_params": zero.offload_params,
            "mode": mode, "precision": precision}
    return ds, info
