"""Reading files a user can hand us without running code from them.

A pickle can name any importable callable (`os.system`, `builtins.exec`) and have it called while loading. So:

- Every `torch.load` in this process is weights-only, whoever calls it: vtrain, Accelerate (optimizer, RNG states)
  and DeepSpeed, whose checkpoint engine and universal-checkpoint converter pass `weights_only=False`.
  `TORCH_FORCE_WEIGHTS_ONLY_LOAD=1` is torch's own switch for that (read on every call, inherited by the
  converter's worker processes); `WEIGHTS_ONLY_GLOBALS` lists exactly the non-tensor types those files
  legitimately hold (measured on ZeRO-1/2/3 and fp16 checkpoints of deepspeed 0.19.8).
- Plain pickles that torch reads with `pickle.load` (the `.metadata` file of a torch distributed checkpoint) are
  checked first with a restricted unpickler that admits only their own classes (`check_dcp`); the items of its
  `.distcp` files are torch.load-ed, so weights-only (`dcp_refusals` names a refused one).

A refused file is one clear error naming the file and what it tried to load.
"""

from __future__ import annotations

import io
import os
import pickle
import pickletools
import re
import warnings
import zipfile
from collections.abc import Iterable
from contextlib import contextmanager
from pathlib import Path

from vtrain.errors import VtrainError, shown


class UnsafeFileError(VtrainError):
    """A file that would run code (or build objects we never write) when unpickled."""


def _deepspeed_globals() -> list:
    import torch

    if not torch.cuda.is_available():  # say it, instead of DeepSpeed warning at import that it guessed the CPU
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address
    except ImportError:  # DeepSpeed is optional at run time (e.g. eval on a machine without it)
        return []
    # optimizer state of ZeRO-1/2/3: the stage enum, the loss scaler (fp16 and torch_autocast modes) and, for
    # ZeRO-1/2, the per-parameter slice map of the flat partitions
    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


_installed = False
_deepspeed_allowed = False
_torch_load = None


def force_weights_only_env() -> None:
    """torch's own switch, cheap enough for CLI start-up (no import): every later torch.load is weights-only."""
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    os.environ.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)


def enforce_weights_only(deepspeed: bool = True) -> None:
    """Make every torch.load in this process weights-only, admit DeepSpeed's own checkpoint types (`deepspeed`,
    which imports it), and turn refusals into one-line errors naming the file. Idempotent."""
    global _installed, _deepspeed_allowed, _torch_load
    import torch

    force_weights_only_env()
    if deepspeed and not _deepspeed_allowed:
        torch.serialization.add_safe_globals(_deepspeed_globals())
        _deepspeed_allowed = True
    if _installed:
        return
    _torch_load = torch.load

    def load(f, *args, **kwargs):
        try:
            return _torch_load(f, *args, **kwargs)
        except pickle.UnpicklingError as e:
            err = UnsafeFileError(f"refusing to unpickle {_name(f)}: {_what(str(e))}")
            err.what = _what(str(e))  # for callers that know the file better (dcp_refusals)
            raise err from None

    load.__doc__ = _torch_load.__doc__
    # DeepSpeed and Accelerate call `torch.load` through the module attribute, so this wrapper sees their calls
    # and can name the file; the environment switch above is what makes them weights-only.
    torch.load = load
    _installed = True


def _name(f) -> str:
    return str(f) if isinstance(f, (str, os.PathLike)) else getattr(f, "name", "a file")


def _what(message: str) -> str:
    m = re.search(r"GLOBAL ([\w.]+)", message) or re.search(r"global ([\w.]+)", message)
    if m:
        return f"it holds a `{m.group(1)}` object (only tensors and plain data are loaded)"
    first = message.strip().splitlines()[0] if message.strip() else "unreadable pickle"
    return f"not a weights-only pickle ({first[:200]})"


# ---- plain pickles ----------------------------------------------------------------------------------------------

def _dcp_globals() -> dict[tuple[str, str], object]:
    import pathlib

    import torch
    from torch.distributed.checkpoint import filesystem, metadata

    allowed = {("torch.distributed.checkpoint.metadata", n): getattr(metadata, n)
               for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                         "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")}
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = filesystem._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    allowed[("pathlib", "PosixPath")] = pathlib.PosixPath  # the checkpoint id of the writer
    allowed[("pathlib", "WindowsPath")] = pathlib.PurePosixPath
    for name in dir(torch):  # dtypes are pickled as `torch.<name>` globals
        if isinstance(getattr(torch, name, None), torch.dtype):
            allowed[("torch", name)] = getattr(torch, name)
    return allowed


class _Restricted(pickle.Unpickler):
    def __init__(self, f, allowed: dict[tuple[str, str], object], path: Path, encoding: str) -> None:
        super().__init__(f, encoding=encoding)
        self.allowed, self.path = allowed, path

    def find_class(self, module: str, name: str):
        obj = self.allowed.get((module, name))
        if obj is None:
            raise UnsafeFileError(f"refusing to unpickle {self.path}: it holds a `{module}.{name}` object")
        return obj


def restricted_load(path: str | Path, allowed: dict[tuple[str, str], object], data: bytes | None = None,
                    encoding: str = "ASCII"):
    """pickle.load admitting only the `allowed` (module, name) globals; anything else is an UnsafeFileError.
    `encoding="bytes"` reads Python-2 pickles whose byte strings were written as `str`."""
    path = Path(path)
    try:
        raw = path.read_bytes() if data is None else data
        _lengths_fit(raw)
        return _Restricted(io.BytesIO(raw), allowed, path, encoding).load()
    except VtrainError:  # a refused global, or a user-facing error raised by one of the `allowed` callables
        raise
    except Exception as e:  # truncated or not a pickle at all
        raise VtrainError(f"cannot read {path}: {type(e).__name__}: {e}") from None


def _lengths_fit(raw: bytes) -> None:
    """Every length an opcode declares (BINBYTES, BINUNICODE, FRAME, ... up to 2^64) lies within the data: the C
    unpickler allocates the declared size before reading it (`load_counted_binbytes`, Modules/_pickle.c, CPython
    3.11: measured, a 13 KB pack whose bytes 11-14 were read as a BINBYTES length of 4,053,075,072 made it allocate
    3.8 GiB). pickletools' opcode reader reads only what is there and raises ValueError ("expected N bytes in a
    bytes4, but only M remain"); it walks the opcodes without building anything (docs/input_limits.md §3)."""
    for _ in pickletools.genops(raw):
        pass


@contextmanager
def dcp_refusals(path: Path):
    """Around a torch.distributed.checkpoint load of folder `path`: DCP unpickles every item of its `.distcp` files
    with torch.load (weights-only here) from an unnamed buffer, and reports a refusal as a CheckpointException
    holding each rank's traceback. Make it the usual one line, naming the checkpoint and what was refused."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as e:
        for failure in e.failures.values():
            exc = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(exc, UnsafeFileError):
                raise UnsafeFileError(f"refusing to unpickle an item of the distributed checkpoint {path}: "
                                      f"{getattr(exc, 'what', exc)}") from None
        raise


def check_dcp(paths: Iterable[Path]) -> None:
    """Check the `.metadata` pickle of torch distributed checkpoint folders before torch reads it with
    pickle.load (torch.distributed.checkpoint.FileSystemReader.read_metadata)."""
    allowed = None
    for folder in paths:
        meta = Path(folder) / ".metadata"
        if meta.is_file():
            allowed = allowed or _dcp_globals()
            restricted_load(meta, allowed)


# ---- published checkpoints -----------------------------------------------------------------------------------------

def _published_globals() -> list:
    """Classes that published checkpoints pickle beside their tensors and that only hold data: IDEA DINO stores
    its command line as an `argparse.Namespace` under `args` (docs/convert.md §1); numpy arrays and scalars (train
    states of several codebases) are rebuilt from bytes and a dtype. Nothing here calls user-named code."""
    import argparse

    import numpy as np

    allowed: list = [argparse.Namespace, np.ndarray, np.dtype]
    core = getattr(np, "_core", None) or np.core  # numpy 2 moved numpy.core to numpy._core
    for fn in ("_reconstruct", "scalar"):
        obj = getattr(core.multiarray, fn)
        # files written under numpy 1 name `numpy.core.multiarray`, under numpy 2 `numpy._core.multiarray`
        allowed += [(obj, f"numpy.core.multiarray.{fn}"), (obj, f"numpy._core.multiarray.{fn}")]
    allowed += [getattr(np.dtypes, n) for n in dir(getattr(np, "dtypes", None)) if n.endswith("DType")]
    return allowed


def _cause(message: str) -> str:
    """torch's own reason inside its long weights-only message (the first line after `Unpickler error:`)."""
    m = re.search(r"Unpickler error:\s*(\S[^\n]*)", message)
    return m.group(1)[:200] if m else "an unreadable pickle"


# A torch file (torch.save since torch 1.6) is a zip archive: the pickle `<archive>/data.pkl` and one record
# `<archive>/data/<key>` per storage. torch reads each record whole into memory, of the size the zip's central
# directory declares (a deflated record is inflated to it), before any tensor exists. torch itself writes every record
# stored, uncompressed (PyTorchStreamWriter, caffe2/serialize/inline_container.cc; every record of the fixtures), so
# the records of its own files add up to less than the file; a zip tool that re-packs one deflates float weights by
# 1.08 (random fp32) to 2.3 (bfloat16-rounded fp32, the fixtures) at level 9. docs/input_limits.md §10.
RECORDS_PER_FILE_BYTE = 4
RECORDS_SLACK = 64 * 2**20


def record_bound(path: Path) -> None:
    """Refuse a torch zip file whose records declare more bytes than RECORDS_PER_FILE_BYTE x its real size (+64 MiB),
    from the central directory alone, before anything is read or inflated: a small deflated record declaring
    gigabytes (a zip bomb), entries overlapping one another, sizes that lie. Other files (torch's legacy format) are
    left to torch, which checks each storage's declared size against the bytes it reads."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        if f.read(4) != b"PK\x03\x04":  # what torch.load tells its zip format by (`_is_zipfile`)
            return
    try:
        with zipfile.ZipFile(path) as z:
            infos = z.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError) as e:
        raise VtrainError(f"cannot read {path}: a damaged zip archive ({' '.join(str(e).split())[:200]})") from None
    declared = sum(i.file_size for i in infos)
    limit = RECORDS_PER_FILE_BYTE * size + RECORDS_SLACK
    if declared > limit:
        big = max(infos, key=lambda i: i.file_size)
        raise VtrainError(f"cannot read {path}: its {len(infos)} zip records declare {declared:,} bytes in a file of "
                          f"{size:,} (at most {RECORDS_PER_FILE_BYTE} x its size + {RECORDS_SLACK >> 20} MiB are read; "
                          f"the largest, {shown(big.filename)}, declares {big.file_size:,} bytes"
                          f"{' compressed into ' + format(big.compress_size, ',') if big.compress_type else ''}): "
                          "not a file torch wrote (docs/input_limits.md §10)")


def load_published(path: str | Path):
    """A checkpoint another codebase wrote (`vtrain convert`, `--pretrained`): torch.load weights-only, admitting
    only the harmless classes of `_published_globals` (never `weights_only=False`). Anything else is refused in one
    line naming the class; a file torch cannot read at all is one line too. The sizes its zip records declare are
    checked against the file's real size first (`record_bound`), so what torch reads into memory is bounded by it."""
    import torch

    path = Path(path)
    try:
        record_bound(path)
    except OSError as e:
        raise VtrainError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        # torch's warnings while it unpickles (the deprecation of a class the file names, its scan of sparse tensors)
        # are about torch, not the file, and nothing a user acts on; what the file holds is checked by its reader
        with torch.serialization.safe_globals(_published_globals()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # torch's own load (not enforce_weights_only's wrapper): its errors are told apart below
            return (_torch_load or torch.load)(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if re.search(r"GLOBAL [\w.]+", str(e)):  # a class or function outside the allowlist
            raise UnsafeFileError(f"refusing to unpickle {path}: {_what(str(e))}") from None
        raise VtrainError(f"cannot read {path}: not a torch checkpoint ({_cause(str(e))})") from None
    except Exception as e:  # truncated, not a torch file, unreadable
        raise VtrainError(f"cannot read {path}: {' '.join(str(e).split())[:300]}") from None
