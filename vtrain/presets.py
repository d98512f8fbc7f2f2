"""Backbone presets: plain functions in a literal dict (no registries).

Each metric preset returns the timm model name and keyword arguments for a backbone that ends in pooled features
(`num_classes=0`), at the requested square image size. `debug` is a tiny ViT for tests and the CPU demo.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(frozen=True)
class BackbonePreset:
    timm_name: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    takes_img_size: bool = True
    description: str = ""


def _vit(name: str, desc: str, **kw: Any) -> Callable[[], BackbonePreset]:
    return lambda: BackbonePreset(name, kw, True, desc)


METRIC_PRESETS: dict[str, Callable[[], BackbonePreset]] = {
    "debug": _vit("vit_tiny_patch16_224", "tiny ViT (dim 64, depth 2) for tests and the CPU demo",
                  embed_dim=64, depth=2, num_heads=2, mlp_ratio=2.0),
    "vit-t": _vit("vit_tiny_patch16_224", "ViT-Ti/16"),
    "vit-s": _vit("vit_small_patch16_224", "ViT-S/16"),
    "vit-b": _vit("vit_base_patch16_224", "ViT-B/16"),
    "vit-l": _vit("vit_large_patch16_224", "ViT-L/16"),
    "swin-t": _vit("swin_tiny_patch4_window7_224", "Swin-T, window 7"),
    "swin-b": _vit("swin_base_patch4_window7_224", "Swin-B, window 7"),
    "swin-l": _vit("swin_large_patch4_window7_224", "Swin-L, window 7"),
    "resnet50": lambda: BackbonePreset("resnet50", {}, False, "ResNet-50 (BatchNorm)"),
}
