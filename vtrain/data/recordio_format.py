"""MXNet RecordIO files in pure Python (no mxnet): record framing, IRHeader payloads, the indexed writer, and the
reader, which finds records through a memory-mapped index of the .idx shared by every process (data/index.py).

Byte layout (dmlc-core include/dmlc/recordio.h + src/recordio.cc, MXNet python/mxnet/recordio.py; docs/face.md §1.4):
- `.rec`: each logical record is one or more parts `magic lrecord data pad`, little-endian uint32s, with
  magic 0xced7230a (bytes 0a 23 d7 ce), length = lrecord & (2^29 - 1), cflag = lrecord >> 29. Where the magic
  word occurs 4-byte aligned inside a payload the writer cuts it out and splits the record there: cflag 1 = first
  part, 2 = middle, 3 = last, 0 = whole record; a reader puts the magic back between the parts. Only the last
  part is padded to 4 bytes (the others end on an aligned magic). dmlc-core's recordio.h is the authority:
  `kMagic = 0xced7230a` and a 29-bit length (write-ups that give 0x3ed7230a or 30 bits are wrong).
- `.idx`: text, `key<TAB>byte offset` per line; a logical record is read at its offset. Several lines may give
  the same offset (a reader only seeks there).
- payload: IRHeader struct 'IfQQ' (flag uint32, label float32, id uint64, id2 uint64, 24 bytes); flag > 0 means
  `flag` float32 labels follow (and the label field is 0); then the encoded image (JPEG).
"""

from __future__ import annotations

import mmap
import os
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vtrain.data.index import Index, IndexWriter, file_identity, open_index
from vtrain.errors import VtrainError, shown

MAGIC = 0xCED7230A
_MAGIC_BYTES = struct.pack("<I", MAGIC)
_LENGTH_BITS = 29
_MAX_RECORD = 1 << _LENGTH_BITS
IR_FORMAT = "<IfQQ"
IR_SIZE = struct.calcsize(IR_FORMAT)  # 24
MAX_EXACT_LABEL = 1 << 24  # float32 holds every integer up to 2^24 exactly, not beyond
INDEX_VERSION = 1  # the layout of a RecordIO index (data/index.py): raise it when the arrays change
_IDX_CHUNK = 64 << 20  # bytes of .idx text parsed at a time


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

    The .idx is parsed once into a memory-mapped index in the data cache (data/index.py): the record offsets in
    key order, and the keys themselves unless they run 0..n-1 (or k..k+n-1) as insightface writes them. Every rank
    and worker maps the same files; pickled for a worker, a reader is its paths. Reads use os.pread on a
    descriptor opened lazily in each process: DataLoader workers forked from a parent that already read would
    otherwise share one file offset and interleave their seeks."""

    def __init__(self, rec: str | Path, idx: str | Path) -> None:
        self.rec_path, self.idx_path = Path(rec), Path(idx)
        for p in (self.rec_path, self.idx_path):
            if not p.is_file():
                raise VtrainError(f"RecordIO set: {p} not found (train.rec needs its train.idx and vice versa)")
        self.size = self.rec_path.stat().st_size
        source = {"rec": file_identity(self.rec_path), "idx": file_identity(self.idx_path)}
        self.index = open_index("recordio", INDEX_VERSION, source,
                                lambda w: _build_index(w, self.idx_path, self.rec_path, source["rec"]["size"]),
                                lambda ix: _check_index(ix, source["rec"]["size"]))
        self.count: int = self.index.info["lines"]
        """Lines of the .idx (a key listed twice counts twice)."""
        self.key_start: int | None = self.index.info["key_start"]
        """The first key when the keys are exactly key_start.. key_start + count - 1 (no `keys` array)."""
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

    @property
    def offsets(self) -> np.ndarray:
        """Byte offset of each record in key order (a key listed twice: its first line's offset, both times)."""
        return self.index.array("offsets")

    def key_at(self, position: int) -> int:
        """The key at `position` in key order."""
        if self.key_start is not None:
            return self.key_start + position
        return int(self.index.array("keys")[position])

    @property
    def max_key(self) -> int:
        return self.key_at(self.count - 1)

    def positions(self, keys: np.ndarray) -> np.ndarray:
        """Positions in key order of `keys` (a key listed twice: its first line); a missing key is an error."""
        keys = np.asarray(keys, dtype=np.int64)
        if self.key_start is not None:
            at = keys - self.key_start
            found = (at >= 0) & (at < self.count)
        else:
            sorted_keys = self.index.array("keys")
            at = np.searchsorted(sorted_keys, keys).clip(0, self.count - 1)
            found = sorted_keys[at] == keys
        missing = np.flatnonzero(~found)
        if len(missing):
            raise VtrainError(f"{self.idx_path} has no record {int(keys[missing[0]])} "
                              f"({len(missing)} of {len(keys)} expected keys missing)")
        return at

    def has(self, key: int) -> bool:
        if self.key_start is not None:
            return 0 <= key - self.key_start < self.count
        sorted_keys = self.index.array("keys")
        i = np.searchsorted(sorted_keys, key)
        return bool(i < self.count and sorted_keys[i] == key)

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


def _build_index(w: IndexWriter, idx: Path, rec: Path, rec_size: int) -> None:
    """The .idx as arrays: checked against the .rec's size, then in key order (dense keys need no array)."""
    keys, offsets = _read_idx(idx)
    bad = np.flatnonzero(offsets > rec_size - 8)
    if len(bad):
        i = int(bad[0])
        raise VtrainError(f"{idx}: line {i + 1}: record {keys[i]} starts at byte {offsets[i]}, past the end of "
                          f"{rec} ({rec_size} bytes); the .idx does not belong to this .rec or the .rec is truncated")
    if _consecutive(keys):  # insightface: keys 0..n-1 in order
        w.info.update(lines=len(keys), key_start=int(keys[0]))
        w.array("offsets", offsets)
        return
    order = np.argsort(keys, kind="stable")
    keys, offsets = keys[order], offsets[order]
    first_line = np.ones(len(keys), bool)  # a key listed twice reads its first line's record, as a lookup by key
    first_line[1:] = keys[1:] != keys[:-1]
    if not first_line.all():
        offsets = offsets[np.maximum.accumulate(np.where(first_line, np.arange(len(keys)), 0))]
    w.info.update(lines=len(keys), key_start=None)
    w.array("keys", keys)
    w.array("offsets", offsets)


def _check_index(ix: Index, rec_size: int) -> None:
    """The layout of a RecordIO index (data/index.py `check`): `lines` offsets inside the .rec, and either the first
    of consecutive keys or the keys themselves, sorted."""
    lines = ix.expect_info("lines", int, 1)
    start = ix.expect_info("key_start", (int, type(None)))
    ix.expect("offsets", "<i8", (lines,))
    ix.within("offsets", 0, rec_size - 8, f"record offsets of a {rec_size}-byte .rec")
    if start is None:
        ix.expect("keys", "<i8", (lines,))
        if not ix.sorted("keys"):
            raise ix.damaged("its keys are not sorted")
    elif not -(2**63) <= start <= 2**63 - lines:
        raise ix.damaged(f"meta.json's info.key_start {shown(start)} + {lines} keys is beyond int64")


def _consecutive(keys: np.ndarray, block: int = 1 << 22) -> bool:
    """keys[i + 1] == keys[i] + 1 throughout, checked a block at a time (no temporary as long as the keys)."""
    return all((np.diff(keys[a:a + block + 1]) == 1).all() for a in range(0, max(len(keys) - 1, 1), block))


def _read_idx(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(keys, offsets) of a `key<TAB>offset` file. numpy's text parser reads millions of lines in seconds
    (WebFace42M's 44.5M in a few); the file is mapped and parsed in chunks that end at a line end, so its text is
    never held whole beside the arrays. A file it cannot read exactly is scanned line by line to name the bad line."""
    size = path.stat().st_size
    keys = offsets = None
    if size:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            text = np.frombuffer(mm, np.uint8)
            chunks, start = [], 0
            while start < size:
                end = mm.find(b"\n", min(start + _IDX_CHUNK, size) - 1) + 1 or size
                chunks.append((start, end, int(np.count_nonzero(text[start:end] == 10)) + (text[end - 1] != 10)))
                start = end
            del text  # the map cannot close while a view of it exists
            n = sum(c[2] for c in chunks)
            keys, offsets, row = np.empty(n, np.int64), np.empty(n, np.int64), 0
            for a, b, lines in chunks:
                with warnings.catch_warnings():
                    warnings.simplefilter("error")  # numpy only warns when it stops at unparsable text
                    try:
                        flat = np.fromstring(mm[a:b], dtype=np.int64, sep=" ")
                    except (ValueError, DeprecationWarning):
                        flat = None
                if flat is None or len(flat) != 2 * lines:
                    keys = None
                    break
                keys[row:row + lines], offsets[row:row + lines] = flat[0::2], flat[1::2]
                row += lines
    if keys is None or not len(keys):
        rows = []
        for n, line in enumerate(path.read_bytes().split(b"\n"), 1):
            parts = line.split()
            if not parts:
                continue
            if len(parts) != 2 or not all(p.lstrip(b"-").isdigit() for p in parts):
                raise VtrainError(f"{path}: line {n}: expected 'key<TAB>offset', got {line[:60]!r}")
            rows.append([int(parts[0]), int(parts[1])])
        if not rows:
            raise VtrainError(f"{path}: no records")
        keys, offsets = np.array(rows, dtype=np.int64).T.copy()
    if (offsets < 0).any():
        raise VtrainError(f"{path}: line {int(np.argmax(offsets < 0)) + 1}: negative offset")
    return keys, offsets
