"""The test tree mirrors the package (docs/testing.md): every test module sits in one of the folders below, every
folder is a package, no test module imports another (shared code lives in tests/helpers/, fixtures in conftest.py),
and conftest.py defines fixtures and pytest hooks only. Checked statically over every file's syntax tree."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT

TESTS = ROOT / "tests"
# folder -> what its tests exercise
FOLDERS = {
    "core": "root-level modules of vtrain: config, cli, dist, the package's layering, this layout",
    "engine": "vtrain/engine: the runtime of a run",
    "data": "vtrain/data: readers, indexes, samplers",
    "models": "vtrain/models and vtrain/tasks",
    "eval": "vtrain/eval: metric functions",
    "memory": "vtrain/memory: the estimator and the planner",
    "tools": "vtrain/tools: offline commands",
    "benchmarks": "benchmarks/ scripts",
    "integration": "whole CLI runs and multi-process runs (marked `integration`)",
}
NOT_TESTS = {"helpers", "fixtures"}  # shared code and scripts, data with the scripts that made it


def _python_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "fixtures" not in p.relative_to(TESTS).parts)


def _is_test_module(name: str) -> bool:
    """A dotted import name that names a test module or a conftest (`test_x`, `tests.data.test_x`, `conftest`)."""
    last = name.split(".")[-1]
    return last.startswith("test_") or last == "conftest"


def _imported(tree: ast.AST) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            names.append(base)
            names += [f"{base}.{a.name}" for a in node.names if node.level or base.startswith("tests")]
    return names


def test_every_test_module_sits_in_a_mirrored_folder():
    misplaced = []
    for p in TESTS.rglob("test_*.py"):
        parts = p.relative_to(TESTS).parts
        if parts[0] in NOT_TESTS:
            continue
        if len(parts) != 2 or parts[0] not in FOLDERS:
            misplaced.append(str(p.relative_to(ROOT)))
    assert not misplaced, f"test modules outside {sorted(FOLDERS)} (docs/testing.md): {misplaced}"


def test_only_conftest_and_the_package_marker_at_the_top():
    top = sorted(p.name for p in TESTS.glob("*.py"))
    assert top == ["__init__.py", "conftest.py"], top


@pytest.mark.parametrize("folder", [*FOLDERS, "helpers"])
def test_every_folder_is_a_package(folder):
    assert (TESTS / folder / "__init__.py").is_file(), folder


def test_no_test_module_imports_another():
    found = []
    for p in _python_files():
        for name in _imported(ast.parse(p.read_text(), str(p))):
            if _is_test_module(name):
                found.append(f"{p.relative_to(ROOT)} imports {name}")
    assert not found, "move what is shared to tests/helpers/ (fixtures to conftest.py):\n" + "\n".join(found)


def test_conftest_holds_fixtures_and_hooks_only():
    tree = ast.parse((TESTS / "conftest.py").read_text())
    other = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            fixture = any("fixture" in ast.unparse(d) for d in getattr(node, "decorator_list", []))
            if not (fixture or node.name.startswith("pytest_")):
                other.append(node.name)
    assert not other, f"not fixtures or hooks, belong in tests/helpers/: {other}"


@pytest.mark.parametrize(("source", "bad"), [
    ("from conftest import ok", True),
    ("from test_hostile_data import Cli", True),
    ("from tests.integration.test_safety import Cli", True),
    ("from tests.integration import test_safety", True),
    ("from .test_lean import AMP", True),
    ("import tests.models.test_lean", True),
    ("from tests.helpers.cli import ok", False),
    ("from vtrain.data.sampler import ShardedEpochSampler", False),
])
def test_the_import_check_sees_each_form(source, bad):
    assert any(_is_test_module(n) for n in _imported(ast.parse(source))) is bad
