"""The one place models are constructed from a model config (training, `vtrain eval`, `consolidate
--check-model`, `estimate-memory`), with activation checkpointing applied."""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from vtrain import recompute
from vtrain.config import ModelConfig, RunConfig
from vtrain.models.recompute_units import apply_spec
from vtrain.models.dino import DINO, DinoOptions
from vtrain.models.metric import MetricModel


def dino_options(m: ModelConfig) -> DinoOptions:
    """The DINO model options of a model config (ModelConfig's fields of the same names)."""
    return DinoOptions(neck_bias=m.neck_bias, pos_temperature=m.pos_temperature, pos_offset=m.pos_offset,
                       pos_normalize=m.pos_normalize, mask_invalid_proposals=m.mask_invalid_proposals,
                       refine_eps=m.refine_eps, box_eps=m.box_eps, clip_boxes=m.clip_boxes,
                       shared_class_head=m.shared_class_head, shared_box_head=m.shared_box_head)


def build_model(task: str, m: ModelConfig, num_classes: int) -> nn.Module:
    """The task's model from its model config, with activation checkpointing applied."""
    if task == "dino":
        model = DINO(m.preset, num_classes, m.drop_path, m.num_queries, m.dn_queries, m.ffn_recompute, m.ffn_chunk,
                     options=dino_options(m))
    else:
        # --head-parallel sharded: the head lives outside the model (engine/head_shard.py)
        classes = 0 if m.head_parallel == "sharded" else num_classes
        model = MetricModel(m.preset, classes, m.image_size, m.embedding_dim, m.neck_norm, m.head, m.margin,
                            m.scale, m.drop_path, m.arcface_grad)
    # --grad-ckpt units (vtrain/recompute.py), checked against this model; `auto` is decided by the memory planner
    # of the training run (engine/autoplan.py), which applies its plan to the built model: nothing here
    if not recompute.parse(m.grad_ckpt).auto:
        apply_spec(model, m.grad_ckpt)
    return model


def model_for_weights(cfg: RunConfig, shapes: dict[str, tuple[int, ...]]) -> nn.Module:
    """The model of a saved config whose class count fits saved weights (name -> shape), built without data:
    for `vtrain eval` and `vtrain consolidate --check-model`. Build it under torch.device("meta") for a check."""
    head = "cls_heads.0.weight" if cfg.task == "dino" else "head.weight"
    if cfg.task == "metric" and head in shapes and cfg.model.head_parallel == "sharded":
        # `vtrain consolidate` of a sharded-head run writes the full head.weight: the model with its head
        cfg = replace(cfg, model=replace(cfg.model, head_parallel="none", sample_rate=1.0))
    # a metric file without head.weight (sharded-head checkpoints, `consolidate --backbone-only`): no head
    return build_model(cfg.task, cfg.model, shapes[head][0] if head in shapes else (0 if cfg.task == "metric" else 1))
