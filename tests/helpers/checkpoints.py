"""What the suites on checkpoint content share: the prior metric and detector runs (and the metric run's flags and
head shard, the detector's COCO dataset), a snapshot of every input a command must leave alone, and a rewrite of a
safetensors file."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.helpers.cli import tree_hash
from tests.helpers.fork_server import Cli

METRIC = ["--batch-size", "4", "--num-workers", "0", "--embedding-dim", "16", "--mixed-precision", "no",
          "--head-parallel", "sharded", "--ema-decay", "0.9"]
SHARD = "head/classes_000000000-000000004.safetensors"


def coco(root: Path) -> list[str]:
    """Two 128 x 96 images with two boxes each of two classes, as a COCO file: the detector's training data."""
    from PIL import Image, ImageDraw

    (root / "images").mkdir(parents=True)
    images, anns = [], []
    for i in range(2):
        im = Image.new("RGB", (128, 96), (20, 20, 20))
        draw = ImageDraw.Draw(im)
        for j, (x, y) in enumerate(((10 + 8 * i, 12), (70, 40 - 8 * i))):
            draw.rectangle((x, y, x + 40, y + 30), fill=(220, 60 + 120 * j, 40))
            anns.append({"id": len(anns) + 1, "image_id": i + 1, "category_id": j + 1, "bbox": [x, y, 40, 30],
                         "area": 1200, "iscrowd": 0})
        im.save(root / "images" / f"{i}.jpg")
        images.append({"id": i + 1, "file_name": f"{i}.jpg", "width": 128, "height": 96})
    (root / "ann.json").write_text(json.dumps({"images": images, "annotations": anns, "categories": [
        {"id": 1, "name": "red"}, {"id": 2, "name": "orange"}]}))
    return ["--task", "dino", "--model", "debug-resnet", "--train-ann", str(root / "ann.json"), "--train-images",
            str(root / "images"), "--val-ann", str(root / "ann.json"), "--val-images", str(root / "images"),
            "--image-size", "128", "--batch-size", "2", "--num-workers", "0", "--num-queries",
            "20", "--dn-queries", "0", "--mixed-precision", "no"]


def metric_and_dino(root: Path, cli: Cli, identities: int, held_out: int = 0) -> tuple[Path, Path, Path, Path]:
    """The prior runs these suites copy, each trained 1 step (checkpoint step_1): metric/ (sharded head, EMA) on
    faces/ (train/: `identities` x 2 images; val/: `held_out` x 2 images when > 0) and dino/ on coco/ (`coco`).
    Returns (faces, coco, metric, dino)."""
    from vtrain.data.demo_faces import write_identity_tree

    write_identity_tree(root / "faces" / "train", 0, identities, 2, seed=3)
    if held_out:
        write_identity_tree(root / "faces" / "val", 100, held_out, 2, seed=3)
    dino = coco(root / "coco")
    for argv in (["--data", str(root / "faces"), "--output-dir", str(root / "metric"), *METRIC],
                 ["--output-dir", str(root / "dino"), *dino]):
        rc, out, err, _ = cli.run(["train", "--max-steps", "1", *argv])
        assert rc == 0, out[-3000:] + err[-3000:]
    return root / "faces", root / "coco", root / "metric", root / "dino"


def edit(file: Path, change: Callable[[dict[str, torch.Tensor]], None], metadata: dict | None = None) -> None:
    """Rewrite a safetensors file with `change` applied to its tensors (its metadata kept, or replaced)."""
    with safe_open(str(file), "pt") as f:
        meta = f.metadata()
    tensors = load_file(str(file))
    change(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(file), metadata=metadata or meta)


def snapshot(root: Path) -> dict[str, str]:
    """Every input a command must leave alone: each run's checkpoints and every file outside a run directory (a
    resumed run's own config.yaml and logs are rewritten by every resume, failed or not)."""
    runs = {p.parent for p in root.rglob("checkpoints")}
    snap = {str(r / "checkpoints"): tree_hash(r / "checkpoints") for r in runs}
    for p in root.rglob("*"):
        if p.is_file() and not any(r in p.parents for r in runs):
            snap[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return snap


def relabelled_as_dino(doc: dict) -> dict:
    """A metric run's config.yaml (as a dict) relabelled `task: dino`, without the face options a DINO config.yaml never
    holds (config fields marked METRIC_ONLY): what tests that hand a command "a detection checkpoint" write."""
    import dataclasses

    from vtrain.config import DataConfig, ModelConfig

    out = {**doc, "task": "dino"}
    for section, cls in (("model", ModelConfig), ("data", DataConfig)):
        face = {f.name for f in dataclasses.fields(cls) if f.metadata.get("task") == "metric"}
        out[section] = {k: v for k, v in doc.get(section, {}).items() if k not in face}
    return out


def weights_run(out: Path, cfg, tensors: dict[str, torch.Tensor], categories: list | None = None) -> Path:
    """A run directory holding one complete checkpoint (step_0) of `tensors` and `cfg`, made with the checkpoint
    API as `vtrain convert` writes its output (config.yaml, model.safetensors, a step-0 train state, categories);
    returns the checkpoint."""
    import uuid

    from vtrain.engine.checkpoint import format as ckpt
    from vtrain.io.files import digest_share

    out.mkdir(parents=True)
    cfg.save(out / ckpt.CONFIG)
    tmp = ckpt.begin(out, 0, True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / ckpt.MODEL))
    cfg.save(tmp / ckpt.CONFIG)
    ckpt.TrainState(step=0, consumed_samples=0, scheduler={"base_lrs": [cfg.optim.lr], "last_epoch": 0,
                                                          "lr_lambdas": [None]}, world_size=1, engine="single").write(tmp)
    if categories is not None:
        ckpt.write_json(tmp / ckpt.CATEGORIES, categories)
    return ckpt.commit(out, 0, uuid.uuid4().hex, digest_share(tmp, ckpt.payload_files(tmp)), keep_last=1)[0]


DEBUG_DETECTOR = {"preset": "debug-resnet", "image_size": 128, "num_queries": 20, "dn_queries": 0}


def debug_detector(root: Path, images: dict[str, tuple[int, int]]) -> dict[str, Path]:
    """A debug-resnet detector of 2 classes as a checkpoint (`weights_run`: untrained, what the readers and the
    output rules need, not what it predicts) and a COCO set `val.json` + `val/` of `images` (file name -> width,
    height; each file written as a plain JPEG). Returns its paths: root, ann, val, ckpt."""
    from PIL import Image

    from vtrain.config import build_config
    from vtrain.tasks import build_model

    val = root / "val"
    val.mkdir(parents=True)
    for name, (w, h) in images.items():
        Image.new("RGB", (w, h), (90, 40, 10)).save(val / name)
    ann = root / "val.json"
    cats = [{"id": 1, "name": "a"}, {"id": 2, "name": "b"}]
    ann.write_text(json.dumps({"images": [{"id": i + 1, "file_name": n, "width": w, "height": h}
                                          for i, (n, (w, h)) in enumerate(images.items())],
                               "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [4, 4, 20, 20],
                                                "area": 400, "iscrowd": 0}], "categories": cats}))
    cfg = build_config("dino", overrides={"model": DEBUG_DETECTOR, "train": {"output_dir": str(root / "run"),
                                                                             "batch_size": 1},
                                          "data": {"val_ann": str(ann), "val_images": str(val), "num_workers": 0}})
    ckpt = weights_run(root / "run", cfg, build_model("dino", cfg.model, 2).state_dict(), cats)
    return {"root": root, "ann": ann, "val": val, "ckpt": ckpt}


def debug_face_model(root: Path) -> Path:
    """A debug metric model (16-d embeddings, LayerNorm neck, 4 identities) as a checkpoint (`weights_run`), whose
    run's data is an identity tree of 4 x 2 images (no held-out set: `vtrain eval` of it needs data given)."""
    from vtrain.config import build_config
    from vtrain.data.demo_faces import write_identity_tree
    from vtrain.tasks import build_model

    write_identity_tree(root / "face_data", 0, 4, 2, seed=3)
    cfg = build_config("metric", overrides={"model": {"embedding_dim": 16, "neck_norm": "ln"},
                                            "train": {"output_dir": str(root / "face"), "batch_size": 2},
                                            "data": {"path": str(root / "face_data"), "num_workers": 0}})
    return weights_run(root / "face", cfg, build_model("metric", cfg.model, 4).state_dict())
