"""vtrain/console.py: the one width rule off a terminal (tables whole at their natural width, nothing cut with `…`),
the log file (header, what was printed before it opened, stderr), and the progress lines of a loop."""

from __future__ import annotations

import io
import sys

from rich.table import Table

from vtrain import console as out
from vtrain.engine import run_files


def _wide_table() -> Table:
    t = Table(title="metric eval")
    for col in ("set", "metric", "value", "threshold", "note"):
        t.add_column(col)
    t.add_row("held-out", "TAR@FAR=0.001", "0.1234", "0.99", "unresolvable: < 1000 impostor pairs " * 5)
    return t


def test_piped_tables_are_whole_rows_at_their_natural_width():
    buf = io.StringIO()
    c = out.VConsole(file=buf)
    assert not c.is_terminal and c.width == out.PIPED_WIDTH
    c.print(_wide_table())
    c.print("a line")
    lines = buf.getvalue().splitlines()
    rows = [line for line in lines if "TAR@FAR" in line]
    assert len(rows) == 1 and rows[0].startswith("│") and rows[0].rstrip().endswith("│")
    assert rows[0].count("│") == 6 and "…" not in buf.getvalue()
    assert len(rows[0]) > out.PIPED_WIDTH  # widened for the table, not squeezed into the rule's width
    assert c.width == out.PIPED_WIDTH and lines[-1] == "a line"


def test_the_log_gets_the_header_what_came_before_and_stderr(tmp_path, monkeypatch):
    screen, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", screen)
    monkeypatch.setattr(sys, "stderr", err)
    out.start_log()
    try:
        out.console.print("before the directory was claimed")
        print("a warning", file=sys.stderr)
        out.log_to(tmp_path / "train.log", "vtrain train log: test")
        out.console.print(_wide_table())
        out.plain('{"AP": 0.5, "[x]": 1}')
        assert out.log_path() == tmp_path / "train.log"
    finally:
        out.end_log()
    assert sys.stderr is err  # given back
    log = (tmp_path / "train.log").read_text()
    assert log.splitlines()[:3] == ["vtrain train log: test", "before the directory was claimed", "a warning"]
    assert log.splitlines()[-1] == '{"AP": 0.5, "[x]": 1}' and "a warning" in err.getvalue()
    assert [line for line in log.splitlines() if "TAR@FAR" in line][0].count("│") == 6
    assert screen.getvalue().splitlines()[0] == "before the directory was claimed"
    assert run_files._RECOGNISE[run_files.TRAIN_LOG](tmp_path / "train.log")  # vtrain's own log, by its header


def test_progress_lines_off_a_terminal(monkeypatch):
    screen = io.StringIO()
    monkeypatch.setattr(sys, "stdout", screen)
    assert list(out.tracked(range(25), 25, "eval held-out")) == list(range(25))
    lines = screen.getvalue().splitlines()
    assert lines[0] == "eval held-out: 0/25 batches" and lines[-1].startswith("eval held-out: 25/25 batches, 0:00:")
    assert len(lines) == 1 + 9  # at every tenth (3, 6, ..., 24) and the end
    assert list(out.tracked(range(3), 3, "quiet", show=False)) == [0, 1, 2] and len(screen.getvalue().splitlines()) == 10


def test_hms():
    assert out.hms(0) == "0:00:00" and out.hms(3725.4) == "1:02:05" and out.hms(None) == "-"
