"""Built-in demo data for detection: a deterministic synthetic shape set written as JPEG files + COCO JSON.

Four classes (circle, square, triangle, cross) in varied sizes, colours and aspect ratios, with overlaps, on
gradient, striped or noisy backgrounds with distractor clutter, on images of varied sizes. Written once to a
cache dir in the standard COCO layout (annotations/instances_{train,val}2017.json, train2017/, val2017/), so
`--data demo` runs the same loading code as real COCO.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

from vtrain.data.cache import cached_dir

VERSION = 1
CLASSES = ("circle", "square", "triangle", "cross")
SPLITS = {"train": 240, "val": 40}


def _background(rng: np.random.Generator, w: int, h: int) -> Image.Image:
    kind = rng.integers(3)
    c1, c2 = rng.integers(0, 256, 3), rng.integers(0, 256, 3)
    if kind == 0:  # linear gradient
        t = np.linspace(0, 1, w)[None, :, None] if rng.random() < 0.5 else np.linspace(0, 1, h)[:, None, None]
        arr = c1 * (1 - t) + c2 * t
        arr = np.broadcast_to(arr, (h, w, 3))
    elif kind == 1:  # stripes
        yy, xx = np.mgrid[0:h, 0:w]
        a, f = rng.uniform(0, np.pi), rng.uniform(0.03, 0.12)
        t = (np.sin((xx * np.cos(a) + yy * np.sin(a)) * f) * 0.5 + 0.5)[..., None]
        arr = c1 * (1 - t) + c2 * t
    else:  # smooth noise
        small = rng.integers(0, 256, (max(h // 16, 2), max(w // 16, 2), 3)).astype(np.uint8)
        arr = np.asarray(Image.fromarray(small).resize((w, h), Image.BICUBIC), dtype=np.float64)
    arr = arr + rng.normal(0, 6, (h, w, 3))
    return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))


def _draw_shape(draw: ImageDraw.ImageDraw, cls: int, box: tuple[float, float, float, float], color) -> None:
    x0, y0, x1, y1 = box
    if cls == 0:
        draw.ellipse(box, fill=color)
    elif cls == 1:
        draw.rectangle(box, fill=color)
    elif cls == 2:
        draw.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=color)
    else:
        tw, th = (x1 - x0) / 3, (y1 - y0) / 3
        draw.rectangle((x0 + tw, y0, x1 - tw, y1), fill=color)
        draw.rectangle((x0, y0 + th, x1, y1 - th), fill=color)


def _image(rng: np.random.Generator) -> tuple[Image.Image, list[tuple[int, list[float]]]]:
    w, h = int(rng.integers(160, 257)), int(rng.integers(128, 225))
    img = _background(rng, w, h)
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(0, 4))):  # clutter: thin lines and small dots, not objects
        pts = [tuple(int(v) for v in rng.integers(0, (w, h))) for _ in range(2)]
        draw.line(pts, fill=tuple(int(c) for c in rng.integers(0, 256, 3)), width=int(rng.integers(1, 3)))
    objects = []
    for _ in range(int(rng.integers(1, 6))):
        cls = int(rng.integers(len(CLASSES)))
        size = rng.uniform(0.12, 0.5) * min(w, h)
        bw, bh = size * rng.uniform(0.7, 1.3), size * rng.uniform(0.7, 1.3)
        x0, y0 = rng.uniform(0, w - bw), rng.uniform(0, h - bh)
        color = tuple(int(c) for c in rng.integers(0, 256, 3))
        _draw_shape(draw, cls, (x0, y0, x0 + bw, y0 + bh), color)
        objects.append((cls, [x0, y0, bw, bh]))
    # later shapes occlude earlier ones; drop objects that are mostly hidden (their box would be a lie)
    kept = []
    for i, (cls, (x, y, bw, bh)) in enumerate(objects):
        hidden = 0.0
        for _, (ox, oy, ow, oh) in objects[i + 1:]:
            ix = max(0.0, min(x + bw, ox + ow) - max(x, ox))
            iy = max(0.0, min(y + bh, oy + oh) - max(y, oy))
            hidden = max(hidden, ix * iy / (bw * bh))
        if hidden < 0.6:
            kept.append((cls, [round(v, 2) for v in (x, y, bw, bh)]))
    if rng.random() < 0.5:
        img = img.filter(ImageFilter.GaussianBlur(rng.uniform(0.3, 1.0)))
    return img, kept


def write_split(root: Path, split: str, count: int, seed: int) -> None:
    images, anns = [], []
    (root / f"{split}2017").mkdir(parents=True, exist_ok=True)
    for i in range(count):
        rng = np.random.default_rng([seed, i])
        img, objects = _image(rng)
        name = f"{i:06d}.jpg"
        img.save(root / f"{split}2017" / name, quality=92)
        image_id = i + 1
        images.append({"id": image_id, "file_name": name, "width": img.width, "height": img.height})
        for cls, (x, y, bw, bh) in objects:
            anns.append({"id": len(anns) + 1, "image_id": image_id, "category_id": cls + 1, "bbox": [x, y, bw, bh],
                         "area": round(bw * bh, 2), "iscrowd": 0})
    cats = [{"id": i + 1, "name": n, "supercategory": "shape"} for i, n in enumerate(CLASSES)]
    (root / "annotations").mkdir(exist_ok=True)
    (root / "annotations" / f"instances_{split}2017.json").write_text(
        json.dumps({"images": images, "annotations": anns, "categories": cats}))


def ensure_demo_shapes() -> Path:
    """Write the demo set once and return its root."""
    def write(tmp: Path) -> None:
        for s, (split, count) in enumerate(SPLITS.items()):
            write_split(tmp, split, count, seed=1000 + s)

    return cached_dir(f"demo_shapes_v{VERSION}", write)
