"""Embedding model for metric learning: backbone -> 512-d neck -> margin-softmax head (ArcFace / CosFace)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from vtrain.models.backbones import build_backbone
from vtrain.models.recompute_units import backbone_units
from vtrain.presets import METRIC_PRESETS


class EmbeddingNeck(nn.Module):
    """Linear projection to the embedding size followed by a per-feature norm (BatchNorm1d as in insightface)."""

    def __init__(self, in_dim: int, dim: int, norm: str = "bn") -> None:
        super().__init__()
        self.proj = nn.Linear(in_dim, dim, bias=norm == "none")
        self.norm: nn.Module = {"bn": lambda: nn.BatchNorm1d(dim), "ln": lambda: nn.LayerNorm(dim),
                                "none": nn.Identity}[norm]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(x))


class FlattenNeck(nn.Module):
    """arcface_torch's ViT feature layer (docs/face.md §6): every token's features flattened, Linear (no bias) to the
    token width + norm, Linear (no bias) to the embedding + norm; its BatchNorms use eps 2e-5. Input (B, N, C)."""

    def __init__(self, tokens: int, width: int, dim: int, norm: str = "bn") -> None:
        super().__init__()
        make = {"bn": lambda n: nn.BatchNorm1d(n, eps=2e-5), "ln": nn.LayerNorm, "none": lambda n: nn.Identity()}[norm]
        self.reduce = nn.Linear(tokens * width, width, bias=norm == "none")
        self.reduce_norm = make(width)
        self.proj = nn.Linear(width, dim, bias=norm == "none")
        self.norm = make(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(self.reduce_norm(self.reduce(x.flatten(1)))))


def margin_target(target: torch.Tensor, kind: str, margin: float, arcface_grad: str = "straight") -> torch.Tensor:
    """The target-class cosine with the margin applied (fp32, clamped cosines in). Shared by MarginHead and the
    sharded head (partial_fc.py); docs/face_head.md §1 gives the sources.

    - CosFace: cos(theta) - m.
    - ArcFace, `straight` (arcface_torch since commit 657ae30e): the value cos(theta + m) for every theta, the
      gradient of cos(theta) itself: the margin is added without a gradient, so d logit / d cos(theta) = 1.
    - ArcFace, `chain` (arcface_torch at 2e2e8c97): cos(theta + m) differentiated, and cos(theta) - m sin(m)
      where theta + m > pi, which keeps the logit decreasing in theta there."""
    if kind != "arcface":
        return target - margin
    if arcface_grad == "straight":
        with torch.no_grad():
            value = torch.cos(torch.acos(target) + margin)
        return value + (target - target.detach())  # forward: `value` exactly; backward: the identity
    sin = (1.0 - target * target).clamp_min(1e-7).sqrt()
    with_margin = target * math.cos(margin) - sin * math.sin(margin)
    th, mm = math.cos(math.pi - margin), math.sin(math.pi - margin) * margin
    return torch.where(target > th, with_margin, target - mm)


class _AngleRoundTrip(torch.autograd.Function):
    """cos(arccos(x)) with the gradient of x: the values arcface_torch's ArcFace gives every logit (it works on
    angles in place, under no_grad), which differ from x by a rounding only."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.acos().cos_()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def class_logits(cos: torch.Tensor, kind: str, arcface_grad: str = "straight") -> torch.Tensor:
    """The cosines every class's logit is made of (before the target's margin and the scale). ArcFace `straight`:
    cos(arccos(x)), as arcface_torch computes them (docs/face_head.md §1: with s = 64 their rounding alone moves the
    gradients by up to 1.6e-6 relative on the fixtures, 1.1e-7 with it), at one arccos and one cos per logit;
    otherwise the cosines themselves."""
    if kind == "arcface" and arcface_grad == "straight":
        return _AngleRoundTrip.apply(cos)
    return cos


class MarginHead(nn.Module):
    """Normalised class centres with an additive angular (ArcFace) or cosine (CosFace) margin.

    The logit and margin math always runs in fp32 with autocast disabled: cos/arccos near +-1 and the
    scale s=64 overflow or lose all precision in fp16/bf16 (docs/face.md §1.1: insightface keeps the FC path fp32).
    """

    def __init__(self, dim: int, num_classes: int, kind: str = "arcface", margin: float = 0.5,
                 scale: float = 64.0, arcface_grad: str = "straight") -> None:
        super().__init__()
        self.kind, self.margin, self.scale, self.arcface_grad = kind, margin, scale, arcface_grad
        self.weight = nn.Parameter(torch.empty(num_classes, dim))
        nn.init.normal_(self.weight, std=0.01)

    def cosine(self, emb: torch.Tensor) -> torch.Tensor:
        return F.linear(F.normalize(emb.float(), dim=1), F.normalize(self.weight.float(), dim=1))

    def forward(self, emb: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast(device_type=emb.device.type, enabled=False):
            cos = self.cosine(emb).clamp(-1.0, 1.0)
            target = cos.gather(1, labels[:, None])
            with_margin = margin_target(target, self.kind, self.margin, self.arcface_grad)
            logits = class_logits(cos, self.kind, self.arcface_grad).scatter(1, labels[:, None], with_margin)
            logits = logits * self.scale
            loss = F.cross_entropy(logits, labels)
        return loss, cos.detach()


class MetricModel(nn.Module):
    """Backbone + neck + head; `embed` is the inference path, `forward` returns the loss dict."""

    def __init__(self, preset: str, num_classes: int, image_size: int = 112, embedding_dim: int = 512,
                 neck_norm: str = "bn", head: str = "arcface", margin: float = 0.5, scale: float = 64.0,
                 drop_path: float | None = None, arcface_grad: str = "straight") -> None:
        super().__init__()
        self.backbone = build_backbone(preset, image_size, drop_path)
        width = self.backbone.num_features
        self.neck: nn.Module = EmbeddingNeck(width, embedding_dim, neck_norm)
        if METRIC_PRESETS[preset]().neck == "flatten":  # every token, not a pooled vector (presets.py)
            self.neck = FlattenNeck(self.backbone.patch_embed.num_patches, width, embedding_dim, neck_norm)
        # num_classes 0: no head in the module (--head-parallel sharded keeps its class shard outside the module
        # the engine wraps, engine/head_shard.py; sharded checkpoints' model.safetensors holds no head)
        self.head = MarginHead(embedding_dim, num_classes, head, margin, scale, arcface_grad) if num_classes else None

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        return self.neck(self.backbone(images))

    def forward(self, images: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        # Inference goes through forward too (labels=None): sharded engines (FSDP2, ZeRO-3) gather parameters
        # in the root module's forward hooks, which a direct call to `embed` would bypass.
        emb = self.embed(images)
        if labels is None or self.head is None:
            return {"embedding": emb}
        loss, cos = self.head(emb, labels)
        acc = (cos.argmax(1) == labels).float().mean()
        return {"loss": loss, "train_acc": acc}

    def recompute_units(self) -> dict[str, tuple[nn.Module, ...]]:
        """The backbone's stages (Swin, ResNet) or blocks (ViT), models/recompute_units.py."""
        return backbone_units(self.backbone)

    def no_weight_decay(self) -> set[str]:
        """Parameter names (full, dotted) exempt from weight decay beyond norms and biases."""
        inner = getattr(self.backbone, "no_weight_decay", lambda: set())()
        return {f"backbone.{n}" for n in inner}
