"""Places on disk every layer shares: the data cache (VTRAIN_CACHE, default ~/.cache/vtrain), the check of a path
that must be or become a directory, and the one atomic text / JSON writer.

The lowest layer (it imports only `errors` and `guarded`): config validation checks the cache before start-up, the
data layer writes generated data into it, and config, tasks, engine and tools all write text and JSON files that
must never be seen half written.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from vtrain.io import guarded
from vtrain.errors import VtrainError


def directory_problem(path: str | Path) -> str | None:
    """Why `path` cannot be (or become) a directory: it, or the nearest part of it that exists, is a file."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    if p.exists() and not p.is_dir():
        return f"{p} is a file, not a directory" + (f" (in {path})" if p != Path(path) else "")
    return None


def cache_root() -> Path:
    """The data cache directory; a VTRAIN_CACHE that cannot be a directory is an error naming it."""
    root = Path(os.environ.get("VTRAIN_CACHE", Path.home() / ".cache" / "vtrain"))
    problem = directory_problem(root)
    if problem is not None:
        raise VtrainError(f"VTRAIN_CACHE: {problem}")
    return root


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write `text` to `path` through a fresh hidden temp file beside it and a rename, so a reader (or a crash)
    never sees half a file and a link at `path` is replaced, never written through; every byte is checked to be on
    disk before the rename (guarded.write_bytes). The parent directory is created when missing. A full or read-only
    disk is one line naming `path`."""
    guarded.write_bytes(path, text.encode())


def write_json_atomic(path: str | Path, obj: Any, indent: int | None = None) -> None:
    """`obj` as JSON, written as `write_text_atomic` does."""
    write_text_atomic(path, json.dumps(obj, indent=indent))


def digest(path: Path, chunk: int = 16 * 2**20) -> dict[str, Any]:
    """Size and SHA-256 of a file, read in chunks (a checkpoint manifest's entry)."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
            size += len(block)
    return {"size": size, "sha256": h.hexdigest()}


def digest_share(root: Path, rels: list[str], rank: int = 0, world: int = 1) -> dict[str, dict[str, Any]]:
    """Digests of this rank's round-robin share of `rels` (ranks hash in parallel; rank 0 merges)."""
    return {r: digest(Path(root) / r) for i, r in enumerate(rels) if i % world == rank}


def fsync_dir(path: Path) -> None:
    """Make a rename in `path` durable (best effort: some file systems refuse a directory fsync)."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass
