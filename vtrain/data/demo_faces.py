"""Built-in demo data for metric learning: deterministic synthetic identities written as real JPEG files.

Each identity is a fixed random "face" (skin and background colours, eye/mouth geometry, marks, a texture);
each image of it varies pose (shift, scale, rotation), lighting, noise and background clutter, so that telling
identities apart has to be learned. Written once to a cache dir in the same identity-per-folder layout a user
provides (train/ and val/ with disjoint identities), so the real loading code is exercised.
"""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

from vtrain.data.cache import cached_dir
from vtrain.data.faces import FaceFolder
from vtrain.data.recordio import write_face_rec
from vtrain.data.verification_bin import write_bin

VERSION = 1
TRAIN_IDS, TRAIN_PER_ID = 200, 12
VAL_IDS, VAL_PER_ID = 50, 8
SIZE = 112


def _identity(rng: np.random.Generator) -> dict:
    return {
        "skin": rng.integers(60, 230, 3),
        "face_w": rng.uniform(0.28, 0.40), "face_h": rng.uniform(0.36, 0.46),
        "eye_dx": rng.uniform(0.09, 0.17), "eye_y": rng.uniform(-0.12, -0.02), "eye_r": rng.uniform(0.03, 0.06),
        "eye_col": rng.integers(0, 255, 3),
        "mouth_w": rng.uniform(0.08, 0.22), "mouth_y": rng.uniform(0.14, 0.24), "mouth_col": rng.integers(0, 255, 3),
        "marks": [(rng.uniform(-0.25, 0.25), rng.uniform(-0.3, 0.3), rng.uniform(0.02, 0.05), rng.integers(0, 255, 3))
                  for _ in range(int(rng.integers(1, 4)))],
        "stripe_angle": rng.uniform(0, np.pi), "stripe_freq": rng.uniform(0.05, 0.25),
    }


def _render(ident: dict, rng: np.random.Generator) -> Image.Image:
    big = SIZE * 2  # draw at 2x, then rotate and downsample (anti-aliasing)
    img = Image.new("RGB", (big, big), tuple(int(c) for c in rng.integers(0, 255, 3)))
    d = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(2, 6))):  # background clutter, different every image
        x0, y0 = rng.integers(0, big, 2)
        r = int(rng.integers(8, 40))
        d.rectangle([x0, y0, x0 + r, y0 + r], fill=tuple(int(c) for c in rng.integers(0, 255, 3)))
    s = big * rng.uniform(0.9, 1.1)
    cx, cy = big / 2 + rng.normal(0, 6), big / 2 + rng.normal(0, 6)

    def pt(x: float, y: float) -> tuple[float, float]:
        return cx + x * s, cy + y * s

    fw, fh = ident["face_w"] * s, ident["face_h"] * s
    d.ellipse([cx - fw, cy - fh, cx + fw, cy + fh], fill=tuple(int(c) for c in ident["skin"]))
    for side in (-1, 1):
        ex, ey = pt(side * ident["eye_dx"], ident["eye_y"])
        r = ident["eye_r"] * s
        d.ellipse([ex - r, ey - r, ex + r, ey + r], fill=tuple(int(c) for c in ident["eye_col"]))
    mx, my = pt(0, ident["mouth_y"])
    mw = ident["mouth_w"] * s
    d.rectangle([mx - mw, my - 0.02 * s, mx + mw, my + 0.02 * s], fill=tuple(int(c) for c in ident["mouth_col"]))
    for x, y, r, col in ident["marks"]:
        px, py = pt(x, y)
        d.ellipse([px - r * s, py - r * s, px + r * s, py + r * s], fill=tuple(int(c) for c in col))
    img = img.rotate(float(rng.normal(0, 8)), resample=Image.BILINEAR, center=(cx, cy))
    img = img.resize((SIZE, SIZE), Image.BILINEAR)
    a = np.asarray(img).astype(np.float32)
    yy, xx = np.mgrid[0:SIZE, 0:SIZE]
    stripes = np.sin((xx * np.cos(ident["stripe_angle"]) + yy * np.sin(ident["stripe_angle"])) * ident["stripe_freq"] * 2)
    a = a + 12 * stripes[..., None]
    a = a * rng.uniform(0.7, 1.3) + rng.normal(0, rng.uniform(2, 10), a.shape)
    out = Image.fromarray(np.clip(a, 0, 255).astype(np.uint8))
    if rng.random() < 0.3:
        out = out.filter(ImageFilter.GaussianBlur(rng.uniform(0.3, 1.2)))
    return out


def _write_identity(args: tuple[Path, int, int, int]) -> None:
    folder, i, per_id, seed = args
    ident = _identity(np.random.default_rng([seed, i]))
    folder.mkdir(parents=True)
    for j in range(per_id):
        _render(ident, np.random.default_rng([seed, i, j, 1])).save(folder / f"{j:03d}.jpg", quality=92)


def write_identity_tree(root: Path, first_id: int, num_ids: int, per_id: int, seed: int = 0) -> Path:
    """Write `num_ids` synthetic identities (ids first_id..) as root/id_XXXXX/NNN.jpg; used by tests too."""
    jobs = [(Path(root) / f"id_{i:05d}", i, per_id, seed) for i in range(first_id, first_id + num_ids)]
    # threads, never forked processes: this runs inside `vtrain train`, where the output-dir lock's heartbeat
    # thread already runs, and a forked child can block forever on a lock another thread held at the fork
    # (docs/input_limits.md §5). PIL's drawing, filters and JPEG encoder and numpy release the GIL
    # for most of the work; every identity has its own seeded generator, so the output does not depend on order.
    with ThreadPoolExecutor(min(4, os.cpu_count() or 1), thread_name_prefix="vtrain-demo-faces") as pool:
        list(pool.map(_write_identity, jobs))  # list(): an exception in any job is raised here
    return Path(root)


def ensure_demo_faces(seed: int = 0) -> Path:
    """Return the demo dataset dir, generating it once."""
    def write(tmp: Path) -> None:
        write_identity_tree(tmp / "train", 0, TRAIN_IDS, TRAIN_PER_ID, seed)
        write_identity_tree(tmp / "val", TRAIN_IDS, VAL_IDS, VAL_PER_ID, seed)

    return cached_dir(f"demo_faces_v{VERSION}_s{seed}", write)


PACK_FOLDS, PACK_PAIRS_PER_FOLD = 10, 30  # LFW's layout: 10 folds of 300 genuine then 300 impostor pairs, scaled


def verification_pairs(samples: list[tuple[str, int]], folds: int, pairs_per_fold: int,
                       rng: np.random.Generator) -> tuple[list[bytes], list[bool]]:
    """Pairs for a verification pack over (path, label) samples, in LFW's layout: per fold `pairs_per_fold`
    genuine pairs (two distinct images of one random identity) then as many impostor pairs (one image each of
    two distinct random identities). Returns the image bytes (two per pair) and the same-identity flags, as
    `write_bin` takes them."""
    by_id: dict[int, list[str]] = {}
    for p, label in samples:
        by_id.setdefault(label, []).append(p)
    images, same = [], []
    for _ in range(folds):
        for genuine in (True, False):
            for _ in range(pairs_per_fold):
                if genuine:
                    a, b = rng.choice(by_id[int(rng.integers(len(by_id)))], 2, replace=False)
                else:
                    i, j = rng.choice(len(by_id), 2, replace=False)
                    a, b = rng.choice(by_id[int(i)]), rng.choice(by_id[int(j)])
                images += [Path(a).read_bytes(), Path(b).read_bytes()]
                same.append(genuine)
    return images, same


def ensure_demo_faces_rec(seed: int = 0) -> Path:
    """The demo set as users have it at scale: the training identities packed into an insightface RecordIO set
    (train.rec, train.idx, property; the same JPEG bytes in FaceFolder's order, so training from it matches
    training from the folders), `heldout.bin`, a verification pack of pairs over the held-out identities, and
    the held-out identity folders (val/) for the sampled-pairs TAR@FAR. Generated once into the cache."""
    src = ensure_demo_faces(seed)

    def write(tmp: Path) -> None:
        train = FaceFolder(src / "train", SIZE, train=False)
        write_face_rec(tmp, [(Path(p).read_bytes(), label) for p, label in train.samples], train.num_classes, SIZE)
        shutil.copytree(src / "val", tmp / "val")
        val = FaceFolder(src / "val", SIZE, train=False)
        rng = np.random.default_rng([seed, 7])
        images, same = verification_pairs(val.samples, PACK_FOLDS, PACK_PAIRS_PER_FOLD, rng)
        write_bin(tmp / "heldout.bin", images, same)

    return cached_dir(f"demo_faces_rec_v{VERSION}_s{seed}", write)
