"""COCO-format detection data: the training targets from the shared data index (coco_index.py), pycocotools for
evaluation, torchvision.transforms.v2 with bounding-box tv_tensors for the DINO augmentation recipe, padded batches
with masks.

Annotation problems are handled once, when the index is built, and reported as counts: crowd boxes are left out of
training (COCOeval handles them in evaluation), boxes are clipped to the image, boxes with no area left are dropped.
Unknown category ids, missing image files and unreadable JSON are errors, and so is a field of the wrong type or
range, found when the file is read (coco_check.py).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset
from torchvision import tv_tensors
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as TF

from vtrain.config import DEFAULT_MAX_IMAGE_PIXELS
from vtrain.data.coco_check import coco_from_dict
from vtrain.data.coco_index import KIND, KIND_VERSION, check_index, gc_paused, parse_coco, write_targets
from vtrain.data.images import decode_rgb
from vtrain.data.index import Index, file_identity, open_index
from vtrain.errors import BadSample, VtrainError
from vtrain.io.records import loads

MEAN = (0.485, 0.456, 0.406)  # ImageNet statistics (MMD preprocessor 123.675/116.28/103.53, 58.395/57.12/57.375)
STD = (0.229, 0.224, 0.225)
PAD_DIVISOR = 32  # every backbone level (stride <= 32) gets an integral size


@dataclass
class AnnotationReport:
    images: int = 0
    boxes: int = 0
    crowd: int = 0
    clipped: int = 0
    dropped_empty: int = 0
    dropped_nonfinite: int = 0
    unknown_image: int = 0
    images_without_boxes: int = 0
    unreadable_images: list[str] = field(default_factory=list)

    def summary(self, name: str) -> str:
        return (f"{name}: {self.images} images, {self.boxes} boxes; crowd boxes left out {self.crowd}, clipped to the "
                f"image {self.clipped}, dropped (no area) {self.dropped_empty}, dropped (NaN/inf coordinates) "
                f"{self.dropped_nonfinite}, annotations of image ids not in 'images' {self.unknown_image}, images "
                f"without boxes {self.images_without_boxes}")


def load_coco(ann_file: str | Path):
    """pycocotools COCO object with its progress prints silenced (evaluation); malformed files are one-line
    errors."""
    path = Path(ann_file)
    if not path.is_file():
        raise VtrainError(f"annotation file not found: {path}")
    try:
        with gc_paused():  # millions of objects kept: the collector's passes over them cost more than the parse
            data = loads(path.read_bytes())  # nesting beyond json's recursion is "not valid JSON" (records.loads)
    except (OSError, ValueError) as e:
        raise VtrainError(f"{path} is not valid JSON ({e})") from None
    return coco_from_dict(data, str(path))


def coco_index(ann_file: Path) -> Index:
    """The shared index of the COCO file `ann_file` (data/coco_index.py), built on first use."""
    if not ann_file.is_file():
        raise VtrainError(f"annotation file not found: {ann_file}")
    where = str(ann_file)
    try:
        source = {"annotations": file_identity(ann_file)}
    except OSError as e:
        raise VtrainError(f"{where} is not valid JSON ({e})") from None
    return open_index(KIND, KIND_VERSION, source, lambda w: write_targets(w, parse_coco(ann_file, where), where),
                      check_index)


def missing_files(image_dir: Path, index: Index) -> tuple[int, str | None]:
    """How many of the index's file names are not files under `image_dir`, and the first of them. Each folder is
    listed once (os.scandir; its entries' `is_file` follows links as `Path.is_file` does) instead of a stat per
    image: Objects365 lists 1.7M files. Names are compared as the bytes the file system holds; a name a listing
    cannot decide (ending in `/`, `.` or `..`) is checked on its own, as `Path` joins it."""
    blob, ends = index.array("file_names.blob").tobytes(), index.array("file_names.offsets").tolist()
    root = os.fsencode(image_dir)
    listed: dict[bytes, set[bytes] | None] = {}
    missing, first = 0, None
    for a, b in zip(ends, ends[1:]):
        name = blob[a:b]
        head, _, tail = name.rpartition(b"/")
        files = listed.get(head, ())
        if files == ():
            try:
                with os.scandir(os.path.join(root, head)) as it:
                    files = listed[head] = {e.name for e in it if e.is_file()}
            except OSError:
                files = listed[head] = None
        if files is None or tail in (b"", b".", b".."):
            there = (image_dir / name.decode("utf-8", "surrogateescape")).is_file()
        else:
            there = tail in files
        if not there:
            missing += 1
            first = first or name.decode("utf-8", "surrogateescape")
    return missing, first


class RandomSizeCrop(v2.Transform):
    """Crop of random height and width in [lo, hi] pixels (clamped to the image), anywhere in the image
    (MMD RandomCrop with crop_type='absolute_range', allow_negative_crop=True)."""

    def __init__(self, lo: int, hi: int) -> None:
        super().__init__()
        self.lo, self.hi = lo, hi

    def make_params(self, flat_inputs: list) -> dict:
        h, w = v2.query_size(flat_inputs)
        ch = int(torch.randint(min(self.lo, h), min(self.hi, h) + 1, ()))
        cw = int(torch.randint(min(self.lo, w), min(self.hi, w) + 1, ()))
        top = int(torch.randint(0, h - ch + 1, ()))
        left = int(torch.randint(0, w - cw + 1, ()))
        return {"top": top, "left": left, "height": ch, "width": cw}

    def transform(self, inpt, params: dict):
        return self._call_kernel(TF.crop, inpt, **params)


def train_transforms(size: int, max_size: int) -> v2.Transform:
    """DINO training augmentation (docs/dino.md §1.1), scaled with `size` (800 = the recipe): flip, then either
    multi-scale resize (short side 0.6-1.0 x size in 25 steps, i.e. 480-800 step 32; long side <= max_size) or
    resize to {0.5, 0.625, 0.75} x size, random crop of 0.48-0.75 x size, and the same multi-scale resize."""
    f = size / 800
    scales = sorted({int(round(s * f)) for s in range(480, 801, 32)})
    crop_scales = [int(round(s * f)) for s in (400, 500, 600)]
    return v2.Compose([
        v2.RandomHorizontalFlip(0.5),
        v2.RandomChoice([
            v2.RandomShortestSize(scales, max_size),
            v2.Compose([v2.RandomShortestSize(crop_scales, int(4200 * f)),
                        RandomSizeCrop(int(round(384 * f)), int(round(600 * f))),
                        v2.RandomShortestSize(scales, max_size)]),
        ]),
        v2.ClampBoundingBoxes(),
        v2.SanitizeBoundingBoxes(min_size=1.0),
    ])


def test_transforms(size: int, max_size: int) -> v2.Transform:
    return v2.Resize(size, max_size=max_size)


def resize_cap(size: int, max_size: int, train: bool) -> int:
    """The smallest longest-side cap the transforms above resize an image to: `max_size` at test time; in training
    also the crop branch's first resize (4200 x size / 800), when smaller."""
    return min(max_size, int(4200 * size / 800)) if train else max_size


def check_resizable(height: int, width: int, cap: int, what: str) -> None:
    """An image the resize can scale: with its long side capped at `cap` pixels its short side must stay at least 2
    pixels (torchvision's Resize and RandomShortestSize make a side of 0 pixels, and fail, below 1; 2 leaves room
    for their rounding), i.e. long side <= cap x short side / 2 (666:1 at the recipe's 1333). A longer strip (a
    1 x 100000 image) is a BadSample naming it, before any transform: one error line, or skipped with
    --skip-bad-images in training (docs/input_limits.md §11)."""
    if 2 * max(height, width) > cap * min(height, width):
        raise BadSample(f"cannot use image {what}: {width}x{height} pixels is too elongated for the detector's "
                        f"resize (its long side capped at {cap} would leave the short side under 2 pixels; at most "
                        f"{cap // 2}:1)")


def normalize(img: torch.Tensor) -> torch.Tensor:
    """uint8 CHW image -> the float model input (ImageNet statistics)."""
    return TF.normalize(img.float().div_(255.0), MEAN, STD)


class CocoDetection(Dataset):
    """Images of a COCO annotation file with training targets: labels (contiguous, sorted category ids) and
    boxes (cxcywh normalised to the transformed image). The file is read once into the shared data index
    (data/coco_index.py, docs/data_index.md): the data set keeps the index's folder, so a DataLoader worker
    receives a path and maps the same arrays."""

    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    """Largest image decoded (--max-image-pixels); larger ones are refused from their header."""

    def __init__(self, ann_file: str | Path, image_dir: str | Path, size: int, max_size: int, train: bool,
                 seed: int = 0, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> None:
        self.ann_file, self.image_dir, self.max_pixels = Path(ann_file), Path(image_dir), max_pixels
        self._coco = None
        self.index = coco_index(self.ann_file)
        if not len(self):
            raise VtrainError(f"{self.ann_file} lists no images")
        if not self.image_dir.is_dir():
            raise VtrainError(f"image folder not found: {self.image_dir}")
        missing, first = missing_files(self.image_dir, self.index)
        if missing:
            raise VtrainError(f"{missing} of {len(self)} images listed in {self.ann_file.name} are missing "
                              f"from {self.image_dir}, e.g. {self.image_dir / first}")
        self._setup(size, max_size, train, seed)

    def _setup(self, size: int, max_size: int, train: bool, seed: int) -> None:
        """Labels, the annotation report and transforms over `self.index`: shared by annotation files and
        in-memory COCO sets (data/hf.py), so both go through the same checks."""
        self.train, self.seed = train, seed
        info = self.index.info
        if info.get("unknown_category"):
            raise VtrainError(info["unknown_category"])
        self.cat_ids = [int(c) for c in self.index.array("cat_ids")]
        self.names = list(self.index.strings("cat_names"))
        self.report = AnnotationReport(**info["report"])
        if train and self.report.boxes == 0:
            raise VtrainError(f"{self.ann_file}: no usable boxes to train on ({self.report.summary('annotations')})")
        self.transforms = train_transforms(size, max_size) if train else test_transforms(size, max_size)
        self.cap = resize_cap(size, max_size, train)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_coco": None}  # a worker needs the index's path, not pycocotools' object

    @property
    def coco(self):
        """pycocotools' COCO object of the file, for evaluation (COCOeval): read on first use, in this process."""
        if self._coco is None:
            self._coco = load_coco(self.ann_file)
        return self._coco

    @property
    def ids(self) -> np.ndarray:
        """The image ids in training order (sorted)."""
        return self.index.array("image_ids")

    @property
    def group_ids(self) -> np.ndarray:
        """Aspect-ratio groups for batching (landscape 0 / portrait 1), as the recipe's AspectRatioBatchSampler."""
        return (self.index.array("width") < self.index.array("height")).astype(np.int8)

    @property
    def targets(self) -> Targets:
        return Targets(self.index)

    @property
    def num_classes(self) -> int:
        return len(self.cat_ids)

    @property
    def categories(self) -> list[dict]:
        """COCO `categories` entries (id, name) in label order; saved with checkpoints for `vtrain predict`."""
        return [{"id": int(c), "name": n} for c, n in zip(self.cat_ids, self.names)]

    def __len__(self) -> int:
        return len(self.ids)

    def read(self, idx: int) -> torch.Tensor:
        return decode_rgb(self.image_dir / self.index.strings("file_names")[idx], max_pixels=self.max_pixels)

    def name_of(self, idx: int) -> str:
        """How errors name image `idx`: its file."""
        return str(self.image_dir / self.index.strings("file_names")[idx])

    def __getitem__(self, key: int | tuple[int, int]) -> dict[str, torch.Tensor]:
        # The sampler passes (epoch, index): the augmentation is seeded by both (in a forked RNG, so the
        # model's random state is untouched), so a resumed run sees the same samples as an uninterrupted one.
        epoch, idx = key if isinstance(key, tuple) else (0, key)
        img = self.read(idx)
        h0, w0 = img.shape[-2:]
        check_resizable(h0, w0, self.cap, self.name_of(idx))
        xyxy, labels = self.targets[idx]
        boxes = tv_tensors.BoundingBoxes(torch.from_numpy(xyxy), format="XYXY", canvas_size=(h0, w0))
        with torch.random.fork_rng(devices=[]):
            # the CPU generator only (the transforms draw from it): torch.manual_seed would also queue a lazy seed
            # of every CUDA device, with a captured stack (~1 ms a sample, a third of a demo sample's loading)
            torch.default_generator.manual_seed(hash((self.seed, epoch, idx)) & 0x7FFFFFFF)
            img, target = self.transforms(tv_tensors.Image(img), {"boxes": boxes, "labels": torch.from_numpy(labels)})
        h, w = img.shape[-2:]
        cxcywh = TF.convert_bounding_box_format(target["boxes"], new_format=tv_tensors.BoundingBoxFormat.CXCYWH)
        norm = torch.tensor([w, h, w, h], dtype=torch.float32)
        return {"images": normalize(img), "boxes": cxcywh.as_subclass(torch.Tensor).float() / norm,
                "labels": target["labels"], "image_id": torch.tensor(int(self.ids[idx])),
                "orig_size": torch.tensor([h0, w0]), "index": torch.tensor(idx)}


class Targets(Sequence):
    """Per image (in `ids` order) its training boxes (float32 x0, y0, x1, y1 pixels) and labels (int64), read
    from the index's flat arrays."""

    def __init__(self, index) -> None:
        self.index = index

    def __len__(self) -> int:
        return len(self.index.array("image_ids"))

    def __getitem__(self, idx: int) -> tuple[np.ndarray, np.ndarray]:  # type: ignore[override]
        n = len(self)
        if not -n <= idx < n:
            raise IndexError(idx)
        start = self.index.array("box_start")
        a, b = int(start[idx % n]), int(start[idx % n + 1])
        return np.array(self.index.array("boxes")[a:b]), self.index.array("labels")[a:b].astype(np.int64)


def collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Pad images to a common size (a multiple of 32) with a padding mask; pad targets to the largest count."""
    b = len(samples)
    h = max(s["images"].shape[1] for s in samples)
    w = max(s["images"].shape[2] for s in samples)
    h, w = -(-h // PAD_DIVISOR) * PAD_DIVISOR, -(-w // PAD_DIVISOR) * PAD_DIVISOR
    images = torch.zeros(b, 3, h, w)
    masks = torch.ones(b, h, w, dtype=torch.bool)
    m = max(max(len(s["labels"]) for s in samples), 1)
    boxes = torch.zeros(b, m, 4)
    labels = torch.zeros(b, m, dtype=torch.long)
    for i, s in enumerate(samples):
        _, ih, iw = s["images"].shape
        images[i, :, :ih, :iw] = s["images"]
        masks[i, :ih, :iw] = False
        n = len(s["labels"])
        boxes[i, :n] = s["boxes"]
        labels[i, :n] = s["labels"]
    return {"images": images, "masks": masks, "boxes": boxes, "labels": labels,
            "num_targets": torch.tensor([len(s["labels"]) for s in samples]),
            "image_id": torch.stack([s["image_id"] for s in samples]),
            "orig_size": torch.stack([s["orig_size"] for s in samples]),
            "index": torch.stack([s["index"] for s in samples])}
