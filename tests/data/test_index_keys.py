"""A cached data index is never used for data it was not built from, and a damaged one is one line (docs/data_index.md
§1): table-driven edits of a COCO file and of an identity tree that keep sizes and put mtimes back (what `touch -r`,
`rsync -t` and a restored backup do) each give a new index with the new content; an identity tree 1,100 levels deep
is walked; and damaged index folders of every kind (labels out of range, meta.json fields of the wrong type or
nested 100,000 deep, arrays of another dtype, shape or length, offsets going back) are refused in one `error:` line
naming the folder, with memory bounded and the sources unchanged (tests/helpers/fuzz.py `contract`)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.fuzz import contract
from vtrain.data import index as index_module
from vtrain.data.coco import CocoDetection
from vtrain.data.faces import FaceFolder
from vtrain.data.recordio import RecordReader, RecordWriter


def _jpeg(path: Path, shade: int, size: int = 24) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (size, size), (shade, 80, 255 - shade)).save(path, "JPEG")


def _coco(root: Path, pad: int = 0) -> tuple[Path, Path]:
    """ann.json (categories 1, 2, 3; each image one box of category 1 or 2) + images/; `pad` bytes of filler in the
    middle (an `info` string between images and annotations) to make a large file."""
    images = root / "images"
    for i in range(4):
        _jpeg(images / f"{i}.jpg", 40 * i)
    data = {"images": [{"id": i + 1, "file_name": f"{i}.jpg", "width": 24, "height": 24} for i in range(4)],
            "info": {"filler": "x" * pad},
            "annotations": [{"id": 10 + i, "image_id": i + 1, "category_id": 1 + i % 2, "bbox": [2, 2, 12, 12],
                             "area": 144, "iscrowd": 0} for i in range(4)],
            "categories": [{"id": 1, "name": "one"}, {"id": 2, "name": "two"}, {"id": 3, "name": "six"}]}
    ann = root / "ann.json"
    ann.write_text(json.dumps(data))
    return ann, images


def _labels(ann: Path, images: Path) -> list[int]:
    ds = CocoDetection(ann, images, 64, 96, train=True)
    return [int(ds.targets[i][1][0]) for i in range(len(ds))]


def _put_back_mtime(path: Path, edit: Callable[[], None]) -> None:
    st = path.stat()
    edit()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _same_size_category_edit(ann: Path) -> None:
    text = ann.read_text()
    new = text.replace('"image_id": 1, "category_id": 1', '"image_id": 1, "category_id": 3')
    assert len(new) == len(text) and new != text
    ann.write_text(new)


def _edit_in_place(ann: Path) -> None:
    _put_back_mtime(ann, lambda: _same_size_category_edit(ann))


def _replace_like_rsync(ann: Path) -> None:
    """rsync -t: a new file written beside it, given the old mtime, renamed over it (a new inode)."""
    st, tmp = ann.stat(), ann.with_name(".ann.json.tmp")
    shutil.copy(ann, tmp)
    _same_size_category_edit(tmp)
    os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(tmp, ann)


@pytest.mark.parametrize(("name", "pad", "edit"), [
    ("a small file edited in place, size and mtime kept", 0, _edit_in_place),
    ("the middle of a 5 MiB file edited in place, size and mtime kept", 5 << 20, _edit_in_place),
    ("replaced by a copy with the old mtime (rsync -t)", 0, _replace_like_rsync),
])
def test_a_coco_file_changed_behind_its_mtime_gets_a_new_index(tmp_path, monkeypatch, name, pad, edit):
    # the 5 MiB file is above the whole-file digest here (as COCO 2017's 448 MiB is above the default): its middle
    # is neither hashed at head nor tail, so only ctime can tell
    monkeypatch.setattr(index_module, "FULL_DIGEST", 1 << 20)
    ann, images = _coco(tmp_path, pad)
    assert _labels(ann, images) == [0, 1, 0, 1]
    edit(ann)
    assert _labels(ann, images) == [2, 1, 0, 1], name  # category 3 is label 2: the file's new content


def _tree(root: Path) -> Path:
    for ident in range(3):
        for j in range(2):
            _jpeg(root / f"id_{ident}" / f"{j}.jpg", 30 * ident + 10 * j)
    _jpeg(root / "id_1" / "deep" / "er" / "x.jpg", 7)
    (root / "id_2" / "empty.jpg").write_bytes(b"")
    return root


def _restore_times(root: Path, edit: Callable[[], None]) -> None:
    """Run `edit` with every folder's and file's mtime put back afterwards (what a restored backup looks like)."""
    times = {p: p.stat() for p in [root, *root.rglob("*")]}
    edit()
    for p, st in times.items():
        if p.exists():
            os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))


TREE_EDITS = {
    "an empty image filled": lambda r: shutil.copy(r / "id_0" / "0.jpg", r / "id_2" / "empty.jpg"),
    "an image added three levels down": lambda r: shutil.copy(r / "id_0" / "0.jpg", r / "id_1" / "deep" / "er" / "y.jpg"),
    "an image moved to another identity, deep": lambda r: os.rename(r / "id_1" / "deep" / "er" / "x.jpg",
                                                                    r / "id_0" / "x.jpg"),
    "an image rewritten in place, same size": lambda r: (r / "id_0" / "1.jpg").write_bytes(
        (r / "id_2" / "1.jpg").read_bytes()[:(r / "id_0" / "1.jpg").stat().st_size].ljust(
            (r / "id_0" / "1.jpg").stat().st_size, b"\0")),
}


@pytest.mark.parametrize("name", list(TREE_EDITS))
def test_an_identity_tree_changed_behind_its_mtimes_gets_a_new_index(tmp_path, name):
    root = _tree(tmp_path / "tree")
    before = FaceFolder(root, 32, skip_bad=True)
    assert FaceFolder(root, 32, skip_bad=True).index.folder == before.index.folder  # unchanged: reused
    _restore_times(root, lambda: TREE_EDITS[name](root))
    after = FaceFolder(root, 32, skip_bad=True)
    assert after.index.folder != before.index.folder, name
    walked = sorted((str(p.relative_to(root)), int(p.parts[len(root.parts)][3:])) for p in root.rglob("*.jpg")
                    if p.stat().st_size)
    assert sorted((str(Path(p).relative_to(root)), label) for p, label in after.samples) == walked
    assert after.empty_files == [str(p) for p in sorted(root.rglob("*.jpg")) if not p.stat().st_size]


def _remove_deep(top: Path) -> None:
    """Delete a tree of any depth and path length, deepest first, through folder descriptors (shutil.rmtree, and
    pytest's clean-up of old temp folders with it, recurses once per level)."""
    if not top.exists():
        return
    stack = [(os.open(top, os.O_RDONLY), None)]  # (descriptor of a folder, its name in the folder above)
    while stack:
        fd, _ = stack[-1]
        sub = None
        for e in os.scandir(fd):
            if e.is_dir(follow_symlinks=False):
                sub = e.name
                break
            os.unlink(e.name, dir_fd=fd)
        if sub is not None:
            stack.append((os.open(sub, os.O_RDONLY, dir_fd=fd), sub))
            continue
        os.close(fd)
        stack.pop()
        if stack:
            os.rmdir(_, dir_fd=stack[-1][0])
    os.rmdir(top)


@pytest.fixture
def deep_root(tmp_path):
    root = tmp_path / "tree"
    yield root
    _remove_deep(root)


def test_an_identity_tree_1100_levels_deep_is_walked(deep_root):
    root = deep_root
    _jpeg(root / "a" / "0.jpg", 10)
    deep = root / "b"
    deep.mkdir()
    for _ in range(1100):  # (Path.mkdir(parents=True) and os.makedirs recurse once per level themselves)
        deep = deep / "d"
        deep.mkdir()
    _jpeg(deep / "1.jpg", 90)
    out = contract(FaceFolder, root, 32, watch=[root])
    assert out.code == 0 and len(out.value) == 2 and out.value.samples[1] == (str(deep / "1.jpg"), 1)


def test_a_tree_deeper_than_the_system_allows_is_one_line(deep_root):
    root = deep_root
    _jpeg(root / "a" / "0.jpg", 10)
    d = root / "b"
    d.mkdir()
    fd = os.open(d, os.O_RDONLY)
    try:  # 40 levels of 200-character names: 8,000 characters, beyond PATH_MAX (4,096), made one level at a time
        for _ in range(40):
            os.mkdir("n" * 200, dir_fd=fd)
            nxt = os.open("n" * 200, os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = nxt
    finally:
        os.close(fd)
    contract(FaceFolder, root, 32, watch=[root / "a"], must="--data: cannot read")


# ---- damaged index folders -------------------------------------------------------------------------------------

def _meta(folder: Path) -> dict:
    return json.loads((folder / "meta.json").read_text())


def _set_meta(folder: Path, meta: dict) -> None:
    (folder / "meta.json").write_text(json.dumps(meta))


def _array(folder: Path, name: str, values: np.ndarray) -> None:
    """Replace an array and record it in meta.json as written, so only the kind's own checks can tell."""
    np.save(folder / f"{name}.npy", values)
    meta = _meta(folder)
    a = np.load(folder / f"{name}.npy", mmap_mode="r")
    meta["arrays"][name] = {"dtype": a.dtype.str, "shape": list(a.shape), "bytes": (folder / f"{name}.npy").stat().st_size}
    _set_meta(folder, meta)


def _info(folder: Path, **values) -> None:
    meta = _meta(folder)
    meta["info"].update(values)
    _set_meta(folder, meta)


def _nested_meta(folder: Path) -> None:
    (folder / "meta.json").write_text('{"format": "vtrain-index", "info": ' + "[" * 100_000 + "]" * 100_000 + "}")


def _load(folder: Path, name: str) -> np.ndarray:
    return np.array(np.load(folder / f"{name}.npy"))


DAMAGE = {
    "folders": {
        "labels out of range": (lambda f: _array(f, "labels", _load(f, "labels") + 40), "labels["),
        "labels of another dtype": (lambda f: _array(f, "labels", _load(f, "labels").astype(np.int64)), "labels holds"),
        "labels of another length": (lambda f: _array(f, "labels", _load(f, "labels")[:-1]), "labels holds"),
        "info.classes a string": (lambda f: _info(f, classes="3"), "info.classes"),
        "info.images negative": (lambda f: _info(f, images=-1), "info.images"),
        "info.empty a bool": (lambda f: _info(f, empty=True), "info.empty"),
        "meta.json nested 100,000 deep": (_nested_meta, "meta.json"),
        "path offsets going back": (lambda f: _array(f, "paths.offsets", _load(f, "paths.offsets")[::-1].copy()),
                                    "string column paths"),
        "an array missing": (lambda f: _set_meta(f, {**_meta(f), "arrays": {k: v for k, v in _meta(f)["arrays"].items()
                                                                             if k != "labels"}}), "no array labels"),
        "shape of floats in meta.json": (lambda f: _set_meta(f, {**_meta(f), "arrays": {
            k: {**v, "shape": [float(x) for x in v["shape"]]} for k, v in _meta(f)["arrays"].items()}}),
            "array list is malformed"),
    },
    "coco": {
        "labels out of range": (lambda f: _array(f, "labels", _load(f, "labels") + 3), "labels["),
        "box starts beyond the boxes": (lambda f: _array(f, "box_start", _load(f, "box_start") + 1), "box_start"),
        "a width of 0": (lambda f: _array(f, "width", np.zeros_like(_load(f, "width"))), "width["),
        "a NaN box": (lambda f: _array(f, "boxes", np.full_like(_load(f, "boxes"), np.nan)), "boxes["),
        "category ids unsorted": (lambda f: _array(f, "cat_ids", _load(f, "cat_ids")[::-1].copy()), "not sorted"),
        "report with a string count": (lambda f: _info(f, report={**_meta(f)["info"]["report"], "boxes": "4"}),
                                       "info.report"),
        "unknown_category a list": (lambda f: _info(f, unknown_category=["x"]), "info.unknown_category"),
        "boxes of 3 columns": (lambda f: _array(f, "boxes", _load(f, "boxes")[:, :3].copy()), "boxes holds"),
    },
    "recordio": {
        "an offset beyond the .rec": (lambda f: _array(f, "offsets", _load(f, "offsets") + 10**6), "offsets["),
        "key_start a string": (lambda f: _info(f, key_start="0"), "info.key_start"),
        "lines a float": (lambda f: _info(f, lines=4.0), "info.lines"),
        "key_start beyond int64": (lambda f: _info(f, key_start=2**63 - 2), "beyond int64"),
    },
}


def _open(kind: str, src: Path):
    if kind == "folders":
        return FaceFolder(src, 32, skip_bad=True)
    if kind == "coco":
        return CocoDetection(src / "ann.json", src / "images", 64, 96, train=True)
    return RecordReader(src / "train.rec", src / "train.idx")


def _source(kind: str, root: Path) -> Path:
    if kind == "folders":
        return _tree(root)
    if kind == "coco":
        _coco(root)
        return root
    root.mkdir()
    with RecordWriter(root / "train.rec", root / "train.idx") as w:
        for k in range(4):
            w.write(k, b"payload %d" % k)
    return root


@pytest.mark.parametrize(("kind", "name"), [(k, n) for k, cases in DAMAGE.items() for n in cases])
def test_a_damaged_index_is_one_line_naming_its_folder(tmp_path, kind, name):
    src = _source(kind, tmp_path / "src")
    folder = _open(kind, src).index.folder
    damage, expected = DAMAGE[kind][name]
    damage(folder)
    size = sum(p.stat().st_size for p in folder.iterdir())
    out = contract(_open, kind, src, watch=[src], input_bytes=size, must=f"data index {folder} is damaged")
    assert expected in out.line and "delete that folder" in out.line, (name, out.line)
    shutil.rmtree(folder)  # as the message says: the next open rebuilds it
    assert _open(kind, src).index.folder == folder
