"""`--overwrite` never reaches an input of the same command (guarded.check_not_input, the one rule every writing
command calls): table-driven cases for predict (detection and embeddings), eval --save-predictions, consolidate and
convert, where the output is an input by its path, through a folder link, as a hard link, or as a file of a folder
the command reads, or where a folder replaced whole holds the input. Each is one `error:` line (the CLI's mapping,
tests/helpers/fuzz.py), with --overwrite given, and every input byte-identical afterwards; outputs beside the
inputs that are not inputs pass the rule."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

from tests.helpers.checkpoints import debug_detector
from tests.helpers.fuzz import contract
from tests.helpers.paths import FIXTURES
from vtrain.tools.consolidate import consolidate
from vtrain.tools.convert import convert
from vtrain.tools.evaluate import evaluate_checkpoint
from vtrain.tools.predict import predict


def _photos(root: Path) -> Path:
    photos = root / "photos"
    photos.mkdir(parents=True)
    for i, name in enumerate(("holiday.jpg", "beach.png", "sub/deep.jpg")):
        (photos / name).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (40, 30), (50 * i, 90, 200)).save(photos / name)
    (photos / "predictions.json").write_text("[]")
    return photos


def _predict(task: str, images: list[str], out: Path, **options):
    # the checkpoint is never reached: the outputs are claimed before anything is loaded
    return predict(out.parent / "no-checkpoint", images, out, task, overwrite=True, num_workers=0, **options)


def _hard_linked(root: Path, photos: Path) -> Path:
    out = root / "drawn"
    out.mkdir()
    os.link(photos / "holiday.jpg", out / "holiday.jpg")
    return out


def _linked(root: Path, photos: Path) -> Path:
    os.symlink(photos, root / "link")
    return root / "link"


PREDICT = {  # name -> (task, images given, output, extra options, the refusal expected or None: the rule passes)
    "drawn images into the photos folder": ("dino", lambda r, p: [str(p)], lambda r, p: p, {}, "holiday.jpg is the same"),
    "into a link to the photos folder": ("dino", lambda r, p: [str(p)], _linked, {}, "is the same file as --images"),
    "over a hard link of a photo": ("dino", lambda r, p: [str(p)], _hard_linked, {}, "is the same file as --images"),
    "predictions.json over the --ann file": ("dino", lambda r, p: [str(p / "beach.png")], lambda r, p: p,
                                             {"ann": "photos/predictions.json"}, "is the same file as --ann"),
    "embeddings over a photo": ("metric", lambda r, p: [str(p)], lambda r, p: p / "sub" / "deep.jpg", {},
                                "is the same file as --images"),
    "png inputs, jpg outputs beside them": ("dino", lambda r, p: [str(p / "beach.png")], lambda r, p: p, {}, None),
}


@pytest.mark.parametrize("name", list(PREDICT))
def test_predict_never_writes_over_its_images(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    photos = _photos(tmp_path)
    task, images, out, options, refusal = PREDICT[name]
    before = {p: p.read_bytes() for p in photos.rglob("*") if p.is_file()}
    result = contract(_predict, task, images(tmp_path, photos), out(tmp_path, photos), **options, watch=[photos])
    if refusal is None:  # past the rule: it stops at the missing checkpoint instead
        assert "no-checkpoint" in result.line and "input of this command" not in result.line, result.line
    else:
        assert refusal in result.line and "even with --overwrite" in result.line, (name, result.line)
    assert {p: p.read_bytes() for p in photos.rglob("*") if p.is_file()} == before


@pytest.fixture(scope="module")
def detector(tmp_path_factory) -> dict[str, Path]:
    return debug_detector(tmp_path_factory.mktemp("inputs"), {"0.jpg": (64, 48), "1.jpg": (64, 48)})


EVAL = {
    "predictions over the annotation file": (lambda d: d["ann"], "is the same file as --val-ann"),
    "predictions over an image of the evaluation folder": (lambda d: d["val"] / "1.jpg", "lies in the folder"),
}


@pytest.mark.parametrize("name", list(EVAL))
def test_eval_never_writes_predictions_over_its_data(detector, name):
    target, refusal = EVAL[name]
    data = {"val_ann": str(detector["ann"]), "val_images": str(detector["val"])}
    out = contract(evaluate_checkpoint, detector["ckpt"], data, None, None, str(target(detector)), None, True,
                   watch=[detector["val"], detector["ckpt"]])
    assert refusal in out.line and "--save-predictions" in out.line, out.line


def _consolidate_file(root: Path, detector: dict) -> tuple[Path, Path]:
    src = root / "weights.safetensors"
    shutil.copy(detector["ckpt"] / "model.safetensors", src)
    return src, src


def _consolidate_folder(root: Path, detector: dict) -> tuple[Path, Path]:
    """A folder that is no vtrain checkpoint (as DeepSpeed's and Accelerate's are not): every file is an input."""
    src = root / "state"
    shutil.copytree(detector["ckpt"], src)
    (src / "COMPLETE").unlink()
    return src, src / "model.safetensors"


@pytest.mark.parametrize("make", [_consolidate_file, _consolidate_folder])
def test_consolidate_never_writes_over_what_it_reads(detector, tmp_path, make):
    src, out = make(tmp_path, detector)
    out = contract(consolidate, src, out, torch.float32, None, False, False, True, watch=[tmp_path])
    assert "is the same file as CKPT" in out.line or "lies in the folder CKPT" in out.line, out.line


def test_convert_never_replaces_a_folder_holding_its_source(tmp_path):
    out = tmp_path / "converted"
    convert(FIXTURES / "arcface" / "model.pt", out, "arcface-vit")
    src = next(out.rglob("model.safetensors"))  # a file of the earlier conversion, given as SRC
    result = contract(convert, src, out, "arcface-vit", None, True, watch=[out])
    assert "OUT:" in result.line and "is replaced whole, and holds SRC" in result.line, result.line
