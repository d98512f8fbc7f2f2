"""insightface verification packs (`lfw.bin`, `cfp_fp.bin`, `agedb_30.bin`, ...) read without trusting them.

A pack is a pickle of `(bins, issame)`: 2N encoded images (pair i = bins[2i], bins[2i+1]) and N same/not-same
flags (docs/face.md §1.5; insightface recognition/arcface_mxnet/common/build_eval_pack.py). The packs are downloaded
from the internet and a pickle can run any callable it names, so they are read with vtrain's restricted unpickler
(`safeio.restricted_load`), admitting only the few globals such a pack legitimately names:
- `_codecs.encode`: Python 3 writes `bytes` as `_codecs.encode(text, 'latin1')` in protocols 0-2;
- numpy array and scalar reconstruction (`numpy.core.multiarray._reconstruct` / `scalar`, `numpy.ndarray`,
  `numpy.dtype`, protocol 5's `numpy.core.numeric._frombuffer`; `numpy._core` under numpy 2), for packs whose
  images are uint8 arrays (cv2.imencode output) or whose flags are a numpy bool array. dtypes holding Python
  objects are refused, so an array cannot smuggle objects in either.
Python-2 packs (the original LFW/CFP/AgeDB ones) hold the images as py2 `str`; they are decoded as latin-1, the
byte-preserving codec numpy also requires for py2 arrays, and turned back into bytes.

Memory is bounded by the file's real size (docs/input_limits.md §3): a pickle can declare an array of any shape in a
few bytes, and can reference one big string from thousands of places at no cost to itself. So numpy arrays are
rebuilt here from the data the file really holds (never from a declared shape alone: numpy's own `__setstate__` is
not used), an object referenced many times is converted once and shared, and every byte vtrain makes while reading
counts against a budget of `BUDGET_FACTOR` x the file's size; past it the file is refused.
A pack must also be scorable (`check_pairs`): the 10-fold protocol needs at least 10 pairs, and accuracy thresholds
and TAR@FAR need both genuine and impostor pairs (docs/face.md §1.5).
"""

from __future__ import annotations

import codecs
import math
import pickle
from pathlib import Path
from typing import Any

import numpy as np

from vtrain.errors import VtrainError, shown
from vtrain.io.safeio import UnsafeFileError, restricted_load


MIN_PAIRS = 10  # the 10-fold protocol scores each fold on its own pairs (eval/verification.py kfold_accuracy)
BUDGET_FACTOR = 2  # bytes vtrain may make while reading a pack, per byte of the file (+ BUDGET_SLACK)
BUDGET_SLACK = 1 << 20


class PackError(VtrainError):
    """A pack that declares more than it holds, or is not usable for verification."""


def _dtype(spec: Any, align: Any = False, *_: Any) -> np.dtype:
    # always a copy (copy=True): a BUILD after it must not be able to change numpy's shared builtin dtypes
    dt = np.dtype(spec, bool(align), True)
    if dt.hasobject or dt.kind not in "biuf" or dt.subdtype is not None or dt.names is not None:
        raise pickle.UnpicklingError(f"numpy dtype {shown(dt)} (only plain numeric arrays are accepted)")
    return dt


class _ArrayType:
    """Stands for `numpy.ndarray`, which a pack names only as the type argument of `_reconstruct`; calling it
    directly (an uninitialised array of any dtype) is refused."""

    def __init__(self, *args: Any) -> None:
        raise pickle.UnpicklingError("a direct numpy.ndarray(...) call")


class _Array:
    """A numpy array between `_reconstruct` (which declares only its type) and the BUILD that gives its shape,
    dtype and data: the data must be exactly what the shape declares, and the array shares its memory."""

    def __init__(self, unpacker: _Unpacker) -> None:
        self.unpacker, self.array, self.raw = unpacker, None, None

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, tuple) or len(state) not in (4, 5):
            raise pickle.UnpicklingError("a numpy array state that is not (version, shape, dtype, fortran, data)")
        shape, dtype, fortran, raw = state[-4:]
        dt = _dtype(dtype)  # again: a BUILD may have changed the dtype object after it was admitted
        if not isinstance(shape, tuple) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise pickle.UnpicklingError(f"numpy array shape {shown(shape)}")
        if isinstance(raw, str):  # py2 byte strings, and numpy's protocol-0..2 data, arrive as latin-1 text
            raw = self.unpacker.latin1(raw)
        if not isinstance(raw, (bytes, bytearray)):
            raise pickle.UnpicklingError(f"numpy array data of type {type(raw).__name__}")
        declared = math.prod(shape) * dt.itemsize
        if declared != len(raw):
            raise PackError(f"a numpy array declares shape {shape} of {dt} ({declared} bytes) but holds "
                            f"{len(raw)} bytes")
        self.raw = raw
        self.array = np.frombuffer(raw, dt).reshape(shape, order="F" if fortran else "C")


class _Unpacker:
    """The globals a pack's pickle may name, bound to one file: their outputs count against the file's budget,
    and an input referenced many times is converted once."""

    def __init__(self, path: Path, size: int) -> None:
        self.path, self.size = path, size
        self.budget, self.used = BUDGET_FACTOR * size + BUDGET_SLACK, 0
        self._latin1: dict[int, tuple[str, bytes]] = {}  # id(text) -> (text kept alive, its bytes)

    def charge(self, nbytes: int) -> None:
        self.used += nbytes
        if self.used > self.budget:
            raise PackError(f"it decodes to more than {self.budget} bytes from a {self.size}-byte file (a pickle "
                            "that references its data many times, or declares more than it holds)")

    def latin1(self, text: str) -> bytes:
        """The bytes of a latin-1 decoded byte string, made once per string object however often it is used."""
        hit = self._latin1.get(id(text))
        if hit is None:
            self.charge(len(text))
            hit = self._latin1[id(text)] = (text, codecs.encode(text, "latin1"))
        return hit[1]

    def encode(self, text: str, encoding: str = "utf-8") -> bytes:
        if codecs.lookup(encoding).name != "iso8859-1" or not isinstance(text, str):  # pickle's bytes encoding
            raise pickle.UnpicklingError(f"_codecs.encode with codec {shown(encoding)}")
        return self.latin1(text)

    def reconstruct(self, subtype: Any, shape: Any, dtype: Any) -> _Array:
        if subtype is not _ArrayType:
            raise pickle.UnpicklingError(f"array subtype {shown(subtype)}")
        _dtype(dtype)
        return _Array(self)  # no memory yet: the BUILD brings the real shape and the data

    def scalar(self, dtype: Any, data: Any) -> Any:
        dt = _dtype(dtype)
        if isinstance(data, str):  # py2 pickles decoded as latin-1
            data = self.latin1(data)
        if not isinstance(data, (bytes, bytearray)) or len(data) != dt.itemsize:
            raise pickle.UnpicklingError(f"numpy scalar data for {dt}")
        return np.frombuffer(data, dt, 1)[0]

    def frombuffer(self, buf: Any, dtype: Any, shape: Any, order: str) -> np.ndarray:
        dt = _dtype(dtype)
        if not isinstance(buf, (bytes, bytearray)) or not isinstance(shape, tuple) or \
                math.prod(shape) * dt.itemsize != len(buf):
            raise PackError(f"a numpy array declares shape {shown(shape)} of {dt} but holds "
                            f"{len(buf) if isinstance(buf, (bytes, bytearray)) else 'no'} bytes")
        return np.frombuffer(buf, dt).reshape(shape, order=order)  # shares the buffer: no copy to charge

    def allowed(self) -> dict[tuple[str, str], Any]:
        out: dict[tuple[str, str], Any] = {("_codecs", "encode"): self.encode, ("numpy", "ndarray"): _ArrayType,
                                           ("numpy", "dtype"): _dtype}
        for core in ("numpy.core", "numpy._core"):
            out[(f"{core}.multiarray", "_reconstruct")] = self.reconstruct
            out[(f"{core}.multiarray", "scalar")] = self.scalar
            out[(f"{core}.numeric", "_frombuffer")] = self.frombuffer
        return out

    def image_bytes(self, item: Any) -> bytes | None:
        """An entry of `bins` as bytes (None: not an encoded image); copies are charged, shared objects reused."""
        if isinstance(item, _Array):
            one_d_bytes = item.array is not None and item.array.ndim == 1 and item.array.dtype in (np.uint8, np.int8)
            # a uint8 array's own data, shared (several arrays on one buffer cost nothing); else the array
            item = item.raw if one_d_bytes else item.array
        if isinstance(item, str):
            return self.latin1(item)
        if isinstance(item, np.ndarray) and item.dtype in (np.uint8, np.int8) and item.ndim == 1:
            self.charge(item.nbytes)
            return item.tobytes()
        if isinstance(item, bytearray):
            self.charge(len(item))
            return bytes(item)
        return item if isinstance(item, bytes) else None


def read_bin(path: str | Path) -> tuple[list[bytes], np.ndarray]:
    """(encoded images, same flags) of a verification pack; refuses anything that is not one, or that decodes to
    more than its budget (whether its pairs can be scored is `check_pairs`)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise VtrainError(f"cannot read {path}: {e.strerror or e}") from None
    unpacker = _Unpacker(path, len(raw))
    try:
        # vtrain's one restricted unpickler (safeio); latin-1 turns py2 byte strings back into their bytes
        obj = restricted_load(path, unpacker.allowed(), raw, encoding="latin1")
    except UnsafeFileError as e:
        raise UnsafeFileError(f"{e}, which a verification .bin never needs (only image bytes and same/not-same "
                              "flags are accepted)") from None
    except PackError as e:
        raise PackError(f"{path}: {e}") from None
    except VtrainError as e:  # truncated / not a pickle / a refused dtype: all "not a verification pack"
        detail = str(e).removeprefix(f"cannot read {path}: ")
        raise VtrainError(f"{path} is not a readable verification .bin ({detail})") from None
    try:
        return _validate(obj, path, unpacker)
    except PackError as e:
        raise PackError(f"{path}: {e}") from None


def _validate(obj: Any, path: Path, unpacker: _Unpacker) -> tuple[list[bytes], np.ndarray]:
    if not isinstance(obj, (tuple, list)) or len(obj) != 2:
        raise VtrainError(f"{path}: expected a pickled (bins, issame) pair, got {type(obj).__name__}")
    bins, issame = obj
    if not isinstance(bins, (list, tuple)):
        raise VtrainError(f"{path}: bins must be a list of encoded images, got {type(bins).__name__}")
    if isinstance(issame, _Array):
        if issame.array is None:  # declared by `_reconstruct`, never given its data: nothing to read
            raise VtrainError(f"{path}: issame is a numpy array without data")
        issame = issame.array
    if isinstance(issame, np.ndarray) and issame.ndim == 1 and issame.dtype.kind in "biu":
        flags = issame.astype(np.int64)  # its data is in the file: no larger than the file
    elif isinstance(issame, (list, tuple)) and all(isinstance(f, (bool, int, np.bool_, np.integer)) for f in issame):
        flags = np.array([int(f) for f in issame], dtype=np.int64)
    else:
        flags = None
    if flags is None or not np.isin(flags, (0, 1)).all():
        raise VtrainError(f"{path}: issame must be a list of booleans")
    if not len(flags) or len(bins) != 2 * len(flags):
        raise VtrainError(f"{path}: {len(bins)} images for {len(flags)} pairs; a pack holds 2 images per pair")
    images = []
    for i, item in enumerate(bins):
        b = unpacker.image_bytes(item)
        if b is None:
            shown = "numpy array without data" if isinstance(item, _Array) else type(item).__name__
            raise VtrainError(f"{path}: bins[{i}] is a {shown}, not encoded image bytes")
        images.append(b)
    return images, flags.astype(bool)


def check_pairs(same: np.ndarray, where: str, min_pairs: int = 1) -> None:
    """Refuse verification pairs that cannot be scored, naming `where`: fewer than `min_pairs` (MIN_PAIRS for a
    pack's 10-fold accuracy), or pairs of one kind only (thresholds and TAR@FAR need genuine and impostor pairs).
    Called when an evaluation set is prepared, so training finds out at start, not after its final save."""
    same = np.asarray(same, dtype=bool)
    if len(same) < min_pairs:
        raise PackError(f"{where}: {len(same)} pairs; the 10-fold accuracy protocol needs at least {min_pairs}")
    if same.all() or not same.any():
        kind = "genuine (same identity)" if same.all() else "impostor (different identities)"
        raise PackError(f"{where}: all {len(same)} pairs are {kind}; accuracy thresholds and TAR@FAR need both "
                        "genuine and impostor pairs")


def write_bin(path: str | Path, images: list[bytes], issame: list[bool], protocol: int = 4) -> Path:
    """Write a verification pack in the insightface layout (used by the demo and tests)."""
    if len(images) != 2 * len(issame):
        raise ValueError(f"{len(images)} images for {len(issame)} pairs")
    Path(path).write_bytes(pickle.dumps(([bytes(b) for b in images], [bool(s) for s in issame]), protocol=protocol))
    return Path(path)
