"""JSON records vtrain reads back from disk (a checkpoint's manifest and train state, best.json, categories.json,
the output-dir lock): every field is checked for its type and range when the file is read, so a hand-edited,
truncated or foreign file is one line naming the file and the key, instead of a traceback wherever the value is
first used (`int(["x"])` in a sort, `"3" > 2`, `None["id"]`).

`Record(data, where)` wraps a parsed object; each accessor returns a checked value or raises `RecordError`.
`bool` is never an integer here (JSON `true` is not a step number), and every integer lies within int64 unless a
field says less. Values are shown in messages bounded (`errors.shown`), and no reader walks a value whose nesting it
does not know: JSON nested beyond Python's recursion limit is one error when parsed (`loads`).

The rules for detection categories (`categories`) are the same for a COCO file a run trains on and for the
`categories.json` its checkpoints hold, so a run never writes a checkpoint that its own readers refuse.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from vtrain.errors import VtrainError, shown

_MISSING = object()
INT64 = (-(2**63), 2**63 - 1)
MAX_COUNT = 2**53 - 1
"""The largest step, sample count or other counter read from a checkpoint: integers up to 2^53 - 1 are exact as
float64 and the range RFC 8259 §6 calls interoperable (https://www.rfc-editor.org/rfc/rfc8259#section-6); a run
would need 9e15 samples to reach it."""
MAX_CATEGORIES = 65_536
"""The most detection categories a COCO file or a checkpoint may list (docs/input_limits.md §7): the DINO class head
scores every encoder token against every class, and beyond this one image's scores alone outgrow a GPU."""


class RecordError(VtrainError):
    """A JSON file whose content is not what vtrain wrote: names the file and the key."""


def loads(text: str | bytes, max_depth: int | None = None) -> Any:
    """`json.loads` for every JSON file vtrain reads: nesting deeper than json's C parser recurses (Python's
    recursion limit, about 1000 levels) is a ValueError like any other invalid JSON, never a RecursionError.
    `max_depth`: also refuse a value nested deeper than that (checked without recursion), for a file whose whole
    content is handed on to code that walks it recursively (a DeepSpeed config is deep-copied)."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError("nested too deep") from None
    if max_depth is not None and depth(value, max_depth) > max_depth:
        raise ValueError(f"nested deeper than {max_depth} levels")
    return value


def depth(value: Any, stop: int) -> int:
    """How deep lists and objects nest in `value` (a scalar is 0), counted without recursion; stops counting
    past `stop`."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        items = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if items is None:
            continue
        deepest = max(deepest, d)
        if d > stop:
            return d
        todo.extend((c, d + 1) for c in items)
    return deepest


def read_json(path: str | Path) -> Any:
    """The parsed content of `path`; an unreadable file, bytes that are no text or invalid JSON is a RecordError
    naming it."""
    try:
        return loads(Path(path).read_text())
    except OSError as e:
        raise RecordError(f"{path}: cannot read it ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise RecordError(f"{path}: not UTF-8 text") from None
    except ValueError as e:
        raise RecordError(f"{path}: not valid JSON ({e})") from None


class Record:
    """A JSON object read from `where` (a file, or `file: key` for a nested object)."""

    def __init__(self, data: Any, where: str | Path) -> None:
        self.where = str(where)
        if not isinstance(data, dict):
            raise RecordError(f"{self.where}: expected a JSON object, got {shown(data)}")
        self.data = data

    def _get(self, key: str, default: Any) -> Any:
        if key in self.data:
            return self.data[key]
        if default is _MISSING:
            raise RecordError(f"{self.where}: the key `{key}` is missing")
        return default

    def _bad(self, key: str, want: str, value: Any) -> RecordError:
        return RecordError(f"{self.where}: `{key}` must be {want}, got {shown(value)}")

    def int(self, key: str, low: int = 0, high: int = INT64[1], default: Any = _MISSING) -> Any:
        value = self._get(key, default)
        if value is default and default is not _MISSING:
            return value
        if not (isinstance(value, int) and not isinstance(value, bool) and low <= value <= high):
            raise self._bad(key, f"an integer in {_range(low, high)}", value)
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

    def bool(self, key: str, default: Any = _MISSING) -> Any:
        value = self._get(key, default)
        if value is default and default is not _MISSING:
            return value
        if not isinstance(value, bool):
            raise self._bad(key, "true or false", value)
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


def _bound(n: int) -> str:
    return {INT64[0]: "-2^63", INT64[1]: "2^63-1", MAX_COUNT: "2^53-1"}.get(n, str(n))


def _range(low: int, high: int) -> str:
    return f"{_bound(low)}..{_bound(high)}"


# ---- detection categories: one rule for a COCO file and for a checkpoint's categories.json ------------------------

def categories(items: Any, where: str) -> list[dict[str, Any]]:
    """Detection categories as a COCO file's `categories` and a checkpoint's categories.json list them: a
    non-empty list of at most MAX_CATEGORIES objects (counted before any entry is read), each with an integer `id`
    within int64, unique, and a `name` that is a string when present (absent: the id as text, as the class names
    vtrain writes). Returns the list; a RecordError names the entry."""
    if not isinstance(items, list):
        raise RecordError(f"{where}: expected a list of categories, got {shown(items)}")
    if not items:
        raise RecordError(f"{where}: no categories")
    if len(items) > MAX_CATEGORIES:
        raise RecordError(f"{where}: {len(items)} categories; a detector holds at most {MAX_CATEGORIES} classes "
                          "(its class head scores every encoder token against every class: docs/input_limits.md §7)")
    seen: dict[int, int] = {}
    for i, c in enumerate(items):
        r = Record(c, f"{where}[{i}]")
        cid = r.int("id", *INT64)
        r.str("name", nonempty=False, default=None)
        if cid in seen:
            raise RecordError(f"{where}: category id {cid} is listed twice ([{seen[cid]}] and [{i}])")
        seen[cid] = i
    return items


# ---- the states vtrain stores in a checkpoint's train_state.json (engine/checkpoint/format.py: TrainState) ----------------

SCHEDULER_KEYS = ("base_lrs", "last_epoch", "_step_count", "_is_initial", "_get_lr_called_within_step", "_last_lr",
                  "lr_lambdas", "verbose")
"""What torch's LambdaLR.state_dict() holds: its `__dict__` but the optimizer (`verbose` in older torch versions)."""


def scheduler_state(r: Record) -> dict[str, Any]:
    """A LambdaLR state. `load_state_dict` copies every key onto the scheduler object, where a key such as `step`
    or `optimizer` would replace a method or the optimizer, and a value of the wrong type fails at the next step:
    so exactly LambdaLR's own keys are admitted, each of its own type (tests/integration/test_hostile_fields.py checks that
    what vtrain's scheduler writes passes)."""
    for key in r.data:
        if key not in SCHEDULER_KEYS:
            raise RecordError(f"{r.where}: `{str(key)[:80]}` is not a scheduler setting vtrain writes")
    lrs = r.numbers("base_lrs", low=0)
    r.int("last_epoch", low=-1, high=MAX_COUNT)
    r.int("_step_count", high=MAX_COUNT, default=0)
    for key in ("_is_initial", "_get_lr_called_within_step", "verbose"):
        r.bool(key, default=False)
    if "_last_lr" in r.data and len(r.numbers("_last_lr", low=0)) != len(lrs):
        raise RecordError(f"{r.where}: `_last_lr` and `base_lrs` differ in length")
    # vtrain's schedule is a plain function, whose state torch stores as null (a dict would be set on it)
    lambdas = r.list("lr_lambdas", default=[None] * len(lrs))
    if len(lambdas) != len(lrs) or any(fn is not None for fn in lambdas):
        raise RecordError(f"{r.where}: `lr_lambdas` must be a list of {len(lrs)} nulls (one per parameter group), "
                          f"got {shown(lambdas)}")
    return r.data


def ema_state(r: Record | None) -> dict[str, Any] | None:
    """WeightEMA.state(): decay, warm-up steps, updates so far."""
    if r is None:
        return None
    r.number("decay", low=0.0, high=1.0)
    r.int("warmup", high=MAX_COUNT, default=0)
    r.int("updates", high=MAX_COUNT, default=0)
    return r.data


def scaler_state(r: Record | None) -> dict[str, Any] | None:
    """A GradScaler state: load_state_dict reads these five keys."""
    if r is None:
        return None
    for key in ("scale", "growth_factor", "backoff_factor"):
        r.number(key, above=0.0)
    r.int("growth_interval", low=1, high=MAX_COUNT)
    r.int("_growth_tracker", high=MAX_COUNT)
    return r.data
