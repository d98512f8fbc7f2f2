"""The training loop: one explicit loop, periodic work as visible `if step % n == 0` lines.

`Trainer.__init__` fixes the build order; `train_step` runs one optimizer step (all micro-batches of an
accumulation window) so tests can call it; `fit` is the loop.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import signal
import time
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import set_seed

from vtrain.config import RunConfig
from vtrain.config.paths import too_large_batch
from vtrain.console import console, header, log_to
from vtrain.data.sampler import ShardedEpochSampler
from vtrain.data.skip import SkipBadSamples
from vtrain.dist import agreed, all_mean_, broadcast_from_main, gather_objects, leave
from vtrain.engine.checkpoint import format as ckpt
from vtrain.engine import autoplan, determinism, faults, head_shard, pretrained, rundir
from vtrain.engine.checkpoint import content
from vtrain.engine.checkpoint.checkpointer import Checkpointer
from vtrain.engine.compile import compile_regions
from vtrain.engine.ema import WeightEMA
from vtrain.engine.interrupt import GracefulInterrupt, TrainingInterrupted
from vtrain.engine.loader import MicroBatches, skip_hint
from vtrain.engine.logging import (RunLogger, StatsWindow, StepTimer, describe_run, memory_gb, start_trackers,
                                   tracker_name, write_run_info)
from vtrain.engine.optim import build_optimizer, build_scheduler, layer_decay_note
from vtrain.engine.engines.accelerator import build_accelerator
from vtrain.engine.engines.build import build_engine
from vtrain.engine.engines.plan import resolve_plan
from vtrain.errors import VtrainError
from vtrain.models.backbones import load_strict, read_state_dict
from vtrain.models.recompute_units import recompute_summary
from vtrain.io.safeio import enforce_weights_only
from vtrain.tasks import build_task


class Trainer:
    """Builds a run in a fixed order (`__init__`) and runs its loop (`fit`); checkpoints go through its
    Checkpointer, to which it hands its own state (`state_dict` / `load_state_dict`)."""

    def __init__(self, cfg: RunConfig, interrupt: GracefulInterrupt | None = None) -> None:
        self.cfg = cfg
        t = cfg.train
        # no file read on this run's behalf may run code (io/safeio.py); DeepSpeed's own types: by its engine class
        enforce_weights_only(deepspeed=False)
        self.interrupt = interrupt or GracefulInterrupt().install()
        self.faults = faults.injected()  # the tests' fault injection, read once (faults.py)
        # 1. launch plan, then the process group and the plan's engine class: everything below may run collectives.
        self.plan = resolve_plan(cfg)
        self.out = Path(t.output_dir)
        self.accelerator = build_accelerator(self.plan, t.grad_accum, tracker_name(t.report_to), t.output_dir)
        self.engine = build_engine(self.plan, self.accelerator)  # the plan's engine class, chosen once
        self.rank, self.world = self.accelerator.process_index, self.accelerator.num_processes
        self.is_main = self.accelerator.is_main_process
        self.interrupt.use_group(self.world)
        # 2. the output directory: rank 0 locks it (one run per directory) and checks what it may hold, before
        # anything is written; then the checkpoint to resume (one ResumePoint, verified on all ranks, each hashing
        # a share; its reshard route set) and the run's lineage (checkpoint/checkpointer.py); then the thread count
        # and --deterministic, and the run's first writes (train.log, config.yaml)
        self.lock = None
        notes = broadcast_from_main(self._claim_output_dir)
        rundir.check_shared(self.out, self.lock)  # collective: every rank sees rank 0's lock
        self.checkpointer = Checkpointer(cfg, self.accelerator)
        self.resume, chosen = self.checkpointer.choose(self.engine)  # also the engine's reshard route, before prepare
        self.logger_notes: list[str] = notes + chosen
        self.resumed_from = self.resume.path if self.resume is not None else None
        # a detector fine-tuned from a vtrain checkpoint takes its model options before the config is recorded
        inherited = pretrained.inherit_model_options(cfg)
        if inherited:
            self.logger_notes.append(inherited)
        # the thread count and --deterministic (a resume keeps its checkpoint's), before anything is computed and
        # before config.yaml records them (engine/determinism.py)
        self.logger_notes += determinism.keep_from_checkpoint(cfg, self.resume.config if self.resume else None)
        self.logger_notes += determinism.apply(cfg, self.accelerator.device)
        if self.is_main:  # the run's first writes: a command refused before them changes nothing it was given
            log_to(self.out / rundir.TRAIN_LOG, header("train"))  # the console from the start, then as it goes
            cfg.save(self.out / ckpt.CONFIG)
            if t.resume is not None:
                rundir.truncate_logs(self.out, self.resume.step if self.resume else 0)
        # 3. the seed (the same initial weights on every rank: FSDP2 shards the full init), the task, its data
        set_seed(t.seed)
        with self.accelerator.main_process_first():  # rank 0 writes the demo data once; the others then read it
            self.task = build_task(cfg)
            with skip_hint():
                dataset = self.task.train_dataset()
        # the evaluation data (held-out sets, .bin packs) is read and checked now: a pack that cannot be scored
        # must stop the run before it trains, not after its final save (--eval-every 0: never read)
        if t.eval_every != 0:
            self.task.check_eval_data()
        # 4. model -> activation checkpointing (inside build_model; with `--grad-ckpt auto` the planner's, made on
        # rank 0 from a fake-tensor trace and broadcast) -> the sharded face head beside it -> pretrained weights
        # -> regional torch.compile -> FSDP2 sharding
        model = self.task.build_model()
        self.memory_plan = autoplan.choose(cfg, self.plan, dataset.num_classes, self.accelerator.device)
        if self.memory_plan is not None:
            autoplan.apply(model, self.memory_plan)
            self.logger_notes.append(f"--grad-ckpt auto: {self.memory_plan.describe()} "
                                     f"({self.memory_plan.traces} traces, {self.memory_plan.seconds:.0f} s)")
        # --head-parallel sharded: this rank's class shard, built beside (never inside) the model the engine wraps
        self.head = head_shard.build(cfg, dataset, self.rank, self.world, self.accelerator.device, self.engine)
        self.pretrained_msg = agreed(lambda: self._load_weights(model))  # every rank reads the file: one line
        # regional torch.compile (engine/compile.py): after activation checkpointing, before FSDP2 shards the same
        # blocks, so each compiled forward runs inside its FSDP unit (torchtitan's order)
        self.logger_notes += compile_regions(model, t, self.accelerator.device, self.task.input_sizes_vary)
        model = self.engine.shard(model)
        # 5. parameter groups and optimizer (after FSDP2: they must see the DTensor parameters)
        optimizer = build_optimizer(model, cfg.optim, self.plan)
        if cfg.optim.layer_decay is not None:
            self.logger_notes.append(layer_decay_note(model, cfg.optim))
        # 6. data: our own sharded, resumable sampler (Accelerate does not shard it; see sampler.py)
        self.sampler = ShardedEpochSampler(len(dataset), t.batch_size, self.rank, self.world, seed=t.seed,
                                           group_ids=getattr(dataset, "group_ids", None))
        if self.sampler.batches_per_epoch < 1:
            raise VtrainError(too_large_batch(t.batch_size, self.world, len(dataset)))
        self.dataset = SkipBadSamples(dataset) if cfg.data.skip_bad_images else dataset
        self.batches = MicroBatches(self.dataset, self.sampler, t.batch_size, self.world, self.task.collate_fn,
                                    cfg.data.num_workers, self.accelerator.device, cfg.data.skip_bad_images,
                                    determinism.loader_generator(t.seed, self.rank))
        per_epoch = self.sampler.batches_per_epoch // t.grad_accum
        if t.max_steps is None and per_epoch < 1:
            raise VtrainError(f"one epoch has {self.sampler.batches_per_epoch} micro-batches per process, fewer "
                              f"than --grad-accum {t.grad_accum}; lower it or set --max-steps")
        self.total_steps = t.max_steps or (t.epochs or 1) * per_epoch
        # 7. one prepare (DDP wrap / DeepSpeed engine; the sharded head is stepped with the optimizer); the
        # scheduler, which the engine steps with the update (the head takes the schedule's multiplier); then the
        # check of what is really active, and the EMA
        self.model, self.optimizer = self.engine.prepare(model, optimizer, self.head)
        self.scheduler = build_scheduler(optimizer, cfg.optim, self.total_steps)
        self.engine.follow(self.scheduler)
        self.active = self.engine.active()  # the sharded head's facts included
        self.active["grad_ckpt"] = recompute_summary(self.engine.unwrapped)  # read from the live blocks
        if self.memory_plan is not None:
            self.active.update(autoplan.report(self.engine.unwrapped, self.memory_plan))
        self.engine.verify(self.active)
        # the EMA starts from the weights as built (pretrained included); a resume below replaces it
        self.ema = WeightEMA(self.engine, t.ema_decay, t.ema_warmup) if t.ema_decay > 0 else None
        # 8. resume: the checkpointer loads the ResumePoint once: model, optimizer, RNG, head, EMA, schedule and,
        # through load_state_dict, the loop's counters below; then the run's logger and trackers
        self.step = 0
        self.consumed_samples = 0
        self.skipped_steps = 0
        self.overflow_skips = 0
        self.consecutive_nonfinite = 0
        self.bad_files: list[str] = []
        self.checkpointer.attach(loop=self, engine=self.engine, scheduler=self.scheduler, head=self.head,
                                 ema=self.ema, dataset=self.dataset)
        if self.resume is not None:
            self.logger_notes += self.checkpointer.load(self.resume)
        self.logger = RunLogger(self.out, self.is_main, self.total_steps, self.step, *start_trackers(
            self.accelerator, t.report_to, self.out, self.checkpointer.run_id, cfg.to_dict()))
        self._wrote_run_info = False

    # ---- the loop's own state: its part of train_state.json (checkpoint.TrainState) ----------------------------
    def state_dict(self) -> dict[str, int]:
        """The loop's counters, as train_state.json holds them."""
        return {"step": self.step, "consumed_samples": self.consumed_samples, "skipped_steps": self.skipped_steps,
                "overflow_skips": self.overflow_skips, "consecutive_nonfinite": self.consecutive_nonfinite}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take the loop's counters from a checkpoint's train state (its other keys are the checkpointer's)."""
        self.step, self.consumed_samples = state["step"], state["consumed_samples"]
        self.skipped_steps, self.overflow_skips = state["skipped_steps"], state["overflow_skips"]
        self.consecutive_nonfinite = state["consecutive_nonfinite"]

    def _load_weights(self, model: torch.nn.Module) -> str:
        """--pretrained (not on a resume) or --resume-weights-only, checked first (checkpoint/content.py): a pretrained
        file's values (its loader matches names and shapes), a weights-only file against this model, head included.
        Returns the note for the log."""
        cfg, file = self.cfg, self.cfg.train.resume_weights_only
        msg = ""
        if cfg.model.pretrained and self.resumed_from is None:
            src = pretrained.resolve(cfg.model.pretrained)  # a file, or a checkpoint with its class names
            content.expect_tensors(src.weights, None, "--pretrained")
            msg = self.task.load_pretrained(model, src.weights, src.categories)
            if self.head is not None:  # a full model file's head.weight (consolidated): this rank's rows
                msg += self.head.take_rows(read_state_dict(src.weights))
        if file:
            sd = read_state_dict(file)
            spec = content.spec_of(model.state_dict(), exact=False)
            if self.head is not None:  # the sharded head's rows come from the file's full head.weight
                fc = self.head.fc
                spec["head.weight"] = content.Want((fc.num_classes, fc.weight.shape[1]), content.FLOATS)
            content.expect_tensors(file, spec, "--resume-weights-only", "this model", tensors=sd)
            head_msg = self.head.take_rows(sd, required=True) if self.head is not None else ""
            load_strict(model, sd, "--resume-weights-only", f"{file} does not fit this model")
            msg = f"weights loaded from {file} (fresh optimizer and schedule)" + head_msg
        return msg

    def _claim_output_dir(self) -> list[str]:
        t = self.cfg.train
        self.lock, notes = rundir.claim(self.out, t.resume, t.overwrite_output_dir)
        atexit.register(self.lock.release)  # also on errors; a killed run's lock is detected as stale
        console.print(f"output directory: {self.out.resolve()} (this console also in {rundir.TRAIN_LOG})",
                      soft_wrap=True)
        return notes

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
                if self.faults.nonfinite("loss", self.step + 1):
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
        # the engine's step: the sharded head's update and the schedule's included; `lr`: the LR this step used
        update = self.engine.step(self.cfg.optim.clip_grad) if window_ok else self.engine.skip()
        if update.applied and self.ema is not None:  # the EMA follows real updates (an fp16 overflow skip is none)
            self.ema.update()
        if window_ok:
            if not update.applied:
                self.overflow_skips += 1
            self.consecutive_nonfinite = 0
        else:
            self.skipped_steps += 1
            self.consecutive_nonfinite += 1
        self.step += 1
        if self.faults.nonfinite("param", self.step):
            with torch.no_grad():
                next(p for p in self.model.parameters() if p.numel()).view(-1)[:1].fill_(float("inf"))
        self.consumed_samples += accum * self.cfg.train.batch_size * self.world
        # loss components and grad_norm are 0-d device tensors (none in a skipped window); lr is a host float
        stats: dict[str, Any] = {k: v / accum for k, v in sums.items()} if window_ok else {}
        if update.grad_norm is not None:
            stats["grad_norm"] = update.grad_norm
            stats.update(self.engine.norm_parts)  # sharded head: the backbone's and the head's share of it
        stats["lr"] = update.lr
        stats["skipped"] = not window_ok
        return stats

    # ---- the loop ------------------------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any] | None:
        try:
            return self._fit()
        finally:
            self.batches.shutdown()

    def _fit(self) -> dict[str, Any] | None:
        t = self.cfg.train
        self.logger.info(describe_run(self.engine, self.world, self.accelerator.device, t.batch_size, t.grad_accum,
                                      self.active.get("local_param_fraction")))
        if self.pretrained_msg:
            self.logger.info(self.pretrained_msg)
        if self.resumed_from is not None:
            self.logger.info(f"resumed from {self.resumed_from} at step {self.step}")
        for note in self.task.notes + self.logger_notes:
            self.logger.info(note)
        stream = self.batches.stream(self.consumed_samples)
        timer = StepTimer()
        window = StatsWindow()
        last_eval: dict[str, Any] | None = None
        epoch = None
        while self.step < self.total_steps:
            self.faults.crash("VTRAIN_DEBUG_CRASH_AT_STEP", self.step + 1)
            self.faults.send_signal(self.step + 1, self.rank)
            batches = []
            for _ in range(t.grad_accum):
                t0 = time.perf_counter()
                with skip_hint():
                    batch_epoch, batch = next(stream)
                timer.add_data(time.perf_counter() - t0)
                if epoch is not None and batch_epoch != epoch:
                    self._report_bad_files(epoch)
                epoch = batch_epoch
                self.bad_files += batch.pop("bad", [])
                batches.append(batch)
            if not self._wrote_run_info:
                self._write_run_info(batches[0]["index"].tolist())
            stats = self.train_step(batches)
            timer.steps += 1
            window.add(stats)
            self.logger.advance()
            if self.step % t.log_every == 0 or self.step == self.total_steps:
                self._check_parameters()
                self._log(epoch, window, timer)
                window = StatsWindow()
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
            keep_best = evaluated and self.checkpointer.best is not None
            if self.step % t.save_every == 0 or self.step == self.total_steps or keep_best:
                self.save()
        if epoch is not None:
            self._report_bad_files(epoch)
        if self.total_steps > 0 and t.eval_every != 0:  # after the last step, unless --eval-every 0 (never)
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
        head_ok = self.head.finite() if self.head is not None else True  # collective, before the engine's
        if not (self.engine.parameters_finite() and head_ok):
            self.logger.close()
            last = self.checkpointer.newest()
            raise VtrainError(f"stopping: the model's parameters became inf/NaN by step {self.step}; nothing was "
                              f"saved from this state (last good checkpoint: {last or 'none'}); lower "
                              "--lr or raise --warmup-steps")

    def _report_bad_files(self, epoch: int) -> None:
        """--skip-bad-images: name the files skipped in an epoch (all ranks' together). Collective."""
        if not self.cfg.data.skip_bad_images:
            return
        mine, self.bad_files = self.bad_files, []
        bad = sorted({b for files in gather_objects(mine) for b in files})
        if bad:
            self.logger.info(f"epoch {epoch}: skipped {len(bad)} unreadable images, e.g. {bad[0]}")

    def close(self) -> None:
        """Leave the process group while every object it serves is alive (the CLI then ends the process without
        interpreter teardown: cli._exit)."""
        self.accelerator.wait_for_everyone()
        if self.lock is not None:
            self.lock.release()
        self.interrupt.leave_group()
        leave()

    def _log(self, epoch: int, window: StatsWindow, timer: StepTimer) -> None:
        # mean over steps since the last log line, averaged over ranks (one all-reduce and the loop's one read of
        # the device-side sums per log line)
        keys, vals = window.means(self.accelerator.device)
        if keys:  # the same keys on every rank (StatsWindow.means)
            all_mean_(vals)
        means = {k: v for k, v in zip(keys, vals.tolist()) if not math.isnan(v)}  # a key with no finite value
        elapsed = time.perf_counter() - timer.t0
        steps = max(timer.steps, 1)
        samples = steps * self.cfg.train.batch_size * self.cfg.train.grad_accum * self.world
        record: dict[str, Any] = {"step": self.step, "epoch": epoch}
        record.update(means)
        record.update({"time": elapsed / steps, "data_time": timer.data / steps,
                       "samples_per_s": samples / max(elapsed, 1e-9), **memory_gb(self.accelerator.device),
                       "skipped": self.skipped_steps})
        if self.engine.loss_scaled:
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
        note = self.checkpointer.consider_best(self.step, metrics)  # collective under --keep-best
        if note:
            self.logger.info(note)
        return metrics

    # ---- checkpoints ---------------------------------------------------------------------------------------------
    def save(self) -> Path:
        """Checkpoint the current step on all ranks (checkpoint/checkpointer.py), never a non-finite one. Collective."""
        self._check_parameters()
        return self.checkpointer.save(self.logger.info)

    def _write_run_info(self, first_batch_indices: list[int]) -> None:
        """run_info.json: what is really active on every rank (read from live objects), for users and tests.
        Collective."""
        mine = {**self.active, "first_batch_indices": first_batch_indices}
        if self.ema is not None:
            mine["ema_local_fraction"] = self.ema.local_fraction()
        t = self.cfg.train
        write_run_info(self.out, self.is_main, {
            **self.engine.run_facts(), "world_size": self.world, "grad_accum": t.grad_accum,  # the live engine's
            "global_batch": t.batch_size * t.grad_accum * self.world,
            "total_steps": self.total_steps, "resumed_from": str(self.resumed_from) if self.resumed_from else None},
            mine)
        self._wrote_run_info = True
