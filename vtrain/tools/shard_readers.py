"""Streaming the tensors out of a checkpoint's own shards, without building the model in RAM: each reader yields
(name, tensor, is_buffer) and records what it noticed in `notes` and tied weights in `aliases` (alias -> source).

- DeepSpeed ZeRO-1/2/3: the fp32 master partitions in `*_optim_states.pt`, loaded with mmap (the Adam moments are
  never read); ZeRO-0: the saved module. Frozen parameters come from their fragments (ZeRO-2/3) or, for ZeRO-1,
  from the saved module, which the reference tool drops (docs/memory_ckpt.md §3-4).
- torch distributed checkpoints (FSDP2): one tensor at a time.
- state-dict files: safetensors lazily, anything else through the safe loader of models/backbones.py.
"""

from __future__ import annotations

import glob
import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from vtrain.errors import VtrainError
from vtrain.models.backbones import read_state_dict
from vtrain.io.safeio import check_dcp, dcp_refusals

Item = tuple[str, torch.Tensor, bool]  # name, tensor, is_buffer
Reader = Callable[[Path, list[str], dict[str, str]], Iterator[Item]]


# ---- DeepSpeed ZeRO ---------------------------------------------------------------------------------------------

def _natural(s: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def read_deepspeed(tag: Path, notes: list[str], aliases: dict[str, str]) -> Iterator[Item]:
    optim_files = sorted(glob.glob(str(tag / "*_optim_states.pt")), key=_natural)
    model_files = sorted(glob.glob(str(tag / "*model_states.pt")), key=_natural)
    if not model_files:
        raise VtrainError(f"{tag}: missing *_model_states.pt files")
    if not optim_files:  # ZeRO-0: the whole module (fp32 master weights under torch_autocast) is in the model file
        ms = torch.load(model_files[0], map_location="cpu", mmap=True, weights_only=True)
        if not isinstance(ms.get("module"), dict):
            raise VtrainError(f"{tag}: no *_optim_states.pt files and no module in {Path(model_files[0]).name}")
        notes.append("ZeRO-0 (no partitioning): weights from the saved module")
        aliases.update(ms.get("shared_params") or {})
        buffers = set(ms.get("buffer_names", []))
        for name, t in ms["module"].items():
            if name not in aliases:
                yield name, _noted(t, name, notes, "buffer" if name in buffers else "parameter"), name in buffers
        return
    # mmap: only the slices we read come into memory; the Adam moments are never read
    optims = [torch.load(f, map_location="cpu", mmap=True, weights_only=True)["optimizer_state_dict"]
              for f in optim_files]
    stage = optims[0].get("zero_stage")
    world = optims[0]["partition_count"]
    world = max(world) if isinstance(world, list) else world
    if world != len(optims):
        raise VtrainError(f"{tag}: {len(optims)} optimizer shards but the checkpoint was written by {world} ranks "
                          "(overwritten or incomplete checkpoint)")
    ms = torch.load(model_files[0], map_location="cpu", mmap=True, weights_only=True)
    stage = int(stage) if stage is not None else None
    notes.append(f"ZeRO-{stage}, {world} ranks")
    aliases.update(ms.get("shared_params") or {})  # before yielding: the writer keeps the tied sources
    param_shapes: list[dict] = ms["param_shapes"]
    module = ms.get("module") or {}
    buffer_names = set(ms.get("buffer_names", []))
    if stage in (1, 2):
        groups = [[o["single_partition_of_fp32_groups"][g] for o in optims] for g in range(len(param_shapes))]
        paddings = optims[0].get("param_alignment_paddings")
        for g, shapes in enumerate(param_shapes):
            parts = groups[g]
            bounds = [0]
            for t in parts:
                bounds.append(bounds[-1] + t.numel())
            offset = 0
            for i, (name, shape) in enumerate(shapes.items()):
                n = math.prod(shape)
                yield name, _span(parts, bounds, offset, n).view(tuple(shape)), False
                offset += n + (paddings[g][i] if paddings is not None else 0)
    elif stage == 3:
        flat = [o["fp32_flat_groups"] for o in optims]
        group_sizes = [t.numel() for t in flat[0]]
        shapes = {k: v for d in param_shapes for k, v in d.items()}
        offset = 0  # offset of this parameter's partition inside each rank's concatenated flat groups
        for name, shape in shapes.items():
            n = math.prod(shape)
            part = math.ceil(n / world)
            pieces = [_slice_groups(flat[r], group_sizes, offset, part) for r in range(world)]
            yield name, torch.cat(pieces)[:n].view(tuple(shape)), False
            offset += part
    else:
        raise VtrainError(f"{tag}: unknown ZeRO stage {stage!r}")
    # frozen parameters: fragments (ZeRO-2/3) or, for ZeRO-1, the saved full module (the reference tool drops them)
    frozen = ms.get("frozen_param_shapes") or {}
    if frozen:
        if stage == 3:
            states = [torch.load(f, map_location="cpu", mmap=True, weights_only=True) for f in model_files]
            for name, shape in frozen.items():
                t = torch.cat([s["frozen_param_fragments"][name].reshape(-1) for s in states])[: math.prod(shape)]
                yield name, _noted(t.view(tuple(shape)), name, notes, "frozen parameter"), False
        else:
            for name, shape in frozen.items():
                yield name, _noted(ms["frozen_param_fragments"][name].view(tuple(shape)), name, notes,
                                   "frozen parameter"), False
    elif stage == 1:
        trainable = {k for d in param_shapes for k in d}
        for name, t in module.items():
            if name not in buffer_names and name not in trainable and name not in aliases:
                yield name, _noted(t, name, notes, "frozen parameter (from the saved module)"), False
    for name, t in module.items():
        if name in buffer_names:
            yield name, _noted(t, name, notes, "buffer"), True


def _noted(t: torch.Tensor, name: str, notes: list[str], what: str) -> torch.Tensor:
    if t.is_floating_point() and t.dtype != torch.float32:
        notes.append(f"{what} {name} was saved in {str(t.dtype).replace('torch.', '')}: its values carry that "
                     "precision")
    return t


def _span(parts: list[torch.Tensor], bounds: list[int], start: int, n: int) -> torch.Tensor:
    """Elements [start, start+n) of the concatenation of `parts` (without concatenating them)."""
    out = []
    for t, lo, hi in zip(parts, bounds, bounds[1:]):
        a, b = max(start, lo), min(start + n, hi)
        if a < b:
            out.append(t[a - lo : b - lo])
    return torch.cat(out) if len(out) > 1 else out[0].clone()


def _slice_groups(groups: list[torch.Tensor], sizes: list[int], start: int, n: int) -> torch.Tensor:
    bounds = [0]
    for s in sizes:
        bounds.append(bounds[-1] + s)
    return _span(groups, bounds, start, n)


# ---- FSDP (DCP) and plain state dicts --------------------------------------------------------------------------

def read_dcp(path: Path, notes: list[str], aliases: dict[str, str]) -> Iterator[Item]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    check_dcp([path])  # DCP reads its .metadata with plain pickle.load
    reader = dcp.FileSystemReader(str(path))
    meta = reader.read_metadata()
    keys = [k for k, v in meta.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)]
    prefix = "model." if any(k.startswith("model.") for k in keys) else ""
    for key in keys:
        if prefix and not key.startswith(prefix):
            continue  # optimizer states
        m = meta.state_dict_metadata[key]
        t = torch.empty(m.size, dtype=m.properties.dtype)
        with dcp_refusals(path):
            dcp.load({key: t}, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
        name = key[len(prefix):]
        yield name, _noted(t, name, notes, "tensor"), _looks_like_buffer(name)


def _looks_like_buffer(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in ("running_mean", "running_var", "num_batches_tracked")


def read_weights_file(path: Path, notes: list[str], aliases: dict[str, str]) -> Iterator[Item]:
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            for k in f.keys():
                yield k, f.get_tensor(k), _looks_like_buffer(k)
        return
    for k, v in read_state_dict(path).items():
        yield k, v, _looks_like_buffer(k)


# by the kind of checkpoint `consolidate.detect` found
READERS: dict[str, Reader] = {"deepspeed": read_deepspeed, "fsdp-dcp": read_dcp, "state-dict": read_weights_file}
