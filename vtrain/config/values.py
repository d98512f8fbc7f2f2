"""Config values as they arrive from a YAML file or a flag: a YAML mapping read safely, and a value turned into the
type a config field declares, or a ConfigError naming where it came from. Below the config package, which knows the fields."""

from __future__ import annotations

import math
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from vtrain.errors import ConfigError, shown


MAX_YAML_DEPTH = 16
"""Deepest nesting a config file may have: vtrain's own are 3 levels (section, key, list)."""
MAX_YAML_NODES = 100_000
"""Most values a config file may hold once its aliases are expanded: a few hundred in vtrain's own."""


class _TooLarge(yaml.YAMLError):
    pass


class BoundedLoader(yaml.SafeLoader):
    """yaml.safe_load's loader (no Python tags), bounded in what the document may become. An alias (`*a`) makes
    the value it names appear again without copying it, so a 420-byte file of nested aliases ("billion laughs")
    is a value of 10^9 items, harmless until something walks it (an error message's repr, a copy, a dump). And
    PyYAML's composer recurses once per level of nesting. So, while the document is composed: at most
    MAX_YAML_DEPTH levels, at most MAX_YAML_NODES values counted with every alias expanded (an alias counts the
    values it stands for), and no alias inside the value it names (a value that contains itself has no end).
    Aliases themselves stay allowed: a small anchor reused is plain YAML, and PyYAML's dumper writes one for an
    object that occurs twice."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._depth, self._nodes = 0, 0
        self._sizes: dict[int, int] = {}  # id(anchored node) -> the values it stands for

    def _count(self, n: int) -> None:
        self._nodes += n
        if self._nodes > MAX_YAML_NODES:
            raise _TooLarge(f"it expands to more than {MAX_YAML_NODES} values (aliases included)")

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            node = self.anchors.get(self.peek_event().anchor)  # (an undefined one: PyYAML's own error below)
            if node is not None and id(node) not in self._sizes:  # still open: a value that contains itself
                raise _TooLarge("an alias refers to a value that contains it (a value without end)")
            self._count(self._sizes.get(id(node), 1))
            return super().compose_node(parent, index)
        self._depth += 1
        if self._depth > MAX_YAML_DEPTH:
            raise _TooLarge(f"it nests deeper than {MAX_YAML_DEPTH} levels")
        start = self._nodes
        self._count(1)
        anchor = self.peek_event().anchor
        node = super().compose_node(parent, index)
        self._depth -= 1
        if anchor is not None:
            self._sizes[id(node)] = self._nodes - start
        return node


def read_yaml(path: str | Path, what: str = "--config") -> dict[str, Any]:
    """A YAML mapping, read with a bounded safe loader (no Python tags, `BoundedLoader`); errors are named after
    `what` (the flag, or the checkpoint the file belongs to)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what}: file not found: {path}")
    try:
        data = yaml.load(p.read_text(), Loader=BoundedLoader) or {}
    except _TooLarge as e:
        raise ConfigError(f"{what}: {path} is refused: {e}") from None
    except (yaml.YAMLError, ValueError, RecursionError) as e:
        # ValueError: a value PyYAML could not build (an integer of more than 4300 digits, a date of month 13)
        first = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
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
    if origin is typing.Literal:  # a choice: its value is checked by the section, whose message lists them
        hint = type(args[0])
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no"):
            return value.lower() in ("true", "yes")
        raise ConfigError(f"{where}: expected true or false, got {shown(value)}")
    if hint is int:
        number = _number(value, where, "an integer")
        if not number.is_integer() or abs(number) >= 2**63:
            raise ConfigError(f"{where}: expected an integer, got {shown(value)}")
        return int(number)
    if hint is float:
        return _number(value, where, "a number")
    if hint is str:
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise ConfigError(f"{where}: expected a string, got {shown(value)}")
        return str(value)
    if origin is list:
        (item,) = args
        if item is str and isinstance(value, str):
            value = [p for p in value.split(",") if p]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {shown(value)}")
        return [coerce(v, item, where) for v in value]
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{where}: expected {len(args)} values, got {shown(value)}")
        return tuple(coerce(v, a, where) for v, a in zip(value, args))
    raise TypeError(f"unsupported config type {hint!r}")  # a programming error, not a user one


def _number(value: Any, where: str, kind: str) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected {kind}, got {shown(value)}")
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: an integer beyond float range
        raise ConfigError(f"{where}: expected {kind}, got {shown(value)}") from None
    if not math.isfinite(number):
        raise ConfigError(f"{where}: must be finite, got {shown(value)}")
    return number
