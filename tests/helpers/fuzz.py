"""The contract every reader of a file vtrain did not write is held to, checked in-process for the fuzz lane and the
table-driven hostile cases (docs/testing.md, "The fuzz lane"):

- success, or exit 2 with exactly one `error:` line: the reader is called in this process and an exception is
  mapped by `vtrain.cli_rules.user_error`, the function the CLI itself maps errors with (anything it does not map is a
  traceback in the CLI, so it fails the test with its traceback);
- memory bounded by the input's size: the peak of Python's and numpy's allocations (tracemalloc) while it runs;
- nothing outside the run changed: the folders named are byte-identical afterwards (`tree_hash`).

`Outcome.of(fn, ...)` runs one call under these checks; `contract(...)` asserts them. Whole commands go through the
fork server (tests/helpers/fork_server.py) instead, whose output is checked with `one_error_line`.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.helpers.cli import tree_hash

MiB = 1 << 20


@dataclass
class Outcome:
    code: int
    """0: success; 2: a user error (one line)."""
    line: str | None
    """The `error: ...` line the CLI would print."""
    value: Any
    peak: int
    """Peak bytes allocated while the call ran (tracemalloc: Python objects and numpy arrays)."""

    @classmethod
    def of(cls, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Outcome:
        from vtrain.cli_rules import user_error

        tracemalloc.start()
        tracemalloc.reset_peak()
        try:
            value = fn(*args, **kwargs)
            code, line = 0, None
        except Exception as e:
            line = user_error(e)
            if line is None:
                raise  # what the CLI prints as a traceback: the test fails with it
            value, code = None, 2
        finally:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        return cls(code, line, value, peak)


def contract(fn: Callable[..., Any], *args: Any, watch: Iterable[Path] = (), input_bytes: int = 0,
             must: str | None = None, **kwargs: Any) -> Outcome:
    """Call `fn(*args, **kwargs)` and assert the contract: success, or one `error:` line (containing `must` when
    given: an expected refusal); peak allocations under 64 MiB + 16 x `input_bytes`; every folder in `watch`
    unchanged."""
    before = {p: tree_hash(p) for p in watch}
    out = Outcome.of(fn, *args, **kwargs)
    if out.line is not None:
        assert out.line.startswith("error: ") and "\n" not in out.line, repr(out.line)
        assert "Traceback" not in out.line, out.line
    if must is not None:
        assert out.code == 2 and must in out.line, (must, out.line)
    limit = 64 * MiB + 16 * input_bytes
    assert out.peak <= limit, f"peak {out.peak / MiB:.1f} MiB for an input of {input_bytes} bytes"
    for p, h in before.items():
        assert tree_hash(p) == h, f"{p} changed"
    return out


def one_error_line(rc: int, stderr: str) -> str:
    """The single `error:` line of a whole command that exited 2 without a traceback."""
    lines = [x for x in stderr.splitlines() if x.startswith("error:")]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in stderr, (rc, stderr[-3000:])
    return lines[0]


# ---- strategies: hostile variants of what a file holds ------------------------------------------------------------
# Imported lazily by the property tests (hypothesis is a test dependency, docs/testing.md).

def strategies():
    """The hypothesis strategies the fuzz lane shares (a namespace), built once."""
    global _STRATEGIES
    if _STRATEGIES is None:
        _STRATEGIES = _build_strategies()
    return _STRATEGIES


_STRATEGIES = None
DEEP = 100_000
"""Nesting of the deepest value drawn: far beyond json's and PyYAML's recursion (about 1,000 levels)."""


class _Deep:
    """A placeholder for a list nested `depth` levels, written into the text where the value stands (a Python value
    that deep could not be dumped)."""

    def __init__(self, depth: int) -> None:
        self.depth = depth


def _build_strategies():
    import types

    from hypothesis import strategies as st

    text = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=12) | st.sampled_from(
        ["", " ", "\0", "\udc80", "../../etc/passwd", "auto", "nan", "inf", "-1", "1e309", "x" * 5000,
         "0x10", "١٢", "²", "true", "null", "\n", "a\nb"])
    numbers = (st.integers(-(2**70), 2**70) | st.sampled_from([0, -1, 1, 2**31, 2**53, 2**63, -(2**63) - 1, 2**64,
                                                                 10**30])
               | st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([1e308, -0.0, 5e-324]))
    scalars = st.none() | st.booleans() | numbers | text
    values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                          | st.dictionaries(text, inner, max_size=4), max_leaves=12)
    hostile = values | st.integers(900, DEEP).map(_Deep)
    return types.SimpleNamespace(text=text, numbers=numbers, scalars=scalars, values=values, hostile=hostile)


def _nodes(doc, path=()):
    """Every (path, value) in a JSON-like document, the root included."""
    yield path, doc
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _nodes(v, (*path, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _nodes(v, (*path, i))


def mutate(data, doc, steps: int = 3):
    """A copy of `doc` with 1..`steps` hostile edits drawn by `data` (hypothesis's st.data()): a value replaced by a
    hostile one (another type, a huge or non-finite number, a deep nesting), a key deleted, a list element repeated,
    a key added."""
    import copy

    from hypothesis import strategies as st

    s = strategies()
    doc = copy.deepcopy(doc)
    for _ in range(data.draw(st.integers(1, steps), label="edits")):
        nodes = list(_nodes(doc))
        path, node = data.draw(st.sampled_from(nodes), label="node")
        action = data.draw(st.sampled_from(["replace", "replace", "delete", "repeat", "add"]), label="action")
        if not path:
            if action == "replace":
                doc = data.draw(s.hostile, label="root")
            continue
        parent = doc
        for k in path[:-1]:
            parent = parent[k]
        key = path[-1]
        if action == "replace":
            parent[key] = data.draw(s.hostile, label="value")
        elif action == "delete":
            del parent[key]
        elif action == "repeat" and isinstance(parent, list):
            parent.append(copy.deepcopy(parent[key]))
        elif action == "add" and isinstance(node, dict):
            node[data.draw(s.text, label="key")] = data.draw(s.hostile, label="added")
    return doc


def dumps(doc) -> str:
    """`doc` as JSON text; a `_Deep` placeholder becomes its nesting, NaN and inf are written as Python's json does."""
    import json

    marks: dict[str, int] = {}

    def default(o):
        if isinstance(o, _Deep):
            mark = f"@@deep{len(marks)}@@"
            marks[mark] = o.depth
            return mark
        raise TypeError(type(o))

    out = json.dumps(doc, default=default)
    for mark, depth in marks.items():
        out = out.replace(f'"{mark}"', "[" * depth + "]" * depth)
    return out


def corrupt(data, raw: bytes) -> bytes:
    """`raw` truncated, with bytes flipped or a span repeated, as drawn by `data`."""
    from hypothesis import strategies as st

    if not raw:
        return raw
    how = data.draw(st.sampled_from(["truncate", "flip", "repeat", "zero"]), label="corruption")
    at = data.draw(st.integers(0, len(raw) - 1), label="at")
    if how == "truncate":
        return raw[:at]
    if how == "flip":
        n = data.draw(st.integers(1, 8), label="flips")
        b = bytearray(raw)
        for i in range(n):
            b[(at + 97 * i) % len(b)] ^= data.draw(st.integers(1, 255), label="bits")
        return bytes(b)
    if how == "zero":
        end = data.draw(st.integers(at, len(raw)), label="end")
        return raw[:at] + bytes(end - at) + raw[end:]
    span = raw[at:at + data.draw(st.integers(1, 64), label="span")]
    return raw[:at] + span * data.draw(st.integers(2, 50), label="times") + raw[at:]
