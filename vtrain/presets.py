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
    neck: str = "linear"
    """The embedding neck (models/metric.py): `linear` projects pooled features; `flatten` flattens every token
    (arcface_torch's ViT feature layer, docs/face.md §6)."""


def _vit(name: str, desc: str, **kw: Any) -> Callable[[], BackbonePreset]:
    return lambda: BackbonePreset(name, kw, True, desc)


def _layer_norm_eps_1e5(dim: int, **kw: Any) -> Any:
    """torch's LayerNorm with its default eps 1e-5, as arcface_torch builds it (timm's ViT default is 1e-6). Imports
    torch when a model is built: presets.py is read by the CLI before torch is imported."""
    from torch import nn

    return nn.LayerNorm(dim, eps=1e-5, **kw)


def _arcface_vit(dim: int, depth: int, drop_path: float, desc: str, heads: int = 8) -> Callable[[], BackbonePreset]:
    """arcface_torch's face ViT (insightface recognition/arcface_torch/backbones/vit.py, docs/face.md §6): patch 9
    at 112 px (12x12 tokens), no class token, no qkv bias, ReLU6 MLP (ratio 4), LayerNorm eps 1e-5, 8 heads, no
    pooling: the neck flattens all tokens."""
    kw = dict(patch_size=9, embed_dim=dim, depth=depth, num_heads=heads, mlp_ratio=4.0, class_token=False,
              global_pool="", qkv_bias=False, act_layer="relu6", norm_layer=_layer_norm_eps_1e5,
              drop_path_rate=drop_path)
    return lambda: BackbonePreset("vit_base_patch16_224", kw, True, desc, neck="flatten")


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
    # the arcface_torch layout at test size (the converter's test fixture, tests/fixtures/arcface/)
    "debug-af": _arcface_vit(24, 2, 0.0, "tiny arcface_torch-layout ViT (dim 24, depth 2) for tests", heads=4),
    # arcface_torch's vit_t / vit_s / vit_b and vit_l_dp005_mask_005 (backbones/__init__.py get_model): 112 px only
    "vit-t-af": _arcface_vit(256, 12, 0.1, "arcface_torch vit_t: dim 256, depth 12, patch 9, flatten neck"),
    "vit-s-af": _arcface_vit(512, 12, 0.1, "arcface_torch vit_s: dim 512, depth 12, patch 9, flatten neck"),
    "vit-b-af": _arcface_vit(512, 24, 0.1, "arcface_torch vit_b: dim 512, depth 24, patch 9, flatten neck"),
    "vit-l-af": _arcface_vit(768, 24, 0.05, "arcface_torch vit_l: dim 768, depth 24, patch 9, flatten neck"),
}


@dataclass(frozen=True)
class DinoPreset:
    """A timm backbone (its stage indices for `forward_intermediates`) and the DINO transformer sizes.

    Defaults are the recipe of docs/dino.md §1 (256-d, 6+6 layers, 8 heads, 4 points, FFN 2048, 900 queries,
    100 denoising queries); `levels` counts backbone levels plus extra stride-2 levels (5-scale = 4 + 1)."""

    timm_name: str
    out_indices: tuple[int, ...]
    levels: int
    kwargs: dict[str, Any] = field(default_factory=dict)
    description: str = ""
    drop_path: float = 0.0
    out_norm: bool = False  # LayerNorm on each taken stage output (Swin, as MMD/official DINO)
    frozen_bn: bool = False  # ResNet: frozen BatchNorm and frozen stem + stage 1 (MMD R50 DINO)
    dim: int = 256
    ffn: int = 2048
    enc_layers: int = 6
    dec_layers: int = 6
    heads: int = 8
    points: int = 4
    queries: int = 900
    dn_queries: int = 100


_SWIN = {"strict_img_size": False}  # variable detection image sizes (docs/dino.md §5: timm strict_img_size=False)

DINO_PRESETS: dict[str, Callable[[], DinoPreset]] = {
    # tiny Swin (the same code path as swin-l) with a small transformer: tests and the CPU demo
    "debug": lambda: DinoPreset("swin_tiny_patch4_window7_224", (1, 2, 3), 4,
                                dict(_SWIN, embed_dim=32, depths=(1, 1, 1, 1), num_heads=(1, 2, 4, 8)),
                                "tiny Swin + 64-d 2+2-layer DINO for tests and the CPU demo", out_norm=True,
                                dim=64, ffn=128, enc_layers=2, dec_layers=2, heads=4, points=4, queries=100,
                                dn_queries=20),
    # tests and the earlier CPU demo: trained from scratch (no downloads), a small conv backbone learns far faster
    # than a tiny Swin (demo data, lr 1e-3: AP 8-15 after 600 steps, the tiny Swin 0.2 after 500)
    "debug-resnet": lambda: DinoPreset("resnet10t", (2, 3, 4), 4, {}, "ResNet-10-T + 64-d 2+2-layer DINO (tests)",
                                       dim=64, ffn=128, enc_layers=2, dec_layers=2, heads=4, points=4, queries=100,
                                       dn_queries=20),
    # the CPU demo (make demo, docs/detection.md "The demo model"): ResNet-10-T at half width (stem 16, stages 32-256
    # channels) from scratch, read at strides 16 and 32 plus two stride-2 levels (16-128): 0.39x debug-resnet's
    # compute per image (benchmarks/demo_step_cost.py), so a run sees 2.5 times the images in about the same time
    "demo-resnet": lambda: DinoPreset("resnet10t", (3, 4), 4, dict(channels=(32, 64, 128, 256), stem_width=16),
                                      "ResNet-10-T at half width, strides 16-128 + 64-d 2+2-layer DINO (the CPU demo)",
                                      dim=64, ffn=128, enc_layers=2, dec_layers=2, heads=4, points=4, queries=100,
                                      dn_queries=40),
    # MMD dino-5scale_swin-l_8xb2-12e_coco: embed 192, depths 2/2/18/2, window 12, drop-path 0.2 (docs/dino.md §1.2)
    "swin-l": lambda: DinoPreset("swin_large_patch4_window12_384", (0, 1, 2, 3), 5, dict(_SWIN),
                                 "Swin-L/12 (384, IN-22k layout), DINO 5-scale (strides 4-64)", drop_path=0.2,
                                 out_norm=True),
    "swin-l-4scale": lambda: DinoPreset("swin_large_patch4_window12_384", (1, 2, 3), 4, dict(_SWIN),
                                        "Swin-L/12, DINO 4-scale (strides 8-64)", drop_path=0.2, out_norm=True),
    "swin-b": lambda: DinoPreset("swin_base_patch4_window12_384", (1, 2, 3), 4, dict(_SWIN),
                                 "Swin-B/12, DINO 4-scale", drop_path=0.3, out_norm=True),
    "swin-t": lambda: DinoPreset("swin_tiny_patch4_window7_224", (1, 2, 3), 4, dict(_SWIN),
                                 "Swin-T/7, DINO 4-scale", drop_path=0.2, out_norm=True),
    "resnet50": lambda: DinoPreset("resnet50", (2, 3, 4), 4, {}, "ResNet-50 (frozen BN, frozen stage 1), DINO 4-scale",
                                   frozen_bn=True),
}


def presets_for(task: str) -> dict[str, Callable[[], Any]]:
    return DINO_PRESETS if task == "dino" else METRIC_PRESETS
