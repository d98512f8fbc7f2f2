"""COCO detection data on the shared index (data/coco_index.py): the same training targets, report and groups as
the reader before it (a reference implementation over pycocotools, below), on a file with polygons, crowd RLE,
images without boxes, boxes to clip and drop, annotations of unknown images, and an annotation list cut into many
chunks; the index reused while the file is unchanged and rebuilt when it changes; refused in one line when
damaged; one valid index from two concurrent builders; the data set pickles to a path."""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import pickle
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers.paths import HELPERS
from vtrain.data import coco_index
from vtrain.data.coco import CocoDetection, load_coco
from vtrain.data.index import Index
from vtrain.data.workers import worker_context
from vtrain.errors import VtrainError


def _jpeg(path: Path, w: int, h: int) -> None:
    from PIL import Image

    Image.fromarray(np.random.default_rng(w * h).integers(0, 255, (h, w, 3), dtype=np.uint8)).save(path)


def coco_set(root: Path, nan: bool = False, seed: int = 0) -> tuple[Path, Path]:
    """ann.json + images/: 30 images (ids unsorted, landscape and portrait, 5 without annotations, one file name
    holding `}, {`), ~150 annotations with polygons, crowd RLE, boxes outside the image or under 1 px, and 6 of
    image ids not listed; categories with gaps, one without a name."""
    rng = np.random.default_rng(seed)
    images_dir = root / "images"
    images_dir.mkdir(parents=True, exist_ok=True)
    sizes = [(64, 48), (48, 64), (40, 40)]
    for w, h in sizes:
        _jpeg(images_dir / f"pool_{w}x{h}.jpg", w, h)
    ids = rng.permutation(np.arange(1000, 1000 + 60, 2))[:30].tolist()
    images = []
    for k, i in enumerate(ids):
        w, h = sizes[k % 3]
        name = f"{i:012d}.jpg" if k != 7 else "odd}, {name.jpg"
        if not (images_dir / name).exists():
            os.link(images_dir / f"pool_{w}x{h}.jpg", images_dir / name)
        images.append({"id": i, "file_name": name, "width": w, "height": h, "license": 1})
    cats = [{"id": 3, "name": "a"}, {"id": 1, "name": "b"}, {"id": 17}, {"id": 9, "name": "}, {"}]
    anns = []
    for j in range(150):
        im = images[int(rng.integers(0, 25))] if j % 25 else {"id": 5000 + j, "width": 50, "height": 50}
        x, y = (float(v) for v in rng.uniform(-10, 50, 2).round(2))
        bw, bh = (float(v) for v in rng.choice([0.5, 3.0, 12.25, 40.0, 80.0], 2))
        a = {"id": 10 * j + 7, "image_id": im["id"], "category_id": [3, 1, 17, 9][j % 4], "bbox": [x, y, bw, bh],
             "area": bw * bh, "iscrowd": 0,
             "segmentation": [[round(float(v), 2) for v in rng.uniform(0, 40, 2 * int(rng.integers(3, 9)))]],
             "note": "}, {", "parts": [{"a": 1}, {"b": 2}]}  # where a cut between two annotations is not
        if j % 11 == 3:
            a["iscrowd"] = 1
            a["segmentation"] = {"counts": rng.integers(0, 30, 12).tolist(), "size": [im["height"], im["width"]]}
        if j % 13 == 5:
            del a["area"]  # filled in for COCOeval, unused in training
        if nan and j == 20:
            a["bbox"][0] = math.nan  # json writes the NaN token: msgspec does not take it, the reference path does
        anns.append(a)
    rng.shuffle(anns)
    path = root / "ann.json"
    path.write_text(json.dumps({"info": {"year": 2017}, "images": images, "annotations": anns, "categories": cats}))
    return path, images_dir


def reference(path: Path) -> dict:
    """The reader before the index (pycocotools, one annotation at a time), as it computed its targets."""
    coco = load_coco(path)
    ids = sorted(coco.imgs)
    cat_ids = sorted(coco.getCatIds())
    to_label = {c: i for i, c in enumerate(cat_ids)}
    r: Counter = Counter()
    targets = []
    for image_id in ids:
        info = coco.imgs[image_id]
        w, h = info["width"], info["height"]
        r["images"] += 1
        boxes, labels = [], []
        for a in coco.imgToAnns.get(image_id, []):
            if a.get("iscrowd", 0):
                r["crowd"] += 1
                continue
            x, y, bw, bh = (float(v) for v in a["bbox"])
            if not all(map(math.isfinite, (x, y, bw, bh))):
                r["dropped_nonfinite"] += 1
                continue
            x0, y0, x1, y1 = max(x, 0.0), max(y, 0.0), min(x + bw, w), min(y + bh, h)
            if (x0, y0, x1, y1) != (x, y, x + bw, y + bh):
                r["clipped"] += 1
            if x1 - x0 < 1.0 or y1 - y0 < 1.0:
                r["dropped_empty"] += 1
                continue
            boxes.append([x0, y0, x1, y1])
            labels.append(to_label[a["category_id"]])
        r["boxes"] += len(boxes)
        r["images_without_boxes"] += not boxes
        targets.append((np.asarray(boxes, np.float32).reshape(-1, 4), np.asarray(labels, np.int64)))
    r["unknown_image"] = sum(len(v) for k, v in coco.imgToAnns.items() if k not in coco.imgs)
    return {"ids": ids, "targets": targets, "report": {k: r[k] for k in coco_index.REPORT_KEYS},
            "groups": [int(coco.imgs[i]["width"] < coco.imgs[i]["height"]) for i in ids], "cat_ids": cat_ids,
            "names": [coco.cats[c].get("name", str(c)) for c in cat_ids]}


@pytest.fixture
def paths_taken(monkeypatch) -> list[str]:
    """Which path read each file (fast / reference) and how many chunks the fast path decoded."""
    taken: list[str] = []
    fast, chunks = coco_index._fast, coco_index._chunks

    def counting_fast(buf):
        try:
            out = fast(buf)
        except coco_index._Refused:
            taken.append("reference")
            raise
        taken.append("fast")
        return out

    def counting_chunks(raw, decoder, tries=4):
        for part in chunks(raw, decoder, tries):
            taken.append("chunk")
            yield part

    monkeypatch.setattr(coco_index, "_fast", counting_fast)
    monkeypatch.setattr(coco_index, "_chunks", counting_chunks)
    return taken


@pytest.mark.parametrize("case", ["one chunk", "a chunk per few annotations", "NaN in a box"])
def test_same_targets_report_and_groups_as_the_reader_before(tmp_path, monkeypatch, paths_taken, case):
    if case == "a chunk per few annotations":
        monkeypatch.setattr(coco_index, "CHUNK", 300)  # cuts fall inside RLE dicts and `}, {` strings too
    ann, images = coco_set(tmp_path, nan=case == "NaN in a box")
    ds = CocoDetection(ann, images, 64, 96, train=True, seed=1)
    ref = reference(ann)
    assert paths_taken.count("fast" if case != "NaN in a box" else "reference") == 1
    if case == "a chunk per few annotations":
        assert paths_taken.count("chunk") > 20
    assert ds.ids.tolist() == ref["ids"] and ds.group_ids.tolist() == ref["groups"]
    assert ds.cat_ids == ref["cat_ids"] and ds.names == ref["names"] and ds.num_classes == 4
    assert {k: getattr(ds.report, k) for k in coco_index.REPORT_KEYS} == ref["report"]
    r = ref["report"]
    assert r["crowd"] and r["clipped"] and r["dropped_empty"] and r["unknown_image"] == 6 and r["boxes"]
    assert r["images_without_boxes"] >= 5 and r["dropped_nonfinite"] == (case == "NaN in a box")
    assert len(ds.targets) == len(ref["targets"])
    for (boxes, labels), (want_boxes, want_labels) in zip(ds.targets, ref["targets"]):
        assert np.array_equal(boxes, want_boxes) and boxes.dtype == np.float32
        assert np.array_equal(labels, want_labels) and labels.dtype == np.int64
    # pycocotools is read only when evaluation asks for it
    assert ds._coco is None and len(ds.coco.anns) == 150 and ds._coco is not None


def test_an_unknown_category_is_the_same_error_after_the_image_checks(tmp_path):
    ann, images = coco_set(tmp_path)
    d = json.loads(ann.read_text())
    first = sorted(d["images"], key=lambda im: im["id"])[2]["id"]
    mine = [a for a in d["annotations"] if a["image_id"] == first]
    mine[-1]["category_id"] = 99  # and one on an image not listed: never read, as before
    next(a for a in d["annotations"] if a["image_id"] >= 5000)["category_id"] = 98
    ann.write_text(json.dumps(d))
    with pytest.raises(VtrainError, match="image folder not found"):
        CocoDetection(ann, tmp_path / "nowhere", 64, 96, train=True)
    with pytest.raises(VtrainError) as e:
        CocoDetection(ann, images, 64, 96, train=True)
    assert str(e.value) == f"{ann}: annotation {mine[-1]['id']} has category id 99, which is not in 'categories'"


def test_the_index_is_reused_while_unchanged_and_rebuilt_when_the_file_changes(tmp_path, paths_taken):
    ann, images = coco_set(tmp_path)
    a = CocoDetection(ann, images, 64, 96, train=True)
    b = CocoDetection(ann, images, 64, 96, train=False)
    assert paths_taken.count("fast") == 1 and a.index.folder == b.index.folder
    # the same size, other bytes, the mtime restored: a box moved by one digit
    st, text = ann.stat(), ann.read_text()
    d = json.loads(text)
    d["annotations"][0]["bbox"][0] = 1.5 if d["annotations"][0]["bbox"][0] != 1.5 else 2.5
    new = json.dumps(d)
    new = new if len(new) == len(text) else text.replace('"year": 2017', '"year": 2018')
    assert len(new) == len(text) and new != text
    ann.write_text(new)
    os.utime(ann, ns=(st.st_atime_ns, st.st_mtime_ns))
    c = CocoDetection(ann, images, 64, 96, train=True)
    assert paths_taken.count("fast") == 2 and c.index.folder != a.index.folder


@pytest.mark.parametrize("how", ["truncated boxes", "other kind version in meta"])
def test_a_damaged_index_is_refused_in_one_line(tmp_path, how):
    ann, images = coco_set(tmp_path)
    folder = CocoDetection(ann, images, 64, 96, train=True).index.folder
    if how == "truncated boxes":
        p = folder / "boxes.npy"
        p.write_bytes(p.read_bytes()[:-16])
    else:
        meta = json.loads((folder / "meta.json").read_text())
        meta["key"]["kind_version"] = 0
        (folder / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(VtrainError) as e:
        CocoDetection(ann, images, 64, 96, train=True)
    assert str(e.value).startswith(f"data index {folder} is damaged") and "\n" not in str(e.value)


@pytest.mark.slow
def test_two_processes_building_at_once_make_one_valid_index(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(HELPERS))  # spawned processes inherit sys.path
    from index_race import build_coco

    ann, images = coco_set(tmp_path)
    ctx = multiprocessing.get_context("spawn")
    log = str(tmp_path / "builds.log")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=build_coco, args=(str(ann), str(images), log, barrier, results)) for _ in range(2)]
    for p in procs:
        p.start()
    got = [results.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    ds = CocoDetection(ann, images, 64, 96, train=True)
    assert got[0] == got[1] == f"{ds.index.folder} {ds.report.boxes}"
    assert len(Path(log).read_text().split()) == 1  # one parsed the file, the other waited for its index
    folder = ds.index.folder
    assert [p.name for p in folder.parent.iterdir() if p.name.startswith(f".{folder.name}_")] == []
    assert Index(folder, json.loads((folder / "meta.json").read_text())["key"]).info["report"]["boxes"]


def test_the_data_set_pickles_to_a_path_and_workers_read_the_same_samples(tmp_path):
    small_ann, images = coco_set(tmp_path / "small")
    big_ann, big_images = coco_set(tmp_path / "big", seed=3)
    d = json.loads(big_ann.read_text())
    d["annotations"] = d["annotations"] * 1 + [{**a, "id": a["id"] + 10**6} for a in d["annotations"]] * 1
    big_ann.write_text(json.dumps(d))
    small, big = (CocoDetection(a, i, 64, 96, train=True, seed=2) for a, i in ((small_ann, images),
                                                                               (big_ann, big_images)))
    big.coco  # noqa: B018 (pycocotools' object, read for evaluation, does not travel to workers)
    sizes = [len(pickle.dumps(ds)) for ds in (small, big)]
    assert max(sizes) < 8192 and abs(sizes[1] - sizes[0]) < 200 and b"segmentation" not in pickle.dumps(big)
    order = [(1, i) for i in range(0, len(big), 3)]
    loader = torch.utils.data.DataLoader(big, batch_size=1, sampler=order, num_workers=2,
                                         multiprocessing_context=worker_context(2))
    for (epoch, i), got in zip(order, loader):
        want = big[(epoch, i)]
        assert torch.equal(got["boxes"][0], want["boxes"]) and torch.equal(got["images"][0], want["images"])
        assert int(got["image_id"]) == int(big.ids[i])


def test_missing_image_files_are_found_as_a_stat_per_file_finds_them(tmp_path):
    from vtrain.data.coco import missing_files
    from vtrain.data.index import open_index

    root = tmp_path / "images"
    (root / "sub" / "deeper").mkdir(parents=True)
    (root / "adir").mkdir()
    for name in ("a.jpg", "sub/b.jpg", "sub/deeper/c.jpg", "t\u00e9.jpg"):
        (root / name).write_bytes(b"x")
    os.symlink(root / "a.jpg", root / "sub" / "link.jpg")
    os.symlink(root / "nowhere.jpg", root / "sub" / "dangling.jpg")
    os.symlink(root / "adir", root / "dirlink")
    names = ["a.jpg", "sub/b.jpg", "sub//b.jpg", "./a.jpg", "sub/deeper/c.jpg", "sub/link.jpg", "sub/dangling.jpg",
             "dirlink", "adir", "a.jpg/", "sub/..", "nope/x.jpg", "sub/none.jpg", "t\u00e9.jpg", str(root / "a.jpg"),
             "te\u0301.jpg"]
    index = open_index("names-test", 1, {"n": len(names)}, lambda w: w.strings("file_names", names))
    want = [n for n in names if not (root / n).is_file()]
    assert want == ["sub/dangling.jpg", "dirlink", "adir", "sub/..", "nope/x.jpg", "sub/none.jpg", "te\u0301.jpg"]
    assert missing_files(root, index) == (len(want), want[0])
