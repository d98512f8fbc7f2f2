"""The fuzz lane for the data formats vtrain reads (docs/testing.md, "The fuzz lane"): hypothesis generates hostile
variants of a valid COCO file (fields of other types, huge and non-finite numbers, nesting 100,000 deep, deleted and
repeated entries; bytes truncated, flipped or repeated), of index folders in the data cache (meta.json edited,
arrays rewritten or corrupted), of images (every mode, depth and size, truncated and corrupted), of pairs files,
of RecordIO `.rec`/`.idx` files and of `.bin` verification packs. Each is read in this process by the reader the
CLI uses, and must meet the contract (tests/helpers/fuzz.py): success, or one `error:` line by the CLI's own error
mapping; no other exception; memory bounded by the input; the inputs unchanged. Every failure these found is fixed
and kept as a row of the table-driven tests (test_index_keys.py, test_image_shapes.py, TestFound below)."""

from __future__ import annotations

import io
import json
import pickle
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image

from tests.helpers.fuzz import contract, corrupt, dumps, mutate
from vtrain.data.coco import CocoDetection, check_resizable, load_coco
from vtrain.data.faces import FaceFolder, read_pairs
from vtrain.data.images import decode_rgb
from vtrain.data.recordio import RecordFaces, write_face_rec
from vtrain.data.verification_bin import read_bin, write_bin

pytestmark = pytest.mark.fuzz


def _jpeg(shade: int, size: tuple[int, int] = (24, 20)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (shade, 90, 255 - shade)).save(buf, "JPEG")
    return buf.getvalue()


COCO = {"images": [{"id": 1, "file_name": "0.jpg", "width": 24, "height": 20},
                   {"id": 2, "file_name": "1.jpg", "width": 24, "height": 20}],
        "annotations": [{"id": 10, "image_id": 1, "category_id": 1, "bbox": [2, 2, 10, 8], "area": 80, "iscrowd": 0,
                         "segmentation": [[2, 2, 12, 2, 12, 10]]},
                        {"id": 11, "image_id": 2, "category_id": 3, "bbox": [1, 1, 5, 5], "area": 25, "iscrowd": 0}],
        "categories": [{"id": 1, "name": "a"}, {"id": 3, "name": "b"}]}


def _coco_dir(root: Path, text: str | bytes) -> tuple[Path, Path]:
    images = root / "images"
    images.mkdir()
    for i in range(2):
        (images / f"{i}.jpg").write_bytes(_jpeg(60 * i))
    ann = root / "ann.json"
    ann.write_bytes(text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text)
    return ann, images


def _train_reader(ann: Path, images: Path) -> None:
    ds = CocoDetection(ann, images, 64, 107, train=True)
    for i in range(len(ds)):
        ds[(0, i)]


# each reader of a COCO file on its own: training's (the index, every sample) and evaluation's (pycocotools)
COCO_READERS = {"training": _train_reader, "evaluation": lambda ann, images: load_coco(ann)}


@given(st.data(), st.sampled_from(sorted(COCO_READERS)))
def test_coco_files(data, reader):
    with tempfile.TemporaryDirectory() as tmp:
        text = dumps(mutate(data, COCO))
        ann, images = _coco_dir(Path(tmp), text)
        contract(COCO_READERS[reader], ann, images, watch=[Path(tmp)], input_bytes=len(text))


@given(st.data(), st.sampled_from(sorted(COCO_READERS)))
def test_coco_bytes(data, reader):
    with tempfile.TemporaryDirectory() as tmp:
        raw = corrupt(data, json.dumps(COCO).encode())
        ann, images = _coco_dir(Path(tmp), raw)
        contract(COCO_READERS[reader], ann, images, watch=[Path(tmp)], input_bytes=len(raw))


# ---- index folders in the data cache ------------------------------------------------------------------------------

def _tree(root: Path) -> Path:
    for ident in range(3):
        (root / f"id_{ident}").mkdir(parents=True)
        for j in range(2):
            (root / f"id_{ident}" / f"{j}.jpg").write_bytes(_jpeg(40 * ident + j))
    return root


class _Quiet(dict):
    """A fixture value hypothesis prints by name only (not its bytes) in a falsifying example."""

    def __repr__(self) -> str:
        return "indexes"


@pytest.fixture(scope="module")
def indexes(tmp_path_factory) -> dict:
    """One index of each kind, built once; every example restores its files before editing them."""
    root = tmp_path_factory.mktemp("fuzz_indexes")
    faces = _tree(root / "faces")
    ann, images = _coco_dir(root, json.dumps(COCO))
    write_face_rec(root / "rec", [(_jpeg(i), i // 2) for i in range(4)], 2)
    opens = {"folders": lambda: FaceFolder(faces, 32), "coco": lambda: CocoDetection(ann, images, 64, 107, True),
             "recordio": lambda: RecordFaces(root / "rec", 32)}
    out = _Quiet()
    for kind, open_ in opens.items():
        folder = open_().index.folder if kind != "recordio" else open_().reader.index.folder
        out[kind] = (open_, folder, {p: p.read_bytes() for p in folder.iterdir()})
    return out


def _edit_array(data, folder: Path, name: str) -> None:
    meta = json.loads((folder / "meta.json").read_text())
    a = np.load(folder / f"{name}.npy")
    how = data.draw(st.sampled_from(["values", "dtype", "length", "bytes"]), label="array edit")
    if how == "bytes":
        p = folder / f"{name}.npy"
        p.write_bytes(corrupt(data, p.read_bytes()))
        return
    if how == "values" and a.size:
        flat = a.reshape(-1).copy()
        value = data.draw(st.sampled_from([-1, 2**31 - 1, 10**6, -(2**31)] + ([np.nan] if a.dtype.kind == "f" else [])))
        flat[data.draw(st.integers(0, flat.size - 1))] = np.array(value).astype(a.dtype)  # (wrapped into its dtype)
        a = flat.reshape(a.shape)
    elif how == "dtype":
        a = a.astype(data.draw(st.sampled_from([np.int64, np.int32, np.float64, np.uint8])))
    else:
        a = np.resize(a, (max(0, len(a) + data.draw(st.integers(-3, 3))), *a.shape[1:]))
    np.save(folder / f"{name}.npy", a)
    meta["arrays"][name] = {"dtype": a.dtype.str, "shape": list(a.shape),
                            "bytes": (folder / f"{name}.npy").stat().st_size}
    (folder / "meta.json").write_text(json.dumps(meta))


@given(st.data(), st.sampled_from(["folders", "coco", "recordio"]))
def test_index_folders(indexes, data, kind):
    open_, folder, files = indexes[kind]
    for p, raw in files.items():
        p.write_bytes(raw)
    try:
        if data.draw(st.booleans(), label="edit meta.json"):
            meta = json.loads(files[folder / "meta.json"])
            text = dumps(mutate(data, {"arrays": meta["arrays"], "info": meta["info"]}))
            edited = json.loads(text[:200_000]) if len(text) < 200_000 and "[[[[" not in text else None
            doc = {**meta, **edited} if isinstance(edited, dict) else None
            (folder / "meta.json").write_text(json.dumps(doc) if doc is not None else text)
        else:
            _edit_array(data, folder, data.draw(st.sampled_from(sorted(json.loads(files[folder / "meta.json"])
                                                                       ["arrays"]))))
        contract(open_, input_bytes=sum(len(b) for b in files.values()))
    finally:
        for p in folder.iterdir():
            if p not in files:
                p.unlink()
        for p, raw in files.items():
            p.write_bytes(raw)


# ---- images -------------------------------------------------------------------------------------------------------

MODES = ["RGB", "L", "P", "LA", "RGBA", "CMYK", "1", "I;16", "I", "F"]
FORMATS = ["PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF"]


def _decode(raw: bytes, cap: int) -> None:
    img = decode_rgb(raw, "image.x")
    assert img.dtype.is_floating_point is False and img.dtype.itemsize == 1 and img.ndim == 3 and img.shape[0] == 3
    check_resizable(*img.shape[-2:], cap, "image.x")


@given(st.data(), st.sampled_from(MODES), st.sampled_from(FORMATS), st.integers(1, 3000), st.integers(1, 3000))
def test_images(data, mode, fmt, w, h):
    buf = io.BytesIO()
    try:
        Image.new(mode, (w, h)).save(buf, fmt)
    except (OSError, ValueError, KeyError):  # PIL cannot write this mode in this format
        return
    raw = buf.getvalue()
    if data.draw(st.booleans(), label="corrupt"):
        raw = corrupt(data, raw)
    contract(_decode, raw, data.draw(st.sampled_from([107, 1333])), input_bytes=len(raw) + 3 * w * h)


# ---- pairs files, RecordIO, .bin packs ----------------------------------------------------------------------------

@given(st.data())
def test_pairs_files(data):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "a.jpg").write_bytes(_jpeg(1))
        (root / "b.jpg").write_bytes(_jpeg(2))
        lines = ["a.jpg b.jpg 1", "a.jpg b.jpg 0", "# comment"]
        extra = data.draw(st.lists(st.text(max_size=40) | st.sampled_from(
            ["a.jpg b.jpg 2", "a.jpg", "/etc/passwd a.jpg 1", "a.jpg\0 b.jpg 1", "x" * 10_000 + " b.jpg 0",
             "../a.jpg b.jpg 1", "a.jpg b.jpg 1 1"]), max_size=4), label="lines")
        text = "\n".join(data.draw(st.permutations(lines + extra), label="order"))
        raw = text.encode("utf-8", "surrogatepass")
        if data.draw(st.booleans(), label="corrupt"):
            raw = corrupt(data, raw)
        (root / "pairs.txt").write_bytes(raw)
        contract(read_pairs, root / "pairs.txt", watch=[root], input_bytes=len(raw))


def _read_rec(root: Path) -> None:
    ds = RecordFaces(root, 32)
    for i in range(len(ds)):
        ds[(0, i)]


@pytest.fixture(scope="module")
def rec_files(tmp_path_factory) -> dict[str, bytes]:
    root = tmp_path_factory.mktemp("fuzz_rec")
    write_face_rec(root, [(_jpeg(9 * i), i // 2) for i in range(6)], 3)
    return _Quiet({name: (root / name).read_bytes() for name in ("train.rec", "train.idx", "property")})


@given(st.data())
def test_recordio_records_and_idx(rec_files, data):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name, raw in rec_files.items():
            (root / name).write_bytes(raw)
        which = data.draw(st.sampled_from(sorted(rec_files)), label="file")
        if which == "train.idx" and data.draw(st.booleans(), label="edit lines"):
            lines = rec_files[which].decode().splitlines()
            i = data.draw(st.integers(0, len(lines) - 1))
            lines[i] = data.draw(st.sampled_from(["0\t-8", "3\t99999999999", "x\ty", "7", "", "1\t0\t5",
                                                  f"{2**64}\t0", "2\t1"]) | st.text(max_size=20), label="line")
            (root / which).write_text("\n".join(lines) + "\n", errors="surrogatepass")
        else:
            (root / which).write_bytes(corrupt(data, rec_files[which]))
        contract(_read_rec, root, watch=[root], input_bytes=sum(len(b) for b in rec_files.values()))


@given(st.data())
def test_bin_packs(data):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        images = [_jpeg(i) for i in range(20)]
        protocol = data.draw(st.sampled_from([2, 4, 5]), label="protocol")
        write_bin(root / "lfw.bin", images, [i % 2 == 0 for i in range(10)], protocol=protocol)
        raw = corrupt(data, (root / "lfw.bin").read_bytes())
        if data.draw(st.booleans(), label="edit the object"):
            obj = data.draw(st.sampled_from([(images, "x"), ([1, 2], [True]), (images, [2] * 10), ([images], []),
                                             {"a": 1}, (images[:3], [True, False]), None]), label="object")
            raw = pickle.dumps(obj, protocol=protocol)
        (root / "lfw.bin").write_bytes(raw)
        contract(read_bin, root / "lfw.bin", watch=[root], input_bytes=len(raw))


# ---- what the lane found, kept as table rows ----------------------------------------------------------------------

def _pairs_not_utf8(root: Path) -> tuple:
    (root / "caf\xe9.jpg".encode("latin-1").decode("utf-8", "surrogateescape")).write_bytes(_jpeg(3))
    (root / "b.jpg").write_bytes(_jpeg(4))
    (root / "pairs.txt").write_bytes(b"caf\xe9.jpg b.jpg 1\ncaf\xe9.jpg b.jpg 0\n")  # a Latin-1 file name
    return read_pairs, root / "pairs.txt"


def _pairs_nul(root: Path) -> tuple:
    (root / "pairs.txt").write_bytes(b"a\0.jpg b.jpg 1\n")
    return read_pairs, root / "pairs.txt"


def _pack_with_a_length_of_4_gb(root: Path) -> tuple:
    """A valid pack whose first 15 bytes are repeated: a BINBYTES opcode then reads 4 of them as its length,
    4,053,075,072 bytes, which the C unpickler allocated before reading (3.8 GiB for a 13 KB file)."""
    raw = pickle.dumps(([_jpeg(i) for i in range(20)], [i % 2 == 0 for i in range(10)]), protocol=4)
    (root / "lfw.bin").write_bytes(raw[:15] * 2 + raw)
    return read_bin, root / "lfw.bin"


def _npy_header(root: Path, header: bytes) -> tuple:
    """An identity-folder index whose labels.npy has a damaged header, opened again."""
    tree = _tree(root / "faces")
    labels = FaceFolder(tree, 32).index.folder / "labels.npy"
    raw = labels.read_bytes()
    labels.write_bytes(raw[:10] + header + raw[10 + len(header):])
    return FaceFolder, tree, 32


FOUND = {  # name -> (the call, its refusal or None for success)
    "an index array whose .npy header holds NUL (numpy's parser: TokenError)":
        (lambda root: _npy_header(root, b"\0\0"), "not a readable .npy file"),
    "an index array whose .npy header opens brackets it never closes (TokenError)":
        (lambda root: _npy_header(root, b"{'descr': (("), "not a readable .npy file"),
    "a .bin pack declaring a 4 GB string (3.8 GiB allocated)": (_pack_with_a_length_of_4_gb,
                                                                "expected 4053075072 bytes"),
    "a pairs file that is not UTF-8 (UnicodeDecodeError)": (_pairs_not_utf8, None),
    "a pairs file naming a path with NUL": (_pairs_nul, "image not found"),
}


@pytest.mark.parametrize("name", list(FOUND))
def test_found(tmp_path, name):
    make, refusal = FOUND[name]
    fn, *args = make(tmp_path)
    out = contract(fn, *args, watch=[tmp_path])
    assert (out.code == 0) if refusal is None else (refusal in out.line), (name, out.line)
