"""The `train` section: the run directory, its length and batch, periodic work, resuming, EMA, logging, compile."""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Literal

from vtrain.config.fields import NO_FLAG, Section
from vtrain.io.guarded import utf8_problem

ReportTo = Literal["none", "tensorboard", "wandb"]
REPORT_TO: tuple[str, ...] = typing.get_args(ReportTo)
# engine/compile.py; not torch's "eager" backend: with activation checkpointing and symbolic sizes it ran a block's
# graph for another shape class (wrong outputs, torch 2.14.1, docs/compile.md §3)
CompileBackend = Literal["inductor", "aot_eager"]
COMPILE_BACKENDS: tuple[str, ...] = typing.get_args(CompileBackend)


@dataclass
class TrainConfig(Section):
    SECTION = "train"

    output_dir: str = "runs/vtrain"
    """Run directory: config, logs, checkpoints (docs/outputs.md)."""
    epochs: int | None = None
    """Epochs to train (ignored when --max-steps is set)."""
    max_steps: int | None = None
    """Optimizer steps to train; takes precedence over --epochs. Default: 1 epoch."""
    batch_size: int = 32
    """Per-device micro-batch size; the global batch is batch x grad-accum x processes."""
    grad_accum: int = 1
    """Gradient accumulation steps (micro-batches per optimizer step)."""
    resume: str | None = None
    """`auto` (newest complete checkpoint in <output-dir>, if any) or a checkpoint directory; either must verify.
    Settings changed on a resume (LR, weight decay, batch) are applied and each is named in the log."""
    resume_weights_only: str | None = None
    """Start a new run (fresh optimizer, schedule, step 0) from a consolidated weights file, loaded strictly."""
    save_every: int = 500
    """Checkpoint every N optimizer steps."""
    keep_last: int = 3
    """Keep the newest K checkpoints; pruning deletes only real folders of this run (a symlinked checkpoint is left
    alone and named)."""
    eval_every: int | None = None
    """Evaluate every N optimizer steps and after the last one; unset: only after the last step; 0: never (no
    evaluation at all, and the evaluation data is not read)."""
    log_every: int = 10
    """Log every N optimizer steps."""
    seed: int = 42
    """Random seed."""
    max_nonfinite: int = 5
    """Stop after this many consecutive steps with a non-finite loss."""
    overwrite_output_dir: bool = False
    """Start a new run in an --output-dir that holds an earlier run: its checkpoints (only the files their manifests
    list) and logs are deleted; never a file vtrain did not write (docs/outputs.md)."""
    ema_decay: float = 0.0
    """EMA of the weights with this decay (e.g. 0.9998), updated after every applied optimizer step; 0: off.
    Evaluation, `vtrain eval` and `vtrain consolidate` then use the averaged weights."""
    ema_warmup: int = 0
    """EMA decay warm-up TAU in steps: decay_t = D * (1 - exp(-t / TAU)) (YOLOX / detrex use 2000); 0: off."""
    keep_best: str | None = None
    """Keep the checkpoint with the best value of this evaluation metric (e.g. AP, tar@far=1e-3, acc) outside
    --keep-last pruning, recorded in checkpoints/best.json. Higher is better; append :min for a lower-is-better
    metric (loss-like names default to :min)."""
    report_to: ReportTo = "none"
    """Also send every logged number and evaluation metric to tensorboard (<output-dir>/tensorboard) or wandb."""
    compile: bool = False
    """Regional torch.compile: each backbone block and each DINO encoder/decoder layer compiled on its own, the rest
    eager, so a new image size recompiles a few small graphs at most, never the whole model (DINO's sizes are
    symbolic from the first compile). Checkpoints keep the eager model's keys (docs/compile.md)."""
    compile_backend: CompileBackend = field(default="inductor", metadata=NO_FLAG)
    """torch.compile backend for --compile: inductor (generated kernels) or aot_eager (traced and split into forward
    and backward, no code generation: to tell a compiler problem from a tracing one)."""
    deterministic: bool = False
    """Bit-identical reruns on one machine: deterministic algorithms only, a fixed intra-op thread count (recorded in
    train.threads) and data-loader workers seeded from --seed and the rank. A resumed run keeps it and the recorded
    thread count (docs/determinism.md)."""
    threads: int = 0
    """Intra-op CPU threads per process (torch.set_num_threads); 0: torch's default (OMP_NUM_THREADS, else one per
    core). Results depend on it (docs/determinism.md §2); --deterministic records the count it runs with."""

    def __post_init__(self) -> None:
        self._check_text()
        check = self._check
        check(self.epochs is None or self.epochs > 0, "epochs", f"must be > 0, got {self.epochs}")
        check(self.max_steps is None or self.max_steps > 0, "max_steps", f"must be > 0, got {self.max_steps}")
        check(self.batch_size >= 1, "batch_size", f"must be >= 1, got {self.batch_size}")
        check(self.grad_accum >= 1, "grad_accum", f"must be >= 1, got {self.grad_accum}")
        check(self.save_every > 0, "save_every", f"must be > 0, got {self.save_every}")
        check(self.keep_last > 0, "keep_last", f"must be > 0, got {self.keep_last}")
        check(self.eval_every is None or self.eval_every >= 0, "eval_every", "must be >= 0")
        check(self.log_every > 0, "log_every", f"must be > 0, got {self.log_every}")
        check(self.max_nonfinite > 0, "max_nonfinite", "must be > 0")
        check(0 <= self.seed < 2**32, "seed", f"must be in 0..2**32-1, got {self.seed}")
        problem = utf8_problem(self.output_dir)  # a value check: whether the folder can be made is paths.py's
        check(problem is None, "output_dir", str(problem))
        check(not (self.resume and self.resume_weights_only), "resume_weights_only",
              "cannot be combined with --resume (one continues a run, the other starts a new one from weights)")
        check(not (self.resume and self.overwrite_output_dir), "overwrite_output_dir",
              "cannot be combined with --resume (one continues the run in --output-dir, the other deletes it)")
        check(0.0 <= self.ema_decay < 1.0, "ema_decay", f"must be in [0, 1) (0: off), got {self.ema_decay}")
        check(0 <= self.ema_warmup <= 10**7, "ema_warmup", f"must be in 0..10000000 steps, got {self.ema_warmup}")
        check(self.ema_warmup == 0 or self.ema_decay > 0, "ema_warmup", "needs --ema-decay > 0")
        check(self.report_to in REPORT_TO, "report_to", f"choose one of {REPORT_TO}")
        check(0 <= self.threads <= 1024, "threads", f"must be in 0..1024 (0: torch's default), got {self.threads}")
        check(self.compile_backend in COMPILE_BACKENDS, "compile_backend",
              f"choose one of {COMPILE_BACKENDS}, got {self.compile_backend!r}")
        check(self.keep_best is None or self.eval_every != 0, "keep_best",
              "keeps the best evaluated checkpoint, but --eval-every 0 never evaluates")
        if self.keep_best is not None:
            name, _, mode = self.keep_best.rpartition(":") if ":" in self.keep_best else (self.keep_best, "", "")
            check(bool(name.strip()) and mode in ("", "min", "max"), "keep_best",
                  f"a metric name, optionally with :min or :max, got {self.keep_best!r}")
