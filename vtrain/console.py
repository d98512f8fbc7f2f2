"""What vtrain prints, and where it goes besides the screen: the one rich console of every command, its width rule,
progress of a long loop, and a run's log file (`train.log`, `eval.log`).

**One width rule for every command.** On a terminal, the terminal's width. Anywhere else (a pipe, a file, a CI log)
`PIPED_WIDTH` columns (or `$COLUMNS` when that is wider), and a table wider than that is printed at its natural
width: nothing is cut with `…` and no row is wrapped inside its cells, so `grep TAR@FAR log` returns whole rows.
`--help` follows the same rule (cli.py hands Typer the width). A log file is rendered by the same rule as a pipe.

**The log file.** `start_log()` (the `train` command, rank 0) keeps what is printed from then on in memory, and
tees `sys.stderr` (warnings, the final `error:` line) into it; `log_to(path)` (once the output directory is claimed)
writes a header line and what was kept, then appends everything printed through `console`, rendered as for a pipe:
no colours, no progress bar, tables whole. `end_log()` closes it.

**Progress.** `tracked(items, total, label)` shows a loop's progress: on a terminal a bar (inside the training bar
when one is live, else its own, removed at the end); elsewhere one line at the start, at every tenth of the way
and at the end, with the elapsed time and the time left.
"""

from __future__ import annotations

import atexit
import io
import os
import socket
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any, TypeVar

from rich.console import Console, ConsoleDimensions
from rich.control import Control
from rich.measure import Measurement
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

PIPED_WIDTH = 160
"""Columns of everything vtrain prints when stdout is not a terminal (wider with $COLUMNS, or where a table needs
more)."""
PROGRESS_LINES = 10
"""A loop's progress lines when stdout is not a terminal: one at every 1/PROGRESS_LINES of the way."""

T = TypeVar("T")


def hms(seconds: float | None) -> str:
    """`h:mm:ss` for a duration (`-` when unknown): the unit of every time left that vtrain prints."""
    if seconds is None:
        return "-"
    s = int(round(max(seconds, 0.0)))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def _unwrap_titles(objects: tuple[Any, ...]) -> None:
    """Each table's title as one unwrapped line: rich wraps a title at its table's width, and a long checkpoint path
    in it would break (off a terminal; `_natural_width` then widens the console to the title)."""
    for o in objects:
        if isinstance(o, Table) and isinstance(o.title, str):
            o.title = Text(o.title, no_wrap=True, overflow="ignore")


def _natural_width(console: Console, objects: tuple[Any, ...]) -> int:
    """The widest natural width of the tables among `objects`, their titles included (0 without one)."""
    options = console.options.update_width(100_000)
    return max((max(Measurement.get(console, options, o).maximum,
                    o.title.cell_len if isinstance(o.title, Text) else 0)
                for o in objects if isinstance(o, Table)), default=0)


class VConsole(Console):
    """A rich Console with vtrain's width rule, which also renders what it prints into the run's log file."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(highlight=False, **kwargs)
        self._table_width = 0  # while a table wider than the rule is printed off a terminal: its natural width
        self.mirror: VConsole | None = None
        """The log file's console: what this one prints is printed there too."""

    @property
    def size(self) -> ConsoleDimensions:
        dims = super().size
        if self.is_terminal:
            return dims
        columns = os.environ.get("COLUMNS", "")
        width = max(PIPED_WIDTH, int(columns) if columns.isdigit() else 0, self._table_width)
        return ConsoleDimensions(width, dims.height)

    def print(self, *objects: Any, **kwargs: Any) -> None:  # type: ignore[override]
        # Console.print never renders wider than the console (`width=` is capped by it): widen the console itself
        if not self.is_terminal:
            _unwrap_titles(objects)
        self._table_width = _natural_width(self, objects) if not self.is_terminal else 0
        try:
            super().print(*objects, **kwargs)
        finally:
            self._table_width = 0
        # a live display's cursor moves are the terminal's business, not the log's
        if self.mirror is not None and objects and not all(isinstance(o, Control) for o in objects):
            self.mirror.print(*objects, **kwargs)


console = VConsole()
"""Everything vtrain prints to stdout goes through this console (and into the run's log file when one is open)."""


def plain(text: str) -> None:
    """`text` as one line, exactly (no markup, no wrapping): a machine-read line such as `--json`'s, also logged."""
    console.print(text, markup=False, emoji=False, highlight=False, soft_wrap=True)
live_progress: Progress | None = None
"""The training bar while it is shown (`show_progress`): `tracked` adds its bar to it."""


def show_progress(progress: Progress | None) -> None:
    """The training bar being shown (engine/logging.py), or None once it is stopped."""
    global live_progress
    live_progress = progress


class _Tee(io.TextIOBase):
    """sys.stderr that also writes into the log (`sink()` names where it is now)."""

    def __init__(self, stream: IO[str], sink: Any) -> None:
        self.stream, self.sink = stream, sink

    def write(self, text: str) -> int:
        n = self.stream.write(text)
        try:
            self.sink().write(text)
        except (OSError, ValueError):  # a full disk or a closed log: the screen still gets it
            pass
        return n

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


class _Log:
    """The open log: a buffer until `log_to`, then the file."""

    def __init__(self) -> None:
        self.file: IO[str] = io.StringIO()
        self.path: Path | None = None
        self.tee: _Tee | None = None
        console.mirror = VConsole(file=self.file, force_terminal=False, color_system=None)


_log: _Log | None = None


def start_log(tee_stderr: bool = True) -> None:
    """Keep what is printed from now on for the log file that `log_to` opens (and what goes to sys.stderr). The log
    ends when the process does (or at `end_log`)."""
    global _log
    end_log()
    _log = _Log()
    if tee_stderr:
        _log.tee = _Tee(sys.stderr, lambda: _log.file if _log is not None else io.StringIO())
        sys.stderr = _log.tee
    atexit.register(end_log)  # after the command's last line (an `error:` line included) was printed


def log_to(path: str | Path, header: str) -> None:
    """Append to `path` from now on (rank 0 of a run, once its directory is claimed): `header`, then what was
    printed since `start_log` (if it was called and no log file is open yet), then everything printed. The caller
    has made sure that `path` is no link and no special file (engine/rundir.py)."""
    if _log is None or _log.path is not None:  # a run built in this process without the CLI, or a second one
        start_log(tee_stderr=False)
    assert _log is not None
    kept = _log.file.getvalue() if isinstance(_log.file, io.StringIO) else ""
    f = open(path, "a", encoding="utf-8", errors="replace", buffering=1)  # line-buffered: a killed run keeps its lines
    f.write(header.rstrip("\n") + "\n" + kept)
    f.flush()
    _log.file, _log.path = f, Path(path)
    assert console.mirror is not None
    console.mirror.file = f


def log_path() -> Path | None:
    """The log file being written, if any."""
    return _log.path if _log is not None else None


def end_log() -> None:
    """Close the log file (what was kept but never written is dropped) and give sys.stderr back."""
    global _log
    if _log is None:
        return
    log, _log = _log, None
    console.mirror = None
    if log.tee is not None and sys.stderr is log.tee:
        sys.stderr = log.tee.stream
    try:
        log.file.close()
    except OSError:
        pass


def header(command: str) -> str:
    """The first line of a log for one start of `command` (`train`, `eval`): when, which process, the command line.
    engine/rundir.py recognises vtrain's logs by it."""
    return (f"vtrain {command} log: {time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()} on {socket.gethostname()}: "
            f"vtrain {' '.join(sys.argv[1:])}")


def tracked(items: Iterable[T], total: int, label: str, show: bool = True, unit: str = "batches") -> Iterator[T]:
    """`items` (`total` `unit`), with their progress shown under `label` when `show` (rank 0): a bar on a terminal,
    else a line at the start, at every tenth and at the end."""
    if not show:
        yield from items
        return
    if console.is_terminal:
        yield from _bar(items, total, label)
        return
    t0 = time.perf_counter()
    step = max(1, -(-total // PROGRESS_LINES))
    console.print(f"{label}: 0/{total} {unit}", soft_wrap=True)
    done = 0
    for item in items:
        yield item
        done += 1
        if done % step == 0 or done == total:
            took = time.perf_counter() - t0
            left = took / done * (total - done)
            console.print(f"{label}: {done}/{total} {unit}, {hms(took)} elapsed, {hms(left)} left", soft_wrap=True)


def _bar(items: Iterable[T], total: int, label: str) -> Iterator[T]:
    progress = live_progress
    own = progress is None
    if own:
        progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            TextColumn("left"), TimeRemainingColumn(), console=console, transient=True)
        progress.start()
    task = progress.add_task(label, total=total)
    try:
        for item in items:
            yield item
            progress.advance(task)
    finally:
        progress.remove_task(task)
        if own:
            progress.stop()
