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
from vtrain.models.dino.matcher import generalized_iou, host_list, hungarian_match

WEIGHTS = {"cls": 1.0, "bbox": 5.0, "giou": 2.0}


def global_num_boxes(num_targets: torch.Tensor) -> float:
    """Mean number of target boxes per process over all processes, at least 1."""
    total = mean_over_ranks(float(sum(host_list(num_targets))), num_targets.device)  # NCCL needs a CUDA tensor
    return max(total, 1.0)


def giou_loss(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """1 - GIoU of paired xyxy boxes, elementwise (matcher.generalized_iou, IDEA DINO's eps)."""
    return 1 - generalized_iou(a, b, pairwise=False)


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


def loss_terms(out: dict, labels: torch.Tensor, boxes: torch.Tensor, num_targets: torch.Tensor,
               dn: DenoisingGroups | None) -> dict[str, torch.Tensor]:
    """Every unweighted loss term, `<part>_<kind>`: part `dec<i>` (decoder layer i's matching queries), `enc` (the
    encoder's top-k proposals) or `dn<i>` (layer i's denoising queries); kind `cls`, `bbox` or `giou` (WEIGHTS).
    IDEA DINO's SetCriterion names the same terms loss_ce_<i> / loss_ce (last layer), loss_ce_interm, loss_ce_dn_<i>
    / loss_ce_dn (tests/models/test_idea_criterion.py compares them one by one). In fp32 with autocast off."""
    with torch.autocast(device_type=labels.device.type, enabled=False):
        num_boxes = global_num_boxes(num_targets)
        terms: dict[str, torch.Tensor] = {}

        def add(part: str, losses: dict[str, torch.Tensor]) -> None:
            terms.update({f"{part}_{k}": v for k, v in losses.items()})

        for i, (lg, bx) in enumerate(zip(out["logits"], out["boxes"])):
            match = hungarian_match(lg, bx, labels, boxes, num_targets)
            add(f"dec{i}", _set_losses(lg, bx, [m[0] for m in match], labels, boxes, [m[1] for m in match],
                                       num_boxes))
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
                add(f"dn{i}", _set_losses(lg, bx, q_idx, labels, boxes, t_idx, num_boxes * dn.groups))
        return terms


def dino_loss(out: dict, labels: torch.Tensor, boxes: torch.Tensor, num_targets: torch.Tensor,
              dn: DenoisingGroups | None) -> dict[str, torch.Tensor]:
    """out: per-layer `logits`/`boxes` lists (matching part), `enc_logits`/`enc_boxes`, and `dn_logits`/`dn_boxes`
    lists when denoising ran. Returns the weighted total `loss` of every term (`loss_terms`) and, for the log, the
    parts of the last layer (`loss_cls`, ...), the encoder (`enc_cls`, ...) and the last denoising layer (`dn_cls`,
    ...)."""
    terms = loss_terms(out, labels, boxes, num_targets, dn)
    total = 0.0
    for name, v in terms.items():
        total = total + WEIGHTS[name.rsplit("_", 1)[1]] * v
    last = len(out["logits"]) - 1
    logged = {f"dec{last}": "loss", "enc": "enc", f"dn{last}": "dn"}
    parts = {f"{logged[p]}_{k}": v.detach() for name, v in terms.items()
             for p, k in [name.rsplit("_", 1)] if p in logged}
    return {"loss": total, **parts}
