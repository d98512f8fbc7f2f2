"""COCO box AP with pycocotools' COCOeval (crowd and area ranges handled by COCOeval itself), overall and per
category."""

from __future__ import annotations

import contextlib
import io
from typing import Any

import numpy as np

METRIC_NAMES = ("AP", "AP50", "AP75", "APs", "APm", "APl", "AR1", "AR10", "AR100", "ARs", "ARm", "ARl")
CLASSWISE = {"AP": None, "AP50": 0.5, "AP75": 0.75}  # per-class metric -> IoU threshold (None: mean over .50:.95)


def coco_detections(image_id: int, boxes_xyxy: np.ndarray, scores: np.ndarray, labels: np.ndarray,
                    cat_ids: list[int]) -> list[dict[str, Any]]:
    """One image's predictions in the COCO results format (xywh boxes, original category ids)."""
    out = []
    for (x0, y0, x1, y1), s, lab in zip(boxes_xyxy.tolist(), scores.tolist(), labels.tolist()):
        out.append({"image_id": int(image_id), "category_id": int(cat_ids[lab]),
                    "bbox": [round(x0, 2), round(y0, 2), round(x1 - x0, 2), round(y1 - y0, 2)],
                    "score": round(float(s), 5)})
    return out


def coco_box_metrics(coco_gt, detections: list[dict[str, Any]], image_ids: list[int] | None = None) -> dict[str, Any]:
    """AP/AP50/AP75/APs/APm/APl (and AR) in [0, 1] over `image_ids` (default: all images of coco_gt), and
    `per_class`: one entry per category of the ground truth (see `per_class_ap`). COCOeval reports -1 for an area
    range or a category without ground truth; those are kept as None."""
    from pycocotools.cocoeval import COCOeval

    ids = sorted(coco_gt.getImgIds()) if image_ids is None else sorted(image_ids)
    if not detections:
        out: dict[str, Any] = {k: 0.0 for k in METRIC_NAMES}
        out.update(images=len(ids), detections=0, per_class=per_class_ap(coco_gt, ids, None))
        return out
    with contextlib.redirect_stdout(io.StringIO()):
        coco_dt = coco_gt.loadRes(detections)
        ev = COCOeval(coco_gt, coco_dt, iouType="bbox")
        ev.params.imgIds = ids
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    stats = [float(v) for v in ev.stats]
    out = {k: (None if v < 0 else v) for k, v in zip(METRIC_NAMES, stats)}
    out.update(images=len(ids), detections=len(detections),
               per_class=per_class_ap(coco_gt, ids, ev.eval["precision"], ev.params.iouThrs))
    return out


def per_class_ap(coco_gt, image_ids: list[int], precision: np.ndarray | None,
                 iou_thrs: np.ndarray | None = None) -> list[dict[str, Any]]:
    """Per-category AP, AP50 and AP75 from COCOeval's accumulated precision array, indexed [IoU threshold, recall
    threshold, category, area range, max detections]: area range `all` (index 0) and 100 detections (the last),
    entries of -1 (no ground truth) left out, as COCOeval's own summary and mmdetection's `classwise` do.
    A category without (non-crowd) ground truth in these images has None; one with ground truth but no matching
    prediction has 0. `gt` counts its non-crowd boxes. `precision` None means no predictions at all."""
    wanted = set(image_ids)
    counts = {c: 0 for c in coco_gt.getCatIds()}
    for a in coco_gt.dataset.get("annotations", []):
        if a["image_id"] in wanted and not a.get("iscrowd", 0) and a["category_id"] in counts:
            counts[a["category_id"]] += 1
    rows = []
    for k, cat in enumerate(sorted(counts)):  # COCOeval's category axis follows the sorted category ids
        row: dict[str, Any] = {"id": int(cat), "name": str(coco_gt.cats[cat].get("name", cat)), "gt": counts[cat]}
        for name, iou in CLASSWISE.items():
            if precision is None:
                row[name] = 0.0 if counts[cat] else None
                continue
            p = precision[:, :, k, 0, -1]
            if iou is not None:
                p = p[np.flatnonzero(np.isclose(iou_thrs, iou))[0]]
            p = p[p > -1]
            row[name] = float(p.mean()) if p.size else None
        rows.append(row)
    return rows
