"""A COCO detection file as flat arrays: what training reads of it, built once into the data index
(docs/data_index.md §3) and memory-mapped by every rank and DataLoader worker.

Per image, in image-id order: its id, width, height, file name and the slice of its training boxes in `boxes`
(float32 x0, y0, x1, y1 in pixels, already clipped and filtered) and `labels` (int32, the category's position
among the sorted category ids). No polygon, no crowd mask and no pycocotools object is kept: evaluation reads the
file with pycocotools itself (`CocoDetection.coco`).

Reading the file (`parse_coco`) takes one of two paths that accept the same files and give the same arrays:

- fast: msgspec decodes the JSON straight into typed records of only the fields training reads (polygons and RLE
  masks are skipped by the parser, never made into Python objects), the annotation list a chunk of about 32 MB of
  text at a time, each chunk turned into numpy arrays before the next is decoded. Anything it does not accept
  (a field of the wrong type or range, a repeated id, `NaN` in a box, another text encoding) sends the file to
- the reference path: `json` + `coco_check.check_coco` + pycocotools, today's reader, whose one-line error names
  the entry and the key (data/coco_check.py). A file that is valid there but not for msgspec (a box holding
  `NaN`, UTF-16 text) trains from its records as well.

The garbage collector is paused over either parse: the objects made are all kept, and its passes over millions of
them cost more than the parse (docs/data_index.md §3).
"""

from __future__ import annotations

import contextlib
import gc
import mmap
import re
from collections.abc import Iterator
from itertools import chain
from operator import attrgetter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from vtrain.data.coco_check import MAX_SIDE, coco_from_dict
from vtrain.errors import VtrainError, shown
from vtrain.io.records import MAX_CATEGORIES
from vtrain.io.records import categories as check_categories
from vtrain.io.records import loads

KIND, KIND_VERSION = "coco", 1
CHUNK = 32 << 20
"""Bytes of annotation text decoded at a time on the fast path."""
REPORT_KEYS = ("images", "boxes", "crowd", "clipped", "dropped_empty", "dropped_nonfinite", "unknown_image",
               "images_without_boxes")


@dataclass
class Records:
    """The fields of a checked COCO file that training reads, as arrays (file order)."""

    image_id: np.ndarray  # int64
    width: np.ndarray  # int64
    height: np.ndarray  # int64
    file_name: list[str]
    ann_id: np.ndarray  # int64 (for the error naming an annotation)
    ann_image: np.ndarray  # int64
    ann_category: np.ndarray  # int64
    bbox: np.ndarray  # float64 (n, 4): x, y, width, height
    crowd: np.ndarray  # bool
    categories: list[dict[str, Any]]


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


# ---- the fast path ----------------------------------------------------------------------------------------------
class _Image(msgspec.Struct, gc=False):
    id: int
    file_name: str
    width: int
    height: int


class _Annotation(msgspec.Struct, gc=False):
    id: int
    image_id: int
    category_id: int
    bbox: tuple[float, float, float, float]
    iscrowd: int | bool = 0
    area: float = 0.0


class _File(msgspec.Struct):
    images: msgspec.Raw
    annotations: msgspec.Raw
    categories: list[Any]


_BETWEEN = re.compile(rb"\}[ \t\n\r]*,[ \t\n\r]*\{")  # between two objects of a list: JSON whitespace only


class _Refused(Exception):
    """The fast path does not take this file: the reference path reads it (and names the problem, if any)."""


def _chunks(raw: msgspec.Raw, decoder: msgspec.json.Decoder, tries: int = 4) -> Iterator[list]:
    """The list of objects `raw` decoded about CHUNK bytes at a time, cut only between two of its elements. A cut
    is tried after a `}` followed by `,` and `{`; one that falls inside an element (a `}, {` within a string or a
    nested object) leaves an unterminated string or structure in the chunk, which does not decode, and the next
    such place is tried instead; after `tries` such failures the rest is decoded at once (so a genuinely bad
    element costs at most `tries` extra partial decodes, never one per later cut)."""
    view = memoryview(raw)
    if len(view) < 2 or view[0] != ord("[") or view[-1] != ord("]"):
        raise _Refused
    pos = 1
    while True:
        cut = _BETWEEN.search(view, pos + CHUNK) if len(view) - pos > 2 * CHUNK else None
        left, part = tries, None
        while cut is not None and left and part is None:
            try:
                part = decoder.decode(b"[" + view[pos:cut.start() + 1] + b"]")
            except (msgspec.DecodeError, msgspec.ValidationError):
                cut, left = _BETWEEN.search(view, cut.end() - 1), left - 1
        if part is None:
            yield decoder.decode(b"[" + view[pos:])
            return
        yield part
        pos = cut.end() - 1


def _column(items: list, field: str, dtype: type = np.int64) -> np.ndarray:
    """One field of decoded records as an array (an integer beyond int64 raises OverflowError: refused)."""
    return np.fromiter(map(attrgetter(field), items), dtype, count=len(items))


def _unique(ids: np.ndarray) -> None:
    s = np.sort(ids)
    if len(s) > 1 and bool((s[1:] == s[:-1]).any()):
        raise _Refused


def _fast(buf: Any) -> Records:
    try:
        top = msgspec.json.decode(buf, type=_File)
        images = [im for part in _chunks(top.images, msgspec.json.Decoder(list[_Image])) for im in part]
        cols: dict[str, list[np.ndarray]] = {k: [] for k in ("id", "image", "category", "bbox", "crowd")}
        for part in _chunks(top.annotations, msgspec.json.Decoder(list[_Annotation])):
            crowd = _column(part, "iscrowd")
            if not (((crowd == 0) | (crowd == 1)).all() and (_column(part, "area", np.float64) >= 0).all()):
                raise _Refused
            for key, field in (("id", "id"), ("image", "image_id"), ("category", "category_id")):
                cols[key].append(_column(part, field))
            cols["bbox"].append(np.fromiter(chain.from_iterable(map(attrgetter("bbox"), part)), np.float64,
                                            count=4 * len(part)).reshape(-1, 4))
            cols["crowd"].append(crowd.astype(bool))
            del part
        width, height, image_id = (_column(images, k) for k in ("width", "height", "id"))
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError, OverflowError):
        raise _Refused from None
    names = [im.file_name for im in images]
    del images
    if not (all(n and "\0" not in n for n in names) and ((width >= 1) & (width <= MAX_SIDE)).all()
            and ((height >= 1) & (height <= MAX_SIDE)).all()):
        raise _Refused
    empty = {"bbox": np.zeros((0, 4)), "crowd": np.zeros(0, bool)}
    ann = {}
    for k in list(cols):  # one column at a time, its chunks freed as it is joined
        parts = cols.pop(k)
        ann[k] = np.concatenate(parts) if parts else empty.get(k, np.zeros(0, np.int64))
        del parts
    if not np.isfinite(ann["bbox"]).all():  # (msgspec refuses NaN and out-of-range numbers: never here)
        raise _Refused
    _unique(image_id)
    _unique(ann["id"])
    try:
        cats = check_categories(top.categories, "categories")
    except VtrainError:
        raise _Refused from None
    return Records(image_id, width, height, names, ann["id"], ann["image"], ann["category"], ann["bbox"],
                   ann["crowd"], cats)


# ---- the reference path -----------------------------------------------------------------------------------------
def records_of(data: dict) -> Records:
    """The Records of a COCO dict that coco_check.check_coco and check_unique accepted."""
    images, anns = data["images"], data["annotations"]
    return Records(
        np.array([im["id"] for im in images], np.int64).reshape(-1),
        np.array([im["width"] for im in images], np.int64).reshape(-1),
        np.array([im["height"] for im in images], np.int64).reshape(-1),
        [im["file_name"] for im in images],
        np.array([a["id"] for a in anns], np.int64).reshape(-1),
        np.array([a["image_id"] for a in anns], np.int64).reshape(-1),
        np.array([a["category_id"] for a in anns], np.int64).reshape(-1),
        np.array([[float(v) for v in a["bbox"]] for a in anns], np.float64).reshape(-1, 4),
        np.array([bool(a.get("iscrowd", 0)) for a in anns], bool).reshape(-1),
        data["categories"])


def parse_coco(path: Path, where: str) -> Records:
    """The checked Records of the COCO file at `path` (`where` names it in errors)."""
    with gc_paused():
        try:
            # mapped, not read: the text is page cache the kernel can drop, not this process's memory; the map
            # is closed when the last view of it (msgspec.Raw) is gone
            with open(path, "rb") as f:
                text = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            return _fast(text)
        except (_Refused, OSError, ValueError):  # (an empty file cannot be mapped) the reference path reads it
            pass
        try:
            data = loads(path.read_bytes())  # nesting beyond json's recursion is "not valid JSON" (records.loads)
        except (OSError, ValueError) as e:
            raise VtrainError(f"{where} is not valid JSON ({e})") from None
        coco_from_dict(data, where)  # every check and its one-line error (coco_check.py)
        return records_of(data)


# ---- training targets -------------------------------------------------------------------------------------------
def write_targets(out: Any, r: Records, where: str) -> None:
    """Fill an IndexWriter (or MemoryIndex) with the training targets of `r`: images in id order; per image its
    annotations in file order, crowd boxes left out, boxes clipped to the image, boxes with NaN/inf coordinates or
    less than 1 pixel of width or height left dropped, each counted in `info["report"]`."""
    order = np.argsort(r.image_id, kind="stable")
    ids = r.image_id[order]
    n = len(ids)
    cat_ids = np.array(sorted(c["id"] for c in r.categories), np.int64)
    # each annotation's image (its position in id order) and label (its category's position in sorted ids)
    pos = np.minimum(np.searchsorted(ids, r.ann_image), max(n - 1, 0))
    known = ids[pos] == r.ann_image if n else np.zeros(len(pos), bool)
    width, height = (r.width[order], r.height[order]) if n else (np.zeros(1, np.int64), np.zeros(1, np.int64))
    label = np.minimum(np.searchsorted(cat_ids, r.ann_category), len(cat_ids) - 1)
    bad = np.flatnonzero(known & (cat_ids[label] != r.ann_category))
    if len(bad):  # the first in the order images are read (by image id, then file order); raised by the data set
        first = bad[np.lexsort((bad, pos[bad]))[0]]  # after its image checks, where it always was
        out.info["unknown_category"] = (f"{where}: annotation {r.ann_id[first]} has category id "
                                        f"{r.ann_category[first]}, which is not in 'categories'")
    crowd = known & r.crowd
    x, y, bw, bh = r.bbox.T
    finite = np.isfinite(r.bbox).all(axis=1)
    use = known & ~crowd & finite
    w, h = width[pos].astype(np.float64), height[pos].astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):  # (NaN/inf rows are not used)
        x0, y0, x1, y1 = np.maximum(x, 0.0), np.maximum(y, 0.0), np.minimum(x + bw, w), np.minimum(y + bh, h)
        clipped = use & ((x0 != x) | (y0 != y) | (x1 != x + bw) | (y1 != y + bh))
        empty = use & ((x1 - x0 < 1.0) | (y1 - y0 < 1.0))
    keep = np.flatnonzero(use & ~empty)
    keep = keep[np.argsort(pos[keep], kind="stable")]
    counts = np.bincount(pos[keep], minlength=n)
    out.array("image_ids", ids)
    out.array("width", r.width[order].astype(np.int32))  # (1..2^31 - 1: coco_check.MAX_SIDE)
    out.array("height", r.height[order].astype(np.int32))
    out.strings("file_names", (r.file_name[i] for i in order.tolist()))
    out.array("box_start", np.concatenate([[0], np.cumsum(counts)]).astype(np.int64))
    out.array("boxes", np.stack([v[keep] for v in (x0, y0, x1, y1)], axis=1).astype(np.float32).reshape(-1, 4))
    out.array("labels", label[keep].astype(np.int32))
    by_id = {c["id"]: c for c in r.categories}
    out.array("cat_ids", cat_ids)
    out.strings("cat_names", (by_id[c].get("name", str(c)) for c in cat_ids.tolist()))
    out.info["report"] = {
        "images": n, "boxes": len(keep), "crowd": int(crowd.sum()), "clipped": int(clipped.sum()),
        "dropped_empty": int(empty.sum()), "dropped_nonfinite": int((known & ~crowd & ~finite).sum()),
        "unknown_image": int((~known).sum()), "images_without_boxes": int((counts == 0).sum())}


def check_index(ix: Any) -> None:
    """The layout of a COCO index (data/index.py `check`), as `write_targets` writes it: per image an id (sorted,
    unique), a width and height in 1..MAX_SIDE, a file name and the start of its boxes (0 to the box count, never
    going back); per box 4 finite coordinates and a label below the category count; the category ids sorted and
    unique, with a name each; the report's counts."""
    report = ix.expect_info("report", dict)
    if sorted(report) != sorted(REPORT_KEYS) or not all(type(v) is int and v >= 0 for v in report.values()):
        raise ix.damaged(f"meta.json's info.report is {shown(report)}, expected the counts {', '.join(REPORT_KEYS)}")
    if ix.info.get("unknown_category") is not None:
        ix.expect_info("unknown_category", str)
    n = len(ix.expect("image_ids", "<i8", (None,)))
    cats = len(ix.expect("cat_ids", "<i8", (None,)))
    for name in ("width", "height"):
        ix.expect(name, "<i4", (n,))
        ix.within(name, 1, MAX_SIDE, "image sides")
    ix.expect_strings("file_names", n)
    ix.expect_strings("cat_names", cats)
    start = ix.expect("box_start", "<i8", (n + 1,))
    boxes = len(ix.expect("boxes", "<f4", (None, 4)))
    ix.expect("labels", "<i4", (boxes,))
    if start[0] != 0 or start[-1] != boxes or not ix.sorted("box_start"):
        raise ix.damaged(f"box_start does not run from 0 to its {boxes} boxes in order")
    if not (ix.sorted("image_ids", strict=True) and ix.sorted("cat_ids", strict=True)) or cats > MAX_CATEGORIES:
        raise ix.damaged(f"its image or category ids are not sorted and unique, or more than {MAX_CATEGORIES} "
                         "categories")
    ix.within("boxes", -MAX_SIDE, MAX_SIDE, "box coordinates")
    ix.within("labels", 0, cats - 1, f"the labels of {cats} categories")


class MemoryIndex:
    """The arrays of an index held in this process (a Hugging Face set, already in memory): IndexWriter's and
    Index's interface, pickled whole."""

    def __init__(self) -> None:
        self.arrays: dict[str, np.ndarray] = {}
        self.info: dict[str, Any] = {}

    def array(self, name: str, values: np.ndarray | None = None) -> np.ndarray:
        if values is not None:
            self.arrays[name] = np.ascontiguousarray(values)
            self.arrays[name].flags.writeable = False
        return self.arrays[name]

    def strings(self, name: str, items: Any = None) -> list[str]:
        if items is not None:
            self.arrays[name] = list(items)  # type: ignore[assignment]
        return self.arrays[name]  # type: ignore[return-value]
