"""Atomic checkpoints: <output>/checkpoints/step_<N>/, written to a temp dir and renamed when complete.

A crash mid-save leaves only `.tmp-step_<N>`, never a half `step_<N>`, so `--resume auto` always finds the
newest complete checkpoint. Rank 0 alone renames, prunes and writes shared files; every rank writes its own
shards (DeepSpeed, FSDP2) into the same temp dir (a shared filesystem across nodes is assumed).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from vtrain.errors import VtrainError

_STEP_RE = re.compile(r"^step_(\d+)$")
COMPLETE = "COMPLETE"


def checkpoint_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def tmp_path(output_dir: str | Path, step: int) -> Path:
    return checkpoint_dir(output_dir) / f".tmp-step_{step}"


def final_path(output_dir: str | Path, step: int) -> Path:
    return checkpoint_dir(output_dir) / f"step_{step}"


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_dir(output_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir() and (p / COMPLETE).is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def is_checkpoint(path: Path) -> bool:
    return (path / COMPLETE).is_file() and (path / "train_state.pt").is_file()


def find(path: str | Path) -> Path | None:
    """`path` itself when it is a complete checkpoint, else the newest complete one of a run dir under it."""
    p = Path(path)
    if is_checkpoint(p):
        return p
    found = complete_checkpoints(p)
    return found[-1] if found else None


def resolve_resume(resume: str | None, output_dir: str | Path) -> Path | None:
    """`auto`: newest complete checkpoint in output_dir (None when there is none); a path: that checkpoint,
    or the newest one of a run directory."""
    if resume is None:
        return None
    if resume == "auto":
        found = complete_checkpoints(output_dir)
        return found[-1] if found else None
    found = find(resume)
    if found is not None:
        return found
    raise VtrainError(f"--resume: {resume} is not a complete vtrain checkpoint (no {COMPLETE} marker) "
                      "and holds no checkpoints/step_<N>")


def begin(output_dir: str | Path, step: int, is_main: bool) -> Path:
    """Rank 0 clears a stale temp dir of an earlier crash; call a barrier after this."""
    tmp = tmp_path(output_dir, step)
    if is_main:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    return tmp


def commit(output_dir: str | Path, step: int, keep_last: int) -> Path:
    """Rank 0, after every rank finished writing: mark complete, rename into place, prune old ones."""
    tmp, final = tmp_path(output_dir, step), final_path(output_dir, step)
    (tmp / COMPLETE).write_text(f"{step}\n")
    _fsync_dir(tmp)
    if final.exists():  # same step saved again (e.g. resumed at the very end): replace
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    for old in complete_checkpoints(output_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass
