"""Memory-mapped dataset indexes: built once per source into the data cache, then opened read-only by every rank
and every DataLoader worker, which share one copy through the page cache (docs/data_index.md).

An index is a folder `<cache>/index/<kind>-<digest>/` of `.npy` arrays opened with `np.load(mmap_mode="r")` and a
`meta.json` naming the format, its version, the source the index was built from and every array's dtype, shape and
file size. Strings (file names) are one uint8 blob plus int64 offsets. The digest is taken over the format version
and the source's identity (`file_identity`: path, size, mtime, ctime and inode, and a digest of the whole file when
it is small, of its head and tail otherwise), so a source changed by any write gets a new folder and an index is
never reused for other bytes.

A dataset keeps the `Index` (folder + meta), never its arrays: pickling it for a worker drops the maps, and the
worker maps the same files again on first use (`__getstate__`). Opening checks the meta and every array's header
and size against it (cheap: no data is read), then the kind's own layout (`check`: the arrays it needs, their
dtypes and lengths, value ranges such as labels below the class count, the types of its `info` fields), read in
slices of a few MB; a folder that fails is one error naming it, never used.
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
from vtrain.errors import VtrainError, shown
from vtrain.io.records import loads

FORMAT = "vtrain-index"
VERSION = 1
"""The container's version (meta.json and the array files); each kind has its own version for its arrays."""
HASH_SPAN = 1 << 20
"""Bytes hashed at each end of a source file larger than FULL_DIGEST."""
FULL_DIGEST = 64 << 20
"""Source files up to this size are hashed whole (SHA-256 ran at ~340 MB/s on the 2-core build machine: 0.2 s);
larger ones at head and tail only, and rely on ctime for an edit in their middle (docs/data_index.md §1)."""
_META_LIMIT = 1 << 20
_META_DEPTH = 16  # vtrain writes 4 levels; anything deeper is not its meta.json (and is never walked)
_SLICE = 1 << 22  # elements checked at a time: no temporary as long as an array
_NAME = re.compile(r"[a-z0-9_]+(\.[a-z0-9_]+)?")


def file_identity(path: str | Path) -> dict[str, Any]:
    """What identifies a source file's content: its resolved path, size, mtime and ctime (ns), inode, and the
    SHA-256 of the whole file up to FULL_DIGEST bytes (of its first and last MiB beyond). Any write to a file sets
    its ctime to the current time, and no user tool can set it back (`touch -r`, `rsync -t` and a restored backup
    set the mtime only; a copy or a restore is a new inode), so an edit that keeps the size and restores the mtime
    still changes the identity. The device number is left out: a network file system's differs from node to node
    for the same file, which would make each node build its own index of the same bytes."""
    p = Path(path).resolve()
    with open(p, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_size <= FULL_DIGEST:
            h, kind = hashlib.file_digest(f, "sha256"), "sha256"
        else:
            h, kind = hashlib.sha256(f.read(HASH_SPAN)), "sha256_head_tail"
            f.seek(max(HASH_SPAN, st.st_size - HASH_SPAN))
            h.update(f.read(HASH_SPAN))
    return {"path": str(p), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns,
            "inode": st.st_ino, kind: h.hexdigest()}


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
            except Exception as e:  # numpy parses a header with ast and tokenize: SyntaxError, TokenError, ...
                what = f"{type(e).__name__}: {getattr(e, 'strerror', None) or e}"  # numpy quotes the header
                raise self.damaged(f"{path.name}: not a readable .npy file "
                                   f"({what if len(what) <= 160 else what[:157] + '...'})") from None
            if a.dtype.str != spec["dtype"] or list(a.shape) != spec["shape"] or \
                    size != spec["bytes"] or size != a.offset + a.nbytes:
                raise self.damaged(f"{path.name} holds {a.dtype.str} {list(a.shape)} in {size} bytes, meta.json "
                                    f"says {shown(spec['dtype'])} {shown(spec['shape'])} in {spec['bytes']}")
            self._arrays[name] = a
        return a

    def strings(self, name: str) -> Strings:
        return Strings(self, name)

    # ---- a kind's layout, checked when its index is opened (open_index's `check`) ------------------------------
    def expect(self, name: str, dtype: str, shape: tuple[int | None, ...]) -> np.ndarray:
        """Array `name`, which must be of `dtype` (`"<i8"`) and `shape` (None: any length on that axis)."""
        if name not in self.meta["arrays"]:
            raise self.damaged(f"it has no array {name}")
        a = self.array(name)
        if a.dtype.str != np.dtype(dtype).str or len(a.shape) != len(shape) or \
                any(want is not None and want != got for want, got in zip(shape, a.shape)):
            want = "x".join("n" if w is None else str(w) for w in shape)
            raise self.damaged(f"{name} holds {a.dtype.str} {list(a.shape)}, expected {np.dtype(dtype).str} "
                                f"of shape {want}")
        return a

    def expect_strings(self, name: str, count: int | None = None) -> int:
        """A string column (`<name>.blob`, `<name>.offsets`) of `count` items (None: any); returns the count. The
        offsets must run from 0 to the blob's end without going back."""
        offsets = self.expect(f"{name}.offsets", "<i8", (None if count is None else count + 1,))
        blob = self.expect(f"{name}.blob", "|u1", (None,))
        if not len(offsets) or offsets[0] != 0 or offsets[-1] != len(blob) or not self.sorted(f"{name}.offsets"):
            raise self.damaged(f"the offsets of the string column {name} do not run from 0 to its blob's end "
                                f"({len(blob)} bytes) in order")
        return len(offsets) - 1

    def expect_info(self, key: str, kind: type | tuple[type, ...], low: int | None = None,
                    high: int | None = None) -> Any:
        """info[key], which must be of `kind` (an integer is never a bool) and, for an integer, in low..high."""
        value = self.info.get(key, _ABSENT)
        kinds = kind if isinstance(kind, tuple) else (kind,)
        ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
        if ok and isinstance(value, int) and not isinstance(value, bool):
            ok = (low is None or value >= low) and (high is None or value <= high)
        if not ok:
            want = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
            bounds = f" in {low}..{high}" if low is not None or high is not None else ""
            raise self.damaged(f"meta.json's info.{key} is {'missing' if value is _ABSENT else shown(value)}, "
                                f"expected {want}{bounds}")
        return value

    def within(self, name: str, low: float, high: float, what: str) -> None:
        """Every value of array `name` in low..high (finite), read a slice at a time."""
        a = self.array(name).reshape(-1)
        for s in range(0, len(a), _SLICE):
            part = a[s:s + _SLICE]
            if len(part) and part.min() >= low and part.max() <= high:  # (a NaN fails both: it propagates)
                continue
            with np.errstate(invalid="ignore"):
                bad = ~((part >= low) & (part <= high))
            if bad.any():
                i = s + int(np.argmax(bad))
                raise self.damaged(f"{name}[{i}] is {a[i]}, but {what} lie in {low}..{high}")

    def sorted(self, name: str, strict: bool = False) -> bool:
        """Whether the 1-d array `name` never goes down (`strict`: always goes up), read a slice at a time."""
        a = self.array(name)
        for s in range(0, max(len(a) - 1, 0), _SLICE):
            part = a[s:s + _SLICE + 1]  # neighbours compared, not subtracted: ids span all of int64
            if ((part[1:] <= part[:-1]) if strict else (part[1:] < part[:-1])).any():
                return False
        return True

    def _verified_meta(self) -> dict[str, Any]:
        path = self.folder / "meta.json"
        try:
            with open(path, "rb") as f:
                raw = f.read(_META_LIMIT + 1)
            if len(raw) > _META_LIMIT:
                raise ValueError(f"larger than {_META_LIMIT} bytes")
            meta = loads(raw, max_depth=_META_DEPTH)  # never walked deeper than vtrain writes it
        except (OSError, ValueError) as e:
            raise self.damaged(f"meta.json: {getattr(e, 'strerror', None) or e}") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT or type(meta.get("version")) is not int \
                or meta.get("version") != VERSION:
            got = (meta.get("format"), meta.get("version")) if isinstance(meta, dict) else "not a JSON object"
            raise self.damaged(f"meta.json is not a {FORMAT} v{VERSION} (found {shown(got)})")
        if json.dumps(meta.get("key"), sort_keys=True) != json.dumps(self.key, sort_keys=True):  # (1 is not true)
            raise self.damaged("meta.json was built from another source than its folder name says")
        arrays, info = meta.get("arrays"), meta.get("info")
        ok = isinstance(arrays, dict) and isinstance(info, dict) and all(
            isinstance(s, dict) and isinstance(s.get("dtype"), str) and isinstance(s.get("shape"), list)
            and all(_count(d) for d in s["shape"]) and _count(s.get("bytes")) and _NAME.fullmatch(n)
            for n, s in arrays.items())
        if not ok:
            raise self.damaged("meta.json's array list is malformed")
        return meta

    def damaged(self, what: str) -> VtrainError:
        what = " ".join(what.split())  # one line, whatever a library's message held
        what = what if len(what) <= 300 else what[:297] + "..."
        return VtrainError(f"data index {self.folder} is damaged or was written by another vtrain ({what}); delete "
                           "that folder and the next run rebuilds it")


def _count(value: Any) -> bool:
    """A JSON integer >= 0 (not a bool)."""
    return type(value) is int and value >= 0


_ABSENT = object()


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


def open_index(kind: str, version: int, source: dict[str, Any], build: Callable[[IndexWriter], None],
               check: Callable[[Index], None] | None = None) -> Index:
    """The index of `source` (JSON: the identities of what it is built from), built by `build` the first time.
    `kind` names the folder (`recordio`, `folders`, ...); `version` is the kind's layout version: raising it makes
    every older index of that kind unused (a new folder), never misread. `check(index)` validates the kind's
    layout (its arrays, their dtypes, lengths and value ranges, its info fields) with Index's `expect*`,
    `within` and `sorted`, raising one error naming the folder; it runs at every open, the build's own included."""
    key = {"format": FORMAT, "version": VERSION, "kind": kind, "kind_version": version, "source": source}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]

    def write(tmp: Path) -> None:
        w = IndexWriter(tmp)
        build(w)
        meta = {"format": FORMAT, "version": VERSION, "key": key, "arrays": w.arrays, "info": w.info}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))

    index = Index(cached_dir(f"index/{kind}-{digest}", write), key)
    if check is not None:
        check(index)
    return index
