"""The IJB-B / IJB-C 1:1 verification protocol as insightface's `arcface_torch/eval_ijbc.py` reads it, read without
trusting the files.

Layout (docs/face.md §7; the release as insightface repackages it, `IJB_release/IJBC/`):

    DIR/meta/<t>_face_tid_mid.txt           image template_id media_id      one line per face (469,375 for IJB-C)
    DIR/meta/<t>_name_5pts_score.txt        image x1 y1 ... x5 y5 score     the same faces in the same order
    DIR/meta/<t>_template_pair_label.txt    template_id template_id 0|1     one line per pair (15.7M for IJB-C)
    DIR/loose_crop/<image>

with <t> = ijbb or ijbc. eval_ijbc.py pairs line i of the face list with line i of the landmarks file without
looking at the names; here the names must be equal line by line (else an error names the line). Any whitespace
separates fields; a blank line is an error (eval_ijbc.py's pandas would skip it in one file and not the other).

Every problem is one VtrainError naming the file and the line: a line with other fields, a number that is not
one, ids out of int64, a label other than 0/1, a pair naming a template that has no face, landmarks that are not
finite or are all one point, a detector score below 0 or not finite, an image name that leaves `loose_crop/`, an
image that is missing. Memory is bounded before anything is parsed: the lines are counted first and the arrays
they need are held against the memory available; the pair file (the big one) is parsed by pandas' C reader in
blocks straight into preallocated arrays, so nothing grows with the file besides those arrays.
"""

from __future__ import annotations

import csv
import io
import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import numpy as np
import psutil

from vtrain.errors import VtrainError, shown

TARGETS = {"ijbb": "IJB-B", "ijbc": "IJB-C"}
BLOCK = 8 << 20  # bytes parsed at a time
MAX_LINE = 4096  # a longer line is an error (a name file never has one; it bounds what one line can hold)
ROW_BYTES = {"faces": 220, "pairs": 48}  # what one line costs while read (arrays, a Python name), for the budget


@dataclass(frozen=True)
class IjbFiles:
    root: Path
    target: str
    """ijbb or ijbc."""

    def meta(self, kind: str) -> Path:
        return self.root / "meta" / f"{self.target}_{kind}.txt"

    @property
    def faces(self) -> Path:
        return self.meta("face_tid_mid")

    @property
    def landmarks(self) -> Path:
        return self.meta("name_5pts_score")

    @property
    def pairs(self) -> Path:
        return self.meta("template_pair_label")

    @property
    def images(self) -> Path:
        return self.root / "loose_crop"

    @property
    def name(self) -> str:
        return TARGETS[self.target]

    def rel(self, path: Path) -> str:
        return str(path.relative_to(self.root)) if path.is_relative_to(self.root) else str(path)


@dataclass
class IjbProtocol:
    files: IjbFiles
    names: list[str]
    """Image of each face (row), relative to loose_crop/."""
    landmarks: np.ndarray
    """N x 5 x 2 float32 (x, y)."""
    scores: np.ndarray
    """N float32: the detector's faceness score of each face."""
    template: np.ndarray
    """N int32: index of each face's template in `template_ids`."""
    media: np.ndarray
    """N int64: each face's media id (a photo, or the video its frame comes from)."""
    template_ids: np.ndarray
    """T int64, sorted."""
    pairs: np.ndarray
    """P x 2 int32: template indices of each pair."""
    labels: np.ndarray
    """P bool: same subject."""

    def line(self, row: int) -> str:
        """Where a face comes from, for messages."""
        return f"{self.files.rel(self.files.landmarks)}:{row + 1}"


def find_ijb(root: str | Path, target: str | None = None, flag: str = "--ijb") -> IjbFiles:
    """The protocol files under `root`; which of IJB-B and IJB-C from the files present or `target`."""
    root = Path(root)
    if not root.is_dir():
        raise VtrainError(f"{flag}: {root} is not a directory")
    if target is not None and target not in TARGETS:
        raise VtrainError(f"--ijb-target: {shown(target)}: expected one of {', '.join(TARGETS)}")
    present = [t for t in TARGETS if IjbFiles(root, t).faces.is_file()]
    if target is None:
        if not present:
            inner = [root / d for d in ("IJBC", "IJBB") if (root / d / "meta").is_dir()]
            hint = f" (did you mean {inner[0]}?)" if inner else ""
            raise VtrainError(f"{flag}: {root} has no meta/ijbc_face_tid_mid.txt or meta/ijbb_face_tid_mid.txt: "
                              f"not an IJB-B or IJB-C release folder{hint}")
        if len(present) > 1:
            raise VtrainError(f"{flag}: {root} holds both IJB-B and IJB-C files; choose one with --ijb-target "
                              "ijbb|ijbc")
        target = present[0]
    files = IjbFiles(root, target)
    for path in (files.faces, files.landmarks, files.pairs):
        if not path.is_file():
            raise VtrainError(f"{flag}: {files.name} file missing: {path}")
    if not files.images.is_dir():
        raise VtrainError(f"{flag}: {files.name} image folder missing: {files.images}")
    return files


def read_ijb(files: IjbFiles, check_images: bool = True, available: int | None = None) -> IjbProtocol:
    """The protocol, checked (module docstring). `available`: the memory budget in bytes (default: what the
    machine has available now)."""
    available = psutil.virtual_memory().available if available is None else available
    n_faces = _budget(files, files.faces, "faces", available)
    n_landmarks = _budget(files, files.landmarks, "faces", available - n_faces * ROW_BYTES["faces"])
    names, ids = _read_faces(files, n_faces)
    names2, landmarks, scores = _read_landmarks(files, n_landmarks)
    if len(names2) != len(names):
        raise VtrainError(f"{files.rel(files.landmarks)} has {len(names2)} faces, {files.rel(files.faces)} "
                          f"{len(names)}: eval_ijbc.py pairs them line by line")
    bad = next((i for i, (a, b) in enumerate(zip(names, names2)) if a != b), None)
    if bad is not None:
        raise VtrainError(f"{files.rel(files.landmarks)}:{bad + 1}: image {shown(names2[bad])}, but line {bad + 1} "
                          f"of {files.rel(files.faces)} is {shown(names[bad])} (the files pair faces line by line)")
    if not names:
        raise VtrainError(f"{files.rel(files.faces)}: no faces")
    template_ids, template = np.unique(ids[:, 0], return_inverse=True)
    n_pairs = _budget(files, files.pairs, "pairs", available - n_faces * ROW_BYTES["faces"])
    pairs, labels = _read_pairs(files, n_pairs, template_ids)
    if not labels.any() or labels.all():
        raise VtrainError(f"{files.rel(files.pairs)}: needs both genuine (1) and impostor (0) pairs")
    if check_images:
        for row, name in enumerate(names):
            if not (files.images / name).is_file():
                raise VtrainError(f"{files.rel(files.landmarks)}:{row + 1}: image not found: "
                                  f"{files.images / name}")
    return IjbProtocol(files, names, landmarks, scores, template.astype(np.int32).reshape(-1), ids[:, 1].copy(),
                       template_ids, pairs, labels)


# ---- the files --------------------------------------------------------------------------------------------------
def _budget(files: IjbFiles, path: Path, kind: str, available: int) -> int:
    """The file's line count, after checking that reading that many lines fits in `available` bytes."""
    lines, last = 0, b"\n"
    with open(path, "rb") as f:
        while block := f.read(BLOCK):
            lines += block.count(b"\n")
            last = block[-1:]
    lines += last != b"\n"
    need = lines * ROW_BYTES[kind]
    if need > max(available, 0):
        raise VtrainError(f"{files.rel(path)}: {lines} lines need about {need / 2**30:.1f} GiB to read, more than "
                          f"the {max(available, 0) / 2**30:.1f} GiB available")
    return lines


def _lines(files: IjbFiles, path: Path, limit: int):
    """(line number, text) of every line; a line longer than MAX_LINE bytes or not UTF-8 is an error."""
    with open(path, "rb") as f:
        n = 0
        while raw := f.readline(MAX_LINE + 1):
            n += 1
            if n > limit:
                raise VtrainError(f"{files.rel(path)}: changed while it was read")
            if len(raw) > MAX_LINE and not raw.endswith(b"\n"):
                raise VtrainError(f"{files.rel(path)}:{n}: line longer than {MAX_LINE} bytes")
            try:
                yield n, raw.decode("utf-8")
            except UnicodeDecodeError:
                raise VtrainError(f"{files.rel(path)}:{n}: not UTF-8 text") from None


def _image_name(files: IjbFiles, path: Path, n: int, name: str) -> str:
    p = PurePosixPath(name)
    if p.is_absolute() or ".." in p.parts or "\\" in name or "\0" in name or not p.parts:
        raise VtrainError(f"{files.rel(path)}:{n}: image {shown(name)} is not a file name inside loose_crop/")
    return name


def _int64(text: str) -> int | None:
    try:
        v = int(text)
    except ValueError:
        return None
    return v if -2**63 <= v < 2**63 else None


def _read_faces(files: IjbFiles, n: int) -> tuple[list[str], np.ndarray]:
    path = files.faces
    names: list[str] = []
    ids = np.empty((n, 2), np.int64)
    for i, line in _lines(files, path, n):
        parts = line.split()
        vals = [_int64(p) for p in parts[1:]]
        if len(parts) != 3 or None in vals:
            raise VtrainError(f"{files.rel(path)}:{i}: expected 'image template_id media_id' (integers within "
                              f"int64), got {shown(line.rstrip())}")
        names.append(_image_name(files, path, i, parts[0]))
        ids[i - 1] = vals
    return names, ids[: len(names)]


def _read_landmarks(files: IjbFiles, n: int) -> tuple[list[str], np.ndarray, np.ndarray]:
    path = files.landmarks
    names: list[str] = []
    values = np.empty((n, 11), np.float32)
    for i, line in _lines(files, path, n):
        parts = line.split()
        try:
            row = [float(p) for p in parts[1:]]  # float() then float32, as eval_ijbc.py converts them
        except ValueError:
            row = []
        if len(parts) != 12 or len(row) != 11:
            raise VtrainError(f"{files.rel(path)}:{i}: expected 'image x1 y1 ... x5 y5 score' (12 fields, "
                              f"numbers), got {shown(line.rstrip())}")
        with np.errstate(over="ignore"):  # beyond float32 becomes inf, refused just below
            values[i - 1] = row
        if not np.isfinite(values[i - 1]).all():
            raise VtrainError(f"{files.rel(path)}:{i}: landmarks and score must be finite numbers (float32), got "
                              f"{shown(line.rstrip())}")
        if values[i - 1, 10] < 0:
            raise VtrainError(f"{files.rel(path)}:{i}: a detector score must be >= 0, got {parts[11]}")
        names.append(_image_name(files, path, i, parts[0]))
    values = values[: len(names)]
    landmarks = values[:, :10].reshape(-1, 5, 2)
    # the alignment's condition (data/face_align.py), checked here for every face at once, before hours of work
    with np.errstate(over="ignore", invalid="ignore"):
        centred = landmarks - landmarks.mean(1, keepdims=True)
        spread = centred.var(1).sum(1)
    bad = np.flatnonzero(~(np.isfinite(spread) & (spread > 0)))
    if len(bad):
        raise VtrainError(f"{files.rel(path)}:{bad[0] + 1}: the five landmarks "
                          f"{'are one point' if spread[bad[0]] == 0 else 'are too far apart'}: no alignment")
    return names, landmarks, values[:, 10].copy()


def _read_pairs(files: IjbFiles, n: int, template_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The pair file in blocks of whole lines, each parsed by pandas' C reader (its values checked after, its
    errors located by `_bad_pair_line`), mapped to template indices as it is read."""
    import pandas as pd

    path = files.pairs
    pairs = np.empty((n, 2), np.int32)
    labels = np.empty(n, bool)
    done, first_line, tail = 0, 1, b""
    with open(path, "rb") as f:
        while True:
            chunk = f.read(BLOCK)
            data = tail + chunk
            cut = data.rfind(b"\n") + 1 if chunk else len(data)
            block, tail = data[:cut], data[cut:]
            if not chunk and not block:
                break
            if len(tail) > MAX_LINE:
                line = first_line + block.count(b"\n")
                raise VtrainError(f"{files.rel(path)}:{line}: line longer than {MAX_LINE} bytes")
            if not block:
                continue
            try:
                df = pd.read_csv(io.BytesIO(block), sep=r"\s+", header=None, dtype=np.int64, na_filter=False,
                                 skip_blank_lines=False, quoting=csv.QUOTE_NONE, engine="c")
                rows = df.to_numpy(np.int64)
            except Exception as e:  # pandas' message, when no line is found wrong by our own reading
                _bad_pair_line(files, block, first_line)
                raise VtrainError(f"{files.rel(path)}: lines {first_line}-: {' '.join(str(e).split())[:200]}") \
                    from None
            if rows.ndim != 2 or rows.shape[1] != 3 or len(rows) != block.count(b"\n") + (not block.endswith(b"\n")):
                _bad_pair_line(files, block, first_line)
                raise VtrainError(f"{files.rel(path)}: lines {first_line}-: expected 'template_id template_id 0|1'")
            if done + len(rows) > n:
                raise VtrainError(f"{files.rel(path)}: changed while it was read")
            bad = np.flatnonzero((rows[:, 2] != 0) & (rows[:, 2] != 1))
            if len(bad):
                raise VtrainError(f"{files.rel(path)}:{first_line + bad[0]}: label must be 0 or 1, got "
                                  f"{rows[bad[0], 2]}")
            for col in (0, 1):
                idx = np.searchsorted(template_ids, rows[:, col]).clip(0, len(template_ids) - 1)
                missing = np.flatnonzero(template_ids[idx] != rows[:, col])
                if len(missing):
                    raise VtrainError(f"{files.rel(path)}:{first_line + missing[0]}: template "
                                      f"{rows[missing[0], col]} has no face in {files.rel(files.faces)}")
                pairs[done:done + len(rows), col] = idx
            labels[done:done + len(rows)] = rows[:, 2] == 1
            done += len(rows)
            first_line += len(rows)
            if not chunk:
                break
    if done == 0:
        raise VtrainError(f"{files.rel(path)}: no pairs")
    return pairs[:done], labels[:done]


def _bad_pair_line(files: IjbFiles, block: bytes, first_line: int) -> None:
    """Raise the error of the first line of `block` that is not 'integer integer 0|1' (our own reading)."""
    for k, raw in enumerate(block.split(b"\n")):
        if k == block.count(b"\n") and not raw:
            break
        try:
            parts = raw.decode("utf-8").split()
        except UnicodeDecodeError:
            raise VtrainError(f"{files.rel(files.pairs)}:{first_line + k}: not UTF-8 text") from None
        ints = [_int64(p) for p in parts]
        if not parts:
            raise VtrainError(f"{files.rel(files.pairs)}:{first_line + k}: empty line")
        if len(parts) != 3 or None in ints:
            raise VtrainError(f"{files.rel(files.pairs)}:{first_line + k}: expected 'template_id template_id 0|1' "
                              f"(integers within int64), got {shown(raw.decode('utf-8').rstrip())}")


def image_path(protocol: IjbProtocol, row: int) -> str:
    return os.fspath(protocol.files.images / protocol.names[row])
