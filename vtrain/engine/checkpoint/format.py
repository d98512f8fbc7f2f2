"""Atomic, verifiable checkpoints: <output>/checkpoints/step_<N>/, written to a temp dir and renamed when complete.

A crash mid-save leaves only `.tmp-step_<N>`, never a half `step_<N>`. The `COMPLETE` marker is a JSON manifest
written last: the run id of the lineage that wrote it, and the size and SHA-256 of every file. Resume, eval and
consolidate verify it and name a damaged file; `--resume auto` falls back to the newest checkpoint that verifies.

A run prunes only checkpoints whose manifest carries its own run id (carried across `--resume`), and deletes only
the files its manifest lists: a directory without a manifest, another run's checkpoint or a file a user put
inside a checkpoint is never deleted. Only real folders are this run's checkpoints: a `step_<N>` that is a
symbolic link or a mount point (a bind mount of an archive or another run) is never read as one, pruned or deleted,
and a listed file that is a link or a mount point (or lies below one) is left alone when pruning and fails
verification (vtrain/io/guarded.py). Every field of the JSON files is checked when
read (vtrain/io/records.py). Rank 0 alone renames, prunes and writes shared files; every rank writes its own shards
(DeepSpeed, FSDP2) into the same temp dir (a shared filesystem across nodes is assumed).

This module is the format: every layout name (below), the manifest, `TrainState` (train_state.json), verify, prune
and find. Which rank writes and reads what, and when, is engine/checkpoint/checkpointer.py's.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from vtrain.io import guarded
from vtrain.errors import VtrainError, shown
from vtrain.io.files import digest, fsync_dir, write_json_atomic
from vtrain.io.records import (MAX_COUNT, Record, RecordError, categories, ema_state, read_json, scaler_state,
                            scheduler_state)

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
BEST = "best.json"  # --keep-best, in CHECKPOINTS beside the step dirs (engine/checkpoint/best.py)
UNIVERSAL = "universal"  # <output>/universal/step_<N>/: a ZeRO checkpoint converted for another world size
TENSORBOARD = "tensorboard"  # <output>/tensorboard/: event files (--report-to tensorboard)
_ENGINE_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")  # TrainState.engine: a name; which ones exist, the engines say
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


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


def parse_manifest(path: Path) -> Manifest:
    """The manifest of a checkpoint directory, every field checked; a RecordError names what is wrong (a missing
    or malformed manifest: not a complete vtrain checkpoint)."""
    marker = Path(path) / COMPLETE
    try:
        text = marker.read_text()
    except (OSError, UnicodeDecodeError):
        raise RecordError(f"{path}: no readable {COMPLETE} manifest (not a complete vtrain checkpoint)") from None
    if text.strip().isdigit():  # vtrain <= 0.1: the step alone (a number of more digits is no step: MAX_COUNT)
        if len(text.strip()) > len(str(MAX_COUNT)) or int(text.strip()) > MAX_COUNT:
            raise RecordError(f"{marker}: a step number beyond 2^53-1")
        return Manifest(int(text.strip()), None, legacy=True)
    r = Record(read_json(marker), marker)
    r.str("format", (FORMAT,))
    files = r.object("files")
    for rel in files.data:
        parts = Path(rel).parts
        if Path(rel).is_absolute() or ".." in parts or not parts or rel == COMPLETE:
            raise RecordError(f"{marker}: lists {rel!r}, which is not a file inside the checkpoint")
        entry = files.object(rel)
        entry.int("size")
        if not _SHA256.match(entry.str("sha256")):
            raise RecordError(f"{marker}: `sha256` of {rel} is not a SHA-256 hex digest")
    return Manifest(r.int("step", high=MAX_COUNT), r.str("run_id", default=None), files.data)


def read_manifest(path: Path) -> Manifest | None:
    """The manifest of a checkpoint directory; None when it has none or a malformed one (not a complete vtrain
    checkpoint; `verify` says what is wrong)."""
    try:
        return parse_manifest(path)
    except RecordError:
        return None


def is_checkpoint(path: Path) -> bool:
    p = Path(path)
    return read_manifest(p) is not None and ((p / TRAIN_STATE).is_file() or (p / LEGACY_TRAIN_STATE).is_file())


def _step_dirs(output_dir: str | Path) -> list[tuple[int, Path]]:
    """(N, path) of every real `step_<N>` folder of a run, oldest first (a link or a mount point is not this
    run's)."""
    root = checkpoint_dir(output_dir)
    if not root.is_dir():
        return []
    mounts = guarded.mount_points()
    return sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_RE.match(p.name))
                  and not p.is_symlink() and p.is_dir() and not guarded.is_mount(p, mounts))


def complete_checkpoints(output_dir: str | Path, run_id: str | None = None) -> list[Path]:
    """Complete checkpoints (a valid manifest), oldest first; only those of lineage `run_id` when given."""
    found = [(p, read_manifest(p)) for _, p in _step_dirs(output_dir)]
    return [p for p, m in found if m is not None and is_checkpoint(p) and (run_id is None or m.run_id == run_id)]


def marked_checkpoints(output_dir: str | Path) -> list[Path]:
    """Checkpoints marked complete (a `COMPLETE` file, valid or not), oldest first: what `--resume auto` and a
    run directory given to eval or consolidate try, newest first, naming each one that does not verify."""
    return [p for _, p in _step_dirs(output_dir) if os.path.lexists(p / COMPLETE)]


def linked_entries(output_dir: str | Path) -> list[str]:
    """One note per link or mount point among the checkpoints of a run: never read, pruned or deleted as the run's
    own."""
    root = checkpoint_dir(output_dir)
    if root.is_symlink() or not root.is_dir():
        return []
    mounts = guarded.mount_points()
    return [f"{guarded.describe_crossing(p)}: not this run's; left alone (never resumed, pruned or deleted)"
            for p in sorted(root.iterdir())
            if _STEP_RE.match(p.name) and (p.is_symlink() or guarded.is_mount(p, mounts))]


def inside_checkpoint(path: str | Path) -> Path | None:
    """The checkpoint (or a run's `checkpoints/` or `universal/` folder) that `path` lies in, links resolved, or
    None: what a command writing a user-named output, or a run's --output-dir, must never write into
    (guarded.claim_output, rundir.claim)."""
    p = Path(os.path.abspath(path)).resolve()
    for d in (p, *p.parents):
        try:
            if not d.is_dir():
                continue
            if d.name.startswith(STAGING) or any(os.path.lexists(d / n) for n in (COMPLETE, TRAIN_STATE,
                                                                                LEGACY_TRAIN_STATE)):
                return d
            if d.name == CHECKPOINTS and (os.path.lexists(d / BEST) or any(
                    _STEP_RE.match(c) or c.startswith(STAGING) for c in os.listdir(d))):
                return d
            if d.name == UNIVERSAL and (d.parent / CHECKPOINTS).is_dir():  # converted ZeRO checkpoints of a run
                return d
        except OSError:  # a folder we may not list holds no checkpoint we would write into
            continue
    return None


# ---- writing ------------------------------------------------------------------------------------------------------

def payload_files(root: Path) -> list[str]:
    """Every file under a checkpoint directory but the manifest, as sorted relative paths."""
    root = Path(root)
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name != COMPLETE)


def begin(output_dir: str | Path, step: int, is_main: bool) -> Path:
    """Rank 0 clears a stale temp dir of an earlier crash (never through a link); call a barrier after this."""
    tmp = tmp_path(output_dir, step)
    if is_main:
        guarded.rmtree(output_dir, tmp)
        tmp.mkdir(parents=True)
    return tmp


def abandon(output_dir: str | Path, step: int) -> None:
    """Rank 0, after a failed save: remove the staging folder, so nothing half-written stays behind."""
    guarded.rmtree(output_dir, tmp_path(output_dir, step))


def commit(output_dir: str | Path, step: int, run_id: str, files: dict[str, dict[str, Any]], keep_last: int,
           protect: tuple[Path, ...] = ()) -> tuple[Path, list[str]]:
    """Rank 0, after every rank finished writing: write the manifest, rename into place, prune this lineage's
    older checkpoints beyond `keep_last` (except `protect`, e.g. the best one). Returns the checkpoint and notes
    on what pruning left alone."""
    tmp, final = tmp_path(output_dir, step), final_path(output_dir, step)
    manifest = {"format": FORMAT, "version": 1, "step": step, "run_id": run_id, "time": time.time(),
                "files": files}
    def write_manifest(part: Path) -> None:
        with open(part, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())

    guarded.replace_file(tmp / COMPLETE, write_manifest, "write the manifest")
    fsync_dir(tmp)
    if os.path.lexists(final):  # the same step saved again (e.g. resumed at the very end): our own copy only
        old = read_manifest(final)
        if final.is_symlink() or old is None or old.run_id != run_id:
            raise CheckpointError(f"{final} exists and is not this run's (another run's, a link, or malformed); "
                                  "not replacing it")
        notes = remove(final)
        if os.path.lexists(final):
            raise CheckpointError(f"{final} still holds files after deleting this run's copy; not replacing it "
                                  f"({'; '.join(notes) or 'files the manifest does not list'})")
    with guarded.disk_op("rename the staging folder to", final):
        os.rename(tmp, final)
    fsync_dir(final.parent)
    return final, prune(output_dir, run_id, keep_last, protect)


def prune(output_dir: str | Path, run_id: str, keep_last: int, protect: tuple[Path, ...] = ()) -> list[str]:
    """Delete this lineage's checkpoints but the newest `keep_last` and `protect` (the best one, kept besides them
    when older); never another run's, never a link. A best that is superseded is pruned like any other at the
    next call. Returns notes on what was left alone."""
    keep = {Path(p).resolve() for p in protect}
    mine = complete_checkpoints(output_dir, run_id)
    old = [p for p in (mine[:-keep_last] if keep_last > 0 else mine) if p.resolve() not in keep]
    return [note for p in old for note in remove(p)]


def remove(path: Path) -> list[str]:
    """Delete a vtrain checkpoint (a real `checkpoints/step_<N>` folder of a run): the manifest first (so a crash
    midway never leaves a 'complete' checkpoint with files missing), then exactly the real files it lists, then
    folders left empty. Anything else stays: a file a user added, and a listed file that is a link or lies below
    one, or a mount point (returned as notes). Refused for a link or a mount point, or a checkpoint whose folders
    above it are links or mount points."""
    path = Path(path)
    root = path.parent.parent  # the run directory: <run>/checkpoints/step_<N>
    crossing = guarded.crossing_in(root, path / COMPLETE)
    if crossing is not None:
        raise CheckpointError(f"{guarded.describe_crossing(crossing)}; not deleting {path} through it")
    manifest = read_manifest(path)
    if manifest is None:
        raise CheckpointError(f"{path} is not a vtrain checkpoint; not deleting it")
    listed = list(manifest.files) if not manifest.legacy else payload_files(path)
    guarded.unlink(root, path / COMPLETE)
    notes = [note for rel in listed if (note := guarded.unlink(root, path / rel)) is not None]
    guarded.remove_empty_dirs(root, path)
    return list(dict.fromkeys(notes))  # one line per link, however many listed files lie below it


# ---- reading ------------------------------------------------------------------------------------------------------

def verify(path: str | Path, rank: int = 0, world: int = 1) -> str | None:
    """Check the manifest and this rank's share of the files (size, then SHA-256). Returns a one-line problem
    naming the file, or None. A listed file must be a real file (no link, none above it), and the checkpoint's
    JSON files must hold what vtrain writes (every reader trusts their fields). Legacy checkpoints are checked
    for their train state only."""
    path = Path(path)
    try:
        manifest = parse_manifest(path)
    except RecordError as e:
        return str(e)
    if manifest.legacy:
        return None if (path / LEGACY_TRAIN_STATE).is_file() else f"{path / LEGACY_TRAIN_STATE}: missing"
    if TRAIN_STATE not in manifest.files:
        return f"{path}: the manifest lists no {TRAIN_STATE}"
    for i, (rel, want) in enumerate(sorted(manifest.files.items())):
        f = path / rel
        crossing = guarded.crossing_in(path, f)
        if crossing is not None:
            return f"{guarded.describe_crossing(crossing)} (a checkpoint holds only real files)"
        if not f.is_file():
            return f"{f}: missing"
        size = f.stat().st_size
        if size != want["size"]:
            return f"{f}: {size} bytes, the manifest says {want['size']} (truncated or replaced)"
        if i % world == rank and digest(f)["sha256"] != want["sha256"]:
            return f"{f}: checksum mismatch (the file is damaged)"
    try:
        state = TrainState.read(path)
        read_categories(path)
    except VtrainError as e:
        return str(e)
    # the step a resume continues from is the train state's: it must be the one the manifest and the folder name
    # say (a step of 10^15 in a step_3 folder would "resume" past --max-steps and train nothing)
    named = _STEP_RE.match(path.name)
    if state.step != manifest.step or (named and int(named.group(1)) != state.step):
        return (f"{path / TRAIN_STATE}: `step` is {state.step}, but the manifest says {manifest.step}"
                + (f" and the folder {path.name}" if named else ""))
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
    if guarded.utf8_problem(p) is not None:  # what safetensors could not open: say so before verifying
        raise CheckpointError(f"{flag}: {guarded.utf8_problem(p)}; rename the folder")
    if is_checkpoint(p) or os.path.lexists(p / COMPLETE):  # a malformed manifest is named by verify
        verify_or_raise(p, flag)
        return p
    found = marked_checkpoints(p)
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
    """`auto`: the checkpoints of output_dir marked complete, newest first (may be empty; each is verified, and
    a damaged or malformed one skipped and named); a path: that checkpoint, or the newest one of a run
    directory."""
    if resume == "auto":
        return list(reversed(marked_checkpoints(output_dir)))
    marked = marked_checkpoints(resume)
    found = Path(resume) if os.path.lexists(Path(resume) / COMPLETE) else marked[-1] if marked else None
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
    """The parallel engine of the run that wrote it, as it names itself (its `kind`, engine/engines/). The format
    checks only that it is a name; whether this run's engine reads what that engine wrote, the engine says
    (`reads_checkpoint_of`)."""
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
        """The train state of a checkpoint (JSON; a legacy `train_state.pt` is read weights-only), every field
        checked for type and range (a RecordError names the file and the key)."""
        path = Path(path)
        if (path / TRAIN_STATE).is_file():
            where, state = path / TRAIN_STATE, read_json(path / TRAIN_STATE)
        else:
            import torch

            where = path / LEGACY_TRAIN_STATE
            state = torch.load(where, map_location="cpu", weights_only=True)
        r = Record(state, where)
        need = [f.name for f in fields(cls) if f.default is MISSING and f.name not in r.data]
        if need:
            raise RecordError(f"{where}: the train state lacks {', '.join(need)}")
        # every counter within what a run can reach; each step consumes at least one sample and skips at most one
        # step, so the counters are bounded by `step` as well
        step = r.int("step", high=MAX_COUNT)
        counters = {k: r.int(k, high=step, default=0) for k in ("skipped_steps", "overflow_skips",
                                                                   "consecutive_nonfinite")}
        engine = r.str("engine")
        if not _ENGINE_NAME.fullmatch(engine):
            raise RecordError(f"{where}: `engine` must be an engine's name (lowercase letters, digits, _), got "
                              f"{shown(engine)}")
        return cls(step=step, consumed_samples=r.int("consumed_samples", low=step, high=MAX_COUNT),
                   scheduler=scheduler_state(r.object("scheduler")), **counters,
                   world_size=r.int("world_size", low=1, high=MAX_COUNT), engine=engine,
                   ema=ema_state(r.object("ema", default=None)),
                   scaler=scaler_state(r.object("scaler", default=None)))


def read_categories(path: Path) -> list[dict[str, Any]] | None:
    """A detection checkpoint's class ids and names in label order (`categories.json`), checked with the rules the
    COCO reader applies to the file the run trained on (records.categories), and in label order (ascending ids, as
    training writes them); None without."""
    file = Path(path) / CATEGORIES
    if not file.is_file():
        return None
    data = categories(read_json(file), str(file))
    ids = [c["id"] for c in data]
    if ids != sorted(ids):
        raise RecordError(f"{file}: the category ids are not in label order (ascending, as training writes them)")
    return data


def read_train_state(path: Path) -> dict[str, Any]:
    """`TrainState.read` as the file's plain keys (defaults filled in), for callers outside the run."""
    return TrainState.read(path).to_json()


def write_json(path: Path, obj: Any) -> None:
    """A checkpoint's JSON file (train state, categories, best.json): indented by 1, written atomically."""
    write_json_atomic(path, obj, indent=1)
