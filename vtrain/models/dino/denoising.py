"""Contrastive denoising (CDN) queries: noised copies of the ground truth the decoder must reconstruct or reject.

Semantics of MMD's `CdnQueryGenerator` with the recipe's `dn_cfg` (docs/dino.md §1.1): dynamic groups,
`groups = num_dn_queries // max_targets` (at least 1); each group holds a positive half (box noise < half the
box size; must reconstruct the box) and a negative half (noise in [1, 2) x half size; must predict "no object");
labels are re-drawn with probability `label_noise * 0.5`. The self-attention mask keeps the matching queries
from seeing any denoising query and keeps the groups from seeing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchvision.ops import box_convert

from vtrain.models.dino.matcher import host_list
from vtrain.models.dino.transformer import inverse_sigmoid


@dataclass
class DenoisingGroups:
    label_ids: torch.Tensor  # (B, N) noised class ids (num_classes = padding, embedded but never trained on)
    boxes_unact: torch.Tensor  # (B, N, 4) logit of noised cxcywh boxes
    attn_mask: torch.Tensor  # (N + Q, N + Q) bool, True = may not attend
    groups: int
    max_targets: int  # per group: [max_targets positives | max_targets negatives]

    @property
    def num_queries(self) -> int:
        return self.label_ids.shape[1]

    def positive_slots(self, image: int, n: int) -> torch.Tensor:
        """Query indices of the positive copies of an image's first n targets, group-major: (groups * n,)."""
        base = torch.arange(self.groups, device=self.label_ids.device)[:, None] * 2 * self.max_targets
        return (base + torch.arange(n, device=self.label_ids.device)[None]).reshape(-1)


def build_denoising(labels: torch.Tensor, boxes: torch.Tensor, num_targets: torch.Tensor, num_classes: int,
                    num_matching: int, num_dn_queries: int = 100, label_noise: float = 0.5,
                    box_noise: float = 1.0, generator: torch.Generator | None = None) -> DenoisingGroups | None:
    """labels (B, M) and boxes (B, M, 4) cxcywh in [0, 1], padded; num_targets (B,). None when the batch has no
    targets (no denoising part at all)."""
    device = boxes.device
    max_t = max(host_list(num_targets), default=0)
    if max_t == 0:
        return None
    groups = max(num_dn_queries // max_t, 1)
    b = labels.shape[0]
    per_group = 2 * max_t
    n = groups * per_group

    def rand(*shape):
        return torch.rand(*shape, device=device, generator=generator)

    # slots: [group][pos|neg][target]; padded targets stay "padding" class with a dummy box
    valid = torch.arange(max_t, device=device)[None] < num_targets[:, None]  # (B, max_t)
    lab = labels[:, :max_t].masked_fill(~valid, num_classes)
    lab = lab[:, None, None].expand(b, groups, 2, max_t).clone()
    flip = (rand(b, groups, 2, max_t) < label_noise * 0.5) & valid[:, None, None]
    new = (rand(b, groups, 2, max_t) * num_classes).long().clamp_max(num_classes - 1)
    lab = torch.where(flip, new, lab).reshape(b, n)

    cxcywh = boxes[:, :max_t].float()
    xyxy = box_convert(cxcywh, "cxcywh", "xyxy")[:, None, None].expand(b, groups, 2, max_t, 4)
    half_wh = cxcywh[..., 2:].repeat(1, 1, 2)[:, None, None] / 2  # (w/2, h/2, w/2, h/2)
    sign = rand(b, groups, 2, max_t, 4).round() * 2 - 1
    mag = rand(b, groups, 2, max_t, 4)
    mag[:, :, 1] += 1.0  # negatives: noise in [1, 2) x half size
    noised = (xyxy + sign * mag * half_wh * box_noise).clamp(0.0, 1.0)
    noised = box_convert(noised, "xyxy", "cxcywh")
    noised = torch.where(valid[:, None, None, :, None], noised, torch.full_like(noised, 0.5))
    boxes_unact = inverse_sigmoid(noised.reshape(b, n, 4))

    total = n + num_matching
    mask = torch.zeros(total, total, dtype=torch.bool, device=device)
    mask[n:, :n] = True  # matching queries never see the denoising part
    gid = torch.arange(n, device=device) // per_group
    mask[:n, :n] = gid[:, None] != gid[None, :]  # groups see only themselves
    return DenoisingGroups(lab, boxes_unact, mask, groups, max_t)
