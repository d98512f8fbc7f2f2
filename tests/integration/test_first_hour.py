"""What a user meets first, through the real CLI: every run keeps its console in <output-dir>/train.log (appended on
a resume); piped output keeps tables whole (grep returns whole rows) and
--help uncut; `--eval-every 0` never evaluates; the log line's time left is h:mm:ss; and (slow) `accelerate launch
--num_processes 2` without --multi_gpu or a config file stops with one line instead of training alone."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers.cli import env, metrics
from tests.helpers.fork_server import Cli
from tests.helpers.paths import ROOT
from tests.helpers.ports import free_port

BASE = ["--embedding-dim", "16", "--head", "cosface", "--batch-size", "8", "--log-every", "1", "--num-workers", "0"]


def _whole_rows(text: str, word: str) -> list[str]:
    rows = [line for line in text.splitlines() if word in line]
    assert rows, f"no {word} in:\n{text[-3000:]}"
    for row in rows:  # a table row: every cell on this one line (5 columns), nothing cut
        assert row.startswith("│") and row.rstrip().endswith("│") and row.count("│") == 6, row
    assert "…" not in text
    return rows


def test_logs_piped_tables_and_eval_every_zero(faces, tmp_path):
    cli = Cli(tmp_path)
    try:
        run = tmp_path / "run"
        first = cli("train", "--data", str(faces / "train"), "--val-data", str(faces / "val"), "--output-dir",
                    str(run), "--max-steps", "2", *BASE)
        assert first.returncode == 0, first.stderr[-3000:]
        log = (run / "train.log").read_text()
        assert log.startswith("vtrain train log: ") and f"--output-dir {run}" in log.splitlines()[0]
        assert f"output directory: {run}" in log and "engine: single process | world 1" in log
        assert log.splitlines()[1:] == first.stdout.splitlines() + first.stderr.splitlines()  # all it showed
        rows = _whole_rows(log, "TAR@FAR")
        assert len(rows) == 3 and all(row in first.stdout for row in rows)
        assert "eval held-out (24 images): 3/3 batches" in log  # the evaluation's progress
        line = next(x for x in log.splitlines() if x.startswith("step=2 "))
        assert "eta_s=0 eta=0:00:00" in line
        # continued with --eval-every 0: no evaluation at all, the log appended with a second header
        second = cli("train", "--data", str(faces / "train"), "--val-data", str(faces / "val"), "--output-dir",
                     str(run), "--max-steps", "3", "--resume", "auto", "--eval-every", "0", *BASE)
        assert second.returncode == 0, second.stderr[-3000:]
        assert [r["step"] for r in metrics(run)] == [1, 2, 3]
        assert [json.loads(x)["step"] for x in (run / "eval.jsonl").read_text().splitlines()] == [2]
        log = (run / "train.log").read_text()
        assert sum(x.startswith("vtrain train log: ") for x in log.splitlines()) == 2
        assert "eval held-out" not in second.stdout
        # vtrain eval writes nothing into the run it reads (its eval.log goes beside --save-predictions, detection's
        # output place: tests/engine/test_run_files.py); --json is one line, the table's rows whole
        before = sorted(p.name for p in run.iterdir())
        ev = cli("eval", "--checkpoint", str(run), "--val-data", str(faces / "val"), "--json")
        assert ev.returncode == 0, ev.stderr[-3000:]
        assert json.loads(ev.stdout.splitlines()[-1])["genuine_pairs"] > 0
        _whole_rows("\n".join(ev.stdout.splitlines()[:-1]), "TAR@FAR")
        assert sorted(p.name for p in run.iterdir()) == before
        # --help piped: the one width rule, no option name or default cut
        helped = cli("train", "--help")
        assert helped.returncode == 0 and "--allow-partial-pretrained" in helped.stdout and "…" not in helped.stdout
    finally:
        cli.close()


@pytest.mark.slow
def test_a_launch_that_starts_one_process_alone_stops(tmp_path):
    """`accelerate launch --num_processes 2 -m vtrain train` on this machine without GPUs: Accelerate starts one
    process; it stops with the fix in one line, exit 2, before anything is built or written."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--main_process_port",
           str(free_port()), "-m", "vtrain", "train", "--data", "demo", "--output-dir", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env(HF_HOME=str(tmp_path / "hf")),
                          timeout=600)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "asked for 2 processes but started this one alone" in errors[0], proc.stderr[-3000:]
    assert "--config_file accelerate_configs/ddp.yaml --num_processes 2" in errors[0]
    assert proc.returncode != 0 and not out.exists()
