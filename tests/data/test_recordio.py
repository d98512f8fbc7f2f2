"""insightface RecordIO in pure Python: exact byte layouts, the face dataset on it, workers, bad files."""

import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from vtrain.data.faces import FaceFolder
from vtrain.data.recordio import (MAGIC, IRHeader, RecordFaces, RecordReader, RecordWriter, frame, pack, unpack,
                                  write_face_rec)
from vtrain.errors import VtrainError

MAGIC_BYTES = bytes([0x0A, 0x23, 0xD7, 0xCE])  # 0xced7230a little-endian (dmlc-core recordio.h kMagic)


def lrec(cflag: int, length: int) -> bytes:
    return struct.pack("<I", cflag << 29 | length)


def folder_samples(root: Path) -> tuple[FaceFolder, list[tuple[bytes, int]]]:
    ff = FaceFolder(root, 112, train=True, seed=5)
    return ff, [(Path(p).read_bytes(), label) for p, label in ff.samples]


def with_comment(jpeg: bytes, comment: bytes) -> bytes:
    """The same JPEG with a COM segment right after SOI (decoders skip comments)."""
    return jpeg[:2] + b"\xff\xfe" + struct.pack(">H", len(comment) + 2) + comment + jpeg[2:]


def test_framing_bytes_and_magic_split():
    assert struct.pack("<I", MAGIC) == MAGIC_BYTES
    # a whole record: magic, lrecord (cflag 0), data, zero padding to 4 bytes
    assert frame(b"abcde") == MAGIC_BYTES + lrec(0, 5) + b"abcde\0\0\0"
    assert frame(b"") == MAGIC_BYTES + lrec(0, 0)
    # aligned magic words are cut out and the record split (first 1, middle 2, last 3); an unaligned one stays
    payload = b"abcd" + MAGIC_BYTES + MAGIC_BYTES + b"x" + MAGIC_BYTES + b"yz"
    assert frame(payload) == (MAGIC_BYTES + lrec(1, 4) + b"abcd" + MAGIC_BYTES + lrec(2, 0)
                              + MAGIC_BYTES + lrec(3, 7) + b"x" + MAGIC_BYTES + b"yz" + b"\0")


def test_irheader_layout():
    assert pack(IRHeader(0, 7.0, 5, 0), b"JPG") == struct.pack("<IfQQ", 0, 7.0, 5, 0) + b"JPG"
    # a label array: flag = its length, label field 0, float32s after the 24-byte header
    raw = pack(IRHeader(0, [3.0, 0.25, 9.0], 8, 1), b"img")
    assert raw == struct.pack("<IfQQ", 3, 0.0, 8, 1) + struct.pack("<3f", 3.0, 0.25, 9.0) + b"img"
    h, img = unpack(raw)
    assert (h.flag, h.id, h.id2, img) == (3, 8, 1, b"img") and h.label.tolist() == [3.0, 0.25, 9.0]
    with pytest.raises(VtrainError, match="too short"):
        unpack(b"\0" * 10)


def test_writer_reader_round_trip_with_split_records(tmp_path):
    payloads = {0: b"", 1: b"abc", 7: b"1234" + MAGIC_BYTES + b"5678" + MAGIC_BYTES, 3: MAGIC_BYTES * 3}
    with RecordWriter(tmp_path / "r.rec", tmp_path / "r.idx") as w:
        for k, p in payloads.items():
            w.write(k, p)
    offsets = [0, 8, 8 + 12, 8 + 12 + 8 + 4 + 8 + 4 + 8]
    assert (tmp_path / "r.idx").read_text() == "".join(f"{k}\t{o}\n" for k, o in zip(payloads, offsets))
    r = RecordReader(tmp_path / "r.rec", tmp_path / "r.idx")
    for k in [3, 7, 0, 1]:  # random access
        assert r.read(k) == payloads[k]


def test_insightface_layout_exact_bytes(tmp_path):
    samples = [(b"A" * 5, 0), (b"B" * 4, 0), (b"C", 1), (b"D" * 8, 3)]  # class 2 has no image
    write_face_rec(tmp_path, samples, num_classes=4, image_size=112)
    rec = (tmp_path / "train.rec").read_bytes()
    # record 0: header, flag 2, labels (first identity key 5, end 9), no image
    head = struct.pack("<IfQQ", 2, 0.0, 0, 0) + struct.pack("<2f", 5, 9)
    assert rec[:8 + 32] == MAGIC_BYTES + lrec(0, 32) + head
    image1 = struct.pack("<IfQQ", 0, 0.0, 1, 0) + b"AAAAA"
    assert rec[40:40 + 8 + 29 + 3] == MAGIC_BYTES + lrec(0, 29) + image1 + b"\0\0\0"
    keys = [int(line.split("\t")[0]) for line in (tmp_path / "train.idx").read_text().splitlines()]
    assert keys == list(range(9)) and (tmp_path / "property").read_text() == "4,112,112\n"
    r = RecordReader(tmp_path / "train.rec", tmp_path / "train.idx")
    ranges = [unpack(r.read(k))[0].label.tolist() for k in range(5, 9)]
    assert ranges == [[1, 3], [3, 4], [5, 5], [4, 5]]  # [start, end) image keys per identity
    h, img = unpack(r.read(4))
    assert (h.flag, h.label, h.id, img) == (0, 3.0, 4, b"D" * 8)


def test_dataset_matches_identity_folders_and_two_workers(faces, tmp_path):
    ff, samples = folder_samples(faces / "train")
    # one image carries the magic word at an aligned payload offset (24-byte IRHeader + SOI + COM header + 2):
    # its record is split into parts on disk and must come back whole
    samples[10] = (with_comment(samples[10][0], b"..\x0a\x23\xd7\xce.."), samples[10][1])
    write_face_rec(tmp_path, samples, ff.num_classes)
    ds = RecordFaces(tmp_path, 112, train=True, seed=5)
    assert (len(ds), ds.num_classes, ds.targets) == (len(ff), ff.num_classes, ff.targets)
    assert ds.identities == (len(ff) + 1, len(ff) + 1 + ff.num_classes)
    for key in [(0, 0), (2, 10), (1, 37), (3, len(ff) - 1)]:  # the same seeded flip and normalisation
        a, b = ff[key], ds[key]
        assert torch.equal(a["images"], b["images"]) and a["labels"] == b["labels"] and a["index"] == b["index"]
    rec = (tmp_path / "train.rec").read_bytes()
    assert MAGIC_BYTES + struct.pack("<I", 1 << 29 | 32) in rec  # the first part of the split record
    assert unpack(ds.reader.read(11))[1] == samples[10][0]  # re-joined byte for byte (image 10 is key 11)
    # random access from 2 forked workers after the parent has read (and opened its descriptor)
    order = [(1, i) for i in np.random.default_rng(0).permutation(len(ds))[:24].tolist()]
    loader = torch.utils.data.DataLoader(ds, batch_size=4, sampler=order, num_workers=2)
    got = torch.cat([b["images"] for b in loader])
    want = torch.stack([ds[k]["images"] for k in order])
    assert torch.equal(got, want)


def test_shuffled_multilabel_rec_without_header(faces, tmp_path):
    ff, samples = folder_samples(faces / "train")
    perm = np.random.default_rng(1).permutation(len(samples))
    shuffled = [(samples[i][0], [float(samples[i][1]), 0.5]) for i in perm]  # multi-label: class id first
    write_face_rec(tmp_path, shuffled, ff.num_classes, header=False)
    (tmp_path / "property").unlink()  # num_classes then comes from the labels (max + 1)
    ds = RecordFaces(tmp_path, 112, train=False)
    assert ds.identities is None and len(ds) == len(ff) and ds.num_classes == ff.num_classes
    assert ds.targets == [ff.targets[i] for i in perm]
    assert torch.equal(ds[5]["images"], ff[int(perm[5])]["images"])  # train=False: no flip in either


@pytest.mark.parametrize("label,num_classes,message", [
    (2.5, 10, "not a class id"),
    (float(2**24 + 2), 2**24, "label 16777218 >= 16777216 classes"),  # a property above 2^24 is refused at load
    (-1.0, 10, "not a class id"),
    (12.0, 10, "label 12 >= 10 classes"),
])
def test_bad_labels_are_clear_errors(faces, tmp_path, label, num_classes, message):
    _, samples = folder_samples(faces / "train")
    write_face_rec(tmp_path, [samples[0], (samples[1][0], [label])], num_classes, header=False)
    ds = RecordFaces(tmp_path, 112)
    ds[0]
    with pytest.raises(VtrainError, match=message) as e:
        ds[1]
    assert "train.rec: record 1" in str(e.value)


def _corrupt(root: Path, problem: str) -> None:
    rec, idx = root / "train.rec", root / "train.idx"
    lines = idx.read_text().splitlines()
    if problem == "missing idx":
        idx.unlink()
    elif problem == "offset past end":
        lines[3] = f"3\t{rec.stat().st_size + 100}"
        idx.write_text("\n".join(lines) + "\n")
    elif problem == "bad idx line":
        lines[2] = "2 x"
        idx.write_text("\n".join(lines) + "\n")
    elif problem == "wrong magic":
        data = bytearray(rec.read_bytes())
        off = int(lines[3].split("\t")[1])
        data[off:off + 4] = b"\0\0\0\0"
        rec.write_bytes(bytes(data))
    elif problem == "truncated":  # cut the last image record (key 4) in half, drop the identity record after it
        last = int(lines[4].split("\t")[1])
        rec.write_bytes(rec.read_bytes()[:last + 60])
        idx.write_text("\n".join(lines[:5]) + "\n")


@pytest.mark.parametrize("problem,message", [
    ("missing idx", r"train.idx not found"),
    ("offset past end", r"train.idx: line 4: record 3 starts at byte \d+, past the end of"),
    ("bad idx line", r"train.idx: line 3: expected 'key<TAB>offset'"),
    ("wrong magic", r"train.rec: record 3 \(byte \d+\): bad magic 0x00000000"),
    ("truncated", r"train.rec: record 4 \(byte \d+\): truncated"),
])
def test_bad_files_are_one_line_errors(faces, tmp_path, problem, message):
    _, samples = folder_samples(faces / "train")
    write_face_rec(tmp_path, samples[:4], 1)
    _corrupt(tmp_path, problem)
    with pytest.raises(VtrainError, match=message) as e:
        ds = RecordFaces(tmp_path, 112)
        for i in range(len(ds)):
            ds[i]
    assert "\n" not in str(e.value)


# ---- header values float32 cannot hold: the image/identity boundary from train.idx ------------------------------
F = 42_474_558  # WebFace42M's first identity key: float32 stores it as 42,474,560


def _sparse_rec(root: Path, jpeg: bytes, first: int, identities: int, listed: bool, prop: int | None) -> RecordReader:
    """An insightface-layout rec whose .idx lists only record 0, the last 3 images before `first` and (`listed`) the
    identity records: legal RecordIO (keys are any integers), small, with the header's values above 2^24."""
    root.mkdir()
    with RecordWriter(root / "train.rec", root / "train.idx") as w:
        w.write(0, pack(IRHeader(2, [first, first + identities]), b""))
        for key in range(first - 3, first):
            w.write(key, pack(IRHeader(0, float(key % identities), key, 0), jpeg))
        for c in range(identities if listed else 0):
            w.write(first + c, pack(IRHeader(2, [first - 3 + c, first - 2 + c], first + c, 0), b""))
    if prop is not None:
        (root / "property").write_text(f"{prop},112,112\n")
    return RecordReader(root / "train.rec", root / "train.idx")


@pytest.mark.parametrize("first,identities,listed,prop,want", [
    (F, 3, True, None, "identities 42474558..42474560 (record 42474558 is the first identity record)"),
    (F, 3, True, 7, "identities 42474558..42474560"),  # the records decide, not a property that disagrees
    (F, 3, False, 3, "identity records not listed, 3 classes from property"),
    (2**24 + 1, 2, True, None, "identities 16777217..16777218"),  # stored as 2^24 (a tie, rounded to even)
    (F + 1, 2, True, None, "identities 42474559..42474560"),
    (F, 3, False, None, "error: the class count cannot be made exact"),
    (F, 3, False, 9, "error: the class count cannot be made exact"),  # F + 9 does not round to the stored end
])
def test_header_range_above_2_24_taken_from_the_idx(faces, tmp_path, first, identities, listed, prop, want):
    from vtrain.data.recordio import _exact_range

    _, samples = folder_samples(faces / "train")
    r = _sparse_rec(tmp_path / "rec", samples[0][0], first, identities, listed, prop)
    header = unpack(r.read(0))[0]
    stored = [int(v) for v in header.label]
    assert stored != [first, first + identities]  # what a reader of the header alone would take
    if want.startswith("error: "):
        with pytest.raises(VtrainError, match=want[7:]):
            _exact_range(r, header, prop)
        return
    got_first, end, note = _exact_range(r, header, prop)
    assert (got_first, end) == (first, first + identities)
    assert f"images 1..{first - 1} (record {first - 1} is an image)" in note and want in note
    assert "float32" in note and "\n" not in note


def test_header_range_without_a_boundary_near_the_stored_value_is_an_error(faces, tmp_path):
    from vtrain.data.recordio import _exact_range

    _, samples = folder_samples(faces / "train")
    root = tmp_path / "rec"
    root.mkdir()
    with RecordWriter(root / "train.rec", root / "train.idx") as w:  # images all the way past the stored value
        w.write(0, pack(IRHeader(2, [F, F + 2]), b""))
        for key in range(F - 4, F + 6):
            w.write(key, pack(IRHeader(0, 0.0, key, 0), samples[0][0]))
    r = RecordReader(root / "train.rec", root / "train.idx")
    with pytest.raises(VtrainError, match=r"stores the first identity key as float32 \(42474560\).*none of the keys "
                                          r"that round to it \(42474558\.\.42474562\)"):
        _exact_range(r, unpack(r.read(0))[0], None)


def test_exact_range_path_feeds_the_set_and_the_run_log(faces, tmp_path, monkeypatch):
    """The whole path through RecordFaces and the task's notes, on a small set with the exactness limit lowered (a
    set with 2^24 images is too large for a test; the rounding itself is covered above)."""
    import vtrain.data.recordio as recordio
    from vtrain.config import build_config
    from vtrain.tasks.metric import MetricTask

    ff, samples = folder_samples(faces / "train")
    write_face_rec(tmp_path, samples, ff.num_classes)
    plain = RecordFaces(tmp_path, 112)
    assert plain.note is None
    monkeypatch.setattr(recordio, "MAX_EXACT_LABEL", len(ff) + 1)  # end = first + 16 classes is "not exact"
    task = MetricTask(build_config("metric", overrides={"data": {"path": str(tmp_path)}}))
    ds = task.train_dataset()
    assert (len(ds), ds.identities) == (len(plain), plain.identities) and ds.targets == plain.targets
    assert task.notes == [ds.note] and f"images 1..{len(ff)}" in ds.note
    assert f"identities {len(ff) + 1}..{len(ff) + ff.num_classes}" in ds.note
