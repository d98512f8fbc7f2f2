"""Where things are: the repository root and this folder (helper scripts that tests run as subprocesses)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HELPERS = ROOT / "tests" / "helpers"
FIXTURES = ROOT / "tests" / "fixtures"
