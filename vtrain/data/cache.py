"""Atomic, race-safe creation of generated data in the data cache (vtrain/io/files.py: `cache_root`)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from vtrain.errors import VtrainError
from vtrain.io.files import cache_root


def cached_dir(name: str, write: Callable[[Path], None]) -> Path:
    """Return cache_root()/name (`name` may hold a subfolder: `index/recordio-...`), calling write(tmp_dir) once to
    create it: written into a temp dir and renamed, so an interrupted write never leaves a half-filled directory.
    Processes that start together (8 ranks) take turns on a lock file beside it: one writes, the others wait and
    then find it done, instead of each spending the build's memory and time on the same bytes. Where the lock
    cannot be taken (a file system without locks) each writes its own copy and the first rename wins."""
    target = cache_root() / name
    if (target / "DONE").is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise VtrainError(f"VTRAIN_CACHE: cannot create {target.parent} ({e.strerror})") from None
    with _turn(target.parent / f".{target.name}.lock"):
        if (target / "DONE").is_file():  # built by the process that held the lock before us
            return target
        _write(target, name, write)
    return target


@contextlib.contextmanager
def _turn(lock: Path) -> Iterator[None]:
    """Hold an exclusive flock on `lock` (created if needed; left in place: removing a lock file that another
    process may be about to lock would let two writers in). Without a lock (read-only folder, no flock support)
    the caller goes on unlocked: the write below reports a read-only cache in its own words."""
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _write(target: Path, name: str, write: Callable[[Path], None]) -> None:
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}_", dir=target.parent))
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
