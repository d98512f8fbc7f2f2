"""AdamW parameter groups (no decay on norms/biases/position embeddings, backbone LR multiplier) and schedules."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from vtrain.config import OptimConfig
from vtrain.engine.plan import Plan

_NO_DECAY_NAMES = ("pos_embed", "cls_token", "reg_token", "relative_position_bias_table", "absolute_pos_embed",
                   "level_embed", "mask_token")


def param_groups(model: nn.Module, cfg: OptimConfig, backbone_prefix: str = "backbone.") -> list[dict]:
    skip = set(getattr(model, "no_weight_decay", lambda: set())())
    groups: dict[tuple[bool, bool], dict] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        no_decay = p.ndim <= 1 or name.endswith(".bias") or name in skip or any(t in name for t in _NO_DECAY_NAMES)
        is_backbone = name.startswith(backbone_prefix)
        key = (is_backbone, no_decay)
        if key not in groups:
            groups[key] = {"params": [], "names": [],
                           "lr": cfg.lr * (cfg.backbone_lr_mult if is_backbone else 1.0),
                           "weight_decay": 0.0 if no_decay else cfg.weight_decay}
        groups[key]["params"].append(p)
        groups[key]["names"].append(name)
    out = []
    for (is_backbone, no_decay), g in sorted(groups.items()):
        g["group"] = f"{'backbone' if is_backbone else 'head'}{'/no_decay' if no_decay else ''}"
        g.pop("names")
        out.append(g)
    return out


def build_optimizer(model: nn.Module, cfg: OptimConfig, plan: Plan) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg)
    if plan.kind == "deepspeed" and plan.offload_optimizer:
        # ZeRO-Offload steps on the CPU and requires DeepSpeed's CPU Adam (compiled once, ~2 min on a new machine)
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, adamw_mode=True)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)


def lr_lambda(cfg: OptimConfig, total_steps: int):
    """Multiplier of the peak LR after `step` optimizer steps: linear warm-up, then cosine/step/constant."""
    warm = cfg.warmup_steps
    # no milestones given: one decay at 11/12 of training (DINO: x0.1 at epoch 11 of 12, dino.md §1.1)
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
