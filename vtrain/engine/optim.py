"""AdamW parameter groups (no decay on norms/biases/position embeddings unless --weight-decay-skip none, backbone
LR multiplier, layer-wise LR decay) and schedules."""

from __future__ import annotations

import math

import torch
from timm.models import group_parameters
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from vtrain.config import OptimConfig
from vtrain.engine.engines.build import engine_class
from vtrain.engine.engines.plan import Plan
from vtrain.errors import VtrainError

_NO_DECAY_NAMES = ("pos_embed", "cls_token", "reg_token", "relative_position_bias_table", "absolute_pos_embed",
                   "level_embed", "mask_token")


def backbone_layer_ids(model: nn.Module, backbone_prefix: str = "backbone.") -> tuple[dict[str, int], int]:
    """Layer id of every parameter of the backbone's timm model, keyed by full parameter name, and the number
    of layers: timm's own grouping (`group_matcher(coarse=False)` through `group_parameters`, as timm's
    `param_groups_layer_decay` uses it): stem/patch embedding 0, then each block (Swin: a stage's downsampling
    with its first block), a final norm with the last block."""
    for name, module in model.named_modules():
        if f"{name}.".startswith(backbone_prefix) and hasattr(module, "group_matcher"):
            ids = group_parameters(module, module.group_matcher(coarse=False), reverse=True)
            return {f"{name}.{n}": i for n, i in ids.items()}, max(ids.values()) + 1
    backbone = dict(model.named_modules()).get(backbone_prefix.rstrip("."), model)
    raise VtrainError(f"--layer-decay: the backbone ({type(backbone).__name__}) has no timm group_matcher() to "
                      "number its layers; use a timm ViT or Swin preset or leave --layer-decay unset")


def param_groups(model: nn.Module, cfg: OptimConfig, backbone_prefix: str = "backbone.") -> list[dict]:
    """AdamW groups: weight decay except on norms, biases, position embeddings and tokens (`weight_decay_skip`
    `norms`; with `none` those groups decay too, and keep their place, so a checkpoint's optimizer state fits either
    way); backbone parameters at `lr * backbone_lr_mult`. With `cfg.layer_decay` R the backbone is further split by timm's layer id
    (`backbone_layer_ids`, L layers): lr * backbone_lr_mult * R^(L - id), so the last block gets R and the stem
    R^L, while the head (neck, heads, DINO's transformer) keeps `lr`, like the head in timm's own layer decay.
    Backbone parameters outside the timm model (DINO's output norms) count as layer L. Each group's `lr` is its
    peak LR: the LambdaLR schedule multiplies every group's initial LR, so the ratios hold all along."""
    skip = set(getattr(model, "no_weight_decay", lambda: set())())
    layer_of, num_layers = backbone_layer_ids(model, backbone_prefix) if cfg.layer_decay is not None else ({}, 0)
    groups: dict[tuple[bool, int, bool], dict] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        no_decay = p.ndim <= 1 or name.endswith(".bias") or name in skip or any(t in name for t in _NO_DECAY_NAMES)
        is_backbone = name.startswith(backbone_prefix)
        layer = layer_of.get(name, num_layers) if is_backbone else num_layers
        key = (is_backbone, layer, no_decay)
        if key not in groups:
            lr = cfg.lr
            if is_backbone:
                lr *= cfg.backbone_lr_mult
                if cfg.layer_decay is not None:
                    lr *= cfg.layer_decay ** (num_layers - layer)
            exempt = no_decay and cfg.weight_decay_skip == "norms"
            groups[key] = {"params": [], "lr": lr, "weight_decay": 0.0 if exempt else cfg.weight_decay}
            if cfg.layer_decay is not None and is_backbone:
                groups[key]["layer"] = layer
        groups[key]["params"].append(p)
    out = []
    for (is_backbone, layer, no_decay), g in sorted(groups.items()):
        part = "backbone" if is_backbone else "head"
        if "layer" in g:
            part += f"/layer{layer}"
        g["group"] = part + (("/no_decay" if g["weight_decay"] == 0.0 else "/norms") if no_decay else "")
        out.append(g)
    return out


def layer_decay_note(model: nn.Module, cfg: OptimConfig, backbone_prefix: str = "backbone.") -> str:
    """The log line that states the layer-wise LR decay (the formula and its two ends)."""
    _, num_layers = backbone_layer_ids(model, backbone_prefix)
    r, base = cfg.layer_decay, cfg.lr * cfg.backbone_lr_mult
    return (f"layer decay {r}: backbone LR {base:.3g} x {r}^({num_layers} - layer id) over timm's layer groups: "
            f"stem {base * r**num_layers:.3g}, last block {base * r:.3g}; head {cfg.lr:.3g}")


def build_optimizer(model: nn.Module, cfg: OptimConfig, plan: Plan) -> torch.optim.Optimizer:
    """AdamW over `param_groups`, of the class the plan's engine steps with (DeepSpeed's CPU Adam under ZeRO-Offload)."""
    return engine_class(plan).make_optimizer(plan, param_groups(model, cfg), cfg)


def lr_lambda(cfg: OptimConfig, total_steps: int):
    """Multiplier of the peak LR after `step` optimizer steps: linear warm-up, then cosine/step/constant."""
    warm = cfg.warmup_steps
    # no milestones given: one decay at 11/12 of training (DINO: x0.1 at epoch 11 of 12, docs/dino.md §1.1)
    milestones = cfg.milestones or [max(1, round(total_steps * 11 / 12))]

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / (warm + 1)
        if cfg.schedule == "cosine":
            progress = min(1.0, (step - warm) / max(1, total_steps - warm))
            return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        if cfg.schedule == "step":
            return cfg.gamma ** sum(step >= m for m in milestones)
        return 1.0

    return f


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int) -> LambdaLR:
    return LambdaLR(optimizer, lr_lambda(cfg, total_steps))
