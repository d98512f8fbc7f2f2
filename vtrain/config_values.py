"""Config values as they arrive from a YAML file or a flag: a YAML mapping read safely, and a value turned into the
type a config field declares, or a ConfigError naming where it came from. Below config.py, which knows the fields."""

from __future__ import annotations

import math
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from vtrain.errors import ConfigError


def read_yaml(path: str | Path, what: str = "--config") -> dict[str, Any]:
    """A YAML mapping, read with safe_load (no Python tags); errors are named after `what` (the flag, or the
    checkpoint the file belongs to)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what}: file not found: {path}")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"{what}: {path} is not valid YAML ({first})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what}: {path} must hold a mapping of sections (model, data, optim, parallel, train)")
    return data


def coerce(value: Any, hint: Any, where: str) -> Any:
    """`value` as the declared type `hint`, or a ConfigError naming `where`. YAML 1.1 reads `1e-3` (no dot) as a
    string, so numeric strings are accepted for numbers; a float is an int only when integral; floats must be
    finite (--lr inf, nan are refused here, for every float field)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (hint,) = [a for a in args if a is not type(None)]
        return coerce(value, hint, where)
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no"):
            return value.lower() in ("true", "yes")
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if hint is int:
        number = _number(value, where, "an integer")
        if not number.is_integer() or abs(number) >= 2**63:
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return int(number)
    if hint is float:
        return _number(value, where, "a number")
    if hint is str:
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return str(value)
    if origin is list:
        (item,) = args
        if item is str and isinstance(value, str):
            value = [p for p in value.split(",") if p]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return [coerce(v, item, where) for v in value]
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{where}: expected {len(args)} values, got {value!r}")
        return tuple(coerce(v, a, where) for v, a in zip(value, args))
    raise TypeError(f"unsupported config type {hint!r}")  # a programming error, not a user one


def _number(value: Any, where: str, kind: str) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected {kind}, got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: expected {kind}, got {value!r}") from None
    if not math.isfinite(number):
        raise ConfigError(f"{where}: must be finite, got {value!r}")
    return number
