"""Face data: which layout --data is, the sample pipeline every face set shares (decode, [-1, 1], seeded flip),
identity-per-folder sets (torchvision's folder scanning) and verification pairs. RecordIO sets: recordio.py."""

from __future__ import annotations

import hashlib
import os
import stat
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset
from torchvision.datasets.folder import IMG_EXTENSIONS
from torchvision.transforms.v2 import functional as TF

from vtrain.config import DEFAULT_MAX_IMAGE_PIXELS, DataConfig
from vtrain.data.images import decode_rgb  # noqa: F401  (the face sets' decoder; also imported from here)
from vtrain.data.index import Index, IndexWriter, open_index
from vtrain.data.labels import check_labels
from vtrain.errors import BadSample, VtrainError, shown


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
    """root/<identity>/<image>; labels are the sorted identity folder indices.

    The file list and labels are a memory-mapped index in the data cache (data/index.py), built by the first scan
    of the tree and reused while a walk of the tree sees the same files (`folder_identity`): every rank and worker
    reads the same index, a worker receives its folder's path, and nothing here grows with the tree."""

    def __init__(self, root: str | Path, image_size: int, train: bool = True, seed: int = 0,
                 skip_bad: bool = False, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> None:
        self.root, self.image_size, self.train, self.seed = Path(root), image_size, train, seed
        self.max_pixels = max_pixels
        source = folder_identity(self.root)
        self.index = open_index("folders", FOLDER_INDEX_VERSION, source,
                                lambda w: _build_folder_index(w, self.root, source), _check_folder_index)
        info = self.index.info
        if info["empty"] and not skip_bad:
            raise BadSample(f"--data: {info['empty']} empty image files under {self.root}, e.g. "
                            f"{self.empty_files[0]}")
        if info["classes"] < 2:
            raise VtrainError(f"--data: need at least 2 identity folders with images under {self.root}")
        self.num_classes_source = f"the identity folders of {self.root}"

    @property
    def num_classes(self) -> int:
        return self.index.info["classes"]

    @property
    def classes(self) -> list[str]:
        """Identity folder names, sorted (a list made on each call: for tests and small sets)."""
        return list(self.index.strings("classes"))

    @property
    def samples(self) -> FolderSamples:
        """(path, class id) of every image, read from the index."""
        return FolderSamples(self)

    @property
    def targets(self) -> list[int]:
        """Class id of every image (a list made on each call: for tests and the held-out set)."""
        return self.index.array("labels").tolist()

    @property
    def empty_files(self) -> list[str]:
        return [str(self.root / rel) for rel in self.index.strings("empty")]

    def __len__(self) -> int:
        return self.index.info["images"]

    def path(self, idx: int) -> str:
        return str(self.root / self.index.strings("paths")[idx])

    def _read(self, idx: int) -> tuple[torch.Tensor, int]:
        return decode_rgb(self.path(idx), max_pixels=self.max_pixels), int(self.index.array("labels")[idx])


class FolderSamples(Sequence):
    """A FaceFolder's images as a sequence of (path, class id)."""

    def __init__(self, folder: FaceFolder) -> None:
        self.folder = folder

    def __len__(self) -> int:
        return len(self.folder)

    def __getitem__(self, i: int) -> tuple[str, int]:  # type: ignore[override]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        return self.folder.path(i), int(self.folder.index.array("labels")[i])


FOLDER_INDEX_VERSION = 2  # the layout of an identity-folder index: raise it when the arrays or the key change


def folder_identity(root: Path) -> dict[str, Any]:
    """What an identity tree's index is keyed by: what a walk of the whole tree sees, as the build walks it. Every
    image file's path, size, mtime, ctime and inode (a `stat` each, as the build needs for the empty ones) and the
    identity folders' names, folded into one SHA-256, so any change the index would reflect gives a new index:
    an image added, removed, renamed or moved at any depth, an identity renamed, an empty file filled or a file
    emptied, also with its mtime put back (ctime cannot be). Errors of the walk (a symlink loop, an unreadable
    folder) are raised here, before anything is built."""
    h = hashlib.sha256()
    classes = _identities(root)
    files = 0
    for rel, _, st in walk_identity_tree(root, classes):
        _fold(h, rel, st)
        files += 1
    _fold_identities(h, classes)
    return {"root": str(root.resolve()), "identities": len(classes), "files": files, "tree_sha256": h.hexdigest()}


def _fold(h: Any, rel: str, st: os.stat_result) -> None:
    h.update(b"%s\0%d %d %d %d\n" % (os.fsencode(rel), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino))


def _fold_identities(h: Any, classes: list[str]) -> None:
    for name in classes:
        h.update(b"identity %s\n" % os.fsencode(name))


def _identities(root: Path) -> list[str]:
    try:
        with os.scandir(root) as it:
            return sorted(e.name for e in it if e.is_dir())
    except OSError as e:
        raise VtrainError(f"--data: cannot read {root} ({e.strerror})") from None


def _build_folder_index(w: IndexWriter, root: Path, source: dict[str, Any]) -> None:
    classes = _identities(root)
    labels, empty, seen = array("i"), [], [0]
    h = hashlib.sha256()

    def images() -> Iterator[str]:
        for rel, label, st in walk_identity_tree(root, classes):
            _fold(h, rel, st)
            seen[0] += 1
            if st.st_size == 0:
                empty.append(rel)
            else:
                labels.append(label)
                yield rel

    w.strings("paths", images())
    _fold_identities(h, classes)
    if h.hexdigest() != source["tree_sha256"] or seen[0] != source["files"]:
        # the tree changed between the walk that made the key and this one: the index would not be of the key
        raise VtrainError(f"--data: {root} changed while it was being indexed; run again once it is settled")
    w.strings("classes", classes)
    w.strings("empty", empty)
    lab = np.frombuffer(labels, np.int32) if labels else np.zeros(0, np.int32)
    # folder indices are class ids by construction; checked like every other source's labels all the same
    check_labels(lab, len(classes), str(root), lambda i: f"image {i}")
    w.array("labels", lab)
    w.info.update(images=len(labels), classes=len(classes), empty=len(empty))


def _check_folder_index(ix: Index) -> None:
    """The layout of an identity-folder index (data/index.py `check`): counts, string columns of those lengths,
    int32 labels below the identity count."""
    images, classes = ix.expect_info("images", int, 0), ix.expect_info("classes", int, 0)
    ix.expect_strings("paths", images)
    ix.expect_strings("classes", classes)
    ix.expect_strings("empty", ix.expect_info("empty", int, 0))
    ix.expect("labels", "<i4", (images,))
    ix.within("labels", 0, classes - 1, f"the labels of {classes} identities")


def walk_identity_tree(root: Path, classes: list[str]) -> Iterator[tuple[str, int, os.stat_result]]:
    """root/<identity>/**/<image>: (path relative to root, class id, stat) of every image file (torchvision's
    extensions), identity by identity, each folder's entries in name order, depth first.

    Iterative (a stack of folder listings), so a tree of any depth is walked without Python's recursion limit.
    Directory symlinks are followed, but a directory reached twice (a symlink loop, or two identities that are
    the same folder) is an error: it would silently multiply an identity or give its images two labels. A folder
    that cannot be listed (permissions, a path beyond the system's length limit) is one error naming it."""
    seen: dict[tuple[int, int], str] = {}
    exts = tuple(IMG_EXTENSIONS)

    def listing(d: str) -> list[os.DirEntry]:
        try:
            st = os.stat(d)
            if (st.st_dev, st.st_ino) in seen:
                raise VtrainError(f"--data: {d} is the same directory as {seen[(st.st_dev, st.st_ino)]} (a symlink "
                                  "loop or a duplicated identity); remove the link")
            seen[(st.st_dev, st.st_ino)] = d
            with os.scandir(d) as it:
                return sorted(it, key=lambda e: e.name, reverse=True)  # popped from the end: name order
        except OSError as e:
            raise VtrainError(f"--data: cannot read the folder {shown(d, 200)} ({e.strerror or e})") from None

    for label, name in enumerate(classes):
        stack = [(listing(os.path.join(root, name)), f"{name}/")]
        while stack:
            entries, rel = stack[-1]
            if not entries:
                stack.pop()
                continue
            e = entries.pop()
            try:
                if e.is_dir():
                    stack.append((listing(e.path), f"{rel}{e.name}/"))
                elif e.name.lower().endswith(exts) and e.is_file():
                    yield rel + e.name, label, e.stat()
            except OSError as err:  # vanished, or a link to nothing readable
                raise VtrainError(f"--data: cannot read {shown(e.path, 200)} ({err.strerror or err})") from None


def read_pairs(path: Path) -> list[tuple[str, str, bool]]:
    """`path1 path2 label` per line (label 1 = same identity); relative paths are relative to the file. The file is
    read as bytes and its names kept as the bytes they are (file names need not be UTF-8: surrogateescape, as
    Python's os functions take them); a line naming no readable file (NUL inside, too long for the system) is
    "image not found" like a missing one."""
    try:
        text = Path(path).read_bytes().decode("utf-8", "surrogateescape")
    except OSError as e:
        raise VtrainError(f"cannot read the pairs file {path} ({e.strerror or e})") from None
    pairs = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 3 or parts[2] not in ("0", "1"):
            raise VtrainError(f"{path}:{n}: expected 'path1 path2 0|1', got {shown(line)}")
        a, b = (str(p if Path(p).is_absolute() else Path(path).parent / p) for p in parts[:2])
        for p in (a, b):
            if not _is_file(p):
                raise VtrainError(f"{path}:{n}: image not found: {shown(p, 200)}")
        pairs.append((a, b, parts[2] == "1"))
    if not any(s for *_, s in pairs) or all(s for *_, s in pairs):
        raise VtrainError(f"{path}: needs both genuine (1) and impostor (0) pairs")
    return pairs


def _is_file(p: str) -> bool:
    try:
        return stat.S_ISREG(os.stat(p).st_mode)
    except (OSError, ValueError):  # missing, a name too long, a NUL in it
        return False
