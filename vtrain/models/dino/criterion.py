"""DINO losses: sigmoid focal (alpha 0.25, gamma 2) x 1, L1 x 5, GIoU x 2 (docs/dino.md §1.1) on every decoder layer,
the encoder's top-k proposals and the denoising queries.

Normalisation across processes: the number of target boxes is all-reduced once and divided by the world size
once, so every rank divides its sum by the global mean. DDP/FSDP/ZeRO then average gradients over ranks, which
gives sum-over-all-boxes / total boxes, the same as one process seeing the whole batch. (HF's DETR loss divides
by the world size twice: docs/dino.md §5.) Losses run in fp32 with autocast off.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torchvision.ops import box_convert, sigmoid_focal_loss

from vtrain.dist import mean_over_ranks
from vtrain.models.dino.denoising import DenoisingGroups
from vtrain.models.dino.matcher import host_list, hungarian_match

WEIGHTS = {"cls": 1.0, "bbox": 5.0, "giou": 2.0}


def global_num_boxes(num_targets: torch.Tensor) -> float:
    """Mean number of target boxes per process over all processes, at least 1."""
    total = mean_over_ranks(float(sum(host_list(num_targets))), num_targets.device)  # NCCL needs a CUDA tensor
    return max(total, 1.0)


def giou_loss(a: torch.Tensor, b: torch.Tensor, eps: float = 1e-7) -> torch.Tensor:
    """1 - GIoU of paired xyxy boxes, elementwise. (torchvision's generalized_box_iou_loss indexes with a boolean
    mask, which the memory estimator's fake tensors cannot trace; the math is the same.)"""
    lt, rb = torch.max(a[:, :2], b[:, :2]), torch.min(a[:, 2:], b[:, 2:])
    inter = (rb - lt).clamp(min=0).prod(1)
    area_a = (a[:, 2:] - a[:, :2]).prod(1)
    area_b = (b[:, 2:] - b[:, :2]).prod(1)
    union = area_a + area_b - inter
    hull = (torch.max(a[:, 2:], b[:, 2:]) - torch.min(a[:, :2], b[:, :2])).clamp(min=0).prod(1)
    return 1 - inter / (union + eps) + (hull - union) / (hull + eps)


def _set_losses(logits: torch.Tensor, boxes: torch.Tensor, q_idx: list[torch.Tensor], tgt_labels: torch.Tensor,
                tgt_boxes: torch.Tensor, t_idx: list[torch.Tensor], num_boxes: float) -> dict[str, torch.Tensor]:
    """Losses for matched (query, target) pairs per image; every unmatched query is trained towards background."""
    b, q, c = logits.shape
    batch = torch.cat([torch.full_like(qi, i) for i, qi in enumerate(q_idx)])
    qs, ts = torch.cat(q_idx), torch.cat(t_idx)
    onehot = torch.zeros(b, q, c, dtype=torch.float32, device=logits.device)
    onehot[batch, qs, tgt_labels[batch, ts]] = 1.0
    cls = sigmoid_focal_loss(logits.float(), onehot, alpha=0.25, gamma=2.0, reduction="sum") / num_boxes
    if qs.numel() == 0:
        zero = boxes.sum() * 0.0  # keep the graph (and every rank's collectives) identical
        return {"cls": cls, "bbox": zero, "giou": zero}
    src = boxes[batch, qs].float()
    tgt = tgt_boxes[batch, ts].float()
    l1 = F.l1_loss(src, tgt, reduction="sum") / num_boxes
    giou = giou_loss(box_convert(src, "cxcywh", "xyxy"), box_convert(tgt, "cxcywh", "xyxy")).sum() / num_boxes
    return {"cls": cls, "bbox": l1, "giou": giou}


def dino_loss(out: dict, labels: torch.Tensor, boxes: torch.Tensor, num_targets: torch.Tensor,
              dn: DenoisingGroups | None) -> dict[str, torch.Tensor]:
    """out: per-layer `logits`/`boxes` lists (matching part), `enc_logits`/`enc_boxes`, and `dn_logits`/`dn_boxes`
    lists when denoising ran. Returns the weighted total `loss` and its parts (last layer, encoder, denoising)."""
    with torch.autocast(device_type=labels.device.type, enabled=False):
        num_boxes = global_num_boxes(num_targets)
        parts: dict[str, torch.Tensor] = {}
        total = 0.0

        def add(prefix: str | None, losses: dict[str, torch.Tensor]) -> None:
            """Add to the total; log the parts of the last layer, the encoder and the last denoising layer."""
            nonlocal total
            for k, v in losses.items():
                total = total + WEIGHTS[k] * v
                if prefix is not None:
                    parts[f"{prefix}_{k}"] = v.detach()

        layers = len(out["logits"])
        for i, (lg, bx) in enumerate(zip(out["logits"], out["boxes"])):
            match = hungarian_match(lg, bx, labels, boxes, num_targets)
            add("loss" if i == layers - 1 else None, _set_losses(lg, bx, [m[0] for m in match], labels, boxes,
                                                                   [m[1] for m in match], num_boxes))
        match = hungarian_match(out["enc_logits"], out["enc_boxes"], labels, boxes, num_targets)
        add("enc", _set_losses(out["enc_logits"], out["enc_boxes"], [m[0] for m in match], labels, boxes,
                               [m[1] for m in match], num_boxes))
        if dn is not None:
            # positives reconstruct their own target; negatives (and padding slots) are trained to "no object"
            q_idx, t_idx = [], []
            for i, n in enumerate(host_list(num_targets)):
                q_idx.append(dn.positive_slots(i, n))
                t_idx.append(torch.arange(n, device=labels.device).repeat(dn.groups))
            for i, (lg, bx) in enumerate(zip(out["dn_logits"], out["dn_boxes"])):
                add("dn" if i == layers - 1 else None, _set_losses(lg, bx, q_idx, labels, boxes, t_idx,
                                                                      num_boxes * dn.groups))
        return {"loss": total, **parts}
