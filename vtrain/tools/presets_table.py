"""`vtrain presets`: every preset with its parameter counts, built on the meta device (instant, no memory)."""

from __future__ import annotations

import torch
from rich.table import Table

from vtrain.models.dino import DINO, count_parameters
from vtrain.models.metric import MetricModel
from vtrain.presets import DINO_PRESETS, METRIC_PRESETS


def preset_tables() -> list[Table]:
    """The metric presets (backbone, and with the embedding neck: the `*-af` flatten neck is large) and the DINO
    presets (backbone and whole detector)."""
    t = Table(title="--task metric: backbones (112x112, 512-d embedding)")
    for col in ("preset", "timm model", "backbone params", "with neck", "description"):
        t.add_column(col)
    for name, fn in METRIC_PRESETS.items():
        p = fn()
        with torch.device("meta"):
            m = MetricModel(name, 0, 112)
        n, total = (sum(x.numel() for x in mod.parameters()) for mod in (m.backbone, m))
        t.add_row(name, p.timm_name, f"{n / 1e6:.2f}M", f"{total / 1e6:.2f}M", p.description)
    d = Table(title="--task dino: detectors (80 classes)")
    for col in ("preset", "timm backbone", "levels", "backbone", "total", "description"):
        d.add_column(col)
    for name, fn in DINO_PRESETS.items():
        p = fn()
        with torch.device("meta"):
            n = count_parameters(DINO(p, 80))
        d.add_row(name, p.timm_name, str(p.levels), f"{n['backbone'] / 1e6:.2f}M", f"{n['total'] / 1e6:.2f}M",
                  p.description)
    return [t, d]
