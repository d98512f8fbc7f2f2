"""The guard of behaviour-preserving refactors (issue 36): every command's `--help` and a table of error lines
(tests/helpers/cli_texts.py) are what tests/fixtures/cli_texts.json recorded before modules moved. A text that
changes on purpose is recorded again (the command is in the helper's docstring) and named in CHANGELOG.md."""

from __future__ import annotations

import difflib
import json
import subprocess
import sys

from tests.helpers.cli import env
from tests.helpers.paths import FIXTURES, ROOT


def _diff(before: str, after: str) -> str:
    return "".join(difflib.unified_diff(before.splitlines(True), after.splitlines(True), "recorded", "now"))


def test_help_and_error_texts_are_the_recorded_ones(tmp_path):
    proc = subprocess.run([sys.executable, "-c", "from tests.helpers.cli_texts import main; main()"], cwd=tmp_path,
                          capture_output=True, text=True, env=env(PYTHONPATH=str(ROOT), COLUMNS=""), timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    now = json.loads(proc.stdout)
    recorded = json.loads((FIXTURES / "cli_texts.json").read_text())
    assert sorted(now["help"]) == sorted(recorded["help"])
    for command, text in recorded["help"].items():
        assert now["help"][command] == text, f"vtrain {command} --help changed:\n{_diff(text, now['help'][command])}"
    assert [e["args"] for e in now["errors"]] == [e["args"] for e in recorded["errors"]]
    for before, after in zip(recorded["errors"], now["errors"]):
        assert after == before, f"vtrain {' '.join(before['args'])}:\n{_diff(json.dumps(before, indent=1), json.dumps(after, indent=1))}"
    assert not any(tmp_path.iterdir())  # no case wrote anything
