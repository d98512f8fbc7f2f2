"""The scaffold of the table-driven integration suites (hostile data, fields, files, checkpoint content, owned
outputs, flag values): a module's prior runs behind one fork server, its table of cases, and the verdict on one
command's output. Each suite keeps its own `Prior`, `Ctx` and `Case` (what its rows build and check); what they all
did alike lives here once.

- `served(tmp_path_factory, name)`: a fresh root folder with `logs/` and a fork server (helpers/fork_server.py)
  logging there, closed when the module's fixture ends.
- `case_table(Case)`: the table `CASES` (name -> Case) and its decorator `case(name, *needles, **fields)`; a name is
  used once.
- `shown(rc, out, err, peak_mb)`: what a failed assertion prints of the command.
- `verdict(rc, out, err, needles, ok, shown)`: no traceback; an `ok` row exits 0 and its needles are in the whole
  output; any other row exits non-zero with exactly one `error:` line holding every needle. Returns that text.
- `copied_run(run, case_root)`: a case's own copy of the prior run, a decoy folder beside it, an output folder."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from tests.helpers.fork_server import Cli

C = TypeVar("C")
S = TypeVar("S", bound=Cli)


@contextmanager
def served(tmp_path_factory: Any, name: str, server: type[S] = Cli) -> Iterator[tuple[Path, S]]:  # type: ignore[assignment]
    """(root, cli): `root` = tmp_path_factory.mktemp(name) with `root/logs` for the server's per-command logs."""
    root = tmp_path_factory.mktemp(name)
    (root / "logs").mkdir()
    cli = server(root / "logs")
    try:
        yield root, cli
    finally:
        cli.close()


def case_table(kind: Callable[..., C]) -> tuple[dict[str, C], Callable[..., Callable]]:
    """(CASES, case): `@case(name, *needles, **fields)` over a row's build function adds
    `kind(build, needles, **fields)` under `name`."""
    cases: dict[str, C] = {}

    def case(name: str, *needles: str, **fields: Any) -> Callable:
        def add(build: Callable) -> Callable:
            assert name not in cases, f"two cases named {name}"
            cases[name] = kind(build, needles, **fields)
            return build
        return add

    return cases, case


def shown(rc: int, out: str, err: str, peak_mb: float | None = None, err_tail: int = 5000) -> str:
    peak = f", peak {peak_mb:.0f} MB" if peak_mb is not None else ""
    return f"exit {rc}{peak}\nSTDOUT:\n{out[-3000:]}\nSTDERR:\n{err[-err_tail:]}"


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error:")]


def verdict(rc: int, out: str, err: str, needles: tuple[str, ...], ok: bool, show: str, tail: int = 2000) -> str:
    """The text the needles were found in: the whole output of an `ok` row, else the one `error:` line."""
    assert "Traceback" not in out + err, show
    if ok:
        assert rc == 0, show
        text = out + err
    else:
        lines = error_lines(err)
        assert rc != 0 and len(lines) == 1, show
        text = lines[0]
    for n in needles:
        assert n in text, f"{n!r} not in {text[-tail:]!r}"
    return text


def copied_run(run: Path, case_root: Path) -> tuple[Path, Path, Path]:
    """(run, decoy, out) under `case_root`: a copy of the prior `run`; a decoy folder outside it holding a copy of
    the run's own step_1 (`archive/step_1`: the same lineage, so a pruning that followed a link would take it) and
    4 KiB of random bytes (`bytes.bin`); an empty folder for outputs."""
    copy, decoy, out = case_root / "run", case_root / "decoy", case_root / "out"
    shutil.copytree(run, copy)
    out.mkdir()
    shutil.copytree(copy / "checkpoints" / "step_1", decoy / "archive" / "step_1")
    (decoy / "bytes.bin").write_bytes(os.urandom(4096))
    return copy, decoy, out
