"""The training loop: one explicit loop, periodic work as visible `if step % n == 0` lines.

`Trainer.__init__` fixes the build order; `train_step` runs one optimizer step (all micro-batches of an
accumulation window) so tests can call it; `fit` is the loop.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import math
import os
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from accelerate.utils import set_seed
from safetensors.torch import save_file
from torch.utils.data import DataLoader

from vtrain.config import RunConfig
from vtrain.data.sampler import ShardedEpochSampler
from vtrain.data.skip import CollateWithBadList, SkipBadSamples
from vtrain.data.workers import worker_context
from vtrain.engine import checkpoint as ckpt
from vtrain.engine import autoplan, head_shard
from vtrain.engine import rundir
from vtrain.engine.interrupt import GracefulInterrupt, TrainingInterrupted, ignore_in_worker
from vtrain.engine import ema as ema_mod
from vtrain.engine.best import BestKeeper
from vtrain.engine.logging import RunLogger, StepTimer, flat_hparams, memory_gb, tracker_name
from vtrain.engine.optim import build_optimizer, build_scheduler, layer_decay_note
from vtrain.engine.parallel import ParallelEngine, build_accelerator
from vtrain.engine.plan import resolve_plan
from vtrain.errors import BadSample, VtrainError
from vtrain.models.backbones import load_strict, read_state_dict
from vtrain.models.checkpointing import recompute_summary
from vtrain.safeio import enforce_weights_only
from vtrain.tasks import build_task


def _debug_crash(var: str, step: int) -> None:
    """Fault injection for the resume tests: a hard kill (no cleanup, no exception handlers) at a given step."""
    if os.environ.get(var) == str(step):
        os._exit(17)


def _debug_signal(step: int, rank: int) -> None:
    """Fault injection for the preemption tests: `VTRAIN_DEBUG_SIGNAL_AT_STEP=N[@RANK]` sends this process a
    SIGTERM while it trains step N (on every rank, or only on RANK), through the real signal handler."""
    spec = os.environ.get("VTRAIN_DEBUG_SIGNAL_AT_STEP", "")
    at, _, who = spec.partition("@")
    if at == str(step) and who in ("", str(rank)):
        os.kill(os.getpid(), signal.SIGTERM)


def _debug_nonfinite(what: str, step: int) -> bool:
    """Fault injection for the non-finite guards: `VTRAIN_DEBUG_NONFINITE=loss@N` makes every loss from step N on
    NaN; `param@N` turns a weight into inf after step N (what an overflowing update does)."""
    kind, _, at = os.environ.get("VTRAIN_DEBUG_NONFINITE", "").partition("@")
    return kind == what and at.isdigit() and step >= int(at)


class _Window:
    """Sums of the per-step stats since the last log line. Device tensors are summed on the device (NaN values
    left out and counted there too, as a host-side `isnan` test would need a sync per step); host floats here."""

    def __init__(self) -> None:
        self.sums: dict[str, Any] = {}
        self.counts: dict[str, Any] = {}

    def add(self, stats: dict[str, Any]) -> None:
        for k, v in stats.items():
            if k == "skipped":
                continue
            if isinstance(v, torch.Tensor):
                v = v.detach().to(torch.float64)
                ok = ~torch.isnan(v)
                v, n = torch.where(ok, v, torch.zeros_like(v)), ok.to(torch.float64)
            elif math.isnan(v):
                continue
            else:
                n = 1
            self.sums[k] = self.sums[k] + v if k in self.sums else v
            self.counts[k] = self.counts[k] + n if k in self.counts else n

    def means(self, device: torch.device) -> tuple[list[str], torch.Tensor]:
        """Sorted keys and their means as one float64 tensor on `device` (NaN where a key had no finite value).
        Every rank holds the same keys: skips are agreed, and a key appears once it was added at all."""
        keys = sorted(self.sums)
        as_t = lambda x: torch.as_tensor(x, dtype=torch.float64).to(device)  # noqa: E731
        if not keys:
            return keys, torch.zeros(0, dtype=torch.float64, device=device)
        sums = torch.stack([as_t(self.sums[k]) for k in keys])
        counts = torch.stack([as_t(self.counts[k]) for k in keys])
        return keys, sums / counts


@contextlib.contextmanager
def _skip_hint():
    """An unreadable training image names the flag that skips it: only here, where the flag exists and applies
    (evaluation, `vtrain eval` and `vtrain predict` never skip an image, so their messages do not suggest it)."""
    try:
        yield
    except BadSample as e:
        raise BadSample(f"{e} (--skip-bad-images skips unreadable images)") from None


class _AgreedError(VtrainError):
    """An error rank 0 found and told the other ranks about: they exit quietly, rank 0 prints it once."""

    quiet = True


class Trainer:
    def __init__(self, cfg: RunConfig, interrupt: GracefulInterrupt | None = None) -> None:
        self.cfg = cfg
        t = cfg.train
        enforce_weights_only()  # no file read on this run's behalf may run code (safeio.py)
        self.interrupt = interrupt or GracefulInterrupt().install()
        # 1. launch plan, then the process group: everything below may run collectives.
        self.plan = resolve_plan(cfg)
        self.out = Path(t.output_dir)
        self.accelerator = build_accelerator(self.plan, t.grad_accum, tracker_name(t.report_to), t.output_dir)
        self.rank, self.world = self.accelerator.process_index, self.accelerator.num_processes
        self.is_main = self.accelerator.is_main_process
        self.interrupt.use_group(self.world)
        # 2. the output directory: rank 0 locks it (one run per directory) and checks what it may hold, before
        # anything is written; then the checkpoint to resume, verified on all ranks, each hashing a share.
        self.lock = None
        notes = self._agree(self._claim_output_dir)
        self._check_shared_output_dir()
        self.resumed_from, resume_notes = self._choose_resume()
        self.logger_notes: list[str] = notes + resume_notes
        self.saved_state = ckpt.read_train_state(self.resumed_from) if self.resumed_from is not None else None
        manifest = ckpt.read_manifest(self.resumed_from) if self.resumed_from is not None else None
        # the lineage: pruning deletes only checkpoints carrying this id; a resumed run keeps its checkpoint's
        self.run_id = (manifest.run_id if manifest is not None and manifest.run_id else None) or \
            self._agree(lambda: uuid.uuid4().hex)
        if self.is_main:
            cfg.save(self.out / "config.yaml")
            if t.resume is not None:
                rundir.truncate_logs(self.out, self.saved_state["step"] if self.saved_state else 0)
        # 3. identical initial weights on every rank (FSDP2 shards from the full init; DDP would broadcast).
        set_seed(t.seed)
        with self.accelerator.main_process_first():  # rank 0 writes the demo data once; the others then read it
            self.task = build_task(cfg)
            with _skip_hint():
                dataset = self.task.train_dataset()
        # the evaluation data (held-out sets, .bin packs) is read and checked now: a pack that cannot be scored
        # must stop the run before it trains, not after its final save
        self.task.check_eval_data()
        # 4. model -> activation checkpointing (inside build_model; with `--grad-ckpt auto` the planner's, made on
        # rank 0 from a fake-tensor trace and broadcast) -> pretrained weights -> sharding
        model = self.task.build_model()
        self.memory_plan = autoplan.choose(cfg, self.plan, dataset.num_classes, self.accelerator.device, self._agree)
        if self.memory_plan is not None:
            autoplan.apply(model, self.memory_plan)
            self.logger_notes.append(f"--grad-ckpt auto: {self.memory_plan.describe()} "
                                     f"({self.memory_plan.traces} traces, {self.memory_plan.seconds:.0f} s)")
        # --head-parallel sharded: this rank's class shard, built beside (never inside) the model the engine wraps
        self.head = head_shard.build(cfg, dataset, self.rank, self.world, self.accelerator.device, self.plan)
        self.pretrained_msg = ""
        if cfg.model.pretrained and self.resumed_from is None:
            self.pretrained_msg = self.task.load_pretrained(model)
            if self.head is not None:  # a full model file's head.weight (consolidated): this rank's rows
                self.pretrained_msg += self.head.take_rows(read_state_dict(cfg.model.pretrained))
        if t.resume_weights_only:
            sd = read_state_dict(t.resume_weights_only)
            head_msg = self.head.take_rows(sd, required=True) if self.head is not None else ""
            load_strict(model, sd, "--resume-weights-only", f"{t.resume_weights_only} does not fit this model")
            self.pretrained_msg = f"weights loaded from {t.resume_weights_only} (fresh optimizer and schedule)" + \
                head_msg
        self.engine = ParallelEngine(self.plan, self.accelerator)
        # A ZeRO checkpoint of another world size is loaded in DeepSpeed's universal format, which must be
        # configured before the engine exists (prepare, below).
        self.reshard_deepspeed = (self.plan.kind == "deepspeed" and self.saved_state is not None
                                  and self.saved_state["engine"] == "deepspeed"
                                  and self.saved_state["world_size"] != self.world)
        if self.reshard_deepspeed:
            self.engine.use_universal_checkpoint()
        model = self.engine.shard(model)
        # 5. parameter groups and optimizer (after FSDP2: they must see the DTensor parameters)
        optimizer = build_optimizer(model, cfg.optim, self.plan)
        if cfg.optim.layer_decay is not None:
            self.logger_notes.append(layer_decay_note(model, cfg.optim))
        # 6. data: our own sharded, resumable sampler (Accelerate does not shard it; see sampler.py)
        self.sampler = ShardedEpochSampler(len(dataset), t.batch_size, self.rank, self.world, seed=t.seed,
                                           group_ids=getattr(dataset, "group_ids", None))
        if self.sampler.batches_per_epoch < 1:
            raise VtrainError(f"--batch-size {t.batch_size} x {self.world} processes exceeds the "
                              f"{len(dataset)} training images")
        self.dataset = SkipBadSamples(dataset) if cfg.data.skip_bad_images else dataset
        per_epoch = self.sampler.batches_per_epoch // t.grad_accum
        if t.max_steps is None and per_epoch < 1:
            raise VtrainError(f"one epoch has {self.sampler.batches_per_epoch} micro-batches per process, fewer "
                              f"than --grad-accum {t.grad_accum}; lower it or set --max-steps")
        self.total_steps = t.max_steps or (t.epochs or 1) * per_epoch
        # 7. one prepare (DDP wrap / DeepSpeed engine); the scheduler computes LRs, engine.set_lrs applies them
        self.model, self.optimizer = self.engine.prepare(model, optimizer)
        self.scheduler = build_scheduler(optimizer, cfg.optim, self.total_steps)
        self.active = self.engine.active()
        self.active["grad_ckpt"] = recompute_summary(self.engine.unwrapped)  # read from the live blocks
        if self.memory_plan is not None:
            self.active.update(autoplan.report(self.engine.unwrapped, self.memory_plan))
        if self.head is not None:
            self.active.update(self.head.active())
        self.engine.verify(self.active)
        # the EMA starts from the weights as built (pretrained included); a resume below replaces it
        self.ema = ema_mod.WeightEMA(self.engine, t.ema_decay, t.ema_warmup) if t.ema_decay > 0 else None
        self.best = BestKeeper(self.out, t.keep_best, self.run_id) if t.keep_best else None
        # 8. resume (model, optimizer, RNG through the engine; step, schedule, counters here)
        self.step = 0
        self.consumed_samples = 0
        self.skipped_steps = 0
        self.overflow_skips = 0
        self.consecutive_nonfinite = 0
        self.bad_files: list[str] = []
        if self.resumed_from is not None:
            self._load(self.resumed_from)
        self.logger = RunLogger(self.out, self.is_main, self.total_steps, self.step, *self._trackers())
        self._first_batch_indices: list[int] | None = None

    # ---- output directory and resume ------------------------------------------------------------------------
    def _agree(self, fn):
        """Run `fn` on rank 0 and hand its result (or its user error) to every rank. Collective."""
        result, error = None, None
        if self.is_main:
            try:
                result = fn()
            except VtrainError as e:
                error = str(e)
                if self.world == 1:
                    raise
        if self.world > 1:
            box = [result, error]
            dist.broadcast_object_list(box, src=0)
            result, error = box
        if error is not None:
            raise VtrainError(error) if self.is_main else _AgreedError(error)
        return result

    def _claim_output_dir(self) -> list[str]:
        t = self.cfg.train
        self.lock, notes = rundir.claim(self.out, t.resume, t.overwrite_output_dir)
        atexit.register(self.lock.release)  # also on errors; a killed run's lock is detected as stale
        return notes

    def _check_shared_output_dir(self) -> None:
        """Every rank must see the directory rank 0 just locked: all ranks write their shards into one checkpoint
        folder that rank 0 renames, so on several nodes --output-dir must be on a file system they all mount.
        Checked here rather than found at the first save, which may be hours in. Collective."""
        if self.world == 1:
            return
        problem = rundir.lock_seen(self.out, self._agree(lambda: self.lock.owner["token"]))
        problems = [None] * self.world
        dist.all_gather_object(problems, problem)
        bad = [f"rank {r}: {p}" for r, p in enumerate(problems) if p]
        if bad:
            error = (f"--output-dir {self.out} is not shared by every process ({'; '.join(bad)}): all ranks write "
                     "each checkpoint into one directory, so put it on a file system every node mounts at the same "
                     "path (docs/multinode.md)")
            raise VtrainError(error) if self.is_main else _AgreedError(error)

    def _choose_resume(self) -> tuple[Path | None, list[str]]:
        """The checkpoint to continue from: the one --resume names, or for `auto` the newest one in the output
        directory that verifies (damaged ones are skipped and named). Every rank checks sizes and hashes its
        share of the files; all ranks see the same verdict."""
        resume = self.cfg.train.resume
        if resume is None:
            return None, []
        candidates = [Path(p) for p in self._agree(lambda: [str(c) for c in ckpt.resume_candidates(resume, self.out)])]
        notes = []
        for cand in candidates:
            problem = ckpt.verify(cand, self.rank, self.world)
            problems = [problem]
            if self.world > 1:
                problems = [None] * self.world
                dist.all_gather_object(problems, problem)
            problem = next((p for p in problems if p), None)
            if problem is None:
                return cand, notes
            if resume != "auto":
                raise VtrainError(f"--resume: damaged checkpoint: {problem}")
            notes.append(f"--resume auto: skipped the damaged checkpoint {cand.name} ({problem})")
        if candidates:
            raise VtrainError(f"--resume auto: no checkpoint in {ckpt.checkpoint_dir(self.out)} verifies; "
                              f"newest: {notes[0].split('(', 1)[1][:-1]}")
        return None, notes

    # ---- description -----------------------------------------------------------------------------------------
    def describe(self) -> str:
        t, p = self.cfg.train, self.plan
        mode = {"torch_autocast": f"{p.precision} autocast, fp32 master weights (DeepSpeed torch_autocast)",
                "bf16": "DeepSpeed full bf16 (BatchNorm kept fp32)", "fp16": "DeepSpeed fp16 + loss scaling",
                "fp32": "fp32"}.get(p.ds_precision_mode, "fp32" if p.precision == "no" else
                                    f"{p.precision} autocast, fp32 master weights")
        extra = ""
        if "local_param_fraction" in self.active:
            extra = f" | local params {self.active['local_param_fraction']:.3f} of model"
        return (f"engine: {p.describe()} | world {self.world} | device {self.accelerator.device} | precision {mode}"
                f" | micro-batch {t.batch_size} x accum {t.grad_accum} x {self.world} = global batch "
                f"{t.batch_size * t.grad_accum * self.world}{extra}")

    # ---- data position -----------------------------------------------------------------------------------------
    def _micro_batches(self):
        """Infinite stream of micro-batches starting at the data position: `consumed_samples` counts global
        samples, so a run resumed with another number of processes continues at the same place (exactly so
        when it keeps the global batch, since ranks take interleaved slices of one permutation per epoch)."""
        per_micro = self.cfg.train.batch_size * self.world
        bpe = self.sampler.batches_per_epoch
        epoch, offset = divmod(self.consumed_samples // per_micro, bpe)
        workers = self.cfg.data.num_workers
        # one loader for the whole run: persistent workers are not re-spawned every epoch (small datasets), and
        # the sampler runs in this process, so its new position applies to the next iteration
        collate = CollateWithBadList(self.task.collate_fn) if self.cfg.data.skip_bad_images else self.task.collate_fn
        # workers start from a fork server, never by forking this process: the lock's heartbeat thread (and
        # tracker threads) already run here (data/workers.py)
        loader = DataLoader(self.dataset, batch_size=self.cfg.train.batch_size, sampler=self.sampler,
                            num_workers=workers, drop_last=True, collate_fn=collate,
                            persistent_workers=workers > 0, pin_memory=self.accelerator.device.type == "cuda",
                            worker_init_fn=ignore_in_worker, multiprocessing_context=worker_context(workers))
        self._loader = loader
        while True:
            self.sampler.set_position(epoch, offset)
            for batch in loader:
                yield epoch, batch
            epoch, offset = epoch + 1, 0

    # ---- one optimizer step ------------------------------------------------------------------------------------
    def train_step(self, batches: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
        """Forward/backward over the micro-batches of one accumulation window, then one update (or a skip
        when any micro-batch had a non-finite loss on any rank)."""
        self.model.train()
        accum = len(batches)
        # loss components stay on the device (a float() per component would wait for the forward pass each
        # micro-batch, leaving the GPU idle while the host queues the backward); the loop reads them per log line
        sums: dict[str, torch.Tensor] = {}
        window_ok = True
        for i, batch in enumerate(batches):
            inputs = {k: v.to(self.accelerator.device, non_blocking=True) for k, v in
                      self.task.model_inputs(batch).items()}
            if inputs["images"].is_floating_point():
                inputs["images"] = inputs["images"].to(self.engine.input_dtype)
            sync = i == accum - 1
            with self.engine.sync_context(sync):
                with self.engine.forward_context():
                    out = self.model(**inputs)
                if self.head is not None:  # the sharded head: embeddings -> loss (collective)
                    out = self.head.loss(out, inputs["labels"])
                loss = out["loss"]
                if _debug_nonfinite("loss", self.step + 1):
                    loss = loss * float("nan")
                finite = self.engine.all_finite(loss)
                if finite:
                    self.engine.backward(loss, accum)
                else:
                    window_ok = False  # no backward on any rank: no collective is left half-done
            for k, v in out.items():
                if v.ndim == 0 and finite:
                    v = v.detach().float()
                    sums[k] = sums[k] + v if k in sums else v
        lr = self.engine.current_lr()  # the LR this update uses, read from the optimizer that steps
        if window_ok:
            grad_norm, applied = self.engine.step(self.cfg.optim.clip_grad, self.head)
            if self.head is not None:  # the same LR multiplier and skip decision as the backbone's update
                if applied:
                    self.head.step(head_shard.lr_factor(self.scheduler), grad_norm, self.cfg.optim.clip_grad)
                else:
                    self.head.zero_grad()
            if applied:  # the schedule and the EMA follow real updates (an fp16 overflow skip is none)
                self.scheduler.step()
                self.engine.set_lrs(self.scheduler.get_last_lr())
                if self.ema is not None:
                    self.ema.update()
            else:
                self.overflow_skips += 1
            self.consecutive_nonfinite = 0
        else:
            self.engine.zero_grad()
            if self.head is not None:
                self.head.zero_grad()
            grad_norm = None
            self.skipped_steps += 1
            self.consecutive_nonfinite += 1
        self.step += 1
        if _debug_nonfinite("param", self.step):
            with torch.no_grad():
                next(p for p in self.model.parameters() if p.numel()).view(-1)[:1].fill_(float("inf"))
        self.consumed_samples += accum * self.cfg.train.batch_size * self.world
        # loss components and grad_norm are 0-d device tensors (none in a skipped window); lr is a host float
        stats: dict[str, Any] = {k: v / accum for k, v in sums.items()} if window_ok else {}
        if grad_norm is not None:
            stats["grad_norm"] = grad_norm
            stats.update(self.engine.norm_parts)  # sharded head: the backbone's and the head's share of it
        stats["lr"] = lr
        stats["skipped"] = not window_ok
        return stats

    # ---- the loop ------------------------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any] | None:
        try:
            return self._fit()
        finally:
            self._stop_workers()

    def _stop_workers(self) -> None:
        """Shut the DataLoader workers down through their queues, also after an error (an unreadable image raised
        in a worker). They ignore SIGTERM (interrupt.ignore_in_worker), so multiprocessing's exit hook, which
        terminates daemonic children with SIGTERM and then joins them, would otherwise wait forever."""
        it = getattr(getattr(self, "_loader", None), "_iterator", None)  # persistent workers' iterator
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()

    def _fit(self) -> dict[str, Any] | None:
        t = self.cfg.train
        self.logger.info(self.describe())
        if self.pretrained_msg:
            self.logger.info(self.pretrained_msg)
        if self.resumed_from is not None:
            self.logger.info(f"resumed from {self.resumed_from} at step {self.step}")
        for note in self.task.notes + self.logger_notes:
            self.logger.info(note)
        stream = self._micro_batches()
        timer = StepTimer()
        window = _Window()
        last_eval: dict[str, Any] | None = None
        epoch = None
        while self.step < self.total_steps:
            _debug_crash("VTRAIN_DEBUG_CRASH_AT_STEP", self.step + 1)
            _debug_signal(self.step + 1, self.rank)
            batches = []
            for _ in range(t.grad_accum):
                t0 = time.perf_counter()
                with _skip_hint():
                    batch_epoch, batch = next(stream)
                timer.add_data(time.perf_counter() - t0)
                if epoch is not None and batch_epoch != epoch:
                    self._report_bad_files(epoch)
                epoch = batch_epoch
                self.bad_files += batch.pop("bad", [])
                batches.append(batch)
            if self._first_batch_indices is None:
                self._first_batch_indices = batches[0]["index"].tolist()
                self._write_run_info()
            stats = self.train_step(batches)
            timer.steps += 1
            window.add(stats)
            self.logger.advance()
            if self.step % t.log_every == 0 or self.step == self.total_steps:
                self._check_parameters()
                self._log(epoch, window, timer)
                window = _Window()
                timer.reset()
            if self.consecutive_nonfinite >= t.max_nonfinite:
                self.logger.close()
                raise VtrainError(f"stopping: {self.consecutive_nonfinite} consecutive steps with a non-finite loss "
                                  f"(step {self.step}); lower --lr or raise --warmup-steps, or use bf16")
            # after the log line (a resumed run's log then misses no step), before an evaluation (preemption
            # leaves little time)
            signum = self.interrupt.requested()  # collective: every rank stops at the same step
            if signum:
                self._stop_interrupted(signum)
            evaluated = t.eval_every and self.step % t.eval_every == 0 and self.step != self.total_steps
            if evaluated:
                last_eval = self.evaluate()
            # --keep-best: every evaluated step gets a checkpoint, so the best one exists to be kept
            if self.step % t.save_every == 0 or self.step == self.total_steps or (evaluated and self.best):
                self.save()
        if epoch is not None:
            self._report_bad_files(epoch)
        if self.total_steps > 0:
            last_eval = self.evaluate()
        self.logger.close()
        self.close()
        return last_eval

    def _stop_interrupted(self, signum: int) -> None:
        """Preemption (interrupt.py): checkpoint the step just finished on all ranks, then leave."""
        path = self.save()
        self.logger.close()
        self.close()
        raise TrainingInterrupted(f"interrupted at step {self.step} ({signal.Signals(signum).name}); checkpoint "
                                  f"written to {path}; continue with --resume auto", 128 + signum)

    def _check_parameters(self) -> None:
        """Stop before a non-finite model is logged as fine or saved: a step can turn weights into inf/NaN with a
        finite loss (a huge LR). Non-finite weights stay non-finite, so checking at log and save time is enough.
        Collective."""
        head_ok = self.head.finite() if self.head is not None else True  # collective
        if not (self.engine.parameters_finite() and head_ok):
            self.logger.close()
            last = ckpt.complete_checkpoints(self.out, self.run_id)
            raise VtrainError(f"stopping: the model's parameters became inf/NaN by step {self.step}; nothing was "
                              f"saved from this state (last good checkpoint: {last[-1] if last else 'none'}); lower "
                              "--lr or raise --warmup-steps")

    def _report_bad_files(self, epoch: int) -> None:
        """--skip-bad-images: name the files skipped in an epoch (all ranks' together). Collective."""
        if not self.cfg.data.skip_bad_images:
            return
        mine, self.bad_files = self.bad_files, []
        every = [mine]
        if self.world > 1:
            every = [None] * self.world
            dist.all_gather_object(every, mine)
        bad = sorted({b for files in every for b in files})
        if bad:
            self.logger.info(f"epoch {epoch}: skipped {len(bad)} unreadable images, e.g. {bad[0]}")

    def close(self) -> None:
        """Leave the process group cleanly: a gloo group torn down at interpreter exit can abort the process
        ('terminate called without an active exception') after a successful run."""
        self.accelerator.wait_for_everyone()
        if self.lock is not None:
            self.lock.release()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _log(self, epoch: int, window: _Window, timer: StepTimer) -> None:
        # mean over steps since the last log line, averaged over ranks (one all-reduce and the loop's one read of
        # the device-side sums per log line)
        keys, vals = window.means(self.accelerator.device)
        if self.world > 1 and keys:
            dist.all_reduce(vals)
            vals /= self.world
        means = {k: v for k, v in zip(keys, vals.tolist()) if not math.isnan(v)}  # a key with no finite value
        elapsed = time.perf_counter() - timer.t0
        steps = max(timer.steps, 1)
        samples = steps * self.cfg.train.batch_size * self.cfg.train.grad_accum * self.world
        record: dict[str, Any] = {"step": self.step, "epoch": epoch}
        record.update(means)
        record.update({"time": elapsed / steps, "data_time": timer.data / steps,
                       "samples_per_s": samples / max(elapsed, 1e-9), **memory_gb(self.accelerator.device),
                       "skipped": self.skipped_steps})
        if self.engine.scaler is not None or self.plan.ds_precision_mode == "fp16":
            record["overflow_skips"] = self.overflow_skips
        eta = self.logger.eta_seconds()
        if eta is None and self.step:
            eta = (self.total_steps - self.step) * elapsed / steps
        record["eta_s"] = round(eta or 0.0, 1)
        if self.ema is not None:
            record["ema_decay"] = self.ema.current_decay()
        lrs = self.scheduler.get_last_lr()  # every group's LR for the trackers (one line would be too long)
        self.logger.log_train(record, {f"lr/group_{i}": lr for i, lr in enumerate(lrs)} if len(lrs) > 1 else None)

    # ---- evaluation ----------------------------------------------------------------------------------------------
    def evaluate(self) -> dict[str, Any] | None:
        self.engine.sync_buffers()
        self.model.eval()
        try:
            def forward(**inputs: torch.Tensor) -> dict[str, torch.Tensor]:
                with self.engine.forward_context():
                    return self.model(**inputs)

            with self.ema.swapped() if self.ema is not None else contextlib.nullcontext():
                metrics = self.task.evaluate(forward, self.accelerator.device, self.rank, self.world,
                                             self.engine.input_dtype)
        finally:
            self.model.train()
        if metrics is not None:
            weights = " (EMA weights)" if self.ema is not None else ""
            self.logger.log_eval(self.step, metrics, self.task.metrics_table(
                metrics, f"{self.task.name} eval @ step {self.step}{weights}"))
        if self.best is not None and self._agree(lambda: self.best.consider(self.step, metrics)):
            if self.is_main:
                self.best.write()  # now if this step is saved already (the last one), else after its save
                self.logger.info(f"--keep-best: new best {self.best.best['metric']} = {self.best.best['value']:.4g} "
                                 f"at step {self.step}")
        return metrics

    # ---- checkpoints ---------------------------------------------------------------------------------------------
    def save(self) -> Path:
        """Write a checkpoint of the current step on all ranks: engine state, full fp32 weights, the loop's state,
        then a manifest with every file's size and SHA-256 (hashed by all ranks in parallel). Collective."""
        t = self.cfg.train
        self._check_parameters()
        tmp = ckpt.begin(self.out, self.step, self.is_main)
        self.accelerator.wait_for_everyone()
        self.engine.sync_buffers()
        self.engine.save(tmp)
        if self.head is not None:
            self.head.save(tmp)  # every rank its class range (head_shard.py)
        full = self.engine.full_state_dict()  # collective (FSDP2 / ZeRO-3 gather)
        ema_full = self.ema.full_state_dict(full) if self.ema is not None else None  # collective, whole on rank 0
        _debug_crash("VTRAIN_DEBUG_CRASH_IN_SAVE", self.step)
        if self.is_main:
            save_file(full, str(tmp / "model.safetensors"))
            if ema_full is not None:
                save_file(ema_full, str(tmp / ema_mod.FILE), metadata={k: str(v) for k, v in self.ema.state().items()})
            ckpt.write_json(tmp / ckpt.TRAIN_STATE, {
                "step": self.step, "consumed_samples": self.consumed_samples,
                "scheduler": self.scheduler.state_dict(), "skipped_steps": self.skipped_steps,
                "overflow_skips": self.overflow_skips, "consecutive_nonfinite": self.consecutive_nonfinite,
                "world_size": self.world, "engine": self.plan.kind,
                "ema": self.ema.state() if self.ema is not None else None,
                "scaler": self.engine.scaler.state_dict() if self.engine.scaler is not None else None})
            self.cfg.save(tmp / "config.yaml")
            if hasattr(self.dataset, "categories"):  # detection class names, for `vtrain predict`; in the manifest
                ckpt.write_json(tmp / ckpt.CATEGORIES, self.dataset.categories)
        self.accelerator.wait_for_everyone()
        files = self._agree(lambda: ckpt.payload_files(tmp))
        digests = ckpt.digest_share(tmp, files, self.rank, self.world)
        if self.world > 1:
            shares = [None] * self.world
            dist.all_gather_object(shares, digests)
            digests = {k: v for share in shares for k, v in share.items()}
        final = ckpt.final_path(self.out, self.step)
        if self.is_main:
            final = ckpt.commit(self.out, self.step, self.run_id, digests, t.keep_last,
                                protect=self.best.protect() if self.best is not None else ())
            if self.best is not None:
                self.best.write()
            self.logger.info(f"saved {final}")
        self.accelerator.wait_for_everyone()
        return final

    def _load(self, path: Path) -> None:
        state = self.saved_state  # read before the engine was built (it decides the universal-checkpoint route)
        saved_kind = "ddp" if state["engine"] == "single" else state["engine"]  # one process is DDP of one
        kind = "ddp" if self.plan.kind == "single" else self.plan.kind
        if saved_kind != kind:
            raise VtrainError(f"--resume: {path} was saved with {state['engine']}, this run uses {self.plan.kind}")
        # the optimizer state is per parameter group, and --layer-decay changes the groups: say so before the
        # optimizer's own loader fails with a traceback (the scheduler state holds one base LR per group)
        saved_groups, groups = len(state["scheduler"]["base_lrs"]), len(self.scheduler.base_lrs)
        if saved_groups != groups:
            raise VtrainError(f"--resume: {path} has {saved_groups} optimizer parameter groups, this run builds "
                              f"{groups} (was --layer-decay changed?); resume with the run's settings or start "
                              "from its weights with --resume-weights-only")
        if self.reshard_deepspeed:
            # DeepSpeed's own loader refuses another DP world size: universal checkpoint route (parallel.py)
            self.engine.load_resharded_deepspeed(path, self.out)
        else:
            self.engine.load(path)
        if self.head is not None:
            self.head.load(path)  # re-split for this run's number of processes
        self.scheduler.load_state_dict(state["scheduler"])
        self.engine.set_lrs(self.scheduler.get_last_lr())  # LambdaLR.load_state_dict leaves the optimizer alone
        self.step = state["step"]
        self.consumed_samples = state["consumed_samples"]
        if state["world_size"] != self.world:
            self.logger_notes.append(f"resharded: saved by {state['world_size']} processes, resumed on {self.world}")
        self.skipped_steps = state.get("skipped_steps", 0)
        self.overflow_skips = state.get("overflow_skips", 0)
        self.consecutive_nonfinite = state.get("consecutive_nonfinite", 0)
        if self.engine.scaler is not None and state.get("scaler"):
            self.engine.scaler.load_state_dict(state["scaler"])
        if self.ema is not None:
            if (path / ema_mod.FILE).is_file() and state.get("ema"):
                self.ema.load(path / ema_mod.FILE, state["ema"])  # re-sharded for this run's processes
            else:
                self.logger_notes.append(f"--ema-decay: {path} holds no EMA; the average starts from its weights")
        elif state.get("ema"):
            self.logger_notes.append(f"{path} holds EMA weights; this run has no --ema-decay and drops them")
        if self.best is not None and self.is_main:
            note = self.best.restore(self.step)
            if note:
                self.logger_notes.append(note)

    def _trackers(self) -> tuple:
        """--report-to: Accelerate's trackers (rank 0 only) with the resolved config as hyper-parameters; the
        logger sends every log line and evaluation to them and ends them on close."""
        if self.cfg.train.report_to == "none":
            return None, None
        name = self.cfg.train.report_to
        kwargs = {"wandb": {"dir": str(self.out), "name": self.out.name, "id": self.run_id, "resume": "allow"}}
        # TensorBoard writes <output-dir>/tensorboard/ (`tensorboard --logdir` on the run or its parent dir)
        self.accelerator.init_trackers("tensorboard" if name == "tensorboard" else "vtrain",
                                       config=flat_hparams(self.cfg.to_dict()),
                                       init_kwargs={k: v for k, v in kwargs.items() if k == name})

        def finish() -> None:  # not accelerator.end_training: that also destroys the process group
            for tracker in self.accelerator.trackers:
                tracker.finish()

        return self.accelerator.log, finish

    def _write_run_info(self) -> None:
        """What is really active on every rank (read from live objects), for users and tests."""
        mine = {**self.active, "first_batch_indices": self._first_batch_indices}
        if self.ema is not None:
            mine["ema_local_fraction"] = self.ema.local_fraction()
        infos = [None] * self.world
        if self.world > 1:
            dist.all_gather_object(infos, mine)
        else:
            infos = [mine]
        if self.is_main:
            info = {"engine": self.plan.kind, "zero_stage": self.plan.zero_stage, "world_size": self.world,
                    "precision": self.plan.precision, "ds_precision_mode": self.plan.ds_precision_mode,
                    "grad_accum": self.cfg.train.grad_accum, "global_batch": self.cfg.train.batch_size *
                    self.cfg.train.grad_accum * self.world, "total_steps": self.total_steps,
                    "resumed_from": str(self.resumed_from) if self.resumed_from else None, "ranks": infos}
            tmp = self.out / "run_info.json.tmp"
            tmp.write_text(json.dumps(info, indent=1))
            os.replace(tmp, self.out / "run_info.json")
