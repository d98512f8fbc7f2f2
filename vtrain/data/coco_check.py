"""The fields of a COCO detection file, checked once, when it is read, for every reader: the training and evaluation
sets (`vtrain train`, `vtrain eval --val-ann`), `vtrain predict --ann`, and Hugging Face detection sets, which
data/hf.py turns into the same dict.

Downstream code trusts these fields: torch makes the batch's `image_id` tensor from the id, pycocotools indexes
images, annotations and categories by id (a repeated id silently replaces the earlier entry), COCOeval compares
`area` with its area ranges and reads `iscrowd` as an integer, and the category ids and names go into every
checkpoint's categories.json. A value of the wrong type would otherwise fail there, with a traceback, often only at
the final evaluation, or not at all (boxes trained on the wrong image). So each is checked here for its type and
range, and a problem is one line naming the file, the entry and the key. Categories follow `records.categories`,
the rule the checkpoint reader applies to categories.json (docs/input_limits.md §7).

Ids are JSON integers (not `1.0`, not `"1"`): they are matched exactly between images, annotations, detections and
pycocotools, and a float id turns the batch's id tensor into floats, exact only below 2^24.
"""

from __future__ import annotations

import contextlib
import io
import math
from typing import Any

from vtrain.errors import VtrainError, shown
from vtrain.io.records import INT64, categories

MAX_SIDE = 2**31 - 1
"""The largest image width or height: PNG's limit for its four-byte dimensions (docs/input_limits.md §7)."""


def _int(v: Any, low: int, high: int) -> bool:
    return type(v) is int and low <= v <= high  # `type` is int: JSON true is not a number here


def _number(v: Any) -> bool:
    return type(v) in (int, float)


def _box(bbox: Any) -> list[float] | None:
    """A bbox as 4 floats, or None when it is not 4 numbers (an integer beyond float range included)."""
    if type(bbox) is not list or len(bbox) != 4 or not all(map(_number, bbox)):
        return None
    try:
        return [float(v) for v in bbox]
    except OverflowError:
        return None


def _problem(where: str, what: str, entry: dict, key: str, want: str) -> VtrainError:
    if key not in entry:
        return VtrainError(f"{where}: {what}: `{key}` is missing")
    return VtrainError(f"{where}: {what}: `{key}` must be {want}, got {shown(entry[key])}")


def check_coco(data: Any, where: str) -> None:
    """Check a parsed COCO detection file (`where` names it in errors); fills in `area` where an annotation lacks
    it (the box's, which COCOeval's area ranges then read, as for a box without a mask). Repeated image and
    annotation ids are found by `check_unique` once pycocotools has indexed the file."""
    if not isinstance(data, dict):
        raise VtrainError(f"{where} is not a COCO detection file: expected a JSON object, got {shown(data)}")
    for key in ("images", "annotations", "categories"):
        if key not in data:
            raise VtrainError(f"{where} is not a COCO detection file: missing {key!r}")
        if not isinstance(data[key], list):
            raise VtrainError(f"{where}: `{key}` must be a list, got {shown(data[key])}")
    categories(data["categories"], f"{where}: categories")  # first: their count is bounded before anything else
    for i, img in enumerate(data["images"]):
        what = f"images[{i}]"
        if type(img) is not dict:
            raise VtrainError(f"{where}: {what} must be an object, got {shown(img)}")
        if not _int(img.get("id"), *INT64):
            raise _problem(where, what, img, "id", "an integer in -2^63..2^63-1")
        name = img.get("file_name")
        if type(name) is not str or not name or "\0" in name:
            raise _problem(where, what, img, "file_name", "a non-empty string (a path without NUL)")
        for key in ("width", "height"):
            if not _int(img.get(key), 1, MAX_SIDE):
                raise _problem(where, what, img, key, f"an integer in 1..{MAX_SIDE}")
    for i, ann in enumerate(data["annotations"]):
        what = f"annotations[{i}]"
        if type(ann) is not dict:
            raise VtrainError(f"{where}: {what} must be an object, got {shown(ann)}")
        for key in ("id", "image_id", "category_id"):
            if not _int(ann.get(key), *INT64):
                raise _problem(where, what, ann, key, "an integer in -2^63..2^63-1")
        box = _box(ann.get("bbox"))
        if box is None:  # (NaN and inf are numbers: CocoDetection counts and drops such boxes)
            raise _problem(where, what, ann, "bbox", "a list of 4 numbers [x, y, width, height]")
        if ann.get("iscrowd", 0) not in (0, 1) or type(ann.get("iscrowd", 0)) not in (int, bool):
            raise _problem(where, what, ann, "iscrowd", "0 or 1")
        if "area" not in ann:
            ann["area"] = box[2] * box[3] if all(map(math.isfinite, box)) else 0.0
        elif not _number(ann["area"]) or not 0 <= ann["area"] < math.inf:
            raise _problem(where, what, ann, "area", "a finite number >= 0")


def check_unique(data: dict, coco: Any, where: str) -> None:
    """After pycocotools indexed `data` into `coco`: every image and annotation id once (an index with fewer
    entries than the file means a repeated id, whose earlier entry the index silently replaced)."""
    for key, index in (("images", coco.imgs), ("annotations", coco.anns)):
        if len(index) == len(data[key]):
            continue
        seen: dict[int, int] = {}
        for i, entry in enumerate(data[key]):
            if entry["id"] in seen:
                raise VtrainError(f"{where}: {key}[{seen[entry['id']]}] and {key}[{i}] have the same id "
                                  f"{entry['id']} (ids must be unique)")
            seen[entry["id"]] = i


def coco_from_dict(data: dict, where: str):
    """pycocotools COCO object over an in-memory COCO dict (`where` names its source in errors), every field
    checked first (data/coco_check.py)."""
    from pycocotools.coco import COCO  # evaluation's and the fallback reader's; not imported for training

    check_coco(data, where)
    coco = COCO()
    coco.dataset = data
    with contextlib.redirect_stdout(io.StringIO()):
        coco.createIndex()
    check_unique(data, coco, where)
    return coco
