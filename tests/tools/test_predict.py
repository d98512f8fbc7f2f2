"""`vtrain predict` on a briefly trained demo detector and a metric model: drawn boxes where the shapes are, the same
predictions and embeddings as evaluation, `vtrain eval --classwise`, and bad input as one error line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torchcodec.decoders import decode_image

from tests.helpers.cli import cli_in_process as cli, faces_dataset, ok, reseal, vtrain
from vtrain.errors import VtrainError

N_IMAGES = 2  # demo training images 000000.jpg and 000001.jpg: 7 shapes


@pytest.fixture(scope="module")
def dino_run(tmp_path_factory) -> dict:
    """debug-resnet trained 40 steps on 2 demo images (train = val). Measured: after 40 steps 5 of the 7 shapes have
    a box drawn along more than 60% of their outline; after 20 steps no box reaches the 0.3 score threshold."""
    from vtrain.data.demo_shapes import ensure_demo_shapes

    demo = ensure_demo_shapes()
    d = json.loads((demo / "annotations" / "instances_train2017.json").read_text())
    images = d["images"][:N_IMAGES]
    ids = {im["id"] for im in images}
    sub = {"images": images, "annotations": [a for a in d["annotations"] if a["image_id"] in ids],
           "categories": d["categories"]}
    root = tmp_path_factory.mktemp("predict")
    ann = root / "two.json"
    ann.write_text(json.dumps(sub))
    img_dir = demo / "train2017"
    run = root / "run"
    ok(vtrain("train", "--task", "dino", "--model", "debug-resnet", "--num-workers", "0", "--mixed-precision", "no",
              "--train-ann", str(ann), "--train-images", str(img_dir), "--val-ann", str(ann), "--val-images",
              str(img_dir), "--output-dir", str(run), "--image-size", "128", "--batch-size", "2", "--max-steps", "40",
              "--lr", "1e-3", "--backbone-lr-mult", "1", "--clip-grad", "1.0", "--schedule", "constant",
              "--log-every", "20", "--save-every", "40"))
    return {"run": run, "ann": ann, "coco": sub, "files": [img_dir / im["file_name"] for im in images]}


@pytest.mark.integration
def test_predicted_boxes_are_drawn_on_the_shapes(dino_run, tmp_path, monkeypatch, capsys):
    out = tmp_path / "drawn"
    code, stdout, err = cli(monkeypatch, capsys, "predict", "--checkpoint", str(dino_run["run"]), "--images",
                            str(dino_run["files"][0]), "--images", str(dino_run["files"][1]), "--out", str(out),
                            "--num-workers", "0")
    assert code == 0, err
    assert "2 images on cpu" in stdout
    preds = json.loads((out / "predictions.json").read_text())
    assert preds and {d["file_name"] for d in preds} <= {"000000.jpg", "000001.jpg"}
    assert {d["image_id"] for d in preds} <= {1, 2} and all(d["score"] >= 0.3 for d in preds)
    assert {d["category_id"] for d in preds} <= {1, 2, 3, 4}  # ids of categories.json, not label indices
    hits = []
    for image_id, src in enumerate(dino_run["files"], 1):
        orig = decode_image(str(src)).int()
        drawn = decode_image(str(out / src.name)).int()
        assert drawn.shape == orig.shape  # drawn on the original image, at its own size
        changed = ((drawn - orig).abs().amax(0) > 60).numpy()  # a line, not JPEG noise
        h, w = changed.shape
        for a in dino_run["coco"]["annotations"]:
            if a["image_id"] == image_id:
                hits.append(_border_fraction(changed, a["bbox"], w, h))
        # away from every kept box (and its label) the image is untouched
        keep_out = np.zeros_like(changed)
        for d in preds:
            if d["file_name"] == src.name:
                x, y, bw, bh = d["bbox"]
                keep_out[max(int(y) - 4, 0):int(y + bh) + 5, max(int(x) - 4, 0):max(int(x + bw), int(x) + 100) + 5] = 1
        assert changed[keep_out == 0].mean() < 0.01
    # at least one ground-truth shape has a box drawn along (within 3 px of) most of its outline
    assert max(hits) > 0.6, hits


def _border_fraction(changed: np.ndarray, bbox: list[float], w: int, h: int, tol: int = 3) -> float:
    """Share of the outline of a ground-truth box (xywh) that has a changed pixel within `tol` pixels."""
    x0, y0, bw, bh = bbox
    x1, y1 = min(x0 + bw, w - 1), min(y0 + bh, h - 1)
    pts = [(x, y) for x in np.linspace(x0, x1, 40) for y in (y0, y1)] + \
          [(x, y) for y in np.linspace(y0, y1, 40) for x in (x0, x1)]
    found = 0
    for x, y in pts:
        xs, ys = slice(max(int(x) - tol, 0), int(x) + tol + 1), slice(max(int(y) - tol, 0), int(y) + tol + 1)
        found += bool(changed[ys, xs].any())
    return found / len(pts)


@pytest.mark.integration
def test_predict_equals_evaluation_and_eval_classwise(dino_run, tmp_path, monkeypatch, capsys):
    """With every top-300 box kept and the image ids of the annotation file, predict writes exactly the results
    that `vtrain eval --save-predictions` scores: the same preprocessing, batches and post-processing."""
    from vtrain.tools.predict import predict_detection

    report = predict_detection(dino_run["run"], [str(f) for f in dino_run["files"]], tmp_path / "all",
                               score_threshold=0.0, ann=str(dino_run["ann"]), num_workers=0)
    assert report.images == 2 and report.detections == 2 * 300  # every image: the top 300 of 100 queries x 4 classes
    saved = tmp_path / "eval_preds.json"
    code, stdout, err = cli(monkeypatch, capsys, "eval", "--checkpoint", str(dino_run["run"]), "--classwise",
                            "--json", "--save-predictions", str(saved))
    assert code == 0, err
    ours = [{k: v for k, v in d.items() if k != "file_name"} for d in
            json.loads((tmp_path / "all" / "predictions.json").read_text())]
    assert ours == json.loads(saved.read_text())
    metrics = json.loads(stdout.strip().splitlines()[-1])
    rows = {r["name"]: r for r in metrics["per_class"]}
    assert set(rows) == {"circle", "square", "triangle", "cross"}
    assert "per category" in stdout and "circle" in stdout
    defined = [r["AP"] for r in rows.values() if r["AP"] is not None]
    assert metrics["AP"] == pytest.approx(sum(defined) / len(defined))
    # the training run's eval.jsonl keeps the per-class numbers too
    last = json.loads((dino_run["run"] / "eval.jsonl").read_text().splitlines()[-1])
    assert {r["name"] for r in last["per_class"]} == set(rows)


@pytest.mark.integration
def test_bad_inputs_are_one_error_line(dino_run, tmp_path, monkeypatch, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    broken = tmp_path / "broken.jpg"
    broken.write_bytes(b"not a jpeg at all")
    run = str(dino_run["run"])
    cases = [
        (["--checkpoint", str(tmp_path / "nope"), "--images", str(dino_run["files"][0])], "--checkpoint: "),
        (["--checkpoint", run, "--images", str(empty)], "--images: no image files"),
        (["--checkpoint", run, "--images", str(tmp_path / "missing.jpg")], "no such file, folder or pattern"),
        (["--checkpoint", run, "--images", str(dino_run["files"][0]), "--images", str(broken)],
         f"cannot decode image {broken}"),
        (["--checkpoint", run, "--images", str(dino_run["files"][0]), "--task", "metric"], "is a dino checkpoint"),
    ]
    for args, message in cases:
        code, _, err = cli(monkeypatch, capsys, "predict", *args, "--out", str(tmp_path / "o"), "--num-workers", "0")
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err


@pytest.mark.integration
def test_checkpoint_without_categories_json(dino_run, tmp_path):
    """A detection checkpoint written before categories.json existed (rebuilt here: its files without it, under a
    fresh manifest): class names and ids come from --ann, giving exactly the new checkpoint's output; without
    --ann the classes are `class <i>` with their label indices as ids; an --ann of another class count is refused."""
    from vtrain.engine.checkpoint import format as ckpt
    from vtrain.tools.predict import predict_detection

    new = ckpt.complete_checkpoints(dino_run["run"])[-1]
    assert (new / ckpt.CATEGORIES).is_file() and ckpt.CATEGORIES in ckpt.read_manifest(new).files
    old = tmp_path / "old" / "checkpoints" / new.name
    old.mkdir(parents=True)
    for name in ("config.yaml", "model.safetensors", ckpt.TRAIN_STATE, ckpt.COMPLETE):
        shutil.copy(new / name, old / name)
    reseal(old)
    assert ckpt.verify(old) is None and not (old / ckpt.CATEGORIES).exists()
    files = [str(f) for f in dino_run["files"]]

    def run(checkpoint, out, ann=None):
        predict_detection(checkpoint, files, tmp_path / out, score_threshold=0.3, ann=ann, num_workers=0)
        return json.loads((tmp_path / out / "predictions.json").read_text())

    reference = run(new, "new")
    assert reference  # the 40-step model keeps boxes above 0.3 (test_predicted_boxes_are_drawn_on_the_shapes)
    assert run(old, "old_ann", str(dino_run["ann"])) == reference
    for f in dino_run["files"]:  # the same names drawn: the same pixels
        assert (tmp_path / "old_ann" / f.name).read_bytes() == (tmp_path / "new" / f.name).read_bytes()
    cat_ids = [c["id"] for c in dino_run["coco"]["categories"]]
    unnamed = run(old, "old_bare")
    assert [{**d, "category_id": cat_ids[d["category_id"]]} for d in unnamed] == reference
    assert {d["category_id"] for d in unnamed} <= {0, 1, 2, 3}
    three = tmp_path / "three.json"
    coco = dino_run["coco"]
    three.write_text(json.dumps({**coco, "categories": coco["categories"][:3],
                                 "annotations": [a for a in coco["annotations"] if a["category_id"] in cat_ids[:3]]}))
    with pytest.raises(VtrainError, match="the model has 4 classes but 3 categories are known"):
        run(old, "old_three", str(three))


def _record_input_sizes(monkeypatch, module) -> list[tuple[int, int]]:
    """Patch `module.load_model` so the loaded model records the unpadded (h, w) of every image it is given (from
    the padding masks): the test resize really used."""
    real, seen = module.load_model, []

    def hook(_, args, kwargs):
        for m in kwargs["masks"]:
            valid = ~m
            seen.append((int(valid.any(1).sum()), int(valid.any(0).sum())))

    def load(*args, **kwargs):
        loaded = real(*args, **kwargs)
        loaded.model.register_forward_pre_hook(hook, with_kwargs=True)
        return loaded

    monkeypatch.setattr(module, "load_model", load)
    return seen


def _resized(files: list[Path], size: int, max_size: int) -> list[tuple[int, int]]:
    from torchvision.transforms import v2

    return [tuple(v2.Resize(size, max_size=max_size)(decode_image(str(f))).shape[-2:]) for f in files]


@pytest.mark.integration
@pytest.mark.parametrize("flags,size", [([], (128, 213)), (["--image-size", "96"], (96, 160)),
                                        (["--image-size", "160", "--max-size", "170"], (160, 170)),
                                        (["--max-size", "140"], (128, 140))])
def test_predict_and_eval_test_size(dino_run, tmp_path, monkeypatch, capsys, flags, size):
    """--image-size / --max-size set the test resize of predict and eval (the run's 128 / 213 without them): the
    images the model is given have that size; --image-size alone takes the recipe's long side (x 1333 / 800)."""
    import vtrain.tools.evaluate
    import vtrain.tools.predict

    files = dino_run["files"]
    seen = _record_input_sizes(monkeypatch, vtrain.tools.predict)
    code, stdout, err = cli(monkeypatch, capsys, "predict", "--checkpoint", str(dino_run["run"]), "--images",
                            str(files[0]), "--images", str(files[1]), "--out", str(tmp_path / "o"), "--num-workers",
                            "0", *flags)
    assert code == 0, err
    assert f"at test size {size[0]}/{size[1]}" in stdout
    assert seen == _resized(files, *size)
    seen = _record_input_sizes(monkeypatch, vtrain.tools.evaluate)
    code, stdout, err = cli(monkeypatch, capsys, "eval", "--checkpoint", str(dino_run["run"]), "--json", *flags)
    assert code == 0, err
    assert json.loads(stdout.strip().splitlines()[-1])["test_size"] == list(size)
    assert sorted(seen) == sorted(_resized(files, *size))  # the val set (= these 2 images), in its own order


@pytest.mark.integration
def test_bad_test_sizes_are_one_error_line(dino_run, metric_run, tmp_path, monkeypatch, capsys):
    image = str(dino_run["files"][0])
    cases = [
        (dino_run["run"], ["--image-size", "0"], "--image-size: must be in 64..8192 pixels"),
        (dino_run["run"], ["--image-size", "9000"], "--image-size: must be in 64..8192 pixels"),
        (dino_run["run"], ["--max-size", "-5"], "--max-size: must be in 64..16384 pixels"),
        (dino_run["run"], ["--image-size", "200", "--max-size", "200"],
         "--max-size: must be above the short side 200 (--image-size), got 200"),
        (dino_run["run"], ["--max-size", "100"], "--max-size: must be above the short side 128 (the run's"),
        (metric_run, ["--image-size", "128"], "--image-size: only for detection checkpoints"),
    ]
    for checkpoint, flags, message in cases:
        for command in (["predict", "--images", image, "--out", str(tmp_path / "o.safetensors"), "--num-workers",
                         "0"], ["eval"]):
            code, _, err = cli(monkeypatch, capsys, command[0], "--checkpoint", str(checkpoint), *command[1:],
                               *flags)
            lines = err.strip().splitlines()
            assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], \
                (command[0], flags, err)


@pytest.mark.integration
def test_nms_leaves_no_two_boxes_above_its_iou(dino_run, metric_run, tmp_path, monkeypatch, capsys):
    """`--nms-iou` (class-agnostic, after the score threshold): of DINO's top-k, where one query gives a box for
    several classes, the kept boxes are a subset of those without NMS, none of them overlaps another above the IoU,
    and each image keeps its best box; a value outside (0, 1], or a face model, is one error line."""
    from torchvision.ops import box_iou

    from vtrain.tools.predict import predict_detection

    files = [str(f) for f in dino_run["files"]]
    plain = predict_detection(dino_run["run"], files, tmp_path / "plain", score_threshold=0.05, num_workers=0)
    cut = predict_detection(dino_run["run"], files, tmp_path / "nms", score_threshold=0.05, nms_iou=0.5,
                            num_workers=0)
    before, after = (json.loads((tmp_path / d / "predictions.json").read_text()) for d in ("plain", "nms"))
    assert 0 < cut.detections == len(after) < plain.detections == len(before) and cut.nms_iou == 0.5

    def key(d: dict) -> tuple:
        return d["image_id"], d["category_id"], tuple(d["bbox"]), d["score"]

    assert {key(d) for d in after} <= {key(d) for d in before}
    for image in {d["image_id"] for d in before}:
        kept = [d for d in after if d["image_id"] == image]
        assert max(d["score"] for d in kept) == max(d["score"] for d in before if d["image_id"] == image)
        xywh = torch.tensor([d["bbox"] for d in kept])
        xyxy = torch.cat([xywh[:, :2], xywh[:, :2] + xywh[:, 2:]], 1)
        assert box_iou(xyxy, xyxy).fill_diagonal_(0).max() <= 0.5 + 1e-3  # the JSON's boxes are rounded
    for checkpoint, value, message in ((dino_run["run"], "0", "--nms-iou: must be in (0, 1], got 0.0"),
                                       (dino_run["run"], "nan", "--nms-iou: must be in (0, 1], got nan"),
                                       (metric_run, "0.5", "--nms-iou: only for detection checkpoints")):
        code, _, err = cli(monkeypatch, capsys, "predict", "--checkpoint", str(checkpoint), "--images", files[0],
                           "--out", str(tmp_path / "o.safetensors"), "--num-workers", "0", "--nms-iou", value)
        assert code == 2 and err.strip() == f"error: {message}", err


@pytest.fixture(scope="module")
def metric_run(faces, tmp_path_factory) -> Path:
    """2 steps of the metric task on `--data hf:` (train + validation splits saved with save_to_disk, the same JPEG
    bytes as the `faces` tree), evaluated at the end on the validation split."""
    from datasets import DatasetDict

    root = tmp_path_factory.mktemp("metric")
    DatasetDict(train=faces_dataset(faces / "train"), validation=faces_dataset(faces / "val")).save_to_disk(
        str(root / "faces"))
    run = root / "run"
    ok(vtrain("train", "--task", "metric", "--model", "debug", "--data", f"hf:{root / 'faces'}", "--output-dir",
              str(run), "--max-steps", "2", "--batch-size", "4", "--num-workers", "1", "--mixed-precision", "no",
              "--save-every", "2"))
    return run


@pytest.mark.integration
def test_metric_embeddings_are_evaluations(metric_run, faces, tmp_path, monkeypatch, capsys):
    """The embeddings of the held-out image files, scored on all their pairs, give exactly the metrics of the
    run's evaluation on its `hf:` validation split (the same images as rows)."""
    from safetensors import safe_open

    from vtrain.data.pairs import sample_pairs
    from vtrain.tools.evaluate import evaluate_checkpoint
    from vtrain.eval.verification import verification_metrics

    logged = json.loads((metric_run / "eval.jsonl").read_text().splitlines()[-1])
    assert logged["genuine_pairs"] == 6 * 6 and logged["impostor_pairs"] == 24 * 23 // 2 - 36  # 6 ids x 4 images
    out = tmp_path / "emb.safetensors"
    code, stdout, err = cli(monkeypatch, capsys, "predict", "--task", "metric", "--checkpoint", str(metric_run),
                            "--images", str(faces / "val"), "--out", str(out), "--batch-size", "5",
                            "--num-workers", "0")
    assert code == 0, err
    with safe_open(str(out), "pt") as f:
        emb, files = f.get_tensor("embeddings"), json.loads(f.metadata()["files"])
    assert emb.shape == (24, 512) and len(files) == 24 and files[0].count("/") == 1  # identity/image.jpg
    assert torch.allclose(emb.norm(dim=1), torch.ones(24), atol=1e-5)
    labels = [f.split("/")[0] for f in files]
    idx, same = sample_pairs([sorted(set(labels)).index(x) for x in labels], 10**6)
    scores = (emb[idx[:, 0]] * emb[idx[:, 1]]).sum(1).numpy()
    ours = verification_metrics(scores, same)
    _, theirs = evaluate_checkpoint(metric_run, {})  # the run's own data: the hf: validation split
    for metrics in (theirs, logged):
        assert ours["genuine_pairs"] == metrics["genuine_pairs"]
        assert ours["impostor_pairs"] == metrics["impostor_pairs"]
        assert ours["balanced_accuracy"] == pytest.approx(metrics["balanced_accuracy"], abs=1e-6)
        assert ours["accuracy_threshold"] == pytest.approx(metrics["accuracy_threshold"], abs=1e-5)
    for a, b in zip(ours["rows"], theirs["rows"]):
        assert a["tar"] == pytest.approx(b["tar"]) and a["threshold"] == pytest.approx(b["threshold"], abs=1e-5)
