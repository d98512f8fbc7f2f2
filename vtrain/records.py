"""JSON records vtrain reads back from disk (a checkpoint's manifest and train state, best.json, categories.json,
the output-dir lock): every field is checked for its type and range when the file is read, so a hand-edited,
truncated or foreign file is one line naming the file and the key, instead of a traceback wherever the value is
first used (`int(["x"])` in a sort, `"3" > 2`, `None["id"]`).

`Record(data, where)` wraps a parsed object; each accessor returns a checked value or raises `RecordError`.
`bool` is never an integer here (JSON `true` is not a step number).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from vtrain.errors import VtrainError

_MISSING = object()


class RecordError(VtrainError):
    """A JSON file whose content is not what vtrain wrote: names the file and the key."""


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def read_json(path: str | Path) -> Any:
    """The parsed content of `path`; an unreadable file, bytes that are no text or invalid JSON is a RecordError
    naming it."""
    try:
        return json.loads(Path(path).read_text())
    except OSError as e:
        raise RecordError(f"{path}: cannot read it ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise RecordError(f"{path}: not UTF-8 text") from None
    except ValueError as e:
        raise RecordError(f"{path}: not valid JSON ({e})") from None
    except RecursionError:  # json's own limit on nesting: nothing vtrain writes is nested that deep
        raise RecordError(f"{path}: not valid JSON (nested too deep)") from None


class Record:
    """A JSON object read from `where` (a file, or `file: key` for a nested object)."""

    def __init__(self, data: Any, where: str | Path) -> None:
        self.where = str(where)
        if not isinstance(data, dict):
            raise RecordError(f"{self.where}: expected a JSON object, got {_shown(data)}")
        self.data = data

    def _get(self, key: str, default: Any) -> Any:
        if key in self.data:
            return self.data[key]
        if default is _MISSING:
            raise RecordError(f"{self.where}: the key `{key}` is missing")
        return default

    def _bad(self, key: str, want: str, value: Any) -> RecordError:
        return RecordError(f"{self.where}: `{key}` must be {want}, got {_shown(value)}")

    def int(self, key: str, low: int = 0, high: int | None = None, default: Any = _MISSING) -> Any:
        value = self._get(key, default)
        if value is default and default is not _MISSING:
            return value
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= low and (high is None or value <= high)
        if not ok:
            raise self._bad(key, f"an integer >= {low}" + (f" and <= {high}" if high is not None else ""), value)
        return value

    def number(self, key: str, low: float | None = None, high: float | None = None, default: Any = _MISSING,
               above: float | None = None) -> Any:
        """A finite number in [low, high] (and > `above` when given)."""
        value = self._get(key, default)
        if value is default and default is not _MISSING:
            return value
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
              and (low is None or value >= low) and (high is None or value <= high)
              and (above is None or value > above))
        if not ok:
            bounds = [f">= {low}" if low is not None else "", f"<= {high}" if high is not None else "",
                      f"> {above}" if above is not None else ""]
            raise self._bad(key, " ".join(["a finite number", *[b for b in bounds if b]]), value)
        return float(value) if isinstance(value, float) else value

    def str(self, key: str, choices: tuple[str, ...] | None = None, default: Any = _MISSING,
            nonempty: bool = True) -> Any:
        value = self._get(key, default)
        if value is default and default is not _MISSING:
            return value
        if not isinstance(value, str) or (nonempty and not value):
            raise self._bad(key, "a non-empty string" if nonempty else "a string", value)
        if choices is not None and value not in choices:
            raise self._bad(key, f"one of {', '.join(choices)}", value)
        return value

    def object(self, key: str, default: Any = _MISSING) -> Any:
        """A nested object as a Record (or `default`, e.g. None for an optional one: JSON null is accepted then)."""
        value = self._get(key, default)
        if default is not _MISSING and value is default or (value is None and default is None):
            return default
        return Record(value, f"{self.where}: {key}")

    def list(self, key: str, default: Any = _MISSING) -> Any:
        value = self._get(key, default)
        if value is default and default is not _MISSING:
            return value
        if not isinstance(value, list):
            raise self._bad(key, "a list", value)
        return value

    def numbers(self, key: str, low: float | None = None, nonempty: bool = True) -> list:
        """A list of finite numbers (>= low)."""
        values = self.list(key)
        bad = [v for v in values if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
               or (low is not None and v < low)]
        if bad or (nonempty and not values):
            raise self._bad(key, "a non-empty list of finite numbers" + (f" >= {low}" if low is not None else ""),
                            bad[0] if bad else values)
        return values


# ---- the states vtrain stores in a checkpoint's train_state.json (engine/checkpoint.py: TrainState) ----------------

def scheduler_state(r: Record) -> dict[str, Any]:
    """A LambdaLR state: the checkpointer counts its base LRs, and `load_state_dict` copies every other key onto
    the scheduler object, so only plain values of its own keys are admitted (never e.g. an `optimizer`)."""
    lrs = r.numbers("base_lrs", low=0)
    r.int("last_epoch", low=-1)
    for key, value in r.data.items():
        if key == "optimizer" or not _plain(value):
            raise RecordError(f"{r.where}: `{key}` is not a scheduler setting vtrain writes")
    if len(r.list("_last_lr", default=lrs)) != len(lrs):
        raise RecordError(f"{r.where}: `_last_lr` and `base_lrs` differ in length")
    return r.data


def _plain(value: Any) -> bool:
    """JSON scalars, and lists / objects of them (LambdaLR keeps a None or a dict per parameter group)."""
    if isinstance(value, (list, dict)):
        return all(_plain(v) for v in (value.values() if isinstance(value, dict) else value))
    return value is None or isinstance(value, (bool, int, float, str))


def ema_state(r: Record | None) -> dict[str, Any] | None:
    """WeightEMA.state(): decay, warm-up steps, updates so far."""
    if r is None:
        return None
    r.number("decay", low=0.0, high=1.0)
    r.int("warmup", default=0)
    r.int("updates", default=0)
    return r.data


def scaler_state(r: Record | None) -> dict[str, Any] | None:
    """A GradScaler state: load_state_dict reads these five keys."""
    if r is None:
        return None
    for key in ("scale", "growth_factor", "backoff_factor"):
        r.number(key, above=0.0)
    r.int("growth_interval", low=1)
    r.int("_growth_tracker")
    return r.data
