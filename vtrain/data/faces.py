"""Identity-per-folder face data (torchvision's folder scanning), train transforms and verification pairs."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset
from torchvision.datasets.folder import IMG_EXTENSIONS
from torchvision.io import ImageReadMode, decode_image
from torchvision.transforms.v2 import functional as TF

from vtrain.config import DataConfig
from vtrain.data.demo_faces import ensure_demo_faces
from vtrain.errors import BadSample, VtrainError


@dataclass
class FaceData:
    train_dir: Path
    val_dir: Path | None
    pairs_file: Path | None


def resolve_face_data(cfg: DataConfig) -> FaceData:
    """Map --data to a train tree plus optional held-out identities / pairs file."""
    root = ensure_demo_faces() if cfg.path == "demo" else Path(cfg.path)
    train = root / "train" if (root / "train").is_dir() else root
    val = Path(cfg.val_path) if cfg.val_path else (root / "val" if (root / "val").is_dir() else None)
    pairs = Path(cfg.pairs_file) if cfg.pairs_file else (root / "pairs.txt" if (root / "pairs.txt").is_file() else None)
    return FaceData(train, val, pairs)


def decode_rgb(src: str | Path | tuple[str, bytes]) -> torch.Tensor:
    """uint8 RGB CHW image from a file path or from (name, encoded bytes), e.g. a row of a Hugging Face datasets
    `Image` column (data/hf.py)."""
    name, data = (src[0], torch.frombuffer(bytearray(src[1]), dtype=torch.uint8)) if isinstance(src, tuple) \
        else (src, str(src))
    try:
        return decode_image(data, mode=ImageReadMode.RGB)
    except Exception as e:
        raise BadSample(f"cannot decode image {name}: {' '.join(str(e).split())[:200]} "
                        "(--skip-bad-images skips unreadable files)") from None


def load_image(path: str | Path | tuple[str, bytes], size: int) -> torch.Tensor:
    """Decode to a float CHW tensor in [-1, 1] (insightface normalisation), resized to size x size."""
    img = decode_rgb(path)
    if img.shape[-2:] != (size, size):
        img = TF.resize(img, [size, size], antialias=True)
    return img.float().div_(127.5).sub_(1.0)


class FaceFolder(Dataset):
    """root/<identity>/<image>; labels are the sorted identity folder indices."""

    def __init__(self, root: str | Path, image_size: int, train: bool = True, seed: int = 0,
                 skip_bad: bool = False) -> None:
        self.root, self.image_size, self.train, self.seed = Path(root), image_size, train, seed
        self.classes, self.samples, self.empty_files = scan_identity_tree(self.root)
        if self.empty_files and not skip_bad:
            raise BadSample(f"--data: {len(self.empty_files)} empty image files under {self.root}, e.g. "
                            f"{self.empty_files[0]} (--skip-bad-images leaves them out)")
        if len(self.classes) < 2:
            raise VtrainError(f"--data: need at least 2 identity folders with images under {self.root}")
        self.targets = [t for _, t in self.samples]

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, key: int | tuple[int, int]) -> dict[str, torch.Tensor]:
        # The sampler passes (epoch, index): augmentation is seeded by both, so a resumed run sees exactly
        # the same augmented samples as an uninterrupted one, whatever worker decodes them.
        epoch, idx = key if isinstance(key, tuple) else (0, key)
        path, label = self.samples[idx]
        img = load_image(path, self.image_size)
        if self.train:
            g = np.random.default_rng([self.seed, epoch, idx])
            if g.random() < 0.5:
                img = img.flip(-1)
        return {"images": img, "labels": torch.tensor(label), "index": torch.tensor(idx)}


def scan_identity_tree(root: Path) -> tuple[list[str], list[tuple[str, int]], list[str]]:
    """root/<identity>/**/<image>: (identity names, (path, label) samples, empty files left out).

    Directory symlinks are followed, but a directory reached twice (a symlink loop, or two identities that are
    the same folder) is an error: it would silently multiply an identity or give its images two labels."""
    try:
        classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    except OSError as e:
        raise VtrainError(f"--data: cannot read {root} ({e.strerror})") from None
    seen: dict[tuple[int, int], Path] = {}
    samples: list[tuple[str, int]] = []
    empty: list[str] = []
    exts = tuple(IMG_EXTENSIONS)

    def walk(d: Path, label: int) -> None:
        st = d.stat()
        if (st.st_dev, st.st_ino) in seen:
            raise VtrainError(f"--data: {d} is the same directory as {seen[(st.st_dev, st.st_ino)]} (a symlink loop "
                              "or a duplicated identity); remove the link")
        seen[(st.st_dev, st.st_ino)] = d
        entries = sorted(os.scandir(d), key=lambda e: e.name)
        for e in entries:
            if e.is_dir():
                walk(Path(e.path), label)
            elif e.is_file() and e.name.lower().endswith(exts):
                if e.stat().st_size == 0:
                    empty.append(e.path)
                else:
                    samples.append((e.path, label))

    for label, name in enumerate(classes):
        walk(root / name, label)
    return classes, samples, empty


def read_pairs(path: Path) -> list[tuple[str, str, bool]]:
    """`path1 path2 label` per line (label 1 = same identity); relative paths are relative to the file."""
    pairs = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 3 or parts[2] not in ("0", "1"):
            raise VtrainError(f"{path}:{n}: expected 'path1 path2 0|1', got {line!r}")
        a, b = (str(p if Path(p).is_absolute() else Path(path).parent / p) for p in parts[:2])
        for p in (a, b):
            if not Path(p).is_file():
                raise VtrainError(f"{path}:{n}: image not found: {p}")
        pairs.append((a, b, parts[2] == "1"))
    if not any(s for *_, s in pairs) or all(s for *_, s in pairs):
        raise VtrainError(f"{path}: needs both genuine (1) and impostor (0) pairs")
    return pairs


def sample_pairs(labels: list[int], max_impostor: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """All genuine pairs and (all or a seeded sample of) impostor pairs over a labelled image list.

    Returns (i, j) index arrays and a boolean `same` array concatenated as columns: shape (P, 3)."""
    labels_np = np.asarray(labels)
    n = len(labels_np)
    i, j = np.triu_indices(n, k=1)
    same = labels_np[i] == labels_np[j]
    gen = np.stack([i[same], j[same]], 1)
    imp = np.stack([i[~same], j[~same]], 1)
    if len(imp) > max_impostor:
        imp = imp[np.random.default_rng(seed).choice(len(imp), max_impostor, replace=False)]
    pairs = np.concatenate([gen, imp])
    return pairs, np.concatenate([np.ones(len(gen), bool), np.zeros(len(imp), bool)])
