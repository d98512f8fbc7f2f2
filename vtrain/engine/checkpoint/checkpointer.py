"""The checkpoint protocol of a training run: what to resume, the write sequence and the read sequence.

format.py is the format (layout names, manifest, verify, prune, find); this module decides which rank does
what, and when. As torchtitan's `components/checkpoint.py` (CheckpointManager), the Trainer builds the run and hands
over what a checkpoint holds: the engine (model, optimizer, per-rank RNG), the sharded head, the EMA, the scheduler,
and the loop itself, whose `state_dict()` / `load_state_dict()` is its part of `train_state.json`
(`checkpoint.TrainState`, the one definition of that file's keys).

Every method here that says "Collective" runs the same collectives and barriers in the same order on every rank;
that order is part of the protocol (a rank that skips or reorders one hangs or desyncs the run), so a change here
is a change to every rank at once. Hardening, and where later hardening goes:
- symlinked checkpoints are never pruned or deleted: checkpoint.prune / checkpoint.remove (the format), through
  vtrain/io/guarded.py;
- a full disk (or a read-only or vanished folder) during a save: `_stage` runs every write into the staging
  folder through `guarded.Writes`, so a rank whose write failed still joins every collective of the save; the
  ranks then agree on the outcome, rank 0 removes the staging folder and every rank stops with one error line
  naming the path and the operation (`_abandon`). The manifest and the rename (`_commit`) are agreed the same way;
- validating every tensor read on resume: `load` is the one read sequence; `_check_and_read` checks the recorded
  model and every file of tensors (engine/checkpoint/content.py), Accelerate's optimizer file and this rank's RNG state
  before the engine reads any, all ranks agreeing; what vtrain does not parse before loading (DeepSpeed's
  optimizer partitions, DCP's values) is checked once loaded (`_check_optimizer_state`).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

from accelerate import Accelerator
from safetensors.torch import save_file

from vtrain.io import guarded
from vtrain.config import RunConfig, load_run_config
from vtrain.dist import AgreedError, agreed, broadcast_from_main, gather_objects
from vtrain.engine.checkpoint import format as ckpt
from vtrain.engine import faults
from vtrain.engine.checkpoint import content, content_state, resume_settings
from vtrain.engine.checkpoint.best import BestKeeper
from vtrain.engine.ema import WeightEMA
from vtrain.engine.head_shard import ShardedHead
from vtrain.engine.engines.base import Engine
from vtrain.errors import VtrainError
from vtrain.io.files import digest_share


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a run continues from, chosen once (`Checkpointer.choose`) and passed where it is needed: the
    Trainer reads its step and saved config, `Checkpointer.load` restores it once after `prepare`."""

    path: Path
    """The checkpoint folder, verified on every rank."""
    state: ckpt.TrainState
    """Its train_state.json, read and checked."""
    config: RunConfig | None
    """The config it recorded (None: a checkpoint of vtrain <= 0.1, without one)."""
    run_id: str
    """Its lineage (the manifest's run id; "" for a checkpoint without one)."""
    reshard: bool
    """Loaded through the engine's reshard route (a ZeRO checkpoint of another world size), configured by `choose`
    before the engine is prepared."""

    @property
    def step(self) -> int:
        return self.state.step


class Checkpointer:
    """Owns saving, resuming (choosing the checkpoint, the lineage, the engine's reshard route), and, through
    format.commit, pruning and the --keep-best record. Use: `choose` (with the engine, before the model is built:
    it returns the run's ResumePoint and configures the reshard route, which must be set before `prepare`),
    `attach` (after `prepare`), then `load(point)` once, `save` at every checkpoint step."""

    def __init__(self, cfg: RunConfig, accelerator: Accelerator) -> None:
        self.cfg, self.accelerator = cfg, accelerator
        self.faults = faults.injected()  # read once, at start-up
        self.out = Path(cfg.train.output_dir)
        self.rank, self.world = accelerator.process_index, accelerator.num_processes
        self.is_main = accelerator.is_main_process
        self.run_id = ""
        """The lineage: pruning deletes only checkpoints carrying this id; a resumed run keeps its checkpoint's."""
        self.best: BestKeeper | None = None
        # what a checkpoint holds, handed over by `attach`
        self.loop: Stateful | None = None
        self.engine: Engine | None = None
        self.scheduler: Any = None
        self.head: ShardedHead | None = None
        self.ema: WeightEMA | None = None
        self.dataset: Any = None

    # ---- what to resume ------------------------------------------------------------------------------------------
    def choose(self, engine: Engine) -> tuple[ResumePoint | None, list[str]]:
        """The checkpoint to continue from (--resume), verified on all ranks, as one ResumePoint (None: a fresh
        run), and the run's lineage (the checkpoint's, else a new run id agreed from rank 0). A ZeRO checkpoint of
        another world size, which DeepSpeed's own loader refuses, takes `engine`'s reshard route (its universal
        format), configured now: it must be before the engine is prepared. Returns the point and notes for the log.
        Collective."""
        path, notes = self._verified_candidate()
        point = None
        if path is not None:
            state = ckpt.TrainState.read(path)
            manifest = ckpt.read_manifest(path)
            # the model it records against this run's, before anything is built or written (the class count is
            # compared in `load`, once the data is read)
            broadcast_from_main(lambda: self._same_model(path, None))
            saved = load_run_config(path / ckpt.CONFIG) if (path / ckpt.CONFIG).is_file() else None
            point = ResumePoint(path, state, saved, manifest.run_id or "",
                                engine.needs_reshard(state.engine, state.world_size))
            if point.reshard:
                engine.use_reshard_route()
        self.run_id = (point.run_id if point is not None else "") or broadcast_from_main(lambda: uuid.uuid4().hex)
        keep_best = self.cfg.train.keep_best
        self.best = BestKeeper(self.out, keep_best, self.run_id) if keep_best else None
        return point, notes

    def _verified_candidate(self) -> tuple[Path | None, list[str]]:
        """The one --resume names, or for `auto` the newest checkpoint in the output directory that verifies
        (damaged ones are skipped and named). Every rank checks sizes and hashes its share of the files; all ranks
        see the same verdict. Collective."""
        resume = self.cfg.train.resume
        if resume is None:
            return None, []
        candidates = [Path(p) for p in broadcast_from_main(
            lambda: [str(c) for c in ckpt.resume_candidates(resume, self.out)])]
        notes = []
        for cand in candidates:
            problem = ckpt.verify(cand, self.rank, self.world)
            problem = next((p for p in gather_objects(problem) if p), None)
            if problem is None:
                return cand, notes
            if resume != "auto":
                raise VtrainError(f"--resume: damaged checkpoint: {problem}")
            notes.append(f"--resume auto: skipped the damaged checkpoint {cand.name} ({problem})")
        if candidates:
            raise VtrainError(f"--resume auto: no checkpoint in {ckpt.checkpoint_dir(self.out)} verifies; "
                              f"newest: {notes[0].split('(', 1)[1][:-1]}")
        return None, notes

    def newest(self) -> Path | None:
        """This lineage's newest complete checkpoint, if any."""
        found = ckpt.complete_checkpoints(self.out, self.run_id)
        return found[-1] if found else None

    # ---- what a checkpoint holds ---------------------------------------------------------------------------------
    def attach(self, *, loop: Stateful, engine: Engine, scheduler: Any, head: ShardedHead | None,
               ema: WeightEMA | None, dataset: Any) -> None:
        """After `prepare`: the objects `save` writes and `load` restores. `dataset`: its `categories` (detection
        class names) go into every checkpoint, for `vtrain predict`."""
        self.loop, self.engine, self.scheduler = loop, engine, scheduler
        self.head, self.ema, self.dataset = head, ema, dataset

    # ---- the read sequence ---------------------------------------------------------------------------------------
    def load(self, point: ResumePoint) -> list[str]:
        """Restore the run from `point`. First what the checkpoint holds is checked against this run (the model
        it records, then the tensors of every file this rank reads) and the head rows and the EMA are read, all ranks
        agreeing on the outcome; then engine state (model, optimizer, RNG), schedule, the loop's counters, loss
        scaler, best. Returns notes for the log. Collective under DeepSpeed and FSDP2."""
        path, state = point.path, point.state
        assert self.engine is not None
        notes: list[str] = []
        # no collective inside: a bad file only one rank reads (its head shard) stops every rank with one line
        agreed(lambda: self._check_and_read(point, notes))
        mine = resume_settings.run_settings(self.engine, self.scheduler)  # before the checkpoint replaces them
        if point.reshard:
            self.engine.load_resharded(path, self.out)  # the engine's reshard route (DeepSpeed: universal)
        else:
            self.engine.load(path)
        if not self.engine.parameters_finite():  # collective: DeepSpeed's and DCP's files are not parsed by vtrain
            problem = f"--resume: {path}: the model's weights hold inf/NaN after loading its {state.engine} state"
            raise VtrainError(problem) if self.is_main else AgreedError(problem)
        # the optimizer state as loaded (DeepSpeed's partitions and DCP's shards are not parsed by vtrain before):
        # moments of their parameters' shapes, finite, second moments >= 0, checked now rather than found at the
        # first update (a shape) or a few steps later (NaN weights); every rank its own state, all agreeing
        agreed(lambda: self._check_optimizer_state(path))
        self.scheduler.load_state_dict(state.scheduler)
        # this run's LRs, weight decay and betas where the checkpoint's replaced them, each change said in the log
        # (LambdaLR.load_state_dict leaves the optimizer alone: the LRs are set here)
        notes += resume_settings.apply(mine, self.engine, self.scheduler, point.config, self.cfg, state, self.world)
        self.loop.load_state_dict(state.to_json())
        if state.world_size != self.world:
            notes.append(f"resharded: saved by {state.world_size} processes, resumed on {self.world}")
        if self.engine.scaler is not None and state.scaler:
            self.engine.scaler.load_state_dict(state.scaler)
        if self.ema is None and state.ema:
            notes.append(f"{path} holds EMA weights; this run has no --ema-decay and drops them")
        if self.best is not None and self.is_main:
            note = self.best.restore(state.step)
            if note:
                notes.append(note)
        return notes

    def _check_optimizer_state(self, path: Path) -> None:
        problem = content_state.optimizer_problem(self.engine.optimizer_states())
        if problem:
            raise VtrainError(f"--resume: {self.engine.optimizer_file(path)}: {problem} (after loading its "
                              f"{self.engine.kind} state)")

    def _same_model(self, path: Path, classes: int | None) -> None:
        """The model checkpoint `path` records (its config.yaml and class count) against the one this run builds
        with `classes` classes (None: not compared), in one line saying both."""
        if not (path / ckpt.CONFIG).is_file():  # vtrain <= 0.1: no record; the tensors are still checked
            return
        saved_cfg = load_run_config(path / ckpt.CONFIG)
        saved_classes = None if classes is None else content.recorded_classes(path, saved_cfg, "--resume")
        content.same_model(content.describe(saved_cfg, saved_classes), content.describe(self.cfg, classes),
                           f"--resume: {path}")

    def _check_and_read(self, point: ResumePoint, notes: list[str]) -> None:
        """The checkpoint's recorded model against this run's (one line saying both), the engine and optimizer
        layout, then every file of tensors this rank reads, each against this run's model (content.py), before the
        engine reads any; the head rows and the EMA are read here. No collective: `load` agrees on the outcome."""
        path, state = point.path, point.state
        classes = self.dataset.num_classes
        self._same_model(path, classes)
        layout = self.engine.layout
        if not self.engine.reads_checkpoint_of(state.engine):  # one process is DDP of one: it reads DDP's
            raise VtrainError(f"--resume: {path} was saved with {state.engine}, this run uses {self.engine.kind}")
        # the optimizer state is per parameter group, and --layer-decay changes the groups: say so before the
        # optimizer's own loader fails with a traceback (the scheduler state holds one base LR per group)
        saved_groups, groups = len(state.scheduler["base_lrs"]), len(self.scheduler.base_lrs)
        if saved_groups != groups:
            raise VtrainError(f"--resume: {path} has {saved_groups} optimizer parameter groups, this run builds "
                              f"{groups} (was --layer-decay changed?); resume with the run's settings or start "
                              "from its weights with --resume-weights-only")
        spec = content.model_spec(self.cfg, classes)
        read = [path / layout.model_file] if layout.model_file else []  # the engine's own file vtrain can read
        if point.reshard:
            read.append(path / ckpt.MODEL)  # its buffers and frozen parameters (engines/deepspeed.py)
        for f in read:
            if f.is_file():
                content.expect_tensors(f, spec, "--resume", "this run's model")
        if layout.optimizer_file and (path / layout.optimizer_file).is_file():
            content_state.expect_optimizer(path / layout.optimizer_file, self.engine.optimizer_groups(), "--resume")
        rng = path / ckpt.ACCELERATE / f"random_states_{self.rank}.pkl"  # Accelerate's name
        if not point.reshard and rng.is_file():  # the universal route restores no RNG state
            content_state.expect_rng_state(rng, "--resume")
        if self.head is not None:
            self.head.load(path)  # this run's rows, re-split for its number of processes, checked as read
        if self.ema is not None:
            if (path / ckpt.EMA).is_file() and state.ema:
                content.expect_tensors(path / ckpt.EMA, spec, "--resume", "this run's model")
                self.ema.load(path / ckpt.EMA, state.ema)  # re-sharded for this run's processes
            else:
                notes.append(f"--ema-decay: {path} holds no EMA; the average starts from its weights")

    # ---- the write sequence --------------------------------------------------------------------------------------
    def save(self, log: Callable[[str], None]) -> Path:
        """Write a checkpoint of the loop's current step: everything into a staging folder, then a manifest with
        every file's size and SHA-256 (hashed by all ranks in parallel), renamed into place by rank 0, which then
        prunes and records the best. `log`: rank 0's run log. Collective."""
        loop = self.loop.state_dict()
        step = loop["step"]
        problem = self._stage(loop)
        # every rank's outcome, agreed before anything is listed or renamed: one rank's full disk stops them all
        problems = [p for p in gather_objects(problem) if p]
        if problems:
            broadcast_from_main(lambda: self._abandon(step, problems[0]))  # raises on every rank
        return self._commit(ckpt.tmp_path(self.out, step), step, log)

    def _stage(self, loop: dict[str, Any]) -> str | None:
        """Every write into the staging folder, on every rank; returns this rank's first failed write as one line
        (None when all succeeded). After a failure a rank skips its own remaining writes but still runs every
        collective below, so no rank is left waiting in one. Collective."""
        step = loop["step"]
        tmp = ckpt.tmp_path(self.out, step)
        write = guarded.Writes()
        self.faults.file_size_limit(step, self.rank)
        write("create", tmp, ckpt.begin, self.out, step, self.is_main)
        self.accelerator.wait_for_everyone()  # the staging folder exists (and is empty) before any rank writes
        self.engine.sync_buffers()  # collective: what is saved is what every rank continues with
        write("write", tmp, self.engine.save, tmp)  # every rank its shards and RNG state
        if self.head is not None:
            write("write", tmp / ckpt.HEAD, self.head.save, tmp)  # every rank its class range (head_shard.py)
        full = self.engine.full_state_dict()  # collective (FSDP2 / ZeRO-3 gather), whole on rank 0
        ema_full = self.ema.full_state_dict(full) if self.ema is not None else None  # collective, whole on rank 0
        self.faults.crash("VTRAIN_DEBUG_CRASH_IN_SAVE", step)
        if self.is_main:
            write("write", tmp / ckpt.MODEL, save_file, full, str(tmp / ckpt.MODEL))
            if ema_full is not None:
                write("write", tmp / ckpt.EMA, save_file, ema_full, str(tmp / ckpt.EMA),
                      metadata={k: str(v) for k, v in self.ema.state().items()})
            state = ckpt.TrainState(
                **loop, scheduler=self.scheduler.state_dict(), world_size=self.world, engine=self.engine.kind,
                ema=self.ema.state() if self.ema is not None else None,
                scaler=self.engine.scaler.state_dict() if self.engine.scaler is not None else None)
            write("write", tmp / ckpt.TRAIN_STATE, state.write, tmp)
            write("write", tmp / ckpt.CONFIG, self.cfg.save, tmp / ckpt.CONFIG)
            if hasattr(self.dataset, "categories"):  # detection class names, for `vtrain predict`; in the manifest
                write("write", tmp / ckpt.CATEGORIES, ckpt.write_json, tmp / ckpt.CATEGORIES, self.dataset.categories)
        self.accelerator.wait_for_everyone()  # every rank's files are complete before any is listed or hashed
        return write.problem

    def _abandon(self, step: int, problem: str) -> None:
        """Rank 0, after a failed save: remove the staging folder (nothing half-written stays) and raise the one
        line every rank stops with. The earlier checkpoints were never touched: pruning runs only after a commit."""
        tmp = ckpt.tmp_path(self.out, step)
        if not tmp.exists() and ckpt.is_checkpoint(ckpt.final_path(self.out, step)):  # failed after the rename
            raise VtrainError(f"saved checkpoint step_{step}, then: {problem}")
        try:
            ckpt.abandon(self.out, step)
            cleanup = f"removed the unfinished {tmp.name}"
        except VtrainError as e:
            cleanup = f"could not remove the unfinished {tmp} ({e})"
        newest = self.newest()
        raise VtrainError(f"saving checkpoint step_{step}: {problem}; {cleanup}; the earlier checkpoints are as "
                          f"they were (newest: {newest.name if newest else 'none'})")

    def _commit(self, tmp: Path, step: int, log: Callable[[str], None]) -> Path:
        """Hash the staged files (each rank a share), then rank 0 writes the manifest, renames the folder into
        place, prunes this lineage beyond --keep-last (never the best) and records the best; a failure there is
        agreed like one in `_stage`. Collective."""
        files = broadcast_from_main(lambda: ckpt.payload_files(tmp))  # one list: rank 0's view of the folder
        digests = digest_share(tmp, files, self.rank, self.world)
        digests = {k: v for share in gather_objects(digests) for k, v in share.items()}

        def commit() -> Path:
            try:
                final, notes = ckpt.commit(self.out, step, self.run_id, digests, self.cfg.train.keep_last,
                                           protect=self.best.protect() if self.best is not None else ())
            except VtrainError as e:  # the manifest could not be written, or the folder not renamed
                self._abandon(step, str(e))
            if self.best is not None:
                self.best.write()
            log(f"saved {final}")
            for note in notes:
                log(note)
            return final

        final = broadcast_from_main(commit)  # raises on every rank when rank 0's commit failed
        self.accelerator.wait_for_everyone()  # no rank goes on (or exits) before the checkpoint is in place
        return final

    # ---- --keep-best ---------------------------------------------------------------------------------------------
    def consider_best(self, step: int, metrics: dict[str, Any] | None) -> str | None:
        """After an evaluation: rank 0 decides whether `step` is the new best and records it now if the step is
        saved already (the last one), else after its save; a user or disk error there stops every rank. Returns
        the note for the log. Collective when --keep-best is on."""
        if self.best is None:
            return None

        def decide() -> str | None:
            if not self.best.consider(step, metrics):
                return None
            note = f"--keep-best: new best {self.best.best['metric']} = {self.best.best['value']:.4g} at step {step}"
            if self.best.write():  # its step is saved already (the last one): the best it replaced is pruned now
                left = ckpt.prune(self.out, self.run_id, self.cfg.train.keep_last, self.best.protect())
                note = "\n".join([note, *left])
            return note

        return broadcast_from_main(decide)
