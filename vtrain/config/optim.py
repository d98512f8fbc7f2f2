"""The `optim` section: AdamW, its schedule, clipping and layer-wise decay (engine/optim.py builds them)."""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Literal

from vtrain.config.fields import NO_FLAG, Section

Schedule = Literal["cosine", "step", "constant"]
SCHEDULES: tuple[str, ...] = typing.get_args(Schedule)
DecaySkip = Literal["norms", "none"]
DECAY_SKIPS: tuple[str, ...] = typing.get_args(DecaySkip)


@dataclass
class OptimConfig(Section):
    SECTION = "optim"

    lr: float = 1e-3
    """Peak learning rate (AdamW)."""
    weight_decay: float = 0.05
    """AdamW weight decay, on the parameters --weight-decay-skip leaves in."""
    weight_decay_skip: DecaySkip = "norms"
    """Parameters left out of weight decay: `norms` (norms, biases, position embeddings and tokens, timm's grouping)
    or `none`: every parameter decays, as IDEA DINO (`util/get_param_dicts.py`) and mmdetection's DINO configs train
    (the dino task's default)."""
    backbone_lr_mult: float = 1.0
    """Backbone learning rate multiplier (DINO's recipe: 0.1)."""
    betas: tuple[float, float] = field(default=(0.9, 0.999), metadata=NO_FLAG)
    """AdamW betas, two values in [0, 1)."""
    warmup_steps: int = 0
    """Linear warm-up steps before the schedule."""
    schedule: Schedule = "cosine"
    """Learning-rate schedule after the warm-up: cosine, step (x gamma at each milestone) or constant."""
    min_lr_ratio: float = field(default=0.0, metadata=NO_FLAG)
    """Cosine schedule: the final learning rate as a share of the peak."""
    milestones: list[int] = field(default_factory=list, metadata=NO_FLAG)
    """Optimizer steps at which a step schedule multiplies the LR by `gamma` (default: at 11/12 of training,
    the DINO recipe's decay at epoch 11 of 12)."""
    gamma: float = field(default=0.1, metadata=NO_FLAG)
    """Step schedule: the factor applied at each milestone."""
    clip_grad: float = 1.0
    """Max global gradient norm; 0 disables clipping."""
    layer_decay: float | None = None
    """Layer-wise LR decay R for timm backbones (ViT, Swin, ResNet): a backbone parameter in timm's layer group i of L
    trains at lr * backbone_lr_mult * R^(L - i) (last block R, stem R^L); head, neck and DINO transformer keep lr.
    The log states the stem, last-block and head LRs. Unset: no decay."""

    def __post_init__(self) -> None:
        self._check_text()
        check = self._check
        check(self.lr > 0, "lr", f"must be > 0, got {self.lr}")
        check(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        check(self.backbone_lr_mult > 0, "backbone_lr_mult", "must be > 0")
        self.betas = tuple(float(b) for b in self.betas)  # type: ignore[assignment]
        check(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "betas", "two values in [0, 1)")
        check(self.warmup_steps >= 0, "warmup_steps", "must be >= 0")
        check(self.schedule in SCHEDULES, "schedule", f"choose one of {SCHEDULES}")
        check(self.weight_decay_skip in DECAY_SKIPS, "weight_decay_skip", f"choose one of {DECAY_SKIPS}")
        check(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", "must be in [0, 1]")
        check(all(m > 0 for m in self.milestones), "milestones", "must be positive step numbers")
        check(self.clip_grad >= 0, "clip_grad", "must be >= 0 (0 disables)")
        check(self.lr <= 10.0, "lr", f"must be <= 10, got {self.lr}")
        check(self.weight_decay <= 10.0, "weight_decay", f"must be <= 10, got {self.weight_decay}")
        check(0 < self.gamma <= 1, "gamma", f"must be in (0, 1], got {self.gamma}")
        check(self.layer_decay is None or 0 < self.layer_decay <= 1, "layer_decay",
              f"must be in (0, 1], got {self.layer_decay}")
