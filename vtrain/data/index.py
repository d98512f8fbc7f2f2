"""Memory-mapped dataset indexes: built once per source into the data cache, then opened read-only by every rank
and every DataLoader worker, which share one copy through the page cache (docs/data_index.md).

An index is a folder `<cache>/index/<kind>-<digest>/` of `.npy` arrays opened with `np.load(mmap_mode="r")` and a
`meta.json` naming the format, its version, the source the index was built from and every array's dtype, shape and
file size. Strings (file names) are one uint8 blob plus int64 offsets. The digest is taken over the format version
and the source's identity (`file_identity`: path, size, mtime and a hash of the file's head and tail), so an edited
source gets a new folder and an index is never reused for other bytes.

A dataset keeps the `Index` (folder + meta), never its arrays: pickling it for a worker drops the maps, and the
worker maps the same files again on first use (`__getstate__`). Opening checks the meta and every array's header
and size against it (cheap: no data is read); a folder that fails is one error naming it, never used.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from vtrain.data.cache import cached_dir
from vtrain.errors import VtrainError

FORMAT = "vtrain-index"
VERSION = 1
"""The container's version (meta.json and the array files); each kind has its own version for its arrays."""
HASH_SPAN = 1 << 20
"""Bytes hashed at each end of a source file."""
_META_LIMIT = 1 << 20
_NAME = re.compile(r"[a-z0-9_]+(\.[a-z0-9_]+)?")


def file_identity(path: str | Path) -> dict[str, Any]:
    """What identifies a source file's content without reading it all: its resolved path, size, mtime (ns) and the
    SHA-256 of its first and last MiB. An edit that keeps the size changes the mtime, and one that also restores the
    mtime still changes the hash unless it lies wholly in the middle of a file larger than 2 MiB."""
    p = Path(path).resolve()
    with open(p, "rb") as f:
        st = os.fstat(f.fileno())
        h = hashlib.sha256(f.read(HASH_SPAN))
        if st.st_size > HASH_SPAN:
            f.seek(max(HASH_SPAN, st.st_size - HASH_SPAN))
            h.update(f.read(HASH_SPAN))
    return {"path": str(p), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256_head_tail": h.hexdigest()}


class IndexWriter:
    """What a build function fills: named arrays, string columns and `info` (JSON fields of its kind)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.arrays: dict[str, dict[str, Any]] = {}
        self.info: dict[str, Any] = {}

    def array(self, name: str, values: np.ndarray) -> None:
        if not _NAME.fullmatch(name) or name in self.arrays:
            raise ValueError(f"index array name {name!r}: taken or not [a-z0-9_]")
        path = self.folder / f"{name}.npy"
        np.save(path, np.ascontiguousarray(values))
        a = np.load(path, mmap_mode="r")
        self.arrays[name] = {"dtype": a.dtype.str, "shape": list(a.shape), "bytes": path.stat().st_size}

    def strings(self, name: str, items: Iterable[str]) -> None:
        """A string column: `<name>.blob` (UTF-8, undecodable file-name bytes kept by surrogateescape) and
        `<name>.offsets` (n + 1 int64, item i is blob[offsets[i]:offsets[i + 1]])."""
        blob, ends = bytearray(), [0]
        for s in items:
            blob += s.encode("utf-8", "surrogateescape")
            ends.append(len(blob))
        self.array(f"{name}.blob", np.frombuffer(bytes(blob), np.uint8))
        self.array(f"{name}.offsets", np.array(ends, np.int64))


class Index:
    """An opened index: `info` (the kind's JSON fields) and its arrays, mapped read-only on first use in each
    process. Pickles to its folder and meta only."""

    def __init__(self, folder: Path, key: dict[str, Any]) -> None:
        self.folder, self.key = folder, key
        self.meta = self._verified_meta()
        self.info: dict[str, Any] = self.meta["info"]
        self._arrays: dict[str, np.ndarray] = {}
        for name in self.meta["arrays"]:  # every header and size now: a damaged file is found at open, not mid-run
            self.array(name)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_arrays": {}}

    def array(self, name: str) -> np.ndarray:
        a = self._arrays.get(name)
        if a is None:
            spec = self.meta["arrays"].get(name)
            if spec is None:
                raise KeyError(name)
            path = self.folder / f"{name}.npy"
            try:
                a = np.load(path, mmap_mode="r")
                size = path.stat().st_size
            except (OSError, ValueError) as e:
                raise self._damaged(f"{path.name}: {e}") from None
            if a.dtype.str != spec["dtype"] or list(a.shape) != spec["shape"] or \
                    size != spec["bytes"] or size != a.offset + a.nbytes:
                raise self._damaged(f"{path.name} holds {a.dtype.str} {list(a.shape)} in {size} bytes, meta.json "
                                    f"says {spec['dtype']} {spec['shape']} in {spec['bytes']}")
            self._arrays[name] = a
        return a

    def strings(self, name: str) -> Strings:
        return Strings(self, name)

    def _verified_meta(self) -> dict[str, Any]:
        path = self.folder / "meta.json"
        try:
            with open(path, "rb") as f:
                raw = f.read(_META_LIMIT + 1)
            meta = json.loads(raw) if len(raw) <= _META_LIMIT else None
        except (OSError, ValueError) as e:
            raise self._damaged(f"meta.json: {getattr(e, 'strerror', None) or e}") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
            got = (meta.get("format"), meta.get("version")) if isinstance(meta, dict) else "not a JSON object"
            raise self._damaged(f"meta.json is not a {FORMAT} v{VERSION} (found {got})")
        if meta.get("key") != self.key:
            raise self._damaged("meta.json was built from another source than its folder name says")
        arrays, info = meta.get("arrays"), meta.get("info")
        ok = isinstance(arrays, dict) and isinstance(info, dict) and all(
            isinstance(s, dict) and isinstance(s.get("dtype"), str) and isinstance(s.get("shape"), list)
            and isinstance(s.get("bytes"), int) and _NAME.fullmatch(n) for n, s in arrays.items())
        if not ok:
            raise self._damaged("meta.json's array list is malformed")
        return meta

    def _damaged(self, what: str) -> VtrainError:
        return VtrainError(f"data index {self.folder} is damaged or was written by another vtrain ({what}); delete "
                           "that folder and the next run rebuilds it")


class Strings(Sequence[str]):
    """A string column of an index, read item by item from the mapped blob."""

    def __init__(self, index: Index, name: str) -> None:
        self.index, self.name = index, name
        self._n = index.meta["arrays"][f"{name}.offsets"]["shape"][0] - 1

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> str:  # type: ignore[override]
        if not -self._n <= i < self._n:
            raise IndexError(i)
        ends = self.index.array(f"{self.name}.offsets")
        i %= self._n
        raw = self.index.array(f"{self.name}.blob")[int(ends[i]):int(ends[i + 1])]
        return raw.tobytes().decode("utf-8", "surrogateescape")


def open_index(kind: str, version: int, source: dict[str, Any], build: Callable[[IndexWriter], None]) -> Index:
    """The index of `source` (JSON: the identities of what it is built from), built by `build` the first time.
    `kind` names the folder (`recordio`, `folders`, ...); `version` is the kind's layout version: raising it makes
    every older index of that kind unused (a new folder), never misread."""
    key = {"format": FORMAT, "version": VERSION, "kind": kind, "kind_version": version, "source": source}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]

    def write(tmp: Path) -> None:
        w = IndexWriter(tmp)
        build(w)
        meta = {"format": FORMAT, "version": VERSION, "key": key, "arrays": w.arrays, "info": w.info}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))

    return Index(cached_dir(f"index/{kind}-{digest}", write), key)
