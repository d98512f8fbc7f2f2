"""What `--pretrained PATH` names: a weights file, or a vtrain checkpoint to fine-tune from (a checkpoint directory,
a run directory's newest checkpoint, or a checkpoint's own model.safetensors / ema.safetensors). For a checkpoint
the class names it was trained on come with the weights (categories.json), so a detector fine-tuned on other
classes keeps the rows of the classes both lists name (models/dino/class_rows.py, docs/detection.md)."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vtrain.config import ModelConfig
from vtrain.config.values import coerce, read_yaml
from vtrain.engine.checkpoint import format as ckpt
from vtrain.engine.ema import weights_file
from vtrain.errors import VtrainError
from vtrain.models.dino.detector import DinoOptions


@dataclass
class PretrainedSource:
    weights: Path
    """The weights file to read."""
    categories: list[dict[str, Any]] | None
    """Detection: the checkpoint's classes (COCO id, name) in label order, when it records them."""


def checkpoint_of(path: str | Path) -> Path | None:
    """The vtrain checkpoint `--pretrained PATH` names, verified against its manifest, in every form the docs show:
    a checkpoint directory, a run directory (its newest checkpoint that verifies; a converted run is one), or a
    checkpoint's own model.safetensors / ema.safetensors (the checkpoint it lies in). None for a weights file of
    its own (a timm backbone, a consolidated file)."""
    p = Path(path)
    if p.is_dir():
        return ckpt.find_verified(p, "--pretrained")
    if p.name in (ckpt.MODEL, ckpt.EMA) and (ckpt.is_checkpoint(p.parent) or (p.parent / ckpt.COMPLETE).exists()):
        return ckpt.find_verified(p.parent, "--pretrained")
    return None


def resolve(path: str | Path) -> PretrainedSource:
    """The weights and class list --pretrained names. A checkpoint (`checkpoint_of`) is verified against its
    manifest, as `vtrain eval` does, and brings its class list (categories.json); for a directory its EMA weights
    are taken when it has them (they are what the run evaluated), a file inside a checkpoint is that file."""
    p = Path(path)
    found = checkpoint_of(p)
    if found is None:  # a copied model.safetensors may still have its categories.json beside it
        named = p.name in (ckpt.MODEL, ckpt.EMA) and (p.parent / ckpt.CATEGORIES).is_file()
        return PretrainedSource(p, ckpt.read_categories(p.parent) if named else None)
    weights = weights_file(found, None)[0] if p.is_dir() else p
    return PretrainedSource(weights, ckpt.read_categories(found))


def inherit_model_options(cfg: Any) -> str | None:
    """A detector fine-tuned from a vtrain checkpoint (in any form `checkpoint_of` takes) is built with that
    checkpoint's model options (the choices on which the published codebases differ: neck bias, sine positions,
    proposal masking, eps, box clipping; docs/detection.md "Model options"), which `vtrain convert` records from
    the source: its weights only fit, and only compute what they were trained to, with them. An option the run did
    not set (`cfg.given`: neither its --config file nor a flag names it) takes the checkpoint's value; one the run
    sets to another value than the checkpoint's, vtrain's default included, is one error line. Returns the log
    line naming the options taken (None when there are none). Called before the run's config.yaml is written, so
    the run records the model it builds."""
    m = cfg.model
    if cfg.task != "dino" or not m.pretrained:
        return None
    found = checkpoint_of(m.pretrained)
    if found is None:
        return None
    saved = read_yaml(found / ckpt.CONFIG, "checkpoint config").get("model") or {}
    if not isinstance(saved, dict):
        return None
    hints = typing.get_type_hints(ModelConfig)
    taken, clash = {}, []
    for f in dataclasses.fields(DinoOptions):
        if f.name not in saved or saved[f.name] is None:
            continue
        theirs = coerce(saved[f.name], hints[f.name], f"checkpoint config {found / ckpt.CONFIG}: model.{f.name}")
        ours = getattr(m, f.name)
        if ours == theirs:
            continue
        if f"model.{f.name}" not in cfg.given:
            taken[f.name] = theirs
        else:
            clash.append(f"model.{f.name}: this run {ours}, the checkpoint {theirs}")
    if clash:
        raise VtrainError(f"--pretrained: {found} was built with other model options ({'; '.join(clash)}); its "
                          "weights fit only its own: leave them unset to take the checkpoint's")
    if not taken:
        return None
    cfg.model = dataclasses.replace(m, **taken)
    return (f"--pretrained: model options of {found} taken: "
            + ", ".join(f"{k}={v}" for k, v in taken.items()))
