"""What the user asked for, resolved once: engine kind, ZeRO stage / FSDP settings, precision, world size.

Sources: vtrain's config (flags / YAML) and the environment `accelerate launch` sets from an accelerate config
file (ACCELERATE_USE_DEEPSPEED, ACCELERATE_DEEPSPEED_CONFIG_FILE, ACCELERATE_USE_FSDP, FSDP_*). The plan is
checked against what is really active after `prepare` (the engine's `verify`); `kind` picks the engine class
(engine/engines/build.py), once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from vtrain.config import RunConfig
from vtrain.engine.engines.ds_config import ds_config_source, env_true, fill_for, world_size_from_env
from vtrain.errors import ConfigError


def resolve_precision(requested: str) -> str:
    """`auto`: bf16 where the device supports it (any CPU, Ampere+ GPUs), else fp16 on older GPUs."""
    if requested != "auto":
        return requested
    if torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        return "fp16"
    return "bf16"


@dataclass
class Plan:
    kind: str  # single | ddp | fsdp | deepspeed
    world_size: int
    precision: str  # no | bf16 | fp16
    ds_config: dict[str, Any] | None = None
    zero_stage: int = 0
    offload_optimizer: bool = False
    offload_params: bool = False
    ds_precision_mode: str = ""  # torch_autocast | bf16 | fp16 | fp32 (DeepSpeed only)
    fsdp_offload: bool = False
    fsdp_reshard_after_forward: bool = True


def resolve_plan(cfg: RunConfig) -> Plan:
    world = world_size_from_env()
    precision = resolve_precision(cfg.parallel.mixed_precision)
    raw, source = ds_config_source(cfg)
    use_fsdp = cfg.parallel.fsdp or env_true("ACCELERATE_USE_FSDP")
    if raw is not None and use_fsdp:
        raise ConfigError("--fsdp: cannot combine FSDP with a DeepSpeed config; choose one")
    if raw is not None:
        filled, info = fill_for(cfg, raw, source, world, precision)
        return Plan("deepspeed", world, info["precision"], ds_config=filled, zero_stage=info["stage"],
                    offload_optimizer=info["offload_optimizer"], offload_params=info["offload_params"],
                    ds_precision_mode=info["mode"])
    if use_fsdp:
        offload = cfg.parallel.fsdp_offload or env_true("FSDP_OFFLOAD_PARAMS")
        reshard = cfg.parallel.fsdp_reshard_after_forward
        if "FSDP_RESHARD_AFTER_FORWARD" in os.environ:
            reshard = os.environ["FSDP_RESHARD_AFTER_FORWARD"].lower() in ("true", "1", "full_shard")
        if precision == "fp16":
            raise ConfigError("--mixed-precision fp16 is not supported with FSDP in vtrain; use bf16 (default)")
        return Plan("fsdp", world, precision, fsdp_offload=offload, fsdp_reshard_after_forward=reshard)
    return Plan("ddp" if world > 1 else "single", world, precision)
