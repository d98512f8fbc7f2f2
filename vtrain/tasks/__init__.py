"""Tasks own model, data and evaluation; the loop never branches on the task."""

from __future__ import annotations

from vtrain.config import RunConfig


def build_task(cfg: RunConfig):
    if cfg.task == "metric":
        from vtrain.tasks.metric import MetricTask

        return MetricTask(cfg)
    raise ValueError(f"unknown task {cfg.task}")
