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
"""

from __future__ import annotations

import codecs
import pickle
from pathlib import Path
from typing import Any

import numpy as np

from vtrain.errors import VtrainError
from vtrain.safeio import UnsafeFileError, restricted_load


def _encode(text: str, encoding: str = "utf-8") -> bytes:
    if codecs.lookup(encoding).name != "iso8859-1":  # the only codec pickle's bytes encoding uses
        raise pickle.UnpicklingError(f"_codecs.encode with codec {encoding!r}")
    return codecs.encode(text, "latin1")


def _dtype(spec: Any, *args: Any) -> np.dtype:
    dt = np.dtype(spec, *args)
    if dt.hasobject or dt.kind not in "biuf":
        raise pickle.UnpicklingError(f"numpy dtype {dt!r} (only plain numeric arrays are accepted)")
    return dt


class _ArrayType:
    """Stands for `numpy.ndarray`, which a pack names only as the type argument of `_reconstruct`; calling it
    directly (an uninitialised array of any dtype) is refused."""

    def __init__(self, *args: Any) -> None:
        raise pickle.UnpicklingError("a direct numpy.ndarray(...) call")


def _reconstruct(subtype: Any, shape: Any, dtype: Any) -> np.ndarray:
    if subtype is not _ArrayType:
        raise pickle.UnpicklingError(f"array subtype {subtype!r}")
    return np.ndarray.__new__(np.ndarray, shape, _dtype(dtype))


def _scalar(dtype: Any, data: Any) -> Any:
    dt = _dtype(dtype)
    if isinstance(data, str):  # py2 pickles decoded as latin-1
        data = data.encode("latin1")
    return np.frombuffer(data, dt, 1)[0]


def _frombuffer(buf: Any, dtype: Any, shape: Any, order: str) -> np.ndarray:
    return np.frombuffer(buf, _dtype(dtype)).reshape(shape, order=order).copy()


_ALLOWED: dict[tuple[str, str], Any] = {("_codecs", "encode"): _encode, ("numpy", "ndarray"): _ArrayType,
                                        ("numpy", "dtype"): _dtype}
for _core in ("numpy.core", "numpy._core"):
    _ALLOWED[(f"{_core}.multiarray", "_reconstruct")] = _reconstruct
    _ALLOWED[(f"{_core}.multiarray", "scalar")] = _scalar
    _ALLOWED[(f"{_core}.numeric", "_frombuffer")] = _frombuffer


def read_bin(path: str | Path) -> tuple[list[bytes], np.ndarray]:
    """(encoded images, same flags) of a verification pack; refuses anything that is not one."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise VtrainError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        # vtrain's one restricted unpickler (safeio); latin-1 turns py2 byte strings back into their bytes
        obj = restricted_load(path, _ALLOWED, raw, encoding="latin1")
    except UnsafeFileError as e:
        raise UnsafeFileError(f"{e}, which a verification .bin never needs (only image bytes and same/not-same "
                              "flags are accepted)") from None
    except VtrainError as e:  # truncated / not a pickle / a refused dtype: all "not a verification pack"
        detail = str(e).removeprefix(f"cannot read {path}: ")
        raise VtrainError(f"{path} is not a readable verification .bin ({detail})") from None
    return _validate(obj, path)


def _validate(obj: Any, path: Path) -> tuple[list[bytes], np.ndarray]:
    if not isinstance(obj, (tuple, list)) or len(obj) != 2:
        raise VtrainError(f"{path}: expected a pickled (bins, issame) pair, got {type(obj).__name__}")
    bins, issame = obj
    if not isinstance(bins, (list, tuple)):
        raise VtrainError(f"{path}: bins must be a list of encoded images, got {type(bins).__name__}")
    images = []
    for i, b in enumerate(bins):
        if isinstance(b, str):
            b = b.encode("latin1")  # a py2 `str`
        elif isinstance(b, np.ndarray) and b.dtype in (np.uint8, np.int8) and b.ndim == 1:
            b = b.tobytes()
        if not isinstance(b, (bytes, bytearray)):
            raise VtrainError(f"{path}: bins[{i}] is a {type(b).__name__}, not encoded image bytes")
        images.append(bytes(b))
    flags = issame.tolist() if isinstance(issame, np.ndarray) and issame.ndim == 1 else issame
    if not isinstance(flags, (list, tuple)) or not all(isinstance(f, (bool, int, np.bool_, np.integer))
                                                       and f in (0, 1) for f in flags):
        raise VtrainError(f"{path}: issame must be a list of booleans")
    if not flags or len(images) != 2 * len(flags):
        raise VtrainError(f"{path}: {len(images)} images for {len(flags)} pairs; a pack holds 2 images per pair")
    return images, np.array(flags, dtype=bool)


def write_bin(path: str | Path, images: list[bytes], issame: list[bool], protocol: int = 4) -> Path:
    """Write a verification pack in the insightface layout (used by the demo and tests)."""
    if len(images) != 2 * len(issame):
        raise ValueError(f"{len(images)} images for {len(issame)} pairs")
    Path(path).write_bytes(pickle.dumps(([bytes(b) for b in images], [bool(s) for s in issame]), protocol=protocol))
    return Path(path)
