"""Every command's `--help` and a table of its error lines, as a user sees them off a terminal: the record
tests/core/test_cli_texts.py compares with tests/fixtures/cli_texts.json, so that moving modules cannot change
what the CLI prints without the fixture saying so.

Run in a fresh interpreter (`_run` sets Typer's width; the commands import what they need), from an empty
directory (every path below is relative and names nothing that exists), by `python -c` so that Click calls the
program `vtrain` as the console script does (`-m` would make it `python -m ...`). To record the fixture again after a
deliberate change of a text (and say which in CHANGELOG.md):
`cd $(mktemp -d) && OMP_NUM_THREADS=1 PYTHONPATH=<repo> <repo>/.venv/bin/python -c "from tests.helpers.cli_texts import
main; main()" > <repo>/tests/fixtures/cli_texts.json`"""

from __future__ import annotations

import contextlib
import io
import json
import sys

COMMANDS = ["train", "eval", "predict", "consolidate", "export", "estimate-memory", "presets", "convert"]

# each one fails before it writes anything; the reasons cover Click's own refusals (unknown option, bad type,
# choice, missing option) and vtrain's (config values, paths, each command's own number checks)
ERRORS: list[list[str]] = [
    ["nosuch"],
    ["train", "--seed", "abc"],
    ["train", "--task", "nosuch"],
    ["train", "--no-such-flag"],
    ["train", "--data", "demo", "--output-dir", "out", "--lr", "-1"],
    ["train", "--data", "demo", "--output-dir", "out", "--batch-size", "0"],
    ["train", "--task", "dino", "--data", "demo", "--output-dir", "out", "--margin", "0.3"],
    ["train", "--data", "demo", "--output-dir", "out", "--mixed-precision", "fp8"],
    ["train", "--data", "demo", "--output-dir", "out", "--grad-ckpt", "bogus"],
    ["train", "--config", "missing.yaml"],
    ["train", "--data", "missing-data", "--output-dir", "out"],
    ["train", "--data", "demo", "--output-dir", "out", "--resume", "missing-ckpt"],
    ["train", "--data", "demo", "--output-dir", "out", "--ds-config", "missing.json"],
    ["eval"],
    ["eval", "--checkpoint", "missing-ckpt"],
    ["eval", "--checkpoint", "missing-ckpt", "--task", "nosuch"],
    ["predict", "--checkpoint", "missing-ckpt"],
    ["predict", "--checkpoint", "missing-ckpt", "--images", "x.jpg", "--out", "out"],
    ["consolidate", "missing-ckpt"],
    ["consolidate", "missing-ckpt", "out.safetensors", "--dtype", "fp8"],
    ["consolidate", "missing-ckpt", "out.safetensors"],
    ["export", "missing-ckpt", "out.onnx"],
    ["export", "missing-ckpt", "out.onnx", "--opset", "x"],
    ["estimate-memory", "--gpus", "0"],
    ["estimate-memory", "--batch-size", "0"],
    ["estimate-memory", "--gpu-memory", "-1"],
    ["estimate-memory", "--breakdown-rows", "3"],
    ["estimate-memory", "--memory-budget", "0"],
    ["estimate-memory", "--task", "nosuch"],
    ["estimate-memory", "--mixed-precision", "fp8"],
    ["estimate-memory", "--config", "missing.yaml"],
    ["presets", "extra"],
    ["convert", "missing.pt", "out"],
    ["convert", "missing.pt", "out", "--from", "arcface-vit"],
]


def _call(args: list[str]) -> dict:
    from vtrain.cli import _run
    from vtrain.console import end_log

    out, err = io.StringIO(), io.StringIO()
    sys.argv = ["vtrain", *args]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = _run()
        finally:
            end_log()
    return {"args": args, "exit": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


def record() -> dict:
    """{"help": {command: text}, "errors": [{args, exit, stdout, stderr}]} in this interpreter."""
    helps = {name: _call([*([name] if name else []), "--help"]) for name in ["", *COMMANDS]}
    assert all(h["exit"] == 0 and not h["stderr"] for h in helps.values()), helps
    return {"help": {k or "vtrain": v["stdout"] for k, v in helps.items()}, "errors": [_call(a) for a in ERRORS]}


def main() -> None:
    sys.argv = ["vtrain"]
    print(json.dumps(record(), indent=1))
