"""Hugging Face datasets as training and evaluation data: `--data hf:PATH`.

PATH is a folder written by `save_to_disk` (a DatasetDict or a single Dataset, which is then the train split), a
folder of parquet files in the Hub's layout (`data/train-00000-of-00001.parquet`, `test.parquet`, ...: the split
comes from the file name), or a parquet file or glob (the train split). Nothing is downloaded: loading runs with
HF_DATASETS_OFFLINE / HF_HUB_OFFLINE. Rows are read from the memory-mapped Arrow files one at a time, so a large set
is not copied into RAM, and they go through the same transforms, sampler and evaluation as folder data:

- metric: columns `image` (an `Image` feature) + `label` (ClassLabel, int or str) -> `FaceFolder` samples;
- detection: `image` + `objects` with `bbox` (COCO xywh in pixels, as in the Hub's cppe-5) and `category`
  (ClassLabel or int), optional `image_id`, `width`, `height`, `objects.area`, `objects.iscrowd` -> an in-memory
  COCO set read by `CocoDetection` (box checks, aspect-ratio groups) and scored by COCOeval.

Splits: `train` for training; evaluation uses `validation` (or `valid`, `val`), else `test`.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vtrain.config import DEFAULT_MAX_IMAGE_PIXELS
from vtrain.data.coco import CocoDetection
from vtrain.data.coco_check import coco_from_dict
from vtrain.data.coco_index import MemoryIndex, records_of, write_targets
from vtrain.data.faces import FaceSamples
from vtrain.data.images import decode_rgb, image_size
from vtrain.data.labels import check_labels
from vtrain.errors import BadSample, VtrainError, shown

PREFIX = "hf:"
EVAL_SPLITS = ("validation", "valid", "val", "test")


def is_hf(path: str | None) -> bool:
    return isinstance(path, str) and path.startswith(PREFIX)


def _datasets():
    # before the first import: datasets reads these once (nothing may be fetched at run time)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets

    datasets.disable_progress_bars()
    return datasets


class HfSplits:
    """The splits of `--data hf:PATH`, opened lazily (memory-mapped), with dataset builders per task."""

    def __init__(self, spec: str) -> None:
        self.spec = spec
        path = spec[len(PREFIX):]
        ds = _datasets()
        p = Path(path)
        try:
            if p.is_dir() and ((p / "dataset_dict.json").is_file() or (p / "state.json").is_file()):
                loaded = ds.load_from_disk(str(p))
            elif p.is_dir():
                loaded = ds.load_dataset("parquet", data_dir=str(p))
            else:
                files = sorted(glob.glob(path))
                if not files:
                    raise VtrainError(f"--data {spec}: no such folder or parquet file")
                loaded = ds.load_dataset("parquet", data_files={"train": files})
        except VtrainError:
            raise
        except Exception as e:  # datasets raises many types (FileNotFoundError, ValueError, its own); one line
            first = (str(e).splitlines() or [type(e).__name__])[0]
            raise VtrainError(f"--data {spec}: cannot load it with Hugging Face datasets "
                              f"({type(e).__name__}: {first})") from None
        self.splits: dict[str, Any] = {"train": loaded} if isinstance(loaded, ds.Dataset) else dict(loaded)
        self.eval_split = next((s for s in EVAL_SPLITS if s in self.splits), None)

    def split(self, name: str):
        if name not in self.splits:
            raise VtrainError(f"--data {self.spec}: no {name!r} split (splits: {', '.join(self.splits)})")
        return self.splits[name]

    def where(self, split: str) -> str:
        return f"{self.spec}[{split}]"

    def faces(self, split: str, image_size: int, train: bool, seed: int = 0,
              max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> HfFaces:
        return HfFaces(self.split(split), self.where(split), image_size, train, seed, max_pixels)

    def detection(self, split: str, size: int, max_size: int, train: bool, seed: int = 0,
                  max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> HfDetection:
        return HfDetection(self.split(split), self.where(split), self._categories(), size, max_size, train, seed,
                           max_pixels)

    def _categories(self) -> list[dict[str, Any]]:
        """COCO categories shared by every split: a ClassLabel's names (id = class index), else the union of the
        integer ids over all splits, so labels mean the same in training and evaluation."""
        first = next(iter(self.splits.values()))
        check_columns(first, self.spec, "image", "objects")
        feat = _category_feature(first.features["objects"])
        if hasattr(feat, "names"):
            return [{"id": i, "name": n} for i, n in enumerate(feat.names)]
        source = f"--data {self.spec}: column 'objects.category'"
        ids = sorted({_whole(c, source) for d in self.splits.values() for objs in d["objects"]
                      for _, c, *_ in _objects(objs)})
        return [{"id": i, "name": str(i)} for i in ids]


def check_columns(ds, where: str, *names: str) -> None:
    missing = [n for n in names if n not in ds.features]
    if missing:
        raise VtrainError(f"--data {where}: missing column(s) {', '.join(missing)}; columns: "
                          f"{', '.join(ds.features)}")
    if "image" in names and not isinstance(ds.features["image"], _datasets().Image):
        raise VtrainError(f"--data {where}: column 'image' must be a datasets Image feature, "
                          f"not {ds.features['image']}")


class ImageColumn(Sequence):
    """The encoded images of an `Image` column, one row at a time, as (name, bytes) for `decode_rgb` (or the file
    path the row points to). Decoding stays in vtrain (torchvision, RGB), as for files."""

    def __init__(self, ds, where: str) -> None:
        self.ds = ds.select_columns(["image"]).cast_column("image", _datasets().Image(decode=False))
        self.where = where

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> tuple[str, bytes] | str:  # type: ignore[override]
        if not 0 <= i < len(self.ds):
            raise IndexError(i)
        cell = self.ds[int(i)]["image"]
        if cell is not None and cell.get("bytes") is not None:
            return f"{self.where} row {i}", cell["bytes"]
        if cell is not None and cell.get("path"):
            return cell["path"]
        # an empty cell (None) is a sample without an image: BadSample, which --skip-bad-images skips
        raise BadSample(f"--data {self.where}: row {i} has no image (empty cell)")


class _Samples(Sequence):
    """FaceFolder's (image, label) list, read lazily from the dataset."""

    def __init__(self, images: ImageColumn, labels: list[int]) -> None:
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):  # type: ignore[override]
        return self.images[i], self.labels[i]


class HfFaces(FaceSamples):
    """`image` + `label` rows as face samples: the same decoding, resize, [-1, 1] scaling and (epoch, index)-seeded
    flip as FaceFolder (FaceSamples.__getitem__), and FaceFolder's `samples` / `targets` / `classes`."""

    def __init__(self, ds, where: str, image_size: int, train: bool = True, seed: int = 0,
                 max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> None:
        check_columns(ds, where, "image", "label")
        self.root, self.image_size, self.train, self.seed = where, image_size, train, seed
        self.max_pixels = max_pixels
        feat = ds.features["label"]
        values = list(ds["label"])
        source = f"--data {where}: column 'label'"
        if hasattr(feat, "names"):  # ClassLabel: its index is the label (-1 marks an unlabelled row)
            self.classes = list(feat.names)
            self.num_classes_source = f"the {len(self.classes)} names of its ClassLabel"
            labels = check_labels(values, len(self.classes), source, count_from=self.num_classes_source).tolist()
        else:  # identity ids or names, numbered in sorted order
            if all(isinstance(v, str) for v in values):
                names = sorted(set(values))
            else:  # ids: whole numbers >= 0 (checked as labels of an unbounded class count; -1 is "no label")
                names = sorted(set(check_labels(values, 2**63 - 1, source).tolist()))
                values = [int(v) for v in values]
            pos = {c: i for i, c in enumerate(names)}
            labels = [pos[v] for v in values]
            self.classes = [str(c) for c in names]
            self.num_classes_source = f"the distinct values of {source}"
        if len(self.classes) < 2:
            raise VtrainError(f"--data {where}: need at least 2 identities (labels), found {len(self.classes)}")
        self.samples = _Samples(ImageColumn(ds, where), labels)
        self.targets = labels

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def __len__(self) -> int:
        return len(self.samples)

    def _read(self, idx: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[idx]
        return decode_rgb(path, max_pixels=self.max_pixels), label


def _whole(value: Any, source: str) -> int:
    """An id, size, category or crowd flag of a row as the integer the COCO checks (data/coco_check.py) expect:
    an integer, or a float column's whole number (exact below 2^53); anything else is one line naming the column,
    never silently truncated (`int(1.5)` is 1)."""
    if type(value) is int or (type(value) is float and value.is_integer() and abs(value) < 2**53):
        return int(value)
    raise VtrainError(f"{source} must hold whole numbers, got {shown(value)}")


def _category_feature(objects_feature):
    """The feature of `objects.category`: objects is a dict of lists (the legacy Sequence of a dict, cppe-5) or a
    list of dicts."""
    inner = getattr(objects_feature, "feature", objects_feature)
    if not isinstance(inner, dict) or "bbox" not in inner or "category" not in inner:
        raise VtrainError(f"column 'objects' must hold 'bbox' and 'category', got {objects_feature}")
    cat = inner["category"]
    return getattr(cat, "feature", cat) if isinstance(objects_feature, dict) else cat


def _objects(cell) -> list[tuple[Any, Any, Any, Any]]:
    """(bbox, category, area, iscrowd) per object of one row, for both layouts of `objects`."""
    if isinstance(cell, dict):  # dict of lists
        n = len(cell["bbox"])
        return [(cell["bbox"][j], cell["category"][j], (cell.get("area") or [None] * n)[j],
                 (cell.get("iscrowd") or [0] * n)[j]) for j in range(n)]
    return [(o["bbox"], o["category"], o.get("area"), o.get("iscrowd", 0)) for o in cell or []]


class HfDetection(CocoDetection):
    """`image` + `objects` rows as an in-memory COCO set: CocoDetection's box checks, transforms, targets and
    aspect-ratio groups, and a COCO ground truth for COCOeval."""

    def __init__(self, ds, where: str, categories: list[dict[str, Any]], size: int, max_size: int, train: bool,
                 seed: int = 0, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> None:
        check_columns(ds, where, "image", "objects")
        self.ann_file, self.image_dir, self.max_pixels = where, None, max_pixels
        self.images = ImageColumn(ds, where)
        cols = [c for c in ("image_id", "width", "height") if c in ds.features]
        table = ds.select_columns(["objects", *cols]).to_dict()
        n = len(ds)
        column = f"--data {where}: column"
        ids = ([_whole(v, f"{column} 'image_id'") for v in table["image_id"]] if "image_id" in table
               else list(range(1, n + 1)))
        if len(set(ids)) != n:
            raise VtrainError(f"--data {where}: column 'image_id' has repeated values")
        images, anns = [], []
        for row, image_id in enumerate(ids):
            if "width" in table and "height" in table:
                w, h = (_whole(table[k][row], f"{column} '{k}'") for k in ("width", "height"))
            else:  # read the size from the encoded header only
                w, h = image_size(self.images[row])
            images.append({"id": image_id, "width": w, "height": h, "file_name": f"row {row}"})
            for bbox, cat, area, crowd in _objects(table["objects"][row]):
                try:
                    box = [float(v) for v in bbox]
                except (TypeError, ValueError):
                    box = bbox  # CocoDetection reports it as a malformed bbox
                if area is None:  # COCOeval's area ranges read it; the box area stands in for a mask's
                    area = box[2] * box[3] if isinstance(box, list) and len(box) == 4 else 0.0
                anns.append({"id": len(anns) + 1, "image_id": image_id, "bbox": box, "area": area,
                             "category_id": _whole(cat, f"{column} 'objects.category'"),
                             "iscrowd": int(crowd) if type(crowd) is bool
                             else _whole(crowd or 0, f"{column} 'objects.iscrowd'")})
        data = {"images": images, "annotations": anns, "categories": categories}
        self._coco = coco_from_dict(data, where)  # the checks; kept as the ground truth COCOeval scores against
        self.index = MemoryIndex()
        write_targets(self.index, records_of(data), where)
        if not len(self):
            raise VtrainError(f"--data {where}: no rows")
        self.rows = np.argsort(np.array(ids, np.int64), kind="stable")  # the row of the idx-th image in id order
        self._setup(size, max_size, train, seed)

    def read(self, idx: int) -> torch.Tensor:
        return decode_rgb(self.images[int(self.rows[idx])], max_pixels=self.max_pixels)

    def name_of(self, idx: int) -> str:
        return f"{self.ann_file} row {int(self.rows[idx])}"
