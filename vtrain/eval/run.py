"""`vtrain eval`: rebuild the model from a checkpoint's config.yaml and its fp32 model.safetensors, evaluate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from vtrain.config import DataConfig, load_run_config, replace
from vtrain.engine import checkpoint as ckpt
from vtrain.errors import VtrainError
from vtrain.models.backbones import load_strict
from vtrain.tasks import build_task


def evaluate_checkpoint(checkpoint: Path, data: str | None, val_data: str | None, pairs: str | None,
                        batch_size: int) -> dict[str, Any]:
    path = ckpt.find(checkpoint)
    if path is None:
        raise VtrainError(f"--checkpoint: {checkpoint} is neither a complete checkpoint nor a run directory with one")
    weights = path / "model.safetensors"
    if not weights.is_file():
        raise VtrainError(f"--checkpoint: {path} has no model.safetensors")
    cfg = load_run_config(path / "config.yaml")
    saved_data = ckpt_data_path(path)
    cfg = replace(cfg, data=DataConfig(path=data or saved_data, val_path=val_data, pairs_file=pairs),
                  train=replace(cfg.train, batch_size=batch_size))
    task = build_task(cfg)
    sd = load_file(str(weights))
    model = task.build_model(num_classes=sd["head.weight"].shape[0] if "head.weight" in sd else None)
    load_strict(model, sd, "--checkpoint", "weights do not match the model in config.yaml")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device).eval()
    metrics = task.evaluate(lambda x: model(x), device)
    if metrics is None:
        raise VtrainError("nothing to evaluate on: give --val-data (held-out identities) or --pairs")
    return metrics


def ckpt_data_path(path: Path) -> str:
    import yaml

    saved = yaml.safe_load((path / "config.yaml").read_text())
    return saved.get("data", {}).get("path", "demo")
