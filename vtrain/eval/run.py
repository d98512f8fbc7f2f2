"""`vtrain eval`: rebuild the model from a checkpoint's config.yaml and its fp32 model.safetensors, evaluate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import load_file

from vtrain.config import DataConfig, RunConfig, load_run_config, replace
from vtrain.engine import checkpoint as ckpt
from vtrain.errors import VtrainError
from vtrain.models.backbones import load_strict
from vtrain.tasks import build_task, model_for_weights


def load_checkpoint(checkpoint: Path, task_name: str | None = None, flag: str = "--checkpoint",
                    task_flag: str | None = None) -> tuple[Path, RunConfig, torch.nn.Module]:
    """(checkpoint dir, its RunConfig, the model with its fp32 weights loaded strictly) of a checkpoint dir or a
    run dir's newest checkpoint that verifies against its manifest;
    shared by `vtrain eval` and `vtrain export`. A `task_name` other than the checkpoint's is an error naming
    `task_flag` (default `--task NAME`)."""
    path = ckpt.find_verified(checkpoint, flag)  # a damaged checkpoint is an error naming the file
    weights = path / "model.safetensors"
    if not weights.is_file():
        raise VtrainError(f"{flag}: {path} has no model.safetensors")
    cfg = load_run_config(path / "config.yaml")
    if task_name is not None and task_name != cfg.task:
        raise VtrainError(f"{task_flag or f'--task {task_name}'}: {path} is a {cfg.task} checkpoint")
    sd = load_file(str(weights))
    model = model_for_weights(cfg, {k: tuple(v.shape) for k, v in sd.items()})
    load_strict(model, sd, flag, "weights do not match the model in config.yaml")
    return path, cfg, model


def evaluate_checkpoint(checkpoint: Path, data: dict[str, Any], batch_size: int | None = None,
                        task_name: str | None = None, save_predictions: str | None = None) -> tuple[Any, dict]:
    """Returns (task, metrics). `data` holds DataConfig overrides (path, val_path, pairs_file, val_ann, ...);
    unset values fall back to the data the run was trained on."""
    path, cfg, model = load_checkpoint(checkpoint, task_name)
    saved = yaml.safe_load((path / "config.yaml").read_text()).get("data", {})
    given = {k: v for k, v in data.items() if v is not None}
    # no --data: the run's own data (and its explicit files); a new --data root: only what is given
    keep = () if "path" in given else ("path", "val_targets", "train_ann", "train_images", "val_ann", "val_images")
    merged = {**{k: saved[k] for k in keep if saved.get(k) is not None}, "max_size": saved.get("max_size"), **given}
    cfg = replace(cfg, data=DataConfig(**merged),
                  train=replace(cfg.train, batch_size=batch_size or cfg.train.batch_size))
    task = build_task(cfg)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device).eval()
    metrics = task.evaluate(lambda **inputs: model(**inputs), device, save_predictions=save_predictions)
    if metrics is None:
        hint = "--val-ann and --val-images (or --data with annotations/instances_val2017.json)" if cfg.task == "dino" \
            else "--val-data (held-out identities), --pairs or --val-targets / --data X.bin (verification packs)"
        raise VtrainError(f"nothing to evaluate on: give {hint}")
    return task, metrics
