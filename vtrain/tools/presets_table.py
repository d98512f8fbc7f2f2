"""`vtrain presets`: every preset with its parameter counts, from the stored table (vtrain/preset_counts.py, which
tests/tools/test_presets_command.py checks against the models as built): no model is built, torch is not imported."""

from __future__ import annotations

from rich.table import Table

from vtrain.preset_counts import COUNTS
from vtrain.presets import DINO_PRESETS, METRIC_PRESETS


def _m(n: int) -> str:
    return f"{n / 1e6:.2f}M"


def preset_tables() -> list[Table]:
    """The metric presets (backbone, and with the embedding neck: the `*-af` flatten neck is large) and the DINO
    presets (backbone and whole detector)."""
    t = Table(title="--task metric: backbones (112x112, 512-d embedding)")
    for col in ("preset", "timm model", "backbone params", "with neck", "description"):
        t.add_column(col)
    for name, fn in METRIC_PRESETS.items():
        p = fn()
        backbone, total = COUNTS["metric"][name]
        t.add_row(name, p.timm_name, _m(backbone), _m(total), p.description)
    d = Table(title="--task dino: detectors (80 classes)")
    for col in ("preset", "timm backbone", "levels", "backbone", "total", "description"):
        d.add_column(col)
    for name, fn in DINO_PRESETS.items():
        p = fn()
        backbone, total = COUNTS["dino"][name]
        d.add_row(name, p.timm_name, str(p.levels), _m(backbone), _m(total), p.description)
    return [t, d]
