"""The structure of a user's DeepSpeed JSON, checked without DeepSpeed: what config validation needs before
start-up. Filling the values vtrain owns into it is the engine's job (engine/ds_config.py), at launch."""

from __future__ import annotations

from typing import Any

from vtrain.errors import ConfigError


def enabled(section: Any) -> Any:
    """A precision section's `enabled` value: true, false or "auto" (also for an absent section)."""
    return section.get("enabled", "auto") if isinstance(section, dict) else "auto"


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
            fail(f'{key} must be an object like {{"enabled": true}}, got {section!r}')
        if isinstance(section, dict) and section.get("enabled", "auto") not in (True, False, "auto"):
            fail(f"{key}.enabled must be true, false or \"auto\", got {section['enabled']!r}")
    if enabled(raw.get("bf16")) is True and enabled(raw.get("fp16")) is True:
        fail("bf16 and fp16 cannot both be enabled")
    zero = raw.get("zero_optimization", {})
    if not isinstance(zero, dict):
        fail("zero_optimization must be an object")
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        fail(f"zero_optimization.stage must be 0-3, got {stage!r}")
    for key in ("offload_optimizer", "offload_param"):
        section = zero.get(key) or {}
        if not isinstance(section, dict):
            fail(f'zero_optimization.{key} must be an object like {{"device": "cpu"}}, got {section!r}')
        if section.get("device", "none") not in ("none", "cpu", "nvme"):
            fail(f"zero_optimization.{key}.device must be none/cpu/nvme, got {section['device']!r}")
    if (zero.get("offload_param") or {}).get("device", "none") != "none" and stage != 3:
        fail(f"offload_param needs zero_optimization.stage 3 (got {stage})")
