"""Class-wise COCO AP (coco_box_metrics' `per_class`) on hand-made cases whose answers are known."""

from __future__ import annotations

import pytest

from vtrain.data.coco_check import coco_from_dict
from vtrain.tasks.dino import DinoTask

# two images; categories: 1 circle (2 boxes), 2 square (1 box), 3 triangle (no box), 4 cross (1 box + 1 crowd)
GT = {
    "images": [{"id": 1, "file_name": "1.jpg", "width": 200, "height": 100},
               {"id": 2, "file_name": "2.jpg", "width": 120, "height": 160}],
    "annotations": [
        {"id": 1, "image_id": 1, "category_id": 1, "bbox": [10, 10, 40, 30], "area": 1200, "iscrowd": 0},
        {"id": 2, "image_id": 2, "category_id": 1, "bbox": [5, 50, 60, 60], "area": 3600, "iscrowd": 0},
        {"id": 3, "image_id": 1, "category_id": 2, "bbox": [100, 20, 50, 50], "area": 2500, "iscrowd": 0},
        {"id": 4, "image_id": 2, "category_id": 4, "bbox": [60, 10, 40, 40], "area": 1600, "iscrowd": 0},
        {"id": 5, "image_id": 1, "category_id": 4, "bbox": [150, 60, 40, 30], "area": 1200, "iscrowd": 1},
    ],
    "categories": [{"id": 1, "name": "circle"}, {"id": 2, "name": "square"}, {"id": 3, "name": "triangle"},
                   {"id": 4, "name": "cross"}],
}


def _gt():
    return coco_from_dict(GT, "hand-made")


def _det(image_id: int, cat: int, bbox: list[float], score: float) -> dict:
    return {"image_id": image_id, "category_id": cat, "bbox": bbox, "score": score}


def _per_class(metrics: dict) -> dict[str, dict]:
    return {r["name"]: r for r in metrics["per_class"]}


def test_ground_truth_as_predictions_gives_one_per_class_and_none_without_ground_truth():
    from vtrain.eval.coco_eval import coco_box_metrics

    dets = [_det(a["image_id"], a["category_id"], a["bbox"], 0.9) for a in GT["annotations"] if not a["iscrowd"]]
    m = coco_box_metrics(_gt(), dets)
    rows = _per_class(m)
    assert [r["id"] for r in m["per_class"]] == [1, 2, 3, 4]
    for name in ("circle", "square", "cross"):
        assert rows[name]["AP"] == pytest.approx(1.0) and rows[name]["AP50"] == pytest.approx(1.0)
        assert rows[name]["AP75"] == pytest.approx(1.0)
    assert rows["triangle"]["AP"] is None and rows["triangle"]["gt"] == 0
    assert [rows[n]["gt"] for n in ("circle", "square", "cross")] == [2, 1, 1]  # the crowd box is not counted
    assert m["AP"] == pytest.approx(1.0)


def test_known_per_class_values_and_their_mean_is_the_overall_ap():
    from vtrain.eval.coco_eval import coco_box_metrics

    dets = [
        # circle: both found exactly -> 1.0
        _det(1, 1, [10, 10, 40, 30], 0.9), _det(2, 1, [5, 50, 60, 60], 0.8),
        # square: a false positive scored above the true one: precision 1/2 at every recall -> 0.5 at every IoU
        _det(1, 2, [0, 60, 30, 30], 0.95), _det(1, 2, [100, 20, 50, 50], 0.6),
        # cross: its box exactly (the crowd box of image 1 is ignored, not a miss) -> 1.0
        _det(2, 4, [60, 10, 40, 40], 0.7),
        # triangle has no ground truth: its predictions are not scored
        _det(1, 3, [20, 20, 10, 10], 0.99),
    ]
    m = coco_box_metrics(_gt(), dets)
    rows = _per_class(m)
    assert rows["circle"]["AP"] == pytest.approx(1.0)
    assert rows["square"]["AP"] == pytest.approx(0.5) and rows["square"]["AP50"] == pytest.approx(0.5)
    assert rows["cross"]["AP"] == pytest.approx(1.0)
    assert rows["triangle"]["AP"] is None
    defined = [r["AP"] for r in m["per_class"] if r["AP"] is not None]
    assert m["AP"] == pytest.approx(sum(defined) / len(defined))


def test_partial_overlap_counts_at_low_iou_only_and_a_class_without_predictions_is_zero():
    from vtrain.eval.coco_eval import coco_box_metrics

    dets = [
        _det(1, 1, [10, 10, 40, 30], 0.9), _det(2, 1, [5, 50, 60, 60], 0.8),
        _det(1, 2, [110, 20, 50, 50], 0.6),  # shifted 10 px: IoU 2000/3000 = 0.667
    ]  # no cross predictions
    rows = _per_class(coco_box_metrics(_gt(), dets))
    assert rows["square"]["AP50"] == pytest.approx(1.0) and rows["square"]["AP75"] == 0.0
    # found at IoU thresholds .50, .55, .60, .65 (4 of 10) -> AP 0.4
    assert rows["square"]["AP"] == pytest.approx(0.4)
    assert rows["cross"]["AP"] == 0.0 and rows["cross"]["AP50"] == 0.0


def test_no_predictions_at_all_and_the_table():
    from vtrain.eval.coco_eval import coco_box_metrics

    m = coco_box_metrics(_gt(), [])
    rows = _per_class(m)
    assert rows["circle"]["AP"] == 0.0 and rows["triangle"]["AP"] is None and m["AP"] == 0.0
    table = DinoTask.classwise_table(m)
    assert table.row_count == 4
    cells = [list(c.cells) for c in table.columns]
    assert cells[1] == ["circle", "square", "triangle", "cross"] and cells[3][2] == "-" and cells[3][0] == "0.000"
