"""Atomic, race-safe creation of generated data in the data cache (vtrain/files.py: `cache_root`)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from vtrain.errors import VtrainError
from vtrain.files import cache_root


def cached_dir(name: str, write: Callable[[Path], None]) -> Path:
    """Return cache_root()/name, calling write(tmp_dir) once to create it: written into a temp dir and renamed,
    so concurrent ranks race safely and an interrupted write never leaves a half-filled directory."""
    target = cache_root() / name
    if (target / "DONE").is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise VtrainError(f"VTRAIN_CACHE: cannot create {target.parent} ({e.strerror})") from None
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}_", dir=target.parent))
    except OSError as e:  # read-only, full, or not ours: nothing was created
        raise VtrainError(f"VTRAIN_CACHE: cannot create a folder in {target.parent} to write {name} into "
                          f"({e.strerror})") from None
    try:
        write(tmp)
        (tmp / "DONE").write_text("ok\n")
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished first
            if not (target / "DONE").is_file():
                raise
    except OSError as e:  # a full disk while writing, say; the half-written folder goes (finally, below)
        raise VtrainError(f"VTRAIN_CACHE: cannot write {name} into {target.parent} "
                          f"({e.strerror or e}{': ' + str(e.filename) if e.filename else ''})") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
