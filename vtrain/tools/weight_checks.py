"""What `vtrain consolidate` checks in the tensors it streams, each as it passes (consolidate.py): the values it
writes, after the cast to --dtype, and the agreement of a vtrain checkpoint's two copies of the weights. Both work one
tensor at a time with small temporaries, so consolidation's memory stays about one tensor plus the reader's pages.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from pathlib import Path

import torch

from vtrain.engine.checkpoint import content
from vtrain.errors import VtrainError

CAST_CHUNK = 2**20  # elements per slice of the cast-and-scan: its temporaries (one bool mask) stay at 1 MiB


def cast_checked(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, int, int]:
    """`t` as written (floating tensors in `dtype`) and the counts of inf/NaN values in `t` and in what is written
    (more there: finite values the cast took beyond `dtype`'s range), cast and counted one slice at a time."""
    if not t.is_floating_point():
        return t, 0, 0
    t = t.contiguous()
    out = t if t.dtype == dtype else torch.empty(t.shape, dtype=dtype)
    src, dst = t.view(-1), out.view(-1)
    before = after = 0
    for i in range(0, src.numel(), CAST_CHUNK):
        piece = src[i:i + CAST_CHUNK]
        before += piece.numel() - int(torch.isfinite(piece).sum())
        if out is not t:
            cast = dst[i:i + CAST_CHUNK]
            cast.copy_(piece)
            after += cast.numel() - int(torch.isfinite(cast).sum())
    return out, before, after if out is not t else before


class SecondCopy:
    """A vtrain checkpoint's `model.safetensors`, read one tensor at a time, against the engine's copy the output is
    streamed from: the two are written by one save from the same weights, so any difference means the checkpoint was
    edited or a save went wrong, and which copy is right cannot be told. Equal means bit-equal, NaN included, or
    equal once the engine's fp32 value is rounded to 16 bits (DeepSpeed's bf16 and fp16 modes keep 16-bit weights
    in the module, which `model.safetensors` holds, and fp32 masters in the partitions)."""

    def __init__(self, path: Path | None, engine_copy: Path) -> None:
        """`path`: the checkpoint's model.safetensors (None: nothing to compare); `engine_copy`: what the output is
        streamed from, for the message."""
        self.path, self.file, self.engine_copy = path, None, engine_copy
        self.difference: str | None = None
        if path is not None:
            self.file = _TensorFile(path)
            self.names = set(self.file.entries)

    def compare(self, name: str, t: torch.Tensor) -> None:
        """`t`, the engine's copy of tensor `name`, against model.safetensors; the first difference is kept for
        `check` (a tensor of the wrong shape is first judged by the model check, which names the model it misfits)."""
        if self.file is None or name not in self.names or self.difference is not None:
            return
        saved = self.file.get(name)
        if _same(t, saved):
            return
        if t.shape != saved.shape or t.is_floating_point() != saved.is_floating_point():
            diff = f"shape {tuple(t.shape)} vs {tuple(saved.shape)}"
        else:
            gap = (t.float() - saved.float()).abs().nan_to_num(nan=float("inf")).max()
            diff = f"max abs difference {float(gap):.4g}"
        self.difference = (f"CKPT: the checkpoint's two copies of the weights differ: tensor {name}: {diff} between "
                           f"{self.engine_copy} and {self.path}; one was changed after the save (or the save went "
                           "wrong), and which one is right cannot be told: nothing was written")

    def check(self) -> None:
        """Raise the first difference `compare` found, if any."""
        if self.difference is not None:
            raise VtrainError(self.difference)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


class _TensorFile:
    """A safetensors file read one tensor at a time with plain reads (its documented layout: an 8-byte little-endian
    header length, a JSON header of dtype, shape and data offsets, the data). Not memory-mapped as `safe_open` is:
    pages of a mapped file count in the process's resident memory for as long as it is open, which would add the
    whole file to consolidation's peak; read pages stay in the page cache only."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.f = open(path, "rb")
        try:
            size = os.fstat(self.f.fileno()).st_size
            n = int.from_bytes(self.f.read(8), "little")
            if not 2 <= n <= size - 8:
                raise ValueError(f"a header of {n} bytes in a file of {size}")
            header = json.loads(self.f.read(n))
            header.pop("__metadata__", None)
            self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int]] = {}
            for name, e in header.items():
                dtype, shape, (start, end) = content.DTYPES[e["dtype"]], tuple(e["shape"]), e["data_offsets"]
                nbytes = math.prod(shape) * dtype.itemsize
                if not (all(type(d) is int and d >= 0 for d in shape) and type(start) is int
                        and end == start + nbytes and 8 + n + end <= size):
                    raise ValueError(f"tensor {name}: its shape and offsets do not fit the file")
                self.entries[name] = (dtype, shape, 8 + n + start)
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            self.f.close()
            raise VtrainError(f"CKPT: {path} is not a readable safetensors file ({e})") from None

    def get(self, name: str) -> torch.Tensor:
        dtype, shape, offset = self.entries[name]
        t = torch.empty(shape, dtype=dtype)
        view = memoryview(t.view(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")
        self.f.seek(offset)
        if self.f.readinto(view) != view.nbytes:
            raise VtrainError(f"CKPT: {self.path}: tensor {name} is cut short")
        return t

    def close(self) -> None:
        self.f.close()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """`a` (the engine's copy) equals `b` (model.safetensors): see SecondCopy. The roundings are tried only when the
    values are not equal as they are, so an equal fp32 tensor costs one comparison and no copy."""
    if a.shape != b.shape or a.is_floating_point() != b.is_floating_point():
        return False
    if not a.is_floating_point():
        return torch.equal(a, b.to(a.dtype))
    b = b.float()
    rounded = (a.to(d).float() for d in (torch.bfloat16, torch.float16)) if a.dtype == torch.float32 else ()
    return any(torch.equal(c, b) or bool(torch.where(c.isnan(), b.isnan(), c == b).all())
               for c in itertools.chain([a.float()], rounded))
