"""insightface RecordIO face sets (`train.rec` + `train.idx` + `property`): the layout of the records, the face
dataset on them and a writer. The file format itself (framing, IRHeader, the indexed reader): recordio_format.py.

insightface layout (docs/face.md §1.4): record 0 is a header (flag 2, labels = [first identity record, end key), no
image), records 1..N images, then one record per identity with labels = [start, end) of its image keys. A shuffled
rec (insightface scripts/shuffle_rec.py, im2rec) has image records only. `property` = `num_classes,h,w`.
The header's labels are float32, exact only below 2^24: above it (Glint360k, WebFace42M) the boundary between
image and identity records is taken from the exact keys of train.idx and checked against the records
(`_exact_range`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from vtrain.config import DEFAULT_MAX_IMAGE_PIXELS
from vtrain.data.faces import FaceSamples, decode_rgb
from vtrain.data.labels import check_labels
from vtrain.data.recordio_format import (IR_SIZE, MAGIC, MAX_EXACT_LABEL, IRHeader, RecordReader,  # noqa: F401
                                         RecordWriter, frame, pack, unpack)
from vtrain.errors import VtrainError


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
    """An insightface RecordIO face set read by key through train.idx; same samples contract as FaceFolder.

    Image i is the record at position `start + i` of the reader's key-ordered index (the images are one run of
    keys), so the set holds no array of its own: every rank and worker reads the shared index."""

    def __init__(self, root: str | Path, image_size: int, train: bool = True, seed: int = 0,
                 max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> None:
        self.root, self.image_size, self.train, self.seed = Path(root), image_size, train, seed
        self.max_pixels = max_pixels
        self.reader = r = RecordReader(self.root / "train.rec", self.root / "train.idx")
        self.identities: tuple[int, int] | None = None
        self.note: str | None = None
        """One line for the run's log when the header's range was made exact from train.idx (`_exact_range`)."""
        header = None
        if r.has(0):
            h, image = unpack(r.read(0), f"{r.rec_path}: record 0")
            # insightface header record: flag > 0, labels (first identity key, end), no image. A flag-0 record 0
            # (or one carrying an image) is an ordinary image of a shuffled / im2rec set.
            if h.flag >= 2 and not image:
                header = h
        # images: positions start.. start + n of the key order, or (a .idx listing an image key twice) their own
        # key and offset arrays, made the way a lookup by key reads them
        self._start, self._n = 0, r.count
        self._keys: np.ndarray | None = None
        self._offsets: np.ndarray | None = None
        if header is not None:
            first, end = int(header.label[0]), int(header.label[1])
            if not 1 <= first <= end:
                raise VtrainError(f"{r.rec_path}: header record 0 has an invalid image/identity range "
                                  f"{header.label.tolist()}")
            # declared counts (images 1..first-1, one identity record per class) against the records the .idx
            # really lists, before an array of declared length is made (identity records may be absent: training
            # reads only the images, and a `property` file can give the class count); above 2^24 the float32
            # values may be off by their rounding
            slack = 0 if end < MAX_EXACT_LABEL else int(np.spacing(np.float32(end)))
            if first - 1 - slack > r.count or end - first - 2 * slack > r.count:
                raise VtrainError(f"{r.rec_path}: header record 0 declares {first - 1} images and "
                                  f"{end - first} identities, but {r.idx_path} lists only {r.count} records; "
                                  "the header is damaged or the .idx is not this .rec's")
            if end >= MAX_EXACT_LABEL:
                first, end, self.note = _exact_range(r, header, self._property_classes())
            self.identities = (first, end)
            self._select(first - 1)
        if len(self) == 0:
            raise VtrainError(f"{r.rec_path}: no image records")
        self._targets: list[int] | None = None
        self.num_classes = self._num_classes()

    def _select(self, images: int) -> None:
        """The image keys 1..images: one run of the key order unless a key is listed twice."""
        r, self._n = self.reader, images
        if images == 0:
            return
        if r.has(1):
            start = int(r.positions(np.array([1]))[0])
            stop = start + images
            if stop <= r.count and r.key_at(stop - 1) == images and (
                    r.key_start is not None or (np.diff(r.index.array("keys")[start:stop]) == 1).all()):
                self._start = start
                return
        self._keys = np.arange(1, images + 1, dtype=np.int64)  # positions() names a missing key
        self._offsets = r.offsets[r.positions(self._keys)]

    def _property_classes(self) -> int | None:
        """The class count of `property`, checked; None without the file."""
        prop = self.root / "property"
        if not prop.is_file():
            return None
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
        return int(head)

    def _num_classes(self) -> int:
        count = self._property_classes()
        if count is not None:
            self.num_classes_source = f"from {self.root / 'property'}"
            return count
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
        return self._n

    def key(self, idx: int) -> int:
        """The record key of image `idx`."""
        if self._keys is not None:
            return int(self._keys[idx])
        return self.reader.key_at(self._start + idx)

    def _what(self, idx: int) -> str:
        return f"{self.reader.rec_path}: record {self.key(idx)}"

    def _record(self, idx: int) -> bytes:
        offset = self._offsets[idx] if self._offsets is not None else self.reader.offsets[self._start + idx]
        return self.reader.read_at(int(offset), self.key(idx))

    def _check_label(self, idx: int, label: int) -> int:
        return class_id(float(label), self._what(idx), self.num_classes, self.num_classes_source)

    def _read(self, idx: int) -> tuple[torch.Tensor, int]:
        header, image = unpack(self._record(idx), self._what(idx))
        label = class_id(header.label, self._what(idx), self.num_classes, self.num_classes_source)
        return decode_rgb(image, self._what(idx), self.max_pixels), label


def _exact_range(r: RecordReader, header: IRHeader, property_classes: int | None) -> tuple[int, int, str]:
    """The header's (first identity key, end) made exact where float32 cannot hold them (>= 2^24; WebFace42M's
    42,474,558 is stored as 42,474,560, so two identity records would be read as images).

    `first` is the one key among those that round to the stored value whose record is an identity-range record
    (flag >= 2, no image) right after an image record (or, identity records not listed, the key after the last
    image); `end` is the last key + 1 when the identity records are listed, else `first` + the class count of
    `property`. Returns them and the line that says so in the run's log."""
    v_first, v_end = float(header.label[0]), float(header.label[1])
    last = r.max_key

    def record(key: int) -> tuple[IRHeader, bytes] | None:
        return unpack(r.read(key), f"{r.rec_path}: record {key}") if r.has(key) else None

    def is_identity(key: int) -> bool:
        rec = record(key)
        return rec is not None and rec[0].flag >= 2 and not rec[1]

    def is_image(key: int) -> bool:
        rec = record(key)
        return rec is not None and bool(rec[1])

    near = _rounding_to(v_first)
    firsts = [k for k in near if is_image(k - 1) and (is_identity(k) or k == last + 1)]
    if len(firsts) != 1:
        raise VtrainError(f"{r.rec_path}: header record 0 stores the first identity key as float32 ({v_first:.0f}), "
                          f"exact only below 2^24, and {'none' if not firsts else 'more than one'} of the keys that "
                          f"round to it ({near[0]}..{near[-1]}) follows the last image record with an identity "
                          "record; the .rec does not have the insightface layout")
    first = firsts[0]
    listed = is_identity(last)
    if listed:
        end, how = last + 1, f"identities {first}..{last} (record {first} is the first identity record)"
    elif property_classes is not None and first + property_classes in _rounding_to(v_end):
        end, how = first + property_classes, f"identity records not listed, {property_classes} classes from property"
    else:
        raise VtrainError(f"{r.rec_path}: header record 0 stores its end key as float32 ({v_end:.0f}), exact only "
                          f"below 2^24, {r.idx_path} lists no identity records after image {first - 1} and no "
                          "`property` file gives a class count that agrees: the class count cannot be made exact")
    return first, end, (f"{r.rec_path}: header record 0 holds the image/identity boundary as float32 "
                        f"({v_first:.0f}, {v_end:.0f}), exact only below 2^24; taken from {r.idx_path} and the records "
                        f"instead: images 1..{first - 1} (record {first - 1} is an image), {how}")


def _rounding_to(value: float) -> list[int]:
    """The integers that float32 rounds to `value` (one below 2^24; two or more above)."""
    f = np.float32(value)
    step = int(np.spacing(f))
    ks = np.arange(int(value) - step, int(value) + step + 1, dtype=np.int64)
    return [int(k) for k in ks[ks.astype(np.float32) == f]]


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
