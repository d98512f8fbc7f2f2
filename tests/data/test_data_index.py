"""The memory-mapped dataset index (data/index.py) and the sets built on it: reused while the source is unchanged,
rebuilt when it changes (same size, other bytes too), refused in one line when damaged or from another format, one
valid index from concurrent builders; data sets pickle to a path and reopen in a worker."""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers.paths import HELPERS
from vtrain.data.faces import FaceFolder
from vtrain.data.index import Index, file_identity, open_index
from vtrain.data.recordio import RecordFaces, RecordReader, RecordWriter, write_face_rec
from vtrain.data.workers import worker_context
from vtrain.errors import VtrainError


def _writes(calls: list[int]):
    def build(w) -> None:
        calls.append(1)
        w.array("values", np.arange(10, dtype=np.int64) * 3)
        w.strings("names", ["a", "b\u00e9", "", "x" * 300])
        w.info["n"] = 10
    return build


def _source(tmp_path: Path, data: bytes = b"source bytes") -> dict:
    src = tmp_path / "src.txt"
    if not src.exists():
        src.write_bytes(data)
    return {"file": file_identity(src)}


def test_built_once_then_reused_with_its_arrays_and_strings(tmp_path):
    calls: list[int] = []
    a = open_index("test", 1, _source(tmp_path), _writes(calls))
    b = open_index("test", 1, _source(tmp_path), _writes(calls))
    assert calls == [1] and a.folder == b.folder
    assert b.array("values").tolist() == list(range(0, 30, 3)) and not b.array("values").flags.writeable
    assert list(b.strings("names")) == ["a", "b\u00e9", "", "x" * 300] and b.info == {"n": 10}
    # the kind's version is part of the key: a new layout is a new folder, an old one is never misread
    c = open_index("test", 2, _source(tmp_path), _writes(calls))
    assert calls == [1, 1] and c.folder != a.folder


@pytest.mark.parametrize("edit", ["same size, other bytes, same mtime", "appended", "touched"])
def test_an_edited_source_gets_a_new_index(tmp_path, edit):
    src = tmp_path / "src.txt"
    src.write_bytes(b"0123456789" * 10)
    before = file_identity(src)
    st = src.stat()
    if edit == "appended":
        src.write_bytes(src.read_bytes() + b"!")
    elif edit == "touched":
        os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    else:
        src.write_bytes(b"0123456780" * 10)
        os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert src.stat().st_size == st.st_size and src.stat().st_mtime_ns == st.st_mtime_ns
    calls: list[int] = []
    a = open_index("test", 1, {"file": before}, _writes(calls))
    b = open_index("test", 1, {"file": file_identity(src)}, _writes(calls))
    assert calls == [1, 1] and a.folder != b.folder


def _damage(folder: Path, how: str) -> None:
    meta = json.loads((folder / "meta.json").read_text())
    if how == "truncated array":
        p = folder / "values.npy"
        p.write_bytes(p.read_bytes()[:-8])
    elif how == "array of another shape":
        np.save(folder / "values.npy", np.arange(11, dtype=np.int64))
    elif how == "array of another dtype":
        np.save(folder / "values.npy", np.arange(10, dtype=np.int32))
    elif how == "not an npy file":
        (folder / "values.npy").write_bytes(b"garbage" * 20)
    elif how == "missing array":
        (folder / "names.blob.npy").unlink()
    elif how == "other container version":
        (folder / "meta.json").write_text(json.dumps({**meta, "version": 99}))
    elif how == "meta of another source":
        meta["key"]["source"] = {"file": "elsewhere"}
        (folder / "meta.json").write_text(json.dumps(meta))
    elif how == "meta not json":
        (folder / "meta.json").write_text("{")


@pytest.mark.parametrize("how", ["truncated array", "array of another shape", "array of another dtype",
                                 "not an npy file", "missing array", "other container version",
                                 "meta of another source", "meta not json"])
def test_a_damaged_index_is_refused_in_one_line_naming_its_folder(tmp_path, how):
    calls: list[int] = []
    good = open_index("test", 1, _source(tmp_path), _writes(calls))
    _damage(good.folder, how)
    with pytest.raises(VtrainError) as e:
        open_index("test", 1, _source(tmp_path), _writes(calls))
    msg = str(e.value)
    assert calls == [1] and "\n" not in msg
    assert msg.startswith(f"data index {good.folder} is damaged") and "delete that folder" in msg
    shutil.rmtree(good.folder)  # as the message says: the next open rebuilds it
    assert open_index("test", 1, _source(tmp_path), _writes(calls)).array("values")[3] == 9 and calls == [1, 1]


@pytest.mark.integration
def test_two_processes_building_at_once_make_one_valid_index(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(HELPERS))  # spawned processes inherit sys.path
    from index_race import build_or_wait

    ctx = multiprocessing.get_context("spawn")
    source, log = _source(tmp_path), str(tmp_path / "builds.log")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=build_or_wait, args=(source, log, barrier, results)) for _ in range(2)]
    for p in procs:
        p.start()
    got = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert got[0] == got[1] and got[0].endswith(" 499500")
    assert len(Path(log).read_text().split()) == 1  # one built, the other waited for it
    folder = Path(got[0].split()[0])
    leftovers = [p.name for p in folder.parent.iterdir() if p.name.startswith(f".{folder.name}_")]
    assert leftovers == [] and Index(folder, json.loads((folder / "meta.json").read_text())["key"])


# ---- the data sets on it --------------------------------------------------------------------------------------------

def _rec(faces: Path, out: Path, images: int) -> Path:
    ff = FaceFolder(faces / "train", 112, train=False)
    samples = [(Path(p).read_bytes(), label) for p, label in list(ff.samples)[:images]]
    return write_face_rec(out, samples, ff.num_classes)


def test_recordio_set_pickles_to_a_path_and_reopens_in_forkserver_workers(faces, tmp_path):
    small = RecordFaces(_rec(faces, tmp_path / "small", 12), 112, train=True, seed=2)
    big = RecordFaces(_rec(faces, tmp_path / "big", 96), 112, train=True, seed=2)
    sizes = [len(pickle.dumps(ds)) for ds in (small, big)]
    assert max(sizes) < 4096 and abs(sizes[1] - sizes[0]) < 100  # nothing in the pickle grows with the set
    copy = pickle.loads(pickle.dumps(big))
    assert torch.equal(copy[(1, 40)]["images"], big[(1, 40)]["images"])
    order = [(0, i) for i in np.random.default_rng(0).permutation(len(big))[:8].tolist()]
    loader = torch.utils.data.DataLoader(big, batch_size=4, sampler=order, num_workers=2,
                                         multiprocessing_context=worker_context(2))
    got = torch.cat([b["images"] for b in loader])
    assert torch.equal(got, torch.stack([big[k]["images"] for k in order]))


def test_folder_set_pickles_to_a_path_and_matches_the_tree(faces, tmp_path):
    root = tmp_path / "tree"
    shutil.copytree(faces / "train", root)
    (root / "id_00000" / "nested").mkdir()
    shutil.copy(next((root / "id_00000").glob("*.jpg")), root / "id_00000" / "nested" / "deep.jpg")
    (root / "id_00001" / "empty.jpg").write_bytes(b"")
    (root / "id_00001" / "notes.txt").write_text("not an image")
    shutil.copytree(root / "id_00002", tmp_path / "outside")
    os.symlink(tmp_path / "outside", root / "zz_link")  # a linked identity folder is followed
    ff = FaceFolder(root, 112, skip_bad=True)
    want = []
    for label, name in enumerate(sorted(d.name for d in root.iterdir() if d.is_dir())):
        for dirpath, dirs, files in os.walk(root / name, followlinks=True):
            dirs.sort()
            want += [(os.path.join(dirpath, f), label) for f in files if f.endswith(".jpg")
                     and os.path.getsize(os.path.join(dirpath, f))]
    want.sort(key=lambda s: (s[1], s[0]))
    assert sorted(ff.samples, key=lambda s: (s[1], s[0])) == want and ff.targets == [t for _, t in ff.samples]
    assert ff.empty_files == [str(root / "id_00001" / "empty.jpg")] and ff.classes[-1] == "zz_link"
    state = pickle.dumps(ff)
    assert len(state) < 4096 and b"deep.jpg" not in state and b"id_00001" not in state  # a path, not the list
    copy = pickle.loads(pickle.dumps(ff))
    assert torch.equal(copy[(0, 3)]["images"], ff[(0, 3)]["images"]) and copy.samples[5] == ff.samples[5]


def test_a_changed_tree_is_indexed_again(faces, tmp_path):
    root = tmp_path / "tree"
    shutil.copytree(faces / "train", root)
    a = FaceFolder(root, 112)
    extra = root / "id_00003" / "zzz.jpg"
    shutil.copy(a.samples[0][0], extra)
    b = FaceFolder(root, 112)
    assert len(b) == len(a) + 1 and (str(extra), 3) in list(b.samples) and b.index.folder != a.index.folder
    shutil.move(str(root / "id_00005"), str(root / "id_99999"))  # a renamed identity: labels move
    c = FaceFolder(root, 112)
    assert c.classes[-1] == "id_99999" and c.samples[len(c) - 1][1] == c.num_classes - 1
    assert FaceFolder(root, 112).index.folder == c.index.folder  # unchanged: the same index


def test_a_recordio_file_rewritten_in_place_is_read_anew(faces, tmp_path):
    root = _rec(faces, tmp_path / "rec", 12)
    ds = RecordFaces(root, 112, train=False)
    idx = root / "train.idx"
    lines = [line.split("\t") for line in idx.read_text().splitlines()]
    st = idx.stat()
    # swap the offsets of two image keys written with as many digits: the same file size
    i, j = next((i, j) for i in range(1, 13) for j in range(i + 1, 13) if len(lines[i][1]) == len(lines[j][1]))
    lines[i][1], lines[j][1] = lines[j][1], lines[i][1]
    idx.write_text("".join(f"{k}\t{o}\n" for k, o in lines))
    os.utime(idx, ns=(st.st_atime_ns, st.st_mtime_ns))  # even with size and mtime restored
    assert idx.stat().st_size == st.st_size
    again = RecordFaces(root, 112, train=False)
    assert again.reader.index.folder != ds.reader.index.folder
    image_i, image_j = ds[(0, i - 1)]["images"], ds[(0, j - 1)]["images"]  # image k - 1 is key k
    assert not torch.equal(image_i, image_j)
    assert torch.equal(again[(0, j - 1)]["images"], image_i) and torch.equal(again[(0, i - 1)]["images"], image_j)


def test_recordio_keys_in_any_order_duplicates_and_gaps(tmp_path):
    """Keys need not run 0..n-1: an index keeps them (sorted) then; a key listed twice reads its first line."""
    with RecordWriter(tmp_path / "r.rec", tmp_path / "r.idx") as w:
        for key, payload in [(40, b"forty"), (7, b"seven"), (1000000007, b"big"), (7, b"seven again")]:
            w.write(key, payload)
    r = RecordReader(tmp_path / "r.rec", tmp_path / "r.idx")
    assert r.key_start is None and r.count == 4 and r.max_key == 1000000007
    assert [r.read(k) for k in (7, 40, 1000000007)] == [b"seven", b"forty", b"big"]
    assert r.has(40) and not r.has(41) and r.positions(np.array([40, 7])).tolist() == [2, 0]
    with pytest.raises(VtrainError, match="has no record 41"):
        r.read(41)
    with RecordWriter(tmp_path / "d.rec", tmp_path / "d.idx") as w:
        for key in range(5, 9):
            w.write(key, b"k%d" % key)
    d = RecordReader(tmp_path / "d.rec", tmp_path / "d.idx")
    assert d.key_start == 5 and "keys" not in d.index.meta["arrays"] and d.read(8) == b"k8" and not d.has(4)
