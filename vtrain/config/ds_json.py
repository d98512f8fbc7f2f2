"""A user's DeepSpeed JSON, read and understood without DeepSpeed, in one place: reading the file, checking its
structure (what config validation needs before start-up) and what its ZeRO and precision sections say (for the
launch plan and for `estimate-memory`). Filling the values vtrain owns into it is the engine's job
(engine/engines/ds_config.py), at launch."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vtrain.errors import ConfigError, shown
from vtrain.io.records import loads

DEEPSPEED_BUCKET = 5e8  # DeepSpeed's own reduce/allgather bucket default, in elements (docs/memory_ckpt.md §2.2)
DS_CONFIG_UNREADABLE = "--ds-config: {path} is not valid JSON ({error})"  # read_json's message for --ds-config


MAX_DEPTH = 16
"""Deepest nesting a DeepSpeed JSON may have (its own sections nest 3 levels): the engine deep-copies it."""


def read_json(path: str, message: str) -> Any:
    """The JSON value in `path`. A file that cannot be read, is not JSON or nests deeper than MAX_DEPTH is a
    ConfigError: `message` with {path} and {error} filled in (each caller names its own source: --ds-config, an
    accelerate config)."""
    try:
        return loads(Path(path).read_text(), max_depth=MAX_DEPTH)
    except (OSError, ValueError) as e:
        raise ConfigError(message.format(path=path, error=e)) from None


def enabled(section: Any) -> Any:
    """A precision section's `enabled` value: true, false or "auto" (also for an absent section)."""
    return section.get("enabled", "auto") if isinstance(section, dict) else "auto"


def explicit_16bit(raw: dict[str, Any]) -> list[str]:
    """The precision sections the JSON explicitly enables (bf16, fp16): DeepSpeed's own 16-bit parameter mode."""
    return [name for name in ("bf16", "fp16") if enabled(raw.get(name)) is True]


@dataclass(frozen=True)
class ZeroSettings:
    """What a JSON's zero_optimization section asks for, with DeepSpeed's defaults for what it leaves out."""

    stage: int
    offload_optimizer: bool
    offload_params: bool
    overlap_comm: bool
    """DeepSpeed turns it on by default at stage 3 only."""


def _zero(raw: dict[str, Any]) -> dict[str, Any]:
    return raw.get("zero_optimization", {}) or {}


def zero_settings(raw: dict[str, Any]) -> ZeroSettings:
    """The ZeRO stage, offloading and communication overlap of a DeepSpeed JSON."""
    zero = _zero(raw)
    stage = int(zero.get("stage", 0))

    def offloaded(key: str) -> bool:
        return (zero.get(key) or {}).get("device", "none") != "none"

    return ZeroSettings(stage, offloaded("offload_optimizer"), offloaded("offload_param"),
                        bool(zero.get("overlap_comm", stage == 3)))


def bucket_sizes(raw: dict[str, Any]) -> tuple[float, float]:
    """reduce_bucket_size and allgather_bucket_size in elements ("auto" or absent: DeepSpeed's default); read for
    `estimate-memory`, while a training run hands them to DeepSpeed untouched."""
    zero = _zero(raw)

    def bucket(key: str) -> float:
        value = zero.get(key, DEEPSPEED_BUCKET)
        return DEEPSPEED_BUCKET if value == "auto" else float(value)

    return bucket("reduce_bucket_size"), bucket("allgather_bucket_size")


def stage3_sizes(raw: dict[str, Any]) -> tuple[float, float]:
    """ZeRO-3's stage3_prefetch_bucket_size (elements gathered ahead) and stage3_param_persistence_threshold
    (parameters smaller than this stay gathered), DeepSpeed's defaults when absent or "auto"
    (deepspeed/runtime/zero/config.py: 5e7 and 1e5); read for `estimate-memory`."""
    zero = _zero(raw)

    def size(key: str, default: float) -> float:
        value = zero.get(key, default)
        return default if value == "auto" else float(value)

    return size("stage3_prefetch_bucket_size", 5e7), size("stage3_param_persistence_threshold", 1e5)


def check_structure(raw: Any, source: str) -> None:
    """The checks that need nothing but the JSON (types, stage, offload devices, sections vtrain owns), so that
    config validation can run them before start-up; engine/ds_config.fill_ds_config runs them again."""
    def fail(msg: str) -> None:
        raise ConfigError(f"--ds-config {source}: {msg}")

    if not isinstance(raw, dict):
        fail("top level must be a JSON object")
    for key in ("optimizer", "scheduler"):
        if key in raw:
            fail(f"remove the '{key}' section; vtrain builds AdamW and the LR schedule from "
                 "--lr/--weight-decay/--warmup-steps (one owner per knob)")
    for key in ("bf16", "fp16", "torch_autocast"):
        section = raw.get(key)
        if section is not None and not isinstance(section, dict):
            fail(f'{key} must be an object like {{"enabled": true}}, got {shown(section)}')
        if isinstance(section, dict) and section.get("enabled", "auto") not in (True, False, "auto"):
            fail(f"{key}.enabled must be true, false or \"auto\", got {shown(section['enabled'])}")
    if len(explicit_16bit(raw)) == 2:
        fail("bf16 and fp16 cannot both be enabled")
    zero = raw.get("zero_optimization", {})
    if not isinstance(zero, dict):
        fail("zero_optimization must be an object")
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        fail(f"zero_optimization.stage must be 0-3, got {shown(stage)}")
    for key in ("offload_optimizer", "offload_param"):
        section = zero.get(key) or {}
        if not isinstance(section, dict):
            fail(f'zero_optimization.{key} must be an object like {{"device": "cpu"}}, got {shown(section)}')
        if section.get("device", "none") not in ("none", "cpu", "nvme"):
            fail(f"zero_optimization.{key}.device must be none/cpu/nvme, got {shown(section['device'])}")
    if (zero.get("offload_param") or {}).get("device", "none") != "none" and stage != 3:
        fail(f"offload_param needs zero_optimization.stage 3 (got {stage})")
    for key in ("reduce_bucket_size", "allgather_bucket_size"):  # read as numbers by estimate-memory (bucket_sizes)
        value = zero.get(key, "auto")
        if value != "auto" and not (type(value) in (int, float) and math.isfinite(value) and value >= 0):
            fail(f'zero_optimization.{key} must be "auto" or a number >= 0, got {shown(value)}')
