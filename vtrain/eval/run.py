"""`vtrain eval`: rebuild the model from a checkpoint's config.yaml and its fp32 weights (the EMA weights when the run
kept them, else model.safetensors), evaluate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import load_file

from vtrain.config import DataConfig, load_run_config, replace
from vtrain.engine import checkpoint as ckpt
from vtrain.engine.ema import weights_file
from vtrain.errors import VtrainError
from vtrain.models.backbones import load_strict
from vtrain.tasks import build_task, model_for_weights


def evaluate_checkpoint(checkpoint: Path, data: dict[str, Any], batch_size: int | None = None,
                        task_name: str | None = None, save_predictions: str | None = None,
                        weights_choice: str | None = None) -> tuple[Any, dict]:
    """Returns (task, metrics); metrics["weights"] says which weights were evaluated (ema | model). `data` holds
    DataConfig overrides (path, val_path, pairs_file, val_ann, ...); unset values fall back to the data the run was
    trained on. `weights_choice`: ema, model or None (EMA when present)."""
    path = ckpt.find_verified(checkpoint, "--checkpoint")
    weights, used = weights_file(path, weights_choice)
    if not weights.is_file():
        raise VtrainError(f"--checkpoint: {path} has no {weights.name}")
    cfg = load_run_config(path / "config.yaml")
    if task_name is not None and task_name != cfg.task:
        raise VtrainError(f"--task {task_name}: {path} is a {cfg.task} checkpoint")
    saved = yaml.safe_load((path / "config.yaml").read_text()).get("data", {})
    given = {k: v for k, v in data.items() if v is not None}
    # no --data: the run's own data (and its explicit files); a new --data root: only what is given
    keep = () if "path" in given else ("path", "train_ann", "train_images", "val_ann", "val_images")
    merged = {**{k: saved[k] for k in keep if saved.get(k) is not None}, "max_size": saved.get("max_size"), **given}
    cfg = replace(cfg, data=DataConfig(**merged),
                  train=replace(cfg.train, batch_size=batch_size or cfg.train.batch_size))
    task = build_task(cfg)
    sd = load_file(str(weights))
    model = model_for_weights(cfg, {k: tuple(v.shape) for k, v in sd.items()})
    load_strict(model, sd, "--checkpoint", "weights do not match the model in config.yaml")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device).eval()
    metrics = task.evaluate(lambda **inputs: model(**inputs), device, save_predictions=save_predictions)
    if metrics is None:
        hint = "--val-ann and --val-images (or --data with annotations/instances_val2017.json)" if cfg.task == "dino" \
            else "--val-data (held-out identities) or --pairs"
        raise VtrainError(f"nothing to evaluate on: give {hint}")
    metrics["weights"] = used
    return task, metrics
