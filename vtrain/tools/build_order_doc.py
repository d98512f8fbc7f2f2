"""The build order of a run in docs/architecture.md, generated from the numbered comments of `Trainer.__init__`
(`# 1. ...` to `# N. ...`, each with the comment lines that continue it), so the page says the code's order:
`python -m vtrain.tools.build_order_doc` rewrites the section between its markers in place;
tests/tools/test_build_order_doc.py fails when the page is stale or the numbers are out of order. The source is read
as text: nothing is imported."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRAINER = ROOT / "vtrain" / "engine" / "trainer.py"
PAGE = ROOT / "docs" / "architecture.md"
BEGIN = "<!-- build order: generated from Trainer.__init__ by `python -m vtrain.tools.build_order_doc` -->"
END = "<!-- end of the build order -->"
_STEP = re.compile(r"^\s*# (\d+)\. (.*)$")


def steps(source: str | None = None) -> list[tuple[int, str]]:
    """(number, text) of each numbered comment in `Trainer.__init__`, in source order."""
    source = TRAINER.read_text() if source is None else source
    init = next(f for c in ast.parse(source).body if isinstance(c, ast.ClassDef) and c.name == "Trainer"
                for f in c.body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
    lines = source.splitlines()[init.lineno - 1:init.end_lineno]
    found: list[tuple[int, str]] = []
    continuing = False
    for line in lines:
        m = _STEP.match(line)
        if m:
            found.append((int(m.group(1)), m.group(2).strip()))
            continuing = True
        elif continuing and line.strip().startswith("#"):
            found[-1] = (found[-1][0], f"{found[-1][1]} {line.strip()[1:].strip()}")
        else:
            continuing = False
    return found


def section(source: str | None = None) -> str:
    """The generated list, markers included."""
    items = "\n".join(f"{n}. {text}" for n, text in steps(source))
    return f"{BEGIN}\n{items}\n{END}"


def rewrite(page: str, source: str | None = None) -> str:
    """`page` with its generated section replaced."""
    start, stop = page.index(BEGIN), page.index(END) + len(END)
    return page[:start] + section(source) + page[stop:]


if __name__ == "__main__":
    PAGE.write_text(rewrite(PAGE.read_text()))
