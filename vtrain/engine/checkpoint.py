"""Atomic, verifiable checkpoints: <output>/checkpoints/step_<N>/, written to a temp dir and renamed when complete.

A crash mid-save leaves only `.tmp-step_<N>`, never a half `step_<N>`. The `COMPLETE` marker is a JSON manifest
written last: the run id of the lineage that wrote it, and the size and SHA-256 of every file. Resume, eval and
consolidate verify it and name a damaged file; `--resume auto` falls back to the newest checkpoint that verifies.

A run prunes only checkpoints whose manifest carries its own run id (carried across `--resume`), and deletes only
the files its manifest lists: a directory without a manifest, another run's checkpoint or a file a user put
inside a checkpoint is never deleted. Rank 0 alone renames, prunes and writes shared files; every rank writes its
own shards (DeepSpeed, FSDP2) into the same temp dir (a shared filesystem across nodes is assumed).

This module is the format: every layout name (below), the manifest, `TrainState` (train_state.json), verify, prune
and find. Which rank writes and reads what, and when, is engine/checkpointer.py's.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import time
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from vtrain.errors import VtrainError
from vtrain.files import write_json_atomic

_STEP_RE = re.compile(r"^step_(\d+)$")
FORMAT = "vtrain-checkpoint"

# ---- the layout: every name a checkpoint (or the run directory around it) uses, defined here once -----------------
CHECKPOINTS = "checkpoints"  # <output>/checkpoints/step_<N>/
STAGING = ".tmp-step_"  # <output>/checkpoints/.tmp-step_<N>/ while it is written
COMPLETE = "COMPLETE"  # the manifest, written last
TRAIN_STATE = "train_state.json"  # the loop's state: `TrainState` below
LEGACY_TRAIN_STATE = "train_state.pt"  # vtrain <= 0.1 (a weights-only pickle of plain types)
CONFIG = "config.yaml"  # the run's resolved config (also in the output directory itself)
MODEL = "model.safetensors"  # the whole model in fp32, gathered on rank 0
EMA = "ema.safetensors"  # the whole EMA model in fp32 (--ema-decay), its state in the metadata
ACCELERATE = "accelerate"  # Accelerate's save_state: model, optimizer, per-rank RNG (DeepSpeed: its engine files)
DS_TAG = "pytorch_model"  # the DeepSpeed checkpoint tag Accelerate's save_state writes inside ACCELERATE
FSDP = "fsdp"  # FSDP2: model and optimizer as a torch distributed checkpoint
HEAD = "head"  # --head-parallel sharded: one file per rank's class range (engine/head_shard.py)
CATEGORIES = "categories.json"  # detection: class ids and names in label order, for `vtrain predict`
BEST = "best.json"  # --keep-best, in CHECKPOINTS beside the step dirs (engine/best.py)
UNIVERSAL = "universal"  # <output>/universal/step_<N>/: a ZeRO checkpoint converted for another world size


class CheckpointError(VtrainError):
    """A checkpoint that is damaged or not a vtrain checkpoint."""


@dataclass
class Manifest:
    step: int
    run_id: str | None
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Relative path -> {"size": bytes, "sha256": hex digest}."""
    legacy: bool = False
    """A marker of vtrain <= 0.1 (a step number only): no run id, no checksums."""


def checkpoint_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / CHECKPOINTS


def tmp_path(output_dir: str | Path, step: int) -> Path:
    return checkpoint_dir(output_dir) / f"{STAGING}{step}"


def final_path(output_dir: str | Path, step: int) -> Path:
    return checkpoint_dir(output_dir) / f"step_{step}"


def read_manifest(path: Path) -> Manifest | None:
    """The manifest of a checkpoint directory; None when it has none (not a complete vtrain checkpoint)."""
    marker = Path(path) / COMPLETE
    try:
        text = marker.read_text()
    except (OSError, UnicodeDecodeError):
        return None
    if text.strip().isdigit():
        return Manifest(int(text.strip()), None, legacy=True)
    try:
        data = json.loads(text)
    except ValueError:
        return None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("files"), dict):
        return None
    return Manifest(int(data.get("step", -1)), data.get("run_id"), data["files"])


def is_checkpoint(path: Path) -> bool:
    p = Path(path)
    return read_manifest(p) is not None and ((p / TRAIN_STATE).is_file() or (p / LEGACY_TRAIN_STATE).is_file())


def complete_checkpoints(output_dir: str | Path, run_id: str | None = None) -> list[Path]:
    """Complete checkpoints (a readable manifest), oldest first; only those of lineage `run_id` when given."""
    root = checkpoint_dir(output_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_RE.match(p.name)
        if not m or not p.is_dir() or not is_checkpoint(p):
            continue
        if run_id is not None and read_manifest(p).run_id != run_id:
            continue
        found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


# ---- writing ------------------------------------------------------------------------------------------------------

def payload_files(root: Path) -> list[str]:
    """Every file under a checkpoint directory but the manifest, as sorted relative paths."""
    root = Path(root)
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name != COMPLETE)


def digest(path: Path, chunk: int = 16 * 2**20) -> dict[str, Any]:
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


def begin(output_dir: str | Path, step: int, is_main: bool) -> Path:
    """Rank 0 clears a stale temp dir of an earlier crash; call a barrier after this."""
    tmp = tmp_path(output_dir, step)
    if is_main:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    return tmp


def commit(output_dir: str | Path, step: int, run_id: str, files: dict[str, dict[str, Any]], keep_last: int,
           protect: tuple[Path, ...] = ()) -> Path:
    """Rank 0, after every rank finished writing: write the manifest, rename into place, prune this lineage's
    older checkpoints beyond `keep_last` (except `protect`, e.g. the best one)."""
    tmp, final = tmp_path(output_dir, step), final_path(output_dir, step)
    manifest = {"format": FORMAT, "version": 1, "step": step, "run_id": run_id, "time": time.time(),
                "files": files}
    marker = tmp / f".{COMPLETE}.tmp"
    with open(marker, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(marker, tmp / COMPLETE)
    _fsync_dir(tmp)
    if final.exists():  # the same step saved again (e.g. resumed at the very end): replace our own copy only
        old = read_manifest(final)
        if old is None or old.run_id != run_id:
            raise CheckpointError(f"{final} exists and belongs to another run; not replacing it")
        remove(final)
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    prune(output_dir, run_id, keep_last, protect)
    return final


def prune(output_dir: str | Path, run_id: str, keep_last: int, protect: tuple[Path, ...] = ()) -> list[Path]:
    """Delete this lineage's checkpoints beyond the newest `keep_last`; never another run's, never `protect`
    (which does not count towards keep_last)."""
    keep = {Path(p).resolve() for p in protect}
    mine = [p for p in complete_checkpoints(output_dir, run_id) if p.resolve() not in keep]
    old = mine[:-keep_last] if keep_last > 0 else mine
    for p in old:
        remove(p)
    return old


def remove(path: Path) -> None:
    """Delete a vtrain checkpoint: the manifest first (so a crash midway never leaves a 'complete' checkpoint with
    files missing), then exactly the files it lists, then directories left empty. Anything else stays."""
    path = Path(path)
    manifest = read_manifest(path)
    if manifest is None:
        raise CheckpointError(f"{path} is not a vtrain checkpoint; not deleting it")
    listed = list(manifest.files) if not manifest.legacy else payload_files(path)
    (path / COMPLETE).unlink()
    for rel in listed:
        target = (path / rel).resolve()
        if path.resolve() in target.parents:  # a manifest cannot point outside its checkpoint
            target.unlink(missing_ok=True)
    for d in sorted((p for p in path.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        if not any(d.iterdir()):
            d.rmdir()
    if not any(path.iterdir()):
        path.rmdir()


# ---- reading ------------------------------------------------------------------------------------------------------

def verify(path: str | Path, rank: int = 0, world: int = 1) -> str | None:
    """Check the manifest and this rank's share of the files (size, then SHA-256). Returns a one-line problem
    naming the file, or None. Legacy checkpoints are checked for their train state only."""
    path = Path(path)
    manifest = read_manifest(path)
    if manifest is None:
        return f"{path}: no readable {COMPLETE} manifest (not a complete vtrain checkpoint)"
    if manifest.legacy:
        return None if (path / LEGACY_TRAIN_STATE).is_file() else f"{path / LEGACY_TRAIN_STATE}: missing"
    if TRAIN_STATE not in manifest.files:
        return f"{path}: the manifest lists no {TRAIN_STATE}"
    for i, (rel, want) in enumerate(sorted(manifest.files.items())):
        f = path / rel
        if not f.is_file():
            return f"{f}: missing"
        size = f.stat().st_size
        if size != want.get("size"):
            return f"{f}: {size} bytes, the manifest says {want.get('size')} (truncated or replaced)"
        if i % world == rank and digest(f)["sha256"] != want.get("sha256"):
            return f"{f}: checksum mismatch (the file is damaged)"
    return None


def verify_or_raise(path: str | Path, flag: str) -> None:
    problem = verify(path)
    if problem is not None:
        raise CheckpointError(f"{flag}: damaged checkpoint: {problem}")


def find(path: str | Path) -> Path | None:
    """`path` itself when it is a complete checkpoint, else the newest complete one of a run dir under it."""
    p = Path(path)
    if is_checkpoint(p):
        return p
    found = complete_checkpoints(p)
    return found[-1] if found else None


def find_verified(path: str | Path, flag: str) -> Path:
    """For eval / consolidate: the checkpoint at `path` (or a run dir's newest one), verified. A damaged
    checkpoint is an error naming the file; in a run dir the newest one that verifies is used."""
    p = Path(path)
    if is_checkpoint(p):
        verify_or_raise(p, flag)
        return p
    found = complete_checkpoints(p)
    if not found:
        raise CheckpointError(f"{flag}: {path} is neither a complete checkpoint nor a run directory with one")
    problems = []
    for cand in reversed(found):
        problem = verify(cand)
        if problem is None:
            for skipped in problems:  # as --resume auto does: never use an older checkpoint silently
                print(f"note: {flag}: skipping a damaged checkpoint: {skipped}", file=sys.stderr)
            return cand
        problems.append(problem)
    raise CheckpointError(f"{flag}: no checkpoint in {path} verifies; newest: {problems[0]}")


def resume_candidates(resume: str, output_dir: str | Path) -> list[Path]:
    """`auto`: the complete checkpoints of output_dir, newest first (may be empty); a path: that checkpoint, or
    the newest one of a run directory."""
    if resume == "auto":
        return list(reversed(complete_checkpoints(output_dir)))
    found = find(resume)
    if found is None:
        raise CheckpointError(f"--resume: {resume} is not a complete vtrain checkpoint (no {COMPLETE} manifest) "
                              "and holds no checkpoints/step_<N>")
    return [found]


@dataclass(kw_only=True)
class TrainState:
    """`train_state.json`, the one definition of its keys: `write` stores the fields in this order, `read` checks
    the keys without a default. Keys that older checkpoints lack take the defaults; keys this version does not
    know are ignored."""

    step: int
    """The keys step .. consecutive_nonfinite are the loop's own (Trainer.state_dict / load_state_dict)."""
    consumed_samples: int
    """Global samples the run has trained on: the data position (a resume on another world size continues there)."""
    scheduler: dict[str, Any]
    skipped_steps: int = 0
    """Optimizer steps skipped for a non-finite loss."""
    overflow_skips: int = 0
    """Updates an fp16 loss scaler skipped."""
    consecutive_nonfinite: int = 0
    world_size: int
    engine: str
    """The parallel engine of the run that wrote it (plan.kind): single, ddp, fsdp or deepspeed."""
    ema: dict[str, Any] | None = None
    """WeightEMA.state() when the run kept an EMA (ema.safetensors)."""
    scaler: dict[str, Any] | None = None
    """The fp16 GradScaler's state_dict."""

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def write(self, directory: Path) -> None:
        write_json(Path(directory) / TRAIN_STATE, self.to_json())

    @classmethod
    def read(cls, path: Path) -> TrainState:
        """The train state of a checkpoint (JSON; a legacy `train_state.pt` is read weights-only)."""
        path = Path(path)
        if (path / TRAIN_STATE).is_file():
            try:
                state = json.loads((path / TRAIN_STATE).read_text())
            except ValueError as e:
                raise CheckpointError(f"{path / TRAIN_STATE}: not valid JSON ({e})") from None
        else:
            import torch

            state = torch.load(path / LEGACY_TRAIN_STATE, map_location="cpu", weights_only=True)
        known = [f.name for f in fields(cls)]
        need = [f.name for f in fields(cls) if f.default is MISSING]
        if not isinstance(state, dict) or any(k not in state for k in need):
            raise CheckpointError(f"{path}: the train state lacks {', '.join(k for k in need if k not in state)}")
        return cls(**{k: state[k] for k in known if k in state})


def read_train_state(path: Path) -> dict[str, Any]:
    """`TrainState.read` as the file's plain keys (defaults filled in), for callers outside the run."""
    return TrainState.read(path).to_json()


def write_json(path: Path, obj: Any) -> None:
    """A checkpoint's JSON file (train state, categories, best.json): indented by 1, written atomically."""
    write_json_atomic(path, obj, indent=1)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass
