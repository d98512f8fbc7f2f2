"""The peer fixtures' small DINO (tests/fixtures/README.md), as a preset the tests register by monkeypatch, and
COCO's category ids in label order."""

from __future__ import annotations

from vtrain.models.dino.adapters import coco_categories
from vtrain.presets import DinoPreset

# Swin embed 8, depths 2/2/2/2, window 7, 5 levels, 256-d DINO with FFN 64, 2 + 2 layers, 30 queries
TINY = DinoPreset("swin_tiny_patch4_window7_224", (0, 1, 2, 3), 5,
                  dict(strict_img_size=False, embed_dim=8, depths=(2, 2, 2, 2), num_heads=(1, 2, 4, 8)),
                  "the peer fixtures' small DINO", out_norm=True, dim=256, ffn=64, enc_layers=2, dec_layers=2,
                  heads=8, points=4, queries=30, dn_queries=0)
COCO_IDS = [c["id"] for c in coco_categories()]
