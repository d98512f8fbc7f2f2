"""`--data hf:PATH`: Hugging Face datasets (save_to_disk folders and parquet files) give the same samples, targets
and evaluation as the same images in folders / COCO files, and train through the CLI for both tasks."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import datasets
from datasets import ClassLabel, Dataset, DatasetDict, Features, Image, List, Value

from tests.helpers.cli import faces_dataset, ok, vtrain
from vtrain.data.coco import CocoDetection
from vtrain.data.faces import FaceFolder
from vtrain.data.hf import HfSplits
from vtrain.errors import VtrainError


@pytest.fixture(autouse=True)
def _hf_cache(tmp_path, monkeypatch):
    # parquet files are converted once into the datasets cache: keep it out of the home directory
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")


@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> dict:
    """4 demo detection images as a COCO file, and the same images and boxes as Hugging Face datasets in the two
    layouts of the Hub's detection sets: `objects` as a dict of lists (cppe-5: + image_id, width, height) written
    with save_to_disk, and as a list of dicts (no sizes: read from the image) written as parquet."""
    from vtrain.data.demo_shapes import ensure_demo_shapes

    demo = ensure_demo_shapes()
    d = json.loads((demo / "annotations" / "instances_train2017.json").read_text())
    images = d["images"][:4]
    ids = {im["id"] for im in images}
    coco = {"images": images, "annotations": [a for a in d["annotations"] if a["image_id"] in ids],
            "categories": d["categories"]}
    root = tmp_path_factory.mktemp("hf_shapes")
    (root / "four.json").write_text(json.dumps(coco))
    names = [c["name"] for c in d["categories"]]
    label = ClassLabel(names=names)  # ClassLabel index = COCO category id - 1 in the demo set
    data = [(im, (demo / "train2017" / im["file_name"]).read_bytes(),
             [a for a in coco["annotations"] if a["image_id"] == im["id"]]) for im in images]
    # float64 boxes: the COCO file's values exactly (float32 would move them by ~1e-6 px)
    columnar = Dataset.from_dict({
        "image_id": [im["id"] for im, _, _ in data],
        "image": [{"bytes": b, "path": None} for _, b, _ in data],
        "width": [im["width"] for im, _, _ in data], "height": [im["height"] for im, _, _ in data],
        "objects": [{"bbox": [a["bbox"] for a in anns], "category": [a["category_id"] - 1 for a in anns]}
                    for _, _, anns in data]},
        features=Features({"image_id": Value("int64"), "image": Image(), "width": Value("int32"),
                           "height": Value("int32"),
                           "objects": {"bbox": List(List(Value("float64"), length=4)), "category": List(label)}}))
    DatasetDict(train=columnar, validation=columnar).save_to_disk(str(root / "disk"))
    rows = Dataset.from_dict({
        "image": [{"bytes": b, "path": None} for _, b, _ in data],
        "objects": [[{"bbox": a["bbox"], "category": a["category_id"] - 1} for a in anns] for _, _, anns in data]},
        features=Features({"image": Image(),
                           "objects": List({"bbox": List(Value("float64"), length=4), "category": label})}))
    rows.to_parquet(str(root / "pq" / "data" / "train-00000-of-00001.parquet"))
    rows.to_parquet(str(root / "pq" / "data" / "test-00000-of-00001.parquet"))
    return {"root": root, "ann": root / "four.json", "images": demo / "train2017"}


@pytest.mark.parametrize("layout", ["disk", "pq"])
def test_detection_rows_give_the_coco_samples(shapes, layout):
    hf = HfSplits(f"hf:{shapes['root'] / layout}")
    assert hf.eval_split == ("validation" if layout == "disk" else "test")
    ours = hf.detection("train", 128, 213, train=True, seed=5)
    ref = CocoDetection(shapes["ann"], shapes["images"], 128, 213, train=True, seed=5)
    assert [c["name"] for c in ours.categories] == [c["name"] for c in ref.categories]
    assert np.array_equal(ours.group_ids, ref.group_ids) and ours.report.summary("x") == ref.report.summary("x")
    for epoch in (0, 3):
        for i in range(len(ref)):
            a, b = ours[(epoch, i)], ref[(epoch, i)]  # same augmentation, seeded by (epoch, index)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (epoch, i)


def test_detection_evaluation_builds_the_coco_ground_truth(shapes):
    """The validation split as an in-memory COCO ground truth: an oracle that predicts exactly the boxes of each
    image scores AP 1 for every class on it, as on the COCO file (wrong image or category ids would not)."""
    from torchvision.ops import box_convert

    from vtrain.config import build_config
    from vtrain.tasks import build_task

    def oracle_metrics(data: dict) -> dict:
        cfg = build_config("dino", {}, {"model": {"preset": "debug-resnet", "image_size": 128},
                                        "data": {"num_workers": 0, **data}, "train": {"batch_size": 3}})
        task = build_task(cfg)
        ds = task.val_dataset()
        order = iter(range(len(ds)))

        def forward(images: torch.Tensor, masks: torch.Tensor) -> dict:
            logits, boxes = torch.full((len(images), 10, 4), -10.0), torch.full((len(images), 10, 4), 0.1)
            for j in range(len(images)):
                i = next(order)
                xyxy, labels = ds.targets[i]
                info = ds.coco.imgs[ds.ids[i]]
                scale = torch.tensor([info["width"], info["height"]] * 2, dtype=torch.float32)
                for q, (box, lab) in enumerate(zip(torch.from_numpy(xyxy), labels.tolist())):
                    logits[j, q, lab] = 10.0
                    boxes[j, q] = box_convert(box, "xyxy", "cxcywh") / scale
            return {"pred_logits": logits, "pred_boxes": boxes}

        return task.evaluate(forward, torch.device("cpu"))

    ours = oracle_metrics({"path": f"hf:{shapes['root'] / 'disk'}"})
    ref = oracle_metrics({"val_ann": str(shapes["ann"]), "val_images": str(shapes["images"])})
    for m in (ours, ref):
        assert m["images"] == 4 and m["AP"] == pytest.approx(1.0)
        assert all(r["AP"] == pytest.approx(1.0) for r in m["per_class"] if r["gt"])
    assert [(r["name"], r["gt"]) for r in ours["per_class"]] == [(r["name"], r["gt"]) for r in ref["per_class"]]


def test_face_rows_give_the_folder_samples(faces, tmp_path):
    faces_dataset(faces / "train").save_to_disk(str(tmp_path / "faces"))
    ours = HfSplits(f"hf:{tmp_path / 'faces'}").faces("train", 112, train=True, seed=3)
    ref = FaceFolder(faces / "train", 112, train=True, seed=3)
    assert ours.classes == ref.classes and ours.targets == ref.targets and len(ours) == len(ref)
    for i in range(0, len(ref), 7):
        a, b = ours[(2, i)], ref[(2, i)]  # decode, resize, [-1, 1] and the seeded flip
        assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.integration
def test_detection_trains_and_evaluates_through_the_cli(shapes, tmp_path):
    """(The metric task's CLI run on `hf:` data is the model of test_predict.py's embedding test.)"""
    ok(vtrain("train", "--task", "dino", "--model", "debug-resnet", "--data", f"hf:{shapes['root'] / 'pq'}",
              "--image-size", "128", "--output-dir", str(tmp_path / "dino"), "--max-steps", "2", "--batch-size", "4",
              "--num-workers", "1", "--mixed-precision", "no",
              extra_env={"HF_DATASETS_CACHE": str(tmp_path / "hf_cache")}))
    ev = json.loads((tmp_path / "dino" / "eval.jsonl").read_text().splitlines()[-1])
    assert ev["images"] == 4 and [r["name"] for r in ev["per_class"]] == ["circle", "square", "triangle", "cross"]
    cats = json.loads(next((tmp_path / "dino" / "checkpoints").glob("step_*/categories.json")).read_text())
    assert cats == [{"id": i, "name": n} for i, n in enumerate(["circle", "square", "triangle", "cross"])]


def test_bad_datasets_are_one_line_errors(tmp_path):
    Dataset.from_dict({"img": [1, 2], "label": [0, 1]}).save_to_disk(str(tmp_path / "cols"))
    with pytest.raises(VtrainError, match=r"missing column\(s\) image; columns: img, label"):
        HfSplits(f"hf:{tmp_path / 'cols'}").faces("train", 112, train=True)
    with pytest.raises(VtrainError, match=r"no 'validation' split \(splits: train\)"):
        HfSplits(f"hf:{tmp_path / 'cols'}").split("validation")
    (tmp_path / "empty").mkdir()
    with pytest.raises(VtrainError, match="cannot load it with Hugging Face datasets"):
        HfSplits(f"hf:{tmp_path / 'empty'}")
    with pytest.raises(VtrainError, match="no such folder or parquet file"):
        HfSplits(f"hf:{tmp_path / 'none'}/*.parquet")


@pytest.mark.parametrize("column, value, shown", [
    ("image_id", 1.5, "1.5"), ("image_id", "7", "'7'"), ("width", 64.25, "64.25"), ("category", 0.5, "0.5")])
def test_detection_ids_and_sizes_are_whole_numbers_never_truncated(tmp_path, column, value, shown):
    """A row's id, size or category that is not a whole number is one line naming the column (`int()` would have
    made 1.5 into 1 and trained on it); a float column's whole numbers are taken as the integers they are."""
    from vtrain.data.demo_shapes import ensure_demo_shapes

    jpeg = next((ensure_demo_shapes() / "train2017").glob("*.jpg")).read_bytes()

    def splits(name: str, **change) -> HfSplits:
        row = {"image_id": 3, "width": 64, "height": 64, "category": 1} | change
        kind = {k: Value({int: "int64", float: "float64", str: "string"}[type(v)]) for k, v in row.items()}
        Dataset.from_dict({
            "image_id": [row["image_id"]], "image": [{"bytes": jpeg, "path": None}],
            "width": [row["width"]], "height": [row["height"]],
            "objects": [{"bbox": [[1.0, 2.0, 10.0, 12.0]], "category": [row["category"]]}]},
            features=Features({"image_id": kind["image_id"], "image": Image(), "width": kind["width"],
                               "height": kind["height"], "objects": {"bbox": List(List(Value("float64"), length=4)),
                                                                     "category": List(kind["category"])}}),
        ).save_to_disk(str(tmp_path / name))
        return HfSplits(f"hf:{tmp_path / name}")

    whole = splits("whole", image_id=3.0, width=64.0)  # float columns holding whole numbers
    det = whole.detection("train", 64, 64, train=False)
    assert det._coco.dataset["images"][0]["id"] == 3 and det._coco.dataset["images"][0]["width"] == 64
    key = "objects.category" if column == "category" else column
    with pytest.raises(VtrainError, match=rf"column '{key}' must hold whole numbers, got {shown}$"):
        splits("bad", **{column: value}).detection("train", 64, 64, train=False)
