"""COCO data pipeline, bad annotation handling, aspect-ratio batching, and the COCOeval round trip."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from vtrain.data.coco import CocoDetection, collate, load_coco
from vtrain.data.sampler import ShardedEpochSampler
from vtrain.errors import VtrainError
from vtrain.eval.coco_eval import coco_box_metrics, coco_detections
from vtrain.models.dino import postprocess


@pytest.fixture(scope="module")
def demo() -> Path:
    from vtrain.data.demo_shapes import ensure_demo_shapes

    return ensure_demo_shapes()


def _write(tmp: Path, data: dict) -> Path:
    p = tmp / "ann.json"
    p.write_text(json.dumps(data))
    return p


def _small_set(demo: Path, n: int = 3) -> dict:
    d = json.loads((demo / "annotations" / "instances_val2017.json").read_text())
    ids = {im["id"] for im in d["images"][:n]}
    return {"images": d["images"][:n], "annotations": [a for a in d["annotations"] if a["image_id"] in ids],
            "categories": d["categories"]}


def test_demo_set_is_coco_layout_with_real_jpegs(demo):
    for split in ("train", "val"):
        coco = load_coco(demo / "annotations" / f"instances_{split}2017.json")
        assert len(coco.getCatIds()) == 4 and len(coco.getImgIds()) > 0
        first = coco.imgs[coco.getImgIds()[0]]
        assert (demo / f"{split}2017" / first["file_name"]).read_bytes()[:2] == b"\xff\xd8"


def test_train_sample_is_normalised_and_resumable(demo):
    ds = CocoDetection(demo / "annotations" / "instances_train2017.json", demo / "train2017", 256, 427, train=True)
    a, b, c = ds[(0, 5)], ds[(0, 5)], ds[(1, 5)]
    assert torch.equal(a["images"], b["images"]) and torch.equal(a["boxes"], b["boxes"])  # seeded by (epoch, idx)
    assert a["images"].shape[0] == 3 and max(a["images"].shape[1:]) <= 427
    assert ((a["boxes"] >= 0) & (a["boxes"] <= 1)).all() and len(a["labels"]) == len(a["boxes"])
    assert not torch.equal(a["images"], c["images"]) or not torch.equal(a["boxes"], c["boxes"])
    # torch's global RNG (the model's: dropout, denoising noise) is untouched by the augmentation
    torch.manual_seed(3)
    x = torch.rand(1)
    torch.manual_seed(3)
    ds[(0, 1)]
    assert torch.equal(torch.rand(1), x)


def test_collate_pads_to_32_with_masks(demo):
    ds = CocoDetection(demo / "annotations" / "instances_val2017.json", demo / "val2017", 160, 267, train=False)
    samples = [ds[i] for i in range(3)]
    batch = collate(samples)
    b, _, h, w = batch["images"].shape
    assert b == 3 and h % 32 == 0 and w % 32 == 0
    for i, s in enumerate(samples):
        _, ih, iw = s["images"].shape
        assert not batch["masks"][i, :ih, :iw].any() and batch["masks"][i].sum() == h * w - ih * iw
        n = len(s["labels"])
        assert batch["num_targets"][i] == n and torch.equal(batch["boxes"][i, :n], s["boxes"])


def test_bad_boxes_are_clipped_dropped_and_counted(demo, tmp_path):
    d = _small_set(demo, 2)
    img = d["images"][0]
    w, h = img["width"], img["height"]
    extra = [
        {"id": 9001, "image_id": img["id"], "category_id": 1, "bbox": [-10, -5, 40, 30], "area": 1, "iscrowd": 0},
        {"id": 9002, "image_id": img["id"], "category_id": 2, "bbox": [w - 5, 10, 50, 20], "area": 1, "iscrowd": 0},
        {"id": 9003, "image_id": img["id"], "category_id": 2, "bbox": [20, 20, 0, 10], "area": 0, "iscrowd": 0},
        {"id": 9004, "image_id": img["id"], "category_id": 3, "bbox": [w + 10, 5, 5, 5], "area": 1, "iscrowd": 0},
        {"id": 9005, "image_id": img["id"], "category_id": 3, "bbox": [5, 5, 50, 50], "area": 1, "iscrowd": 1},
    ]
    d["annotations"] += extra
    d["images"].append({"id": 777, "file_name": d["images"][1]["file_name"], "width": d["images"][1]["width"],
                        "height": d["images"][1]["height"]})  # an image without boxes
    ds = CocoDetection(_write(tmp_path, d), demo / "val2017", 128, 213, train=True)
    r = ds.report
    assert r.crowd == 1 and r.clipped == 3 and r.dropped_empty == 2 and r.images_without_boxes == 1
    boxes, _ = ds.targets[0]
    assert (boxes[:, 0] >= 0).all() and (boxes[:, 2] <= w).all()
    empty = ds[(0, len(ds) - 1)]
    assert empty["boxes"].shape == (0, 4)
    assert collate([empty, ds[(0, 0)]])["num_targets"][0] == 0


@pytest.mark.parametrize("problem,message", [
    ("json", "not valid JSON"),
    ("category", "category id 99"),
    ("missing", "are missing from"),
    ("keys", "missing 'annotations'"),
])
def test_bad_annotation_files_are_clear_errors(demo, tmp_path, problem, message):
    d = _small_set(demo, 2)
    if problem == "category":
        d["annotations"][0]["category_id"] = 99
    if problem == "missing":
        d["images"][0]["file_name"] = "nope.jpg"
    if problem == "keys":
        del d["annotations"]
    path = _write(tmp_path, d)
    if problem == "json":
        path.write_text('{"images": [')
    with pytest.raises(VtrainError, match=message):
        CocoDetection(path, demo / "val2017", 128, 213, train=True)


def test_unreadable_image_is_a_clear_error(demo, tmp_path):
    d = _small_set(demo, 1)
    images = tmp_path / "images"
    images.mkdir()
    (images / d["images"][0]["file_name"]).write_bytes(b"not a jpeg")
    ds = CocoDetection(_write(tmp_path, d), images, 128, 213, train=False)
    with pytest.raises(VtrainError, match="cannot decode image"):
        ds[0]


def test_aspect_ratio_grouping_keeps_batch_count_and_disjoint_ranks():
    groups = [0] * 37 + [1] * 23
    import random

    random.Random(0).shuffle(groups)
    per_rank = [ShardedEpochSampler(60, 4, r, 2, seed=1, group_ids=groups) for r in range(2)]
    assert per_rank[0].batches_per_epoch == 60 // 8
    idx = [s.epoch_indices(0).tolist() for s in per_rank]
    assert len(idx[0]) == len(idx[1]) == 7 * 4 and not set(idx[0]) & set(idx[1])
    pure = 0
    for b in range(7):  # global micro-batch b = both ranks' b-th batch
        members = idx[0][b * 4:(b + 1) * 4] + idx[1][b * 4:(b + 1) * 4]
        pure += len({groups[i] for i in members}) == 1
    assert pure >= 5  # at most one mixed batch per group's leftovers
    assert per_rank[0].epoch_indices(0).tolist() == per_rank[0].epoch_indices(0).tolist()
    assert per_rank[0].epoch_indices(0).tolist() != per_rank[0].epoch_indices(1).tolist()


def test_ground_truth_as_predictions_scores_ap_1(demo):
    """Round trip through our post-processing (normalised cxcywh -> original pixels, label -> category id) and
    COCOeval: predicting the ground truth exactly gives AP 1.0."""
    ann = demo / "annotations" / "instances_val2017.json"
    ds = CocoDetection(ann, demo / "val2017", 160, 267, train=False)
    dets = []
    for idx, image_id in enumerate(ds.ids[:20]):
        xyxy, labels = ds.targets[idx]
        info = ds.coco.imgs[image_id]
        w, h = info["width"], info["height"]
        q = 10
        logits = torch.full((1, q, ds.num_classes), -10.0)
        boxes = torch.full((1, q, 4), 0.5)
        for j, (bx, lab) in enumerate(zip(xyxy, labels)):
            x0, y0, x1, y1 = bx.tolist()
            boxes[0, j] = torch.tensor([(x0 + x1) / 2 / w, (y0 + y1) / 2 / h, (x1 - x0) / w, (y1 - y0) / h])
            logits[0, j, lab] = 10.0
        r = postprocess(logits, boxes, torch.tensor([[h, w]]), top_k=q * ds.num_classes)[0]
        dets += coco_detections(image_id, r["boxes"].numpy(), r["scores"].numpy(), r["labels"].numpy(), ds.cat_ids)
    m = coco_box_metrics(ds.coco, dets, image_ids=ds.ids[:20])
    assert m["AP"] == pytest.approx(1.0, abs=1e-6) and m["AP50"] == pytest.approx(1.0, abs=1e-6)
    # and a shifted prediction is penalised
    for d in dets:
        d["bbox"][0] += d["bbox"][2] * 0.4
    assert coco_box_metrics(ds.coco, dets, image_ids=ds.ids[:20])["AP"] < 0.5


def test_empty_predictions_score_zero(demo):
    coco = load_coco(demo / "annotations" / "instances_val2017.json")
    assert coco_box_metrics(coco, [])["AP"] == 0.0


def test_copy_of_demo_layout_is_found_by_data_dir(demo, tmp_path):
    from vtrain.config import DataConfig
    from vtrain.tasks.dino import resolve_coco_data

    root = tmp_path / "coco"
    shutil.copytree(demo, root)
    paths = resolve_coco_data(DataConfig(path=str(root)))
    assert paths.train_ann == root / "annotations" / "instances_train2017.json"
    assert paths.val_images == root / "val2017"
    with pytest.raises(VtrainError, match="go together"):
        resolve_coco_data(DataConfig(path=str(tmp_path), val_images=str(root / "val2017")))
