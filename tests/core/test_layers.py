"""The package's layering (docs/architecture.md): imports run only downward, there is no import circle, and
imports inside functions are kept to a short list with a reason each. Checked statically over every module's
syntax tree, and at run time by importing a low module in a fresh interpreter."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.cli import env
from tests.helpers.paths import ROOT

PACKAGE = ROOT / "vtrain"

# low to high; a module may import its own layer and the ones below it. The first part of the dotted name after
# `vtrain.` picks the layer ("" is the package's own __init__).
LAYERS: list[tuple[str, set[str]]] = [
    ("base", {"", "errors", "presets", "io", "dist", "recompute", "console", "launch", "exit", "preset_counts"}),
    ("config", {"config"}),
    ("data, models, eval", {"data", "models", "eval"}),
    ("tasks", {"tasks"}),
    ("memory", {"memory"}),
    ("engine", {"engine"}),
    ("tools", {"tools"}),
    ("cli", {"cli", "cli_rules", "cli_options", "__main__"}),
]

# modules allowed to import vtrain modules inside functions, and why (never to dodge an import circle)
LAZY_IMPORTS = {
    "vtrain.cli": "start-up: a flag error is reported before torch is imported (the commands import it)",
    "vtrain.models.dino.msda": "msda_triton reads TRITON_INTERPRET when it is imported, so it is imported on use",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer(module: str) -> int:
    part = module.split(".")[1] if "." in module else ""
    for i, (_, names) in enumerate(LAYERS):
        if part in names:
            return i
    raise AssertionError(f"{module} belongs to no layer: add `{part}` to LAYERS in tests/core/test_layers.py")


def _targets(node: ast.Import | ast.ImportFrom, module: str) -> list[str]:
    """The vtrain modules an import statement loads (`from vtrain.x import y` loads vtrain.x.y when y is one)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "vtrain"]
    base = node.module or ""
    if node.level:  # relative: resolve against this module's package
        pkg = module.split(".") if MODULES[module].name == "__init__.py" else module.split(".")[:-1]
        base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
    if base.split(".")[0] != "vtrain":
        return []
    return list(dict.fromkeys(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names))


def imports(module: str) -> list[tuple[str, int, bool]]:
    """(target, line, inside a function) for every vtrain import of `module`."""
    tree = ast.parse(MODULES[module].read_text(), str(MODULES[module]))
    found: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.extend((t, child.lineno, in_function) for t in _targets(child, module))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return found


GRAPH = {m: imports(m) for m in MODULES}


def test_every_module_has_a_layer_and_every_import_resolves():
    for m, edges in GRAPH.items():
        layer(m)
        for target, line, _ in edges:
            assert target in MODULES, f"{m}:{line} imports {target}, which is not a vtrain module"


def test_no_import_runs_upward():
    upward = [f"{MODULES[m].relative_to(ROOT)}:{line}: {LAYERS[layer(m)][0]} imports {t} ({LAYERS[layer(t)][0]})"
              for m, edges in GRAPH.items() for t, line, _ in edges if layer(t) > layer(m)]
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_data_models_and_eval_do_not_import_each_other():
    """One layer, three independent packages: the data pipeline, the networks and the pure metric functions meet
    only in a task."""
    mixed = [f"{MODULES[m].relative_to(ROOT)}:{line}: imports {t}" for m, edges in GRAPH.items()
             for t, line, _ in edges if layer(m) == layer(t) == 2 and m.split(".")[1] != t.split(".")[1]]
    assert not mixed, "\n".join(mixed)


def test_no_import_circle():
    """No cycle, counting imports inside functions too: one there that closes a circle only hides it."""
    graph = {m: sorted({t for t, _, _ in edges if t != m}) for m, edges in GRAPH.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []
    cycles: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for t in graph[m]:
            if state.get(t) == 1:
                cycles.append(" -> ".join(path[path.index(t):] + [t]))
            elif t not in state:
                visit(t)
        path.pop()
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m)
    assert not cycles, "import circles:\n" + "\n".join(cycles)


def test_imports_inside_functions_only_where_listed():
    lazy = [f"{MODULES[m].relative_to(ROOT)}:{line}: imports {t} inside a function"
            for m, edges in GRAPH.items() if m not in LAZY_IMPORTS for t, line, inside in edges if inside]
    assert not lazy, ("vtrain imports inside functions (move them to the top of the module, or, with a reason "
                      "other than an import circle, list the module in LAZY_IMPORTS):\n" + "\n".join(lazy))


def test_the_lists_name_real_modules():
    assert set(LAZY_IMPORTS) <= set(MODULES)
    parts = {m.split(".")[1] if "." in m else "" for m in MODULES}
    unused = {p for _, names in LAYERS for p in names} - parts - {"dist"}  # dist: collective helpers (docs/architecture.md)
    assert not unused, f"LAYERS names modules that do not exist: {sorted(unused)}"


_LOADED = ("import importlib, json, sys; importlib.import_module(sys.argv[1]); "
           "print(json.dumps(sorted(m for m in sys.modules if m == 'vtrain' or m.startswith(('vtrain.', 'torch')))))")


@pytest.mark.parametrize("module", ["vtrain.config", "vtrain.data.faces", "vtrain.models.dino", "vtrain.eval.coco_eval",
                                    "vtrain.tasks", "vtrain.memory.planner", "vtrain.engine.trainer"])
def test_importing_a_layer_loads_nothing_above_it(module):
    """At run time too (package __init__ files and anything the static walk cannot see included)."""
    proc = subprocess.run([sys.executable, "-c", _LOADED, module], cwd=ROOT, capture_output=True, text=True,
                          env=env(), timeout=600)
    assert proc.returncode == 0, proc.stderr
    loaded = [m for m in json.loads(proc.stdout.splitlines()[-1]) if m.split(".")[0] == "vtrain"]
    above = [m for m in loaded if layer(m) > layer(module)]
    assert not above, f"importing {module} ({LAYERS[layer(module)][0]}) loaded {above}"


def test_the_cli_module_loads_without_torch():
    """`vtrain train --seed abc` and every other flag error are reported before torch is imported (~0.5 s)."""
    proc = subprocess.run([sys.executable, "-c", _LOADED, "vtrain.cli"], cwd=ROOT, capture_output=True, text=True,
                          env=env(), timeout=600)
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stdout.splitlines()[-1])
    assert "torch" not in loaded and "vtrain.cli" in loaded
