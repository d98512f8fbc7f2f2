"""Tasks own model, data and evaluation; the loop never branches on the task."""

from __future__ import annotations

from torch import nn

from vtrain.config import RunConfig


def build_task(cfg: RunConfig):
    if cfg.task == "metric":
        from vtrain.tasks.metric import MetricTask

        return MetricTask(cfg)
    if cfg.task == "dino":
        from vtrain.tasks.dino import DinoTask

        return DinoTask(cfg)
    raise ValueError(f"unknown task {cfg.task}")


def model_for_weights(cfg: RunConfig, shapes: dict[str, tuple[int, ...]]) -> nn.Module:
    """The model of a saved config whose class count fits saved weights (name -> shape), built without data:
    for `vtrain eval` and `vtrain consolidate --check-model`. Build it under torch.device("meta") for a check."""
    m = cfg.model
    if cfg.task == "dino":
        from vtrain.models.dino import DINO

        n = shapes["cls_heads.0.weight"][0] if "cls_heads.0.weight" in shapes else 1
        return DINO(m.preset, n, m.drop_path, m.num_queries, m.dn_queries)
    from vtrain.models.metric import MetricModel

    n = shapes["head.weight"][0] if "head.weight" in shapes else 1
    return MetricModel(m.preset, n, m.image_size, m.embedding_dim, m.neck_norm, m.head, m.margin, m.scale,
                       m.drop_path)
