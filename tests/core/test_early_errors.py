"""Mistakes that start-up would find after a minute of imports are found before torch is imported (cli.py; the
mechanism, not a time: the error line is printed and `torch` is still not in sys.modules): a missing checkpoint, a
re-used --output-dir, a DeepSpeed JSON that contradicts the flags, a batch larger than the demo set, and an option of
the other task."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers.cli import env
from tests.helpers.paths import ROOT

# each command runs through the CLI's own entry (`_run`: its error handling), one after another in one interpreter
RUN = """
import json, sys
from vtrain.cli import _run
from vtrain.console import end_log
cases = json.loads(sys.argv[1])
report = []
for args in cases:
    sys.argv = ["vtrain", *args]
    code = _run()
    end_log()
    report.append([code, "torch" in sys.modules])
print(json.dumps(report))
"""


def test_errors_before_torch_is_imported(tmp_path):
    run = tmp_path / "run"  # an earlier run's directory: marker, logs, no checkpoint
    run.mkdir()
    (run / ".vtrain-run.json").write_text(json.dumps({"format": "vtrain-run", "version": 1, "created": 0}))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "epoch": 0, "time": 1.0}) + "\n")
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 2}}))
    fresh = str(tmp_path / "fresh")
    cases = [
        (["eval", "--checkpoint", str(tmp_path / "missing")], "--checkpoint: no such file or directory"),
        (["predict", "--checkpoint", str(tmp_path / "missing"), "--images", "x.jpg", "--out", fresh],
         "--checkpoint: no such file or directory"),
        (["consolidate", str(tmp_path / "missing"), str(tmp_path / "m.safetensors")], "CKPT: no such file"),
        (["train", "--data", "demo", "--output-dir", str(run)], "already holds logs of an earlier run (metrics.jsonl)"),
        (["train", "--data", "demo", "--output-dir", fresh, "--ds-config", str(ds), "--batch-size", "4"],
         "train_micro_batch_size_per_gpu=8 contradicts --batch-size (=4)"),
        (["train", "--data", "demo", "--output-dir", fresh, "--batch-size", "5000"],
         "--batch-size 5000 x 1 processes exceeds the 2400 training images"),
        (["train", "--task", "dino", "--data", "demo", "--output-dir", fresh, "--margin", "0.3"],
         "--margin (model.margin): applies to --task metric only"),
    ]
    proc = subprocess.run([sys.executable, "-c", RUN, json.dumps([c for c, _ in cases])], cwd=ROOT,
                          capture_output=True, text=True, env=env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.splitlines()[-1])
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == len(cases), proc.stderr[-4000:]
    for (args, expected), (code, torch_loaded), line in zip(cases, report, errors):
        assert code == 2 and expected in line, (args, line)
        assert not torch_loaded, f"vtrain {' '.join(args)}: torch was imported before the error"
    assert not (tmp_path / "fresh").exists()  # nothing was created
