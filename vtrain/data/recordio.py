"""insightface / MXNet RecordIO face sets (`train.rec` + `train.idx` + `property`) in pure Python: no mxnet.

Byte layout (dmlc-core include/dmlc/recordio.h + src/recordio.cc, MXNet python/mxnet/recordio.py; docs/face.md §1.4):
- `.rec`: each logical record is one or more parts `magic lrecord data pad`, little-endian uint32s, with
  magic 0xced7230a (bytes 0a 23 d7 ce), length = lrecord & (2^29 - 1), cflag = lrecord >> 29. Where the magic
  word occurs 4-byte aligned inside a payload the writer cuts it out and splits the record there: cflag 1 = first
  part, 2 = middle, 3 = last, 0 = whole record; a reader puts the magic back between the parts. Only the last
  part is padded to 4 bytes (the others end on an aligned magic). dmlc-core's recordio.h is the authority:
  `kMagic = 0xced7230a` and a 29-bit length (write-ups that give 0x3ed7230a or 30 bits are wrong).
- `.idx`: text, `key<TAB>byte offset` per line; a logical record is read at its offset.
- payload: IRHeader struct 'IfQQ' (flag uint32, label float32, id uint64, id2 uint64, 24 bytes); flag > 0 means
  `flag` float32 labels follow (and the label field is 0); then the encoded image (JPEG).
- insightface layout: record 0 is a header (flag 2, labels = [first identity record, end key), no image),
  records 1..N images, then one record per identity with labels = [start, end) of its image keys. A shuffled
  rec (insightface scripts/shuffle_rec.py, im2rec) has image records only. `property` = `num_classes,h,w`.
"""

from __future__ import annotations

import os
import struct
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from vtrain.config import DEFAULT_MAX_IMAGE_PIXELS
from vtrain.data.faces import FaceSamples, decode_rgb
from vtrain.data.labels import check_labels
from vtrain.errors import VtrainError

MAGIC = 0xCED7230A
_MAGIC_BYTES = struct.pack("<I", MAGIC)
_LENGTH_BITS = 29
_MAX_RECORD = 1 << _LENGTH_BITS
IR_FORMAT = "<IfQQ"
IR_SIZE = struct.calcsize(IR_FORMAT)  # 24
MAX_EXACT_LABEL = 1 << 24  # float32 holds every integer up to 2^24 exactly, not beyond


# ---- IRHeader payloads (mx.recordio.pack / unpack) --------------------------------------------------------------
@dataclass
class IRHeader:
    flag: int
    label: float | np.ndarray
    """A float, or when flag > 0 a float32 array of `flag` labels."""
    id: int = 0
    id2: int = 0


def pack(header: IRHeader, image: bytes) -> bytes:
    """IRHeader + image bytes; a sequence label becomes flag = len(labels) float32s after the header."""
    if np.ndim(header.label) == 0:
        return struct.pack(IR_FORMAT, 0, float(header.label), header.id, header.id2) + image
    labels = np.asarray(header.label, dtype="<f4").reshape(-1)
    return struct.pack(IR_FORMAT, labels.size, 0.0, header.id, header.id2) + labels.tobytes() + image


def unpack(payload: bytes, what: str = "record") -> tuple[IRHeader, bytes]:
    if len(payload) < IR_SIZE:
        raise VtrainError(f"{what}: {len(payload)} bytes, too short for its 24-byte IRHeader")
    flag, label, id_, id2 = struct.unpack_from(IR_FORMAT, payload)
    body = payload[IR_SIZE:]
    if flag == 0:
        return IRHeader(0, label, id_, id2), body
    if len(body) < 4 * flag:
        raise VtrainError(f"{what}: IRHeader announces {flag} labels but the record ends after {len(body)} bytes")
    return IRHeader(flag, np.frombuffer(body, "<f4", flag).copy(), id_, id2), body[4 * flag:]


# ---- record framing (dmlc RecordIOWriter::WriteRecord / RecordIOReader::NextRecord) ---------------------------
def frame(payload: bytes) -> bytes:
    """One logical record as it lies in the .rec file."""
    if len(payload) >= _MAX_RECORD:
        raise VtrainError(f"RecordIO records must be < 2^29 bytes, got {len(payload)}")
    out, start = [], 0
    for i in range(0, len(payload) - 3, 4):  # only 4-byte aligned occurrences count
        if payload[i:i + 4] == _MAGIC_BYTES:
            out.append(_part(1 if start == 0 else 2, payload[start:i]))
            start = i + 4
    out.append(_part(3 if start else 0, payload[start:]))
    return b"".join(out)


def _part(cflag: int, data: bytes) -> bytes:
    return _MAGIC_BYTES + struct.pack("<I", (cflag << _LENGTH_BITS) | len(data)) + data + b"\0" * (-len(data) % 4)


class RecordWriter:
    """Indexed writer (MXIndexedRecordIO in 'w' mode): appends records to .rec and `key<TAB>offset` to .idx."""

    def __init__(self, rec: str | Path, idx: str | Path) -> None:
        self.rec, self.idx = open(rec, "wb"), open(idx, "w")

    def write(self, key: int, payload: bytes) -> None:
        self.idx.write(f"{key}\t{self.rec.tell()}\n")
        self.rec.write(frame(payload))

    def close(self) -> None:
        self.rec.close()
        self.idx.close()

    def __enter__(self) -> RecordWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RecordReader:
    """Random access to the logical records of a .rec through its .idx.

    Reads use os.pread on a descriptor opened lazily in each process: DataLoader workers forked from a parent
    that already read would otherwise share one file offset and interleave their seeks."""

    def __init__(self, rec: str | Path, idx: str | Path) -> None:
        self.rec_path, self.idx_path = Path(rec), Path(idx)
        for p in (self.rec_path, self.idx_path):
            if not p.is_file():
                raise VtrainError(f"RecordIO set: {p} not found (train.rec needs its train.idx and vice versa)")
        self.size = self.rec_path.stat().st_size
        self.keys, self.offsets = _read_idx(self.idx_path)
        bad = np.flatnonzero(self.offsets + 8 > self.size)
        if len(bad):
            i = int(bad[0])
            raise VtrainError(f"{self.idx_path}: line {i + 1}: record {self.keys[i]} starts at byte "
                              f"{self.offsets[i]}, past the end of {self.rec_path} ({self.size} bytes); "
                              "the .idx does not belong to this .rec or the .rec is truncated")
        self._order = np.argsort(self.keys, kind="stable")
        self._sorted_keys = self.keys[self._order]
        self._fd: int | None = None
        self._pid = -1

    def __getstate__(self) -> dict:  # spawn/forkserver workers: never ship a descriptor
        return {**self.__dict__, "_fd": None, "_pid": -1}

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None and self._pid == os.getpid():
            os.close(self._fd)

    def _descriptor(self) -> int:
        if self._fd is None or self._pid != os.getpid():
            self._fd, self._pid = os.open(self.rec_path, os.O_RDONLY), os.getpid()
        return self._fd

    def positions(self, keys: np.ndarray) -> np.ndarray:
        """Row numbers in the .idx of `keys`; a missing key is an error naming it."""
        keys = np.asarray(keys, dtype=np.int64)
        at = np.searchsorted(self._sorted_keys, keys).clip(0, len(self._sorted_keys) - 1)
        missing = np.flatnonzero(self._sorted_keys[at] != keys)
        if len(missing):
            raise VtrainError(f"{self.idx_path} has no record {int(keys[missing[0]])} "
                              f"({len(missing)} of {len(keys)} expected keys missing)")
        return self._order[at]

    def has(self, key: int) -> bool:
        i = np.searchsorted(self._sorted_keys, key)
        return bool(i < len(self._sorted_keys) and self._sorted_keys[i] == key)

    def read(self, key: int) -> bytes:
        return self.read_at(int(self.offsets[self.positions(np.array([key]))[0]]), key)

    def read_at(self, offset: int, key: int) -> bytes:
        """The logical record at byte `offset`, its parts joined with the magic they were split at."""
        fd, parts, pos = self._descriptor(), [], offset
        where = f"{self.rec_path}: record {key} (byte {offset})"
        while True:
            head = os.pread(fd, 8, pos)
            if len(head) < 8:
                raise VtrainError(f"{where}: truncated, the file ends inside a record header")
            magic, lrec = struct.unpack("<II", head)
            if magic != MAGIC:
                raise VtrainError(f"{where}: bad magic 0x{magic:08x} at byte {pos} (expected 0x{MAGIC:08x}); "
                                  "not an MXNet RecordIO file, or its .idx offsets are wrong")
            cflag, length = lrec >> _LENGTH_BITS, lrec & (_MAX_RECORD - 1)
            if cflag > 3 or (cflag in (0, 1)) != (not parts):
                raise VtrainError(f"{where}: corrupt part flag {cflag} at byte {pos}")
            # os.pread allocates the length asked for before reading: a length field is checked against the
            # file's real size first, so a record cannot make us allocate what the file does not hold
            data = os.pread(fd, length, pos + 8) if pos + 8 + length <= self.size else b""
            if len(data) < length:
                raise VtrainError(f"{where}: truncated, needs {length} bytes at byte {pos + 8} but the file has "
                                  f"{self.size}")
            parts.append(data)
            if cflag in (0, 3):
                return _MAGIC_BYTES.join(parts)
            pos += 8 + length + (-length % 4)


def _read_idx(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(keys, offsets) of a `key<TAB>offset` file. numpy's text parser reads millions of lines in seconds
    (MS1MV3: 5.2M); a file it cannot read exactly is scanned line by line to name the bad line."""
    raw = path.read_bytes()
    lines = raw.count(b"\n") + (1 if raw and not raw.endswith(b"\n") else 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy only warns when it stops at unparsable text
        try:
            flat = np.fromstring(raw, dtype=np.int64, sep=" ")
        except (ValueError, DeprecationWarning):
            flat = None
    if flat is not None and len(flat) == 2 * lines and lines:
        table = flat.reshape(-1, 2)
    else:
        rows = []
        for n, line in enumerate(raw.split(b"\n"), 1):
            parts = line.split()
            if not parts:
                continue
            if len(parts) != 2 or not all(p.lstrip(b"-").isdigit() for p in parts):
                raise VtrainError(f"{path}: line {n}: expected 'key<TAB>offset', got {line[:60]!r}")
            rows.append([int(parts[0]), int(parts[1])])
        if not rows:
            raise VtrainError(f"{path}: no records")
        table = np.array(rows, dtype=np.int64)
    if (table[:, 1] < 0).any():
        raise VtrainError(f"{path}: line {int(np.argmax(table[:, 1] < 0)) + 1}: negative offset")
    return table[:, 0].copy(), table[:, 1].copy()


# ---- the insightface face set ------------------------------------------------------------------------------------
def class_id(label: float | np.ndarray, what: str, num_classes: int = MAX_EXACT_LABEL, count_from: str = "") -> int:
    """The class id of an image record: the float label, or the first of a multi-label array (insightface
    MXFaceDataset), checked by data/labels.py against `num_classes`. Float32 holds integers exactly only up to 2^24,
    so larger ids cannot be trusted whatever the class count."""
    value = float(label if np.ndim(label) == 0 else (label[0] if len(label) else np.nan))
    source, _, record = what.rpartition(": ")
    limit = min(num_classes, MAX_EXACT_LABEL)
    note = count_from if limit == num_classes else "float32 labels hold whole numbers exactly only below 2^24"
    return int(check_labels(np.array([value]), limit, source or what, lambda _: record, note)[0])


class RecordFaces(FaceSamples):
    """An insightface RecordIO face set read by key through train.idx; same samples contract as FaceFolder."""

    def __init__(self, root: str | Path, image_size: int, train: bool = True, seed: int = 0,
                 max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> None:
        self.root, self.image_size, self.train, self.seed = Path(root), image_size, train, seed
        self.max_pixels = max_pixels
        self.reader = RecordReader(self.root / "train.rec", self.root / "train.idx")
        self.identities: tuple[int, int] | None = None
        header = None
        if self.reader.has(0):
            h, image = unpack(self.reader.read(0), f"{self.reader.rec_path}: record 0")
            # insightface header record: flag > 0, labels (first identity key, end), no image. A flag-0 record 0
            # (or one carrying an image) is an ordinary image of a shuffled / im2rec set.
            if h.flag >= 2 and not image:
                header = h
        if header is not None:
            first, end = int(header.label[0]), int(header.label[1])
            if not 1 <= first <= end:
                raise VtrainError(f"{self.reader.rec_path}: header record 0 has an invalid image/identity range "
                                  f"{header.label.tolist()}")
            # declared counts (images 1..first-1, one identity record per class) against the records the .idx
            # really lists, before an array of declared length is made (identity records may be absent: training
            # reads only the images, and a `property` file can give the class count)
            n = len(self.reader.keys)
            if first - 1 > n or end - first > n:
                raise VtrainError(f"{self.reader.rec_path}: header record 0 declares {first - 1} images and "
                                  f"{end - first} identities, but {self.reader.idx_path} lists only {n} records; "
                                  "the header is damaged or the .idx is not this .rec's")
            self.keys = np.arange(1, first, dtype=np.int64)
            self.identities = (first, end)
        else:
            self.keys = np.sort(self.reader.keys)
        if len(self.keys) == 0:
            raise VtrainError(f"{self.reader.rec_path}: no image records")
        self._offsets = self.reader.offsets[self.reader.positions(self.keys)]
        self._targets: list[int] | None = None
        self.num_classes = self._num_classes()

    def _num_classes(self) -> int:
        prop = self.root / "property"
        if prop.is_file():
            text = prop.read_text(errors="replace")[:200]  # three numbers; a huge file is not a property file
            head = text.strip().split(",")[0]
            if not head.isdigit() or int(head) < 1:
                raise VtrainError(f"{prop}: expected 'num_classes,height,width', got {text[:60]!r}")
            # a declared count, checked before any head is sized by it: float32 labels cannot address more
            # classes exactly (the memory the head would need is checked where the head is planned, tasks/metric)
            if int(head) > MAX_EXACT_LABEL:
                raise VtrainError(f"{prop}: {int(head)} classes is more than RecordIO's float32 labels can address "
                                  f"(whole numbers are exact only below 2^24 = {MAX_EXACT_LABEL}); the file is "
                                  "damaged or not this set's")
            self.num_classes_source = f"from {prop}"
            return int(head)
        if self.identities is not None:  # one identity record per class
            self.num_classes_source = f"from the identity records of {self.reader.rec_path}"
            return self.identities[1] - self.identities[0]
        self.num_classes_source = f"from the largest label in {self.reader.rec_path}"
        return max(self._scan_labels()) + 1

    def _scan_labels(self) -> list[int]:
        """Class id of every image from its record header (minutes for millions of images)."""
        return [class_id(unpack(self._record(i), self._what(i))[0].label, self._what(i)) for i in range(len(self))]

    @property
    def targets(self) -> list[int]:
        """Class id of every image; reads every record header once."""
        if self._targets is None:
            self._targets = self._scan_labels()
            self._check_label(int(np.argmax(self._targets)), max(self._targets))
        return self._targets

    def __len__(self) -> int:
        return len(self.keys)

    def _what(self, idx: int) -> str:
        return f"{self.reader.rec_path}: record {int(self.keys[idx])}"

    def _record(self, idx: int) -> bytes:
        return self.reader.read_at(int(self._offsets[idx]), int(self.keys[idx]))

    def _check_label(self, idx: int, label: int) -> int:
        return class_id(float(label), self._what(idx), self.num_classes, self.num_classes_source)

    def _read(self, idx: int) -> tuple[torch.Tensor, int]:
        header, image = unpack(self._record(idx), self._what(idx))
        label = class_id(header.label, self._what(idx), self.num_classes, self.num_classes_source)
        return decode_rgb(image, self._what(idx), self.max_pixels), label


def write_face_rec(out_dir: str | Path, samples: Sequence[tuple[bytes, float | Sequence[float]]], num_classes: int,
                   image_size: int = 112, header: bool = True) -> Path:
    """Write (encoded image, label) samples as train.rec / train.idx / property.

    header=True: the insightface layout (header record 0, images 1..N, one identity-range record per class);
    the samples must then come grouped by class id in increasing order. header=False: image records only, keys
    0..N-1 in the given order (a shuffled rec). A label is a class id or a sequence of floats (multi-label)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    first = len(samples) + 1  # key of the first identity record
    ranges: dict[int, list[int]] = {}
    with RecordWriter(out / "train.rec", out / "train.idx") as w:
        if header:
            w.write(0, pack(IRHeader(2, [first, first + num_classes]), b""))
        for key, (image, label) in enumerate(samples, 1 if header else 0):
            w.write(key, pack(IRHeader(0, label, key, 0), image))
            if header:
                cls = class_id(np.asarray(label, np.float32), f"write_face_rec: sample {key}")
                if ranges and cls < max(ranges):
                    raise VtrainError(f"write_face_rec: sample {key} (class {cls}) after class {max(ranges)}; "
                                      "the header layout needs samples grouped by increasing class id")
                ranges.setdefault(cls, [key, key])[1] = key + 1
        if header:
            for cls in range(num_classes):
                start, end = ranges.get(cls, (first, first))
                w.write(first + cls, pack(IRHeader(2, [start, end], first + cls, 0), b""))
    (out / "property").write_text(f"{num_classes},{image_size},{image_size}\n")
    return out
