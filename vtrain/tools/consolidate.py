"""Offline consolidation of a checkpoint into one fp32 state dict, streamed tensor by tensor.

Readers yield (name, tensor, is_buffer) from the checkpoint's own shards without building the whole model in RAM:
DeepSpeed ZeRO-1/2/3 from the fp32 master partitions in `*_optim_states.pt` (loaded with mmap; the Adam moments
are never touched), FSDP2 from DCP one tensor at a time, DDP/single from `model.safetensors`; the EMA weights of a
vtrain checkpoint (the default when it has them, `--weights ema|model`) from its whole `ema.safetensors`. Known gaps of the
reference tools that are handled here (docs/memory_ckpt.md §3-4): frozen parameters of ZeRO-1
(taken from the saved module), frozen parameters and buffers returned in their training dtype (reported),
tied weights (written as separate copies so safetensors accepts them).
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vtrain.engine import checkpoint as ckpt
from vtrain.errors import VtrainError
from vtrain.files import write_json_atomic
from vtrain.safeio import check_dcp, dcp_refusals, enforce_weights_only

Item = tuple[str, torch.Tensor, bool]  # name, tensor, is_buffer


@dataclass
class Source:
    kind: str  # deepspeed | fsdp-dcp | state-dict
    path: Path
    description: str
    notes: list[str] = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)
    """Tied weights: alias name -> name of the tensor it shares storage with."""
    head_shards: Path | None = None
    """A vtrain checkpoint of a `--head-parallel sharded` run: its directory (the head lives in head/, per rank)."""


def _ds_tag_dir(path: Path) -> Path | None:
    """A DeepSpeed `save_checkpoint` dir (with `latest`) or one of its tag dirs."""
    if glob.glob(str(path / "*_optim_states.pt")) or glob.glob(str(path / "*model_states.pt")):
        return path
    latest = path / "latest"
    if latest.is_file():
        tag = path / latest.read_text().strip()
        if not tag.is_dir():
            raise VtrainError(f"{path}: `latest` names {tag.name}, which does not exist")
        return _ds_tag_dir(tag)
    return None


def detect(path: str | Path, weights: str | None = None) -> Source:
    """Find what kind of checkpoint `path` is (a vtrain run dir, a vtrain checkpoint, plain DeepSpeed, plain
    Accelerate save_state, a DCP dir, or a state-dict file). `weights` (ema | model | None: EMA when present)
    applies to vtrain checkpoints only."""
    src = _detect(path, weights)
    if weights == "ema" and "EMA" not in src.description:
        raise VtrainError(f"--weights ema: {path} is not a vtrain checkpoint with EMA weights")
    return src


def _detect(path: str | Path, weights: str | None) -> Source:
    p = Path(path)
    if not p.exists():
        raise VtrainError(f"{path}: no such file or directory")
    if p.is_file():
        return Source("state-dict", p, f"state-dict file {p.name}")
    if not any(p.iterdir()):
        raise VtrainError(f"{path}: empty directory")
    if not ckpt.is_checkpoint(p) and (p / "checkpoints").is_dir():
        return _in_vtrain_checkpoint(ckpt.find_verified(p, "CKPT"), weights)
    if p.name.startswith(".tmp-step_") or (any((p / n).exists() for n in (ckpt.TRAIN_STATE, ckpt.LEGACY_TRAIN_STATE))
                                           and not ckpt.is_checkpoint(p)):
        raise VtrainError(f"{path}: a half-written checkpoint (no {ckpt.COMPLETE} manifest); use an earlier one")
    if ckpt.is_checkpoint(p):
        return _in_vtrain_checkpoint(ckpt.find_verified(p, "CKPT"), weights)
    return _plain(p, p)


def _in_vtrain_checkpoint(p: Path, weights: str | None) -> Source:
    from vtrain.engine.ema import weights_file

    file, used = weights_file(p, weights)
    if used == "ema":  # already whole and fp32 (gathered at save time), buffers and frozen parameters included
        return Source("state-dict", file, f"vtrain checkpoint {p} (EMA weights {file.name})")
    src = _plain(p / "fsdp", p) if (p / "fsdp").is_dir() else _plain(p / "accelerate", p)
    src.description = f"vtrain checkpoint {p} ({src.description})"
    if (p / "head").is_dir():  # the sharded face head: per-rank class ranges, stitched by head_shard.full_weight
        src.head_shards = p
        src.description += ", sharded face head"
    return src


def _plain(p: Path, shown: Path) -> Source:
    tag = _ds_tag_dir(p) or next((t for d in sorted(p.iterdir()) if d.is_dir() and (t := _ds_tag_dir(d))), None)
    if tag is not None:
        return Source("deepspeed", tag, f"DeepSpeed checkpoint {tag}")
    if (p / ".metadata").is_file():
        return Source("fsdp-dcp", p, f"torch distributed checkpoint (FSDP) {p}")
    dcp = sorted(p.glob("pytorch_model_fsdp_*"))
    if dcp and (dcp[0] / ".metadata").is_file():
        return Source("fsdp-dcp", dcp[0], f"Accelerate FSDP sharded state {dcp[0]}")
    for name in ("model.safetensors", "pytorch_model.bin", "pytorch_model_fsdp.bin", "model.pt"):
        if (p / name).is_file():
            return Source("state-dict", p / name, f"Accelerate save_state model {p / name}")
    raise VtrainError(f"{shown}: no DeepSpeed, FSDP or model weights found (not a checkpoint?)")


# ---- DeepSpeed ZeRO ---------------------------------------------------------------------------------------------

def _natural(s: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def _read_deepspeed(tag: Path, notes: list[str], aliases: dict[str, str]) -> Iterator[Item]:
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

def _read_dcp(path: Path, notes: list[str], aliases: dict[str, str]) -> Iterator[Item]:
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


def _read_state_dict(path: Path, notes: list[str], aliases: dict[str, str]) -> Iterator[Item]:
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            for k in f.keys():
                yield k, f.get_tensor(k), _looks_like_buffer(k)
        return
    from vtrain.models.backbones import read_state_dict

    for k, v in read_state_dict(path).items():
        yield k, v, _looks_like_buffer(k)


def iter_tensors(src: Source) -> Iterator[Item]:
    reader = {"deepspeed": _read_deepspeed, "fsdp-dcp": _read_dcp, "state-dict": _read_state_dict}[src.kind]
    return reader(src.path, src.notes, src.aliases)


# ---- writing ---------------------------------------------------------------------------------------------------

@dataclass
class Offender:
    name: str
    dtype: str
    nonfinite: int
    numel: int
    is_buffer: bool


@dataclass
class Report:
    source: Source
    tensors: int = 0
    numel: int = 0
    offenders: list[Offender] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    peak_rss_mb: float = 0.0


def _config_path(path: str | Path) -> Path | None:
    p = Path(path)
    for c in (p / "config.yaml", p.parent / "config.yaml", p.parent.parent / "config.yaml"):
        if c.is_file():
            return c
    return None


def _check_model(path: str | Path, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
    """Rebuild the model from the run's config.yaml on the meta device and check, as load_state_dict(strict=True)
    does, that names and shapes match exactly (no data needed)."""
    from vtrain.config import load_run_config
    from vtrain.tasks import model_for_weights

    cfg_path = _config_path(path)
    if cfg_path is None:
        raise VtrainError(f"--check-model: no config.yaml next to {path} (only vtrain checkpoints carry one)")
    with torch.device("meta"):
        model = model_for_weights(load_run_config(cfg_path), {k: v[0] for k, v in shapes.items()})
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = sorted(set(want) - set(shapes))
    unexpected = sorted(set(shapes) - set(want))
    wrong = sorted(k for k in set(want) & set(shapes) if want[k] != shapes[k][0])
    if missing or unexpected or wrong:
        detail = "; ".join(f"{label} {len(keys)}: {', '.join(keys[:3])}" for label, keys in
                           (("missing", missing), ("unexpected", unexpected), ("shape mismatch", wrong)) if keys)
        raise VtrainError(f"--check-model: the consolidated weights do not fit the model in {cfg_path}: {detail}")


def parse_size(text: str | None) -> int | None:
    if text is None:
        return None
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)B?\s*", text.upper())
    if not m:
        raise VtrainError(f"--max-shard-size: cannot read {text!r} (use e.g. 500MB, 5GB)")
    return int(float(m.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[m.group(2)])


def consolidate(path: str | Path, out: str | Path, dtype: torch.dtype = torch.float32,
                max_shard_size: int | None = None, allow_nonfinite: bool = False,
                check_model: bool = False, overwrite: bool = False, weights: str | None = None,
                best: bool = False, backbone_only: bool = False) -> Report:
    """Stream `path` into `out` (.safetensors or .pt, sharded above max_shard_size), scanning every tensor
    for inf/NaN. safetensors output is written tensor by tensor as each is completed (RAM holds one tensor plus
    the reader's memory-mapped pages; `.pt` output needs the whole dict once). Nothing appears at OUT when
    non-finite values are found (unless allowed) or the model check fails; otherwise OUT appears complete.
    `best`: `path` is a run directory whose checkpoints/best.json (--keep-best) names the checkpoint.

    A sharded face head (`--head-parallel sharded`) is written as one full fp32 `head.weight`; `backbone_only`
    leaves every `head.` tensor out (backbone + embedding neck: what inference needs)."""
    out = Path(out)
    if out.suffix not in (".safetensors", ".pt", ".bin"):
        raise VtrainError(f"OUT must end in .safetensors or .pt, got {out.name}")
    if out.is_dir():
        raise VtrainError(f"OUT {out} is a directory; give a file name ending in .safetensors or .pt")
    existing = [f for f in (out, out.parent / f"{out.name}.index.json") if f.exists()]
    if existing and not overwrite:
        raise VtrainError(f"OUT {existing[0]} exists; --overwrite replaces it")
    enforce_weights_only()  # DeepSpeed's checkpoint files hold its own types (safeio.py)
    if best:
        from vtrain.engine.best import best_checkpoint

        path = best_checkpoint(path, "CKPT")
    src = detect(path, weights)
    report = Report(src)
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = _ShardWriter(out, max_shard_size)
    try:
        kept: dict[str, torch.Tensor] = {}
        for name, t, is_buffer in _with_head(src, backbone_only):
            if t.is_floating_point():
                bad = int((~torch.isfinite(t)).sum())
                if bad:
                    report.offenders.append(Offender(name, str(t.dtype).replace("torch.", ""), bad, t.numel(),
                                                     is_buffer))
                t = t.to(dtype)
            writer.add(name, t)
            if name in src.aliases.values():
                kept[name] = t
            report.tensors += 1
            report.numel += t.numel()
        for alias, source in src.aliases.items():  # tied weights: a copy (safetensors refuses shared storage)
            writer.add(alias, kept[source])
            src.notes.append(f"tied weight {alias} written as a copy of {source}")
        if check_model:
            _check_model(path, writer.shapes)
        if report.offenders and not allow_nonfinite:
            return report
        report.files = writer.commit()
    finally:
        writer.cleanup()
    import resource

    report.peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return report


def _with_head(src: Source, backbone_only: bool) -> Iterator[Item]:
    """The source's tensors, plus the stitched sharded head; without any `head.` tensor for --backbone-only."""
    for item in iter_tensors(src):
        if not (backbone_only and item[0].startswith("head.")):
            yield item
    if src.head_shards is not None and not backbone_only:
        from vtrain.engine.head_shard import full_weight

        yield "head.weight", full_weight(src.head_shards), False


_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}


class _ShardWriter:
    """Writes tensors as they arrive into per-shard temp data files; `commit` prepends each safetensors header
    (8-byte length, JSON with dtype/shape/offsets; the documented layout) by streaming the data file behind it,
    writes the 🤗-style index for several shards, and renames everything into place. `safetensors.torch.save_file`
    would need the whole dict and serialises it to Python bytes first (a second full copy in RAM)."""

    def __init__(self, out: Path, max_shard_size: int | None) -> None:
        self.out, self.max = out, max_shard_size
        self.safetensors = out.suffix == ".safetensors"
        self.shards: list[dict] = []  # {"data": tmp path, "header": {...}, "size": bytes, "tensors": {...}}
        self.shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self._file = None

    def _new_shard(self) -> dict:
        if self._file is not None:
            self._file.close()
        shard = {"data": self.out.parent / f".{self.out.name}.{len(self.shards)}.data.tmp", "header": {},
                 "size": 0, "tensors": {}}
        self.shards.append(shard)
        if self.safetensors:
            self._file = open(shard["data"], "wb")
        return shard

    def add(self, name: str, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        shard = self.shards[-1] if self.shards else self._new_shard()
        if self.max and shard["size"] and shard["size"] + nbytes > self.max:
            shard = self._new_shard()
        self.shapes[name] = (tuple(t.shape), t.dtype)
        if self.safetensors:
            shard["header"][name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape),
                                     "data_offsets": [shard["size"], shard["size"] + nbytes]}
            if nbytes:
                self._file.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)
        else:
            shard["tensors"][name] = t.contiguous()
        shard["size"] += nbytes

    def _names(self) -> list[Path]:
        if len(self.shards) <= 1:
            return [self.out]
        stem, ext, n = self.out.name[: -len(self.out.suffix)], self.out.suffix, len(self.shards)
        return [self.out.parent / f"{stem}-{i + 1:05d}-of-{n:05d}{ext}" for i in range(n)]

    def commit(self) -> list[str]:
        if self._file is not None:
            self._file.close()
            self._file = None
        if not self.shards:
            self._new_shard()
            if self._file is not None:
                self._file.close()
                self._file = None
        finals = self._names()
        tmps = [f.parent / f".{f.name}.tmp" for f in finals]
        for shard, tmp in zip(self.shards, tmps):
            if self.safetensors:
                raw = json.dumps({"__metadata__": {"format": "pt"}, **shard["header"]}, separators=(",", ":")).encode()
                raw += b" " * (-len(raw) % 8)
                with open(tmp, "wb") as f, open(shard["data"], "rb") as data:
                    f.write(len(raw).to_bytes(8, "little"))
                    f.write(raw)
                    shutil.copyfileobj(data, f, 16 * 2**20)
                    f.flush()
                    os.fsync(f.fileno())
            else:
                torch.save(shard["tensors"], tmp)
        written = []
        for tmp, final in zip(tmps, finals):
            os.replace(tmp, final)
            written.append(str(final))
        if len(finals) > 1:
            index = {"metadata": {"total_size": sum(s["size"] for s in self.shards)},
                     "weight_map": {k: final.name for s, final in zip(self.shards, finals)
                                    for k in (s["header"] or s["tensors"])}}
            idx = self.out.parent / f"{self.out.name}.index.json"
            write_json_atomic(idx, index, indent=2)
            written.append(str(idx))
        return written

    def cleanup(self) -> None:
        if self._file is not None:
            self._file.close()
        for s in self.shards:
            s["data"].unlink(missing_ok=True)
        for f in self._names():
            (f.parent / f".{f.name}.tmp").unlink(missing_ok=True)
