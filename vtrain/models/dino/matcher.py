"""Hungarian matching of queries to ground truth (scipy's linear_sum_assignment), DINO costs 2/5/2.

Costs (docs/dino.md §1.1, MMD HungarianAssigner / official DINO): focal-loss class cost (alpha 0.25, gamma 2) x 2,
L1 on normalised cxcywh x 5, negative GIoU x 2. Computed per image in fp32 on the device, solved on the CPU.
GIoU adds GIOU_EPS to the union and the enclosing box on normalised boxes, in the cost and in the loss, as IDEA DINO
does (`util/box_ops.py`; docs/detection.md "GIoU eps").
"""

from __future__ import annotations

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment
from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily
from torchvision.ops import box_convert


GIOU_EPS = 1e-6
"""Added to the union and to the enclosing box's area (normalised boxes) in every GIoU, cost and loss: IDEA DINO's
`generalized_box_iou` (docs/detection.md "GIoU eps" gives the effect)."""


def generalized_iou(a: torch.Tensor, b: torch.Tensor, pairwise: bool = True, eps: float = GIOU_EPS) -> torch.Tensor:
    """GIoU of xyxy boxes: (N, M) for every pair of a (N, 4) and b (M, 4), or (N,) of paired rows with
    `pairwise=False`. inter / (union + eps) - (hull - union) / (hull + eps), IDEA DINO's form. (torchvision's has no
    eps, and its loss indexes with a boolean mask, which the memory estimator's fake tensors cannot trace.)"""
    if pairwise:
        a, b = a[:, None], b[None]
    lt, rb = torch.max(a[..., :2], b[..., :2]), torch.min(a[..., 2:], b[..., 2:])
    inter = (rb - lt).clamp(min=0).prod(-1)
    union = (a[..., 2:] - a[..., :2]).prod(-1) + (b[..., 2:] - b[..., :2]).prod(-1) - inter
    hull = (torch.max(a[..., 2:], b[..., 2:]) - torch.min(a[..., :2], b[..., :2])).clamp(min=0).prod(-1)
    return inter / (union + eps) - (hull - union) / (hull + eps)


def match_cost(logits: torch.Tensor, boxes: torch.Tensor, tgt_labels: torch.Tensor, tgt_boxes: torch.Tensor,
               w_class: float = 2.0, w_bbox: float = 5.0, w_giou: float = 2.0, alpha: float = 0.25,
               gamma: float = 2.0) -> torch.Tensor:
    """(Q, C) logits, (Q, 4) cxcywh predictions, (T,) labels, (T, 4) cxcywh targets -> (Q, T) cost."""
    prob = logits.float().sigmoid()[:, tgt_labels]
    neg = (1 - alpha) * prob.pow(gamma) * -(1 - prob + 1e-8).log()
    pos = alpha * (1 - prob).pow(gamma) * -(prob + 1e-8).log()
    cost_class = pos - neg
    cost_bbox = torch.cdist(boxes.float(), tgt_boxes.float(), p=1)
    cost_giou = -generalized_iou(box_convert(boxes.float(), "cxcywh", "xyxy"),
                                 box_convert(tgt_boxes.float(), "cxcywh", "xyxy"))
    return w_class * cost_class + w_bbox * cost_bbox + w_giou * cost_giou


def host_list(t: torch.Tensor) -> list:
    """Python values of a small host-side tensor (per-image target counts). The memory estimator keeps targets
    as real tensors under FakeTensorMode; reading them must leave that mode for a moment."""
    with unset_fake_temporarily():
        return t.tolist()


@torch.no_grad()
def hungarian_match(logits: torch.Tensor, boxes: torch.Tensor, tgt_labels: torch.Tensor, tgt_boxes: torch.Tensor,
                    num_targets: torch.Tensor, **costs: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Batched inputs (B, Q, C), (B, Q, 4), padded targets (B, M), (B, M, 4) and counts (B,). Returns per image
    (query indices, target indices) of a minimum-cost one-to-one assignment."""
    out = []
    counts = host_list(num_targets)
    if is_fake(logits):
        # memory estimation traces the model under FakeTensorMode: there are no values to match on, and which
        # queries are matched does not change the memory; take the first n
        return [(torch.arange(n, device=logits.device), torch.arange(n, device=logits.device)) for n in counts]
    for i, n in enumerate(counts):
        if n == 0:
            empty = torch.zeros(0, dtype=torch.long, device=logits.device)
            out.append((empty, empty))
            continue
        c = match_cost(logits[i], boxes[i], tgt_labels[i, :n], tgt_boxes[i, :n], **costs)
        c = torch.nan_to_num(c, nan=1e8, posinf=1e8, neginf=-1e8)  # a non-finite prediction must not crash scipy
        rows, cols = linear_sum_assignment(c.cpu().numpy())
        out.append((torch.as_tensor(rows, dtype=torch.long, device=logits.device),
                    torch.as_tensor(np.asarray(cols), dtype=torch.long, device=logits.device)))
    return out
