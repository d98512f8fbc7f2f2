"""Small model inputs: a DINO batch of two padded images with their targets."""

from __future__ import annotations

import torch


def dino_batch(b: int = 2, h: int = 64, w: int = 96, classes: int = 3):
    g = torch.Generator().manual_seed(0)
    images = torch.randn(b, 3, h, w, generator=g)
    masks = torch.zeros(b, h, w, dtype=torch.bool)
    masks[1, :, w - 32:] = True  # second image is narrower (padded)
    labels = torch.tensor([[0, 2], [1, 0]])[:b]
    boxes = torch.tensor([[[.5, .5, .3, .4], [.2, .3, .2, .2]], [[.6, .4, .5, .3], [0, 0, 0, 0]]])[:b]
    return {"images": images, "masks": masks, "labels": labels % classes, "boxes": boxes,
            "num_targets": torch.tensor([2, 1])[:b]}
