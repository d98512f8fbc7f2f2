"""Face data: which layout --data is, the sample pipeline every face set shares (decode, [-1, 1], seeded flip),
identity-per-folder sets (torchvision's folder scanning) and verification pairs. RecordIO sets: recordio.py."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset
from torchvision.datasets.folder import IMG_EXTENSIONS
from torchvision.transforms.v2 import functional as TF

from vtrain.config import DEFAULT_MAX_IMAGE_PIXELS, DataConfig
from vtrain.data.images import decode_rgb  # noqa: F401  (the face sets' decoder; also imported from here)
from vtrain.data.labels import check_labels
from vtrain.errors import BadSample, VtrainError


@dataclass
class FaceData:
    root: Path
    layout: str
    """"recordio" (train.rec + train.idx), "folders" (one folder per identity) or "bin" (--data X.bin: eval only)."""
    train_dir: Path | None
    val_dir: Path | None
    pairs_file: Path | None
    val_targets: list[tuple[str, Path]]
    """Verification packs to evaluate on: (name, .bin path)."""


def resolve_face_data(cfg: DataConfig, root: Path | None = None) -> FaceData:
    """Map --data to its layout (recognised by its files), train data, held-out identities / pairs file and the
    `.bin` packs of --val-targets (default: every *.bin beside a train.rec, as insightface's rec dirs ship them).
    `root`: where --data points, `demo` already turned into its directory (data/demo.py); default: --data."""
    root = Path(cfg.path) if root is None else root
    val = Path(cfg.val_path) if cfg.val_path else None
    pairs = Path(cfg.pairs_file) if cfg.pairs_file else None
    if root.is_file():  # a verification pack on its own
        targets = [str(root), *(cfg.val_targets or [])]
        return FaceData(root, "bin", None, val, pairs, _val_targets(targets, root.parent))
    if (root / "train.rec").is_file() or (root / "train.idx").is_file():
        layout, train = "recordio", root
    else:
        layout, train = "folders", root / "train" if (root / "train").is_dir() else root
    val = val or (root / "val" if (root / "val").is_dir() else None)
    pairs = pairs or (root / "pairs.txt" if (root / "pairs.txt").is_file() else None)
    names = cfg.val_targets
    if names is None:
        names = sorted(p.name for p in root.glob("*.bin")) if layout == "recordio" else []
    return FaceData(root, layout, train, val, pairs, _val_targets(names, root))


def _val_targets(names: list[str], root: Path) -> list[tuple[str, Path]]:
    """insightface style: `lfw` is <root>/lfw.bin; a name ending in .bin is a path (or a file in <root>)."""
    out: dict[str, Path] = {}
    for name in names:
        cands = [Path(name), root / name] if name.endswith(".bin") else [root / f"{name}.bin"]
        path = next((c for c in cands if c.is_file()), None)
        if path is None:
            raise VtrainError(f"--val-targets: {name}: no such verification pack "
                              f"({' or '.join(str(c) for c in cands)})")
        if path.stem in out and out[path.stem].resolve() != path.resolve():
            raise VtrainError(f"--val-targets: two packs named {path.stem} ({out[path.stem]}, {path})")
        out[path.stem] = path
    return list(out.items())


def to_model_input(img: torch.Tensor, size: int) -> torch.Tensor:
    """uint8 RGB CHW -> float CHW in [-1, 1] (insightface normalisation x / 127.5 - 1), resized to size x size."""
    if img.shape[-2:] != (size, size):
        img = TF.resize(img, [size, size], antialias=True)
    return img.float().div_(127.5).sub_(1.0)


def load_image(path: str | Path | tuple[str, bytes], size: int,
               max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> torch.Tensor:
    """Decode (refusing more than `max_pixels`) to a float CHW tensor in [-1, 1] (insightface normalisation),
    resized to size x size."""
    return to_model_input(decode_rgb(path, max_pixels=max_pixels), size)


class FaceSamples(Dataset):
    """What every face training set shares: decoding, [-1, 1] normalisation and the seeded flip. Subclasses
    give `_read(idx) -> (uint8 RGB CHW image, class id)`, `targets` and `num_classes`."""

    image_size: int
    train: bool
    seed: int
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    """Largest image decoded (--max-image-pixels); larger ones are refused from their header."""
    num_classes_source: str = ""
    """Where the class count comes from (a file, the identity folders, a column), for errors about it."""

    def _read(self, idx: int) -> tuple[torch.Tensor, int]:
        raise NotImplementedError

    def __getitem__(self, key: int | tuple[int, int]) -> dict[str, torch.Tensor]:
        # The sampler passes (epoch, index): augmentation is seeded by both, so a resumed run sees exactly
        # the same augmented samples as an uninterrupted one, whatever worker decodes them.
        epoch, idx = key if isinstance(key, tuple) else (0, key)
        raw, label = self._read(idx)
        img = to_model_input(raw, self.image_size)
        if self.train:
            g = np.random.default_rng([self.seed, epoch, idx])
            if g.random() < 0.5:
                img = img.flip(-1)
        return {"images": img, "labels": torch.tensor(label), "index": torch.tensor(idx)}


class FaceFolder(FaceSamples):
    """root/<identity>/<image>; labels are the sorted identity folder indices."""

    def __init__(self, root: str | Path, image_size: int, train: bool = True, seed: int = 0,
                 skip_bad: bool = False, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> None:
        self.root, self.image_size, self.train, self.seed = Path(root), image_size, train, seed
        self.max_pixels = max_pixels
        self.classes, self.samples, self.empty_files = scan_identity_tree(self.root)
        if self.empty_files and not skip_bad:
            raise BadSample(f"--data: {len(self.empty_files)} empty image files under {self.root}, e.g. "
                            f"{self.empty_files[0]}")
        if len(self.classes) < 2:
            raise VtrainError(f"--data: need at least 2 identity folders with images under {self.root}")
        self.num_classes_source = f"the identity folders of {self.root}"
        # folder indices are class ids by construction; checked like every other source's labels all the same
        self.targets = check_labels([t for _, t in self.samples], len(self.classes), str(self.root),
                                    lambda i: str(self.samples[i][0])).tolist()

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def __len__(self) -> int:
        return len(self.samples)

    def _read(self, idx: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[idx]
        return decode_rgb(path, max_pixels=self.max_pixels), label


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
