"""Tasks own model, data and evaluation; the loop never branches on the task."""

from __future__ import annotations

from vtrain.config import RunConfig
from vtrain.tasks.dino import DinoTask
from vtrain.tasks.metric import MetricTask
from vtrain.tasks.model import build_model, model_for_weights

# build_model and model_for_weights are offered here too: the engine and the tools build models through them
__all__ = ["TASK_CLASSES", "build_model", "build_task", "model_for_weights"]

TASK_CLASSES = {"metric": MetricTask, "dino": DinoTask}


def build_task(cfg: RunConfig) -> MetricTask | DinoTask:
    """The task object of `cfg.task`."""
    if cfg.task not in TASK_CLASSES:
        raise ValueError(f"unknown task {cfg.task}")
    return TASK_CLASSES[cfg.task](cfg)
