"""COCO box AP with pycocotools' COCOeval (crowd and area ranges handled by COCOeval itself)."""

from __future__ import annotations

import contextlib
import io
from typing import Any

import numpy as np

METRIC_NAMES = ("AP", "AP50", "AP75", "APs", "APm", "APl", "AR1", "AR10", "AR100", "ARs", "ARm", "ARl")


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
    """AP/AP50/AP75/APs/APm/APl (and AR) in [0, 1] over `image_ids` (default: all images of coco_gt).
    COCOeval reports -1 for an area range without ground truth; those are kept as None."""
    from pycocotools.cocoeval import COCOeval

    ids = sorted(coco_gt.getImgIds()) if image_ids is None else sorted(image_ids)
    if not detections:
        return {**{k: 0.0 for k in METRIC_NAMES}, "images": len(ids), "detections": 0}
    with contextlib.redirect_stdout(io.StringIO()):
        coco_dt = coco_gt.loadRes(detections)
        ev = COCOeval(coco_gt, coco_dt, iouType="bbox")
        ev.params.imgIds = ids
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    stats = [float(v) for v in ev.stats]
    out: dict[str, Any] = {k: (None if v < 0 else v) for k, v in zip(METRIC_NAMES, stats)}
    out.update(images=len(ids), detections=len(detections))
    return out
