"""Images of any shape and depth (docs/input_limits.md §11), table-driven over every reader that decodes them: the
detection readers (training and evaluation sets, `vtrain predict`, `vtrain eval`) refuse a strip too elongated for
their resize in one line naming the file, the face readers (identity folders, `vtrain predict` of a face model)
resize it as any other; 16-bit PNGs become 8-bit values (the top byte), palette, grey + alpha, RGBA and CMYK images
come out as RGB; truncated files are one line naming the file. Each case asserts the CLI's mapping of the error
(tests/helpers/fuzz.py `contract`: one `error:` line, bounded memory, the inputs unchanged)."""

from __future__ import annotations

import io
import json
import struct
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import vtrain.eval.coco_eval  # noqa: F401  (imported here, not inside a measured call: contract counts allocations)
import vtrain.tasks.dino  # noqa: F401
from tests.helpers.checkpoints import debug_detector, debug_face_model
from tests.helpers.fuzz import contract
from vtrain.data.coco import CocoDetection
from vtrain.data.faces import FaceFolder
from vtrain.tools.evaluate import evaluate_checkpoint
from vtrain.tools.predict import predict


def _png16(w: int, h: int, rgb: tuple[int, int, int] | None, grey: int = 0) -> bytes:
    """A 16-bit PNG (colour type 2, RGB, or 0, grey) of one colour; PIL cannot write 16-bit RGB."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    pixel = struct.pack(">HHH", *rgb) if rgb else struct.pack(">H", grey)
    ihdr = struct.pack(">IIBBBBB", w, h, 16, 2 if rgb else 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress((b"\0" + pixel * w) * h))
            + chunk(b"IEND", b""))


NOISE = np.random.default_rng(0).integers(0, 255, (40, 40, 3), dtype=np.uint8)


def _png_rows(filter_byte: bytes, cut: int = 0) -> bytes:
    """An 8 x 4 RGB PNG whose chunks are all valid (CRCs, zlib) but whose rows are not: a filter byte of another
    value than 0-4, or `cut` bytes missing."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = (filter_byte + b"\x10" * 24) * 4
    rows = rows[:len(rows) - cut]
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 8, 4, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


def _pil(mode: str, fmt: str, size=(40, 30), value=None) -> bytes:
    im = Image.new(mode, size, value)
    if mode == "P":
        im.putpalette([(7 * i) % 256 for i in range(768)])
    buf = io.BytesIO()
    im.save(buf, fmt)
    return buf.getvalue()


def _noise_png() -> bytes:
    buf = io.BytesIO()
    Image.fromarray(NOISE).save(buf, "PNG")
    return buf.getvalue()


def _cut(data: bytes) -> bytes:
    return data[: len(data) // 2]


# name -> (file name, bytes, the RGB value of pixel (0, 0) or None when refused, the refusal's words)
IMAGES: dict[str, tuple[str, Callable[[], bytes], tuple[int, int, int] | str]] = {
    "1 x 100000": ("strip.png", lambda: _pil("L", "PNG", (1, 100_000), 200), "too elongated"),
    "100000 x 1": ("bar.png", lambda: _pil("L", "PNG", (100_000, 1), 200), "too elongated"),
    "16-bit RGB PNG": ("deep.png", lambda: _png16(40, 30, (65535, 40000, 256)), (255, 156, 1)),
    "16-bit grey PNG": ("grey16.png", lambda: _png16(40, 30, None, 51400), (200, 200, 200)),
    "palette PNG": ("palette.png", lambda: _pil("P", "PNG", value=3), (63, 70, 77)),
    "grey + alpha PNG": ("la.png", lambda: _pil("LA", "PNG", value=(120, 30)), (120, 120, 120)),
    "RGBA PNG": ("rgba.png", lambda: _pil("RGBA", "PNG", value=(10, 20, 30, 0)), (10, 20, 30)),
    "CMYK JPEG": ("cmyk.jpg", lambda: _pil("CMYK", "JPEG", value=(0, 0, 0, 0)), "white"),
    "truncated JPEG": ("cut.jpg", lambda: _cut(Image.fromarray(NOISE).tobytes("jpeg", "RGB")), "cannot decode"),
    "truncated PNG": ("cut.png", lambda: _cut(_noise_png()), "cannot decode"),
    # each a libpng error while the rows are read, which ended the process in torchvision's decoder (SIGSEGV)
    "PNG with a bad filter byte": ("filter.png", lambda: _png_rows(b"\x07"), "cannot decode"),
    "PNG with too little image data": ("short.png", lambda: _png_rows(b"\0", cut=5), "cannot decode"),
}
FACES_RESIZE = {"1 x 100000": (200, 200, 200), "100000 x 1": (200, 200, 200)}  # face readers: resized like any


def _expect_pixel(out, want, name: str, file: Path) -> None:
    if isinstance(want, str) and want != "white":
        assert out.code == 2 and want in out.line and file.name in out.line, (name, out.line)
        return
    assert out.code == 0, (name, out.line)
    pixel = out.value
    if want == "white":  # CMYK 0, 0, 0, 0: decoders differ by a level or two on the conversion
        assert all(v >= 250 for v in pixel), (name, pixel)
    else:
        assert tuple(pixel) == tuple(want), (name, pixel)


def _coco(root: Path, name: str, data: bytes) -> tuple[Path, Path]:
    images = root / "images"
    images.mkdir(parents=True)
    (images / name).write_bytes(data)
    ann = root / "ann.json"
    ann.write_text(json.dumps({"images": [{"id": 1, "file_name": name, "width": 40, "height": 30}],
                               "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [1, 1, 9, 9],
                                                "area": 81, "iscrowd": 0}],
                               "categories": [{"id": 1, "name": "a"}, {"id": 2, "name": "b"}]}))
    return ann, images


def _detection_pixel(ann: Path, images: Path, train: bool) -> list[int]:
    ds = CocoDetection(ann, images, 64, 107, train=train)
    img = ds.read(0)
    ds[(0, 0)]  # every check and transform of a sample
    return img[:, 0, 0].tolist()


@pytest.mark.parametrize("train", [True, False], ids=["training set", "evaluation set"])
@pytest.mark.parametrize("name", list(IMAGES))
def test_detection_sets_read_or_refuse_every_image(tmp_path, name, train):
    file, data, want = IMAGES[name]
    ann, images = _coco(tmp_path, file, data())
    out = contract(_detection_pixel, ann, images, train, watch=[images])
    _expect_pixel(out, want, name, images / file)


def _face_pixel(root: Path) -> list[int]:
    ds = FaceFolder(root, 32, train=False)
    raw = ds._read(1)[0]
    ds[(0, 1)]
    return raw[:, 0, 0].tolist()


@pytest.mark.parametrize("name", list(IMAGES))
def test_identity_folders_read_or_refuse_every_image(tmp_path, name):
    file, data, want = IMAGES[name]
    root = tmp_path / "faces"
    for ident in ("a", "b"):
        (root / ident).mkdir(parents=True)
        (root / ident / "0.jpg").write_bytes(_pil("RGB", "JPEG", value=(9, 9, 9)))
    (root / "a" / f"1_{file}").write_bytes(data())  # image 1 in name order
    out = contract(_face_pixel, root, watch=[root])
    _expect_pixel(out, FACES_RESIZE.get(name, want), name, root / "a" / f"1_{file}")


COMMAND_CASES = ["1 x 100000", "16-bit RGB PNG", "CMYK JPEG", "truncated PNG"]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("shapes")
    return {"dino": debug_detector(root / "det", {"0.jpg": (64, 48)})["ckpt"], "metric": debug_face_model(root)}


def _drawn_pixel(out: Path, file: str) -> list[int]:
    from torchvision.io import decode_image

    assert json.loads((out / "predictions.json").read_text()) is not None
    return decode_image(str(out / Path(file).with_suffix(".jpg")))[:, 0, 0].tolist()


@pytest.mark.integration
@pytest.mark.parametrize("task", ["dino", "metric"])
@pytest.mark.parametrize("name", COMMAND_CASES)
def test_predict_reads_or_refuses_every_image(models, tmp_path, name, task):
    file, data, want = IMAGES[name]
    photos = tmp_path / "photos"
    photos.mkdir()
    (photos / file).write_bytes(data())
    out = tmp_path / ("drawn" if task == "dino" else "emb.safetensors")
    result = contract(predict, models[task], [str(photos)], out, None, num_workers=0, watch=[photos])
    if task == "metric" and name in FACES_RESIZE:
        want = FACES_RESIZE[name]
    if isinstance(want, str) and want != "white":
        assert result.code == 2 and want in result.line and file in result.line, (name, result.line)
        return
    assert result.code == 0, (name, result.line)
    if task == "dino":  # drawn (uint8) and written; the JPEG of a flat image keeps its colour within a few levels
        pixel = _drawn_pixel(out, file)
        assert want == "white" and min(pixel) >= 245 or np.abs(np.subtract(pixel, want)).max() <= 4, (name, pixel)
    else:
        from safetensors.torch import load_file

        assert torch.isfinite(load_file(str(out))["embeddings"]).all()


@pytest.mark.integration
@pytest.mark.parametrize("name", ["1 x 100000", "16-bit RGB PNG", "truncated JPEG"])
def test_eval_reads_or_refuses_every_image(models, tmp_path, name):
    file, data, want = IMAGES[name]
    ann, images = _coco(tmp_path, file, data())
    out = contract(evaluate_checkpoint, models["dino"], {"val_ann": str(ann), "val_images": str(images)},
                   watch=[images])
    if isinstance(want, str):
        assert out.code == 2 and want in out.line and file in out.line, (name, out.line)
    else:
        assert out.code == 0 and "AP" in out.value[1], out.value


@pytest.mark.parametrize("size", [(1, 1), (1, 3), (3, 1), (40, 30)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("mode", ["RGB", "L", "P"])
def test_a_decoded_png_is_a_writable_tensor_without_a_warning(size, mode):
    """PIL's array is read-only; a 1 x 1 RGB PNG was handed to torch without a copy, which warned (on the console of
    a user's run) and gave a tensor that must not be written."""
    import warnings

    from vtrain.data.images import decode_rgb

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        img = decode_rgb(_pil(mode, "PNG", size, 7), "x.png")
    assert img.shape == (3, size[1], size[0]) and img.dtype == torch.uint8
    img[:, 0, 0] = 1  # writable: its own memory
