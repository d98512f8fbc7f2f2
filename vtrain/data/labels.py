"""Class labels, checked once and the same way for every data source and both heads.

A label outside [0, num_classes) is never harmless: the replicated head indexes its logits with it (a traceback in
`cross_entropy`, or on a GPU a device-side assert), and the sharded head (Partial FC) treats a class no rank owns
as "not mine" on every rank, so the sample trains against negatives only, silently. -1 in particular is how
Hugging Face `ClassLabel` columns mark an unlabelled row. So image folders, RecordIO records and `hf:` rows all pass
their labels through `check_labels` before a head sees them, and a bad one is one error naming the source, the
row or record, the value and the valid range.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from vtrain.errors import VtrainError


def _row(i: int) -> str:
    return f"row {i}"


def check_labels(values: Sequence[Any] | np.ndarray, num_classes: int, source: str,
                 name: Callable[[int], str] = _row, count_from: str = "") -> np.ndarray:
    """`values` as int64 class ids in [0, num_classes), or a VtrainError naming `source`, the first bad entry
    (`name(i)`, default `row i`) and the valid range; `count_from` says where num_classes came from. Integral
    floats (RecordIO stores labels as float32) are class ids; None, NaN, fractions, bools and strings are not."""
    arr = values if isinstance(values, np.ndarray) else np.asarray(values)
    if arr.dtype.kind in "USV" and not isinstance(values, np.ndarray):  # numpy made [1, "a"] all strings
        arr = np.empty(len(values), dtype=object)
        arr[:] = list(values)
    if arr.dtype == object:  # Python objects: ints and integral floats only (None, str, bool are refused)
        ok_type = np.fromiter((_number(v) for v in arr.ravel()), dtype=bool, count=arr.size)
        numeric = np.where(ok_type, arr, 0).astype(np.float64) if arr.size else np.zeros(0)
    elif arr.dtype.kind in "iuf":
        ok_type, numeric = np.ones(arr.shape, bool), arr
    else:  # bool, str, bytes columns
        ok_type, numeric = np.zeros(arr.shape, bool), np.zeros(arr.shape)
    with np.errstate(invalid="ignore"):
        whole = ok_type & np.isfinite(numeric) & (np.floor(numeric) == numeric) if numeric.dtype.kind == "f" \
            else ok_type
        bad = ~whole | (numeric < 0) | (numeric >= num_classes)
    if bad.any():
        i = int(np.argmax(bad))
        raise VtrainError(f"{source}: {name(i)}: {_problem(arr.ravel()[i], num_classes, count_from)}")
    return numeric.astype(np.int64)


def _number(v: Any) -> bool:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
        return False
    return not isinstance(v, int) or abs(v) < 2**63  # a float64 holds it (as a float, for the range check)


def _problem(value: Any, n: int, count_from: str) -> str:
    shown = value.item() if isinstance(value, np.generic) else value  # 2.5, not np.float64(2.5)
    if isinstance(shown, float) and shown.is_integer():
        shown = int(shown)
    where = f" ({count_from})" if count_from else ""
    text = repr(shown) if len(repr(shown)) <= 40 else repr(shown)[:37] + "..."
    if isinstance(shown, int) and not isinstance(shown, bool) and shown >= n:
        return f"label {text} >= {n} classes{where}; class ids are whole numbers in [0, {n})"
    return f"label {text} is not a class id (a whole number in [0, {n})){where}"
