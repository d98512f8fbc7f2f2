"""What `--pretrained PATH` names: a weights file, or a vtrain checkpoint to fine-tune from (a checkpoint directory,
a run directory's newest checkpoint, or a checkpoint's own model.safetensors / ema.safetensors). For a checkpoint
the class names it was trained on come with the weights (categories.json), so a detector fine-tuned on other
classes keeps the rows of the classes both lists name (models/dino/class_rows.py, docs/detection.md)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vtrain.engine import checkpoint as ckpt
from vtrain.engine.ema import weights_file


@dataclass
class PretrainedSource:
    weights: Path
    """The weights file to read."""
    categories: list[dict[str, Any]] | None
    """Detection: the checkpoint's classes (COCO id, name) in label order, when it records them."""


def resolve(path: str | Path) -> PretrainedSource:
    """The weights and class list --pretrained names. A directory must be a complete checkpoint (or a run directory
    with one) and is verified against its manifest, as `vtrain eval` does; its EMA weights are taken when it has
    them (they are what the run evaluated). A file inside a checkpoint carries that checkpoint's categories."""
    p = Path(path)
    if p.is_dir():
        found = ckpt.find_verified(p, "--pretrained")
        weights, _ = weights_file(found, None)
        return PretrainedSource(weights, ckpt.read_categories(found))
    beside = p.parent
    if p.name in (ckpt.MODEL, ckpt.EMA) and (beside / ckpt.CATEGORIES).is_file():
        return PretrainedSource(p, ckpt.read_categories(beside))
    return PretrainedSource(p, None)
