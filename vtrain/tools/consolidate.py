"""Offline consolidation of a checkpoint into one fp32 state dict, streamed tensor by tensor.

Readers (shard_readers.py) yield (name, tensor, is_buffer) from the checkpoint's own shards without building the
whole model in RAM: DeepSpeed ZeRO-1/2/3 from the fp32 master partitions in `*_optim_states.pt` (loaded with mmap;
the Adam moments are never touched), FSDP2 from DCP one tensor at a time, DDP/single from `model.safetensors`; the
EMA weights of a vtrain checkpoint (the default when it has them, `--weights ema|model`) from its whole
`ema.safetensors`. Known gaps of the reference tools that are handled here (docs/memory_ckpt.md §3-4): frozen
parameters of ZeRO-1 (taken from the saved module), frozen parameters and buffers returned in their training dtype
(reported), tied weights (written as separate copies so safetensors accepts them).

What is written is what is checked: each floating tensor is cast to `--dtype` and scanned for inf/NaN slice by
slice (`weight_checks.cast_checked`), so a finite value beyond fp16's range, which the cast turns into inf, is an
offender like a NaN of the checkpoint, and the temporaries stay small. A vtrain checkpoint holds the weights twice,
the engine's own copy (Accelerate's model file, DeepSpeed's partitions, FSDP2's DCP) and the gathered
`model.safetensors`; when the model weights are consolidated from the engine's copy, every tensor both hold is
compared as it is streamed (`weight_checks.SecondCopy`, one tensor of `model.safetensors` in memory at a time), and
a difference stops the command.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vtrain.io import guarded
from vtrain.config import load_run_config
from vtrain.engine.checkpoint import format as ckpt
from vtrain.engine.checkpoint import content
from vtrain.engine.checkpoint.best import best_checkpoint
from vtrain.engine.ema import weights_file
from vtrain.engine.head_shard import full_weight
from vtrain.errors import VtrainError
from vtrain.io.files import write_json_atomic
from vtrain.io.safeio import enforce_weights_only
from vtrain.tasks import model_for_weights
from vtrain.tools.shard_readers import READERS, Item
from vtrain.tools.weight_checks import SecondCopy, cast_checked


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
    checkpoint: Path | None = None
    """A vtrain checkpoint: its directory, whose config.yaml and class count say what the output must hold."""
    second_copy: Path | None = None
    """A vtrain checkpoint's `model.safetensors` when the output comes from the engine's copy: compared with it."""


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
    if not ckpt.is_checkpoint(p) and ckpt.checkpoint_dir(p).is_dir():
        return _in_vtrain_checkpoint(ckpt.find_verified(p, "CKPT"), weights)
    if p.name.startswith(ckpt.STAGING) or (any((p / n).exists() for n in (ckpt.TRAIN_STATE, ckpt.LEGACY_TRAIN_STATE))
                                           and not ckpt.is_checkpoint(p)):
        raise VtrainError(f"{path}: a half-written checkpoint (no {ckpt.COMPLETE} manifest); use an earlier one")
    if ckpt.is_checkpoint(p):
        return _in_vtrain_checkpoint(ckpt.find_verified(p, "CKPT"), weights)
    return _plain(p, p)


def _in_vtrain_checkpoint(p: Path, weights: str | None) -> Source:
    file, used = weights_file(p, weights)
    if used == "ema":  # already whole and fp32 (gathered at save time), buffers and frozen parameters included
        src = Source("state-dict", file, f"vtrain checkpoint {p} (EMA weights {file.name})")
    elif not (p / ckpt.FSDP).is_dir() and not (p / ckpt.ACCELERATE).is_dir() and (p / ckpt.MODEL).is_file():
        # no engine state, only the gathered weights: what `vtrain convert` writes (its step_0); the manifest, which
        # find_verified checked, lists no engine folder, so none was lost
        src = Source("state-dict", p / ckpt.MODEL, f"vtrain checkpoint {p} ({ckpt.MODEL}; no engine state: a "
                                                   "converted checkpoint)")
    else:
        src = _plain(p / ckpt.FSDP, p) if (p / ckpt.FSDP).is_dir() else _plain(p / ckpt.ACCELERATE, p)
        src.description = f"vtrain checkpoint {p} ({src.description})"
        if (p / ckpt.MODEL).is_file() and (p / ckpt.MODEL).resolve() != src.path.resolve():
            src.second_copy = p / ckpt.MODEL  # compared with the engine's copy as it is streamed
    src.checkpoint = p
    if (p / ckpt.HEAD).is_dir():  # the sharded face head: per-rank class ranges, stitched by head_shard.full_weight
        src.head_shards = p
        # the head lives outside the averaged model: an EMA output takes its trained rows, and says so
        src.description += ", sharded face head" + (" (its trained weights: the head keeps no EMA)"
                                                    if used == "ema" else "")
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


def iter_tensors(src: Source) -> Iterator[Item]:
    """(name, tensor, is_buffer) of every tensor in `src`, streamed by its kind's reader (shard_readers.py)."""
    return READERS[src.kind](src.path, src.notes, src.aliases)


# ---- writing ---------------------------------------------------------------------------------------------------

@dataclass
class Offender:
    name: str
    dtype: str
    """The dtype written (--dtype for floating tensors)."""
    nonfinite: int
    """inf/NaN values in what is written."""
    numel: int
    is_buffer: bool
    overflow: int = 0
    """Of those, values finite in the checkpoint that the cast to --dtype turned into inf (beyond its range)."""


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
    for c in (p / ckpt.CONFIG, p.parent / ckpt.CONFIG, p.parent.parent / ckpt.CONFIG):
        if c.is_file():
            return c
    return None


def _check_complete(src: Source, path: str | Path, found: content.Found, check_model: bool,
                    backbone_only: bool) -> None:
    """What was streamed against the model it must be, names and shapes exactly, as load_state_dict(strict=True)
    would (no data needed): for a vtrain checkpoint always, the whole model its config.yaml and recorded class count
    describe (head stitched from shards included, every `head.` tensor left out for --backbone-only), so no weight set
    (model or EMA) is written incomplete; for another source with --check-model, the model of the config.yaml beside
    it, sized by the weights."""
    flag = "--check-model" if check_model else "CKPT"
    cfg_path = src.checkpoint / ckpt.CONFIG if src.checkpoint is not None else None
    cfg = load_run_config(cfg_path) if cfg_path is not None and cfg_path.is_file() else None
    classes = content.recorded_classes(src.checkpoint, cfg, flag) if cfg is not None else None
    if classes is not None:
        spec = content.model_spec(cfg, classes, whole=True, exact=False)
        spec = {k: v for k, v in spec.items() if not (backbone_only and k.startswith("head."))}
    elif check_model:
        cfg_path = _config_path(path)
        if cfg_path is None:
            raise VtrainError(f"--check-model: no config.yaml next to {path} (only vtrain checkpoints carry one)")
        with torch.device("meta"):
            model = model_for_weights(load_run_config(cfg_path), {k: v[0] for k, v in found.items()})
        spec = content.spec_of(model.state_dict(), exact=False)
    else:
        return
    problem = content.compare(found, spec)  # exact=False: the output's dtype is --dtype's
    if problem:
        raise VtrainError(f"{flag}: the consolidated weights do not fit the model in {cfg_path}: {problem}")


def parse_size(text: str | None) -> int | None:
    if text is None:
        return None
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)B?\s*", text.upper())
    if not m:
        raise VtrainError(f"--max-shard-size: cannot read {text!r} (use e.g. 500MB, 5GB)")
    size = int(float(m.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[m.group(2)])
    if size < 1:  # 0 would be taken for "no limit" (one file): refused instead
        raise VtrainError(f"--max-shard-size: must be at least 1 byte, got {text!r}")
    return size


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
    # never into a checkpoint; an existing OUT, its index or shards of an earlier sharded run only with --overwrite
    shards = sorted(out.parent.glob(f"{glob.escape(out.stem)}-*-of-*{out.suffix}"))
    # what it reads: a vtrain run or checkpoint only in its checkpoints (the rule above covers them); any other
    # folder (DeepSpeed's, Accelerate's) in every file; a file itself
    src_path = Path(path)
    reads = [] if src_path.is_dir() and ckpt.find(src_path) is not None else \
        [guarded.Read("CKPT", src_path, folder=src_path.is_dir())]
    guarded.claim_output([out, out.parent / f"{out.name}.index.json", *shards], overwrite, "OUT",
                         ckpt.inside_checkpoint, reads)
    enforce_weights_only()  # DeepSpeed's checkpoint files hold its own types (io/safeio.py)
    if best:
        path = best_checkpoint(path, "CKPT")
    src = detect(path, weights)
    if backbone_only:
        _backbone_only_applies(src)
    report = Report(src)
    with guarded.disk_op("create the folder of", out):
        out.parent.mkdir(parents=True, exist_ok=True)
    writer = _ShardWriter(out, max_shard_size)
    second = SecondCopy(src.second_copy, src.path)
    try:
        kept: dict[str, torch.Tensor] = {}
        for name, t, is_buffer in _with_head(src, backbone_only):
            second.compare(name, t)
            t, before, after = cast_checked(t, dtype)
            if after:
                report.offenders.append(Offender(name, str(t.dtype).replace("torch.", ""), after, t.numel(),
                                                 is_buffer, after - before))
            writer.add(name, t)
            if name in src.aliases.values():
                kept[name] = t
            report.tensors += 1
            report.numel += t.numel()
        for alias, source in src.aliases.items():  # tied weights: a copy (safetensors refuses shared storage)
            writer.add(alias, kept[source])
            src.notes.append(f"tied weight {alias} written as a copy of {source}")
        _check_complete(src, path, writer.shapes, check_model, backbone_only)
        second.check()  # after the model check: a copy of the wrong shape is named with the model it misfits
        if report.offenders and not allow_nonfinite:
            return report
        report.files = writer.commit()
    finally:
        writer.cleanup()
        second.close()
    import resource

    report.peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return report


def _backbone_only_applies(src: Source) -> None:
    """--backbone-only leaves out the face model's class head: refused for a checkpoint recorded as another task's,
    whose weights it would write whole."""
    cfg_path = src.checkpoint / ckpt.CONFIG if src.checkpoint is not None else None
    if cfg_path is not None and cfg_path.is_file():
        task = load_run_config(cfg_path).task
        if task != "metric":
            raise VtrainError(f"--backbone-only: only for face (metric) checkpoints; {src.checkpoint} is a {task} "
                              "checkpoint (it has no class head to leave out)")


def _with_head(src: Source, backbone_only: bool) -> Iterator[Item]:
    """The source's tensors, plus the stitched sharded head; without any `head.` tensor for --backbone-only."""
    for item in iter_tensors(src):
        if not (backbone_only and item[0].startswith("head.")):
            yield item
    if src.head_shards is not None and not backbone_only:
        yield "head.weight", full_weight(src.head_shards), False


_ST_DTYPES = {v: k for k, v in content.DTYPES.items()}


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
            shard["data"].unlink(missing_ok=True)  # a stale one of a killed run, or a link: never written through
            self._file = open(shard["data"], "xb")
        return shard

    def add(self, name: str, t: torch.Tensor) -> None:
        with guarded.disk_op("write", self.out):  # a full disk: one line, and cleanup() removes the temp files
            self._add(name, t)

    def _add(self, name: str, t: torch.Tensor) -> None:
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
        with guarded.disk_op("write", self.out):
            return self._commit()

    def _commit(self) -> list[str]:
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
            tmp.unlink(missing_ok=True)  # stale, or a link: the output is always a new file
            if self.safetensors:
                raw = json.dumps({"__metadata__": {"format": "pt"}, **shard["header"]}, separators=(",", ":")).encode()
                raw += b" " * (-len(raw) % 8)
                with open(tmp, "xb") as f, open(shard["data"], "rb") as data:
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
