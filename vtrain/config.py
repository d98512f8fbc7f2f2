"""Typed run configuration: sections validated in ``__post_init__``; errors name the flag to change.

Precedence (lowest first): dataclass defaults < task defaults < ``--config FILE.yaml`` < CLI flags.
The resolved config is written to ``<output-dir>/config.yaml`` and is enough to rebuild the model.
"""

from __future__ import annotations

import dataclasses
import glob
import typing
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from vtrain import recompute
from vtrain.config_values import coerce, read_yaml
from vtrain.ds_json import DS_CONFIG_UNREADABLE, check_structure, read_json
from vtrain.errors import ConfigError, shown
from vtrain.files import cache_root, directory_problem, write_text_atomic
from vtrain.guarded import utf8_problem
from vtrain.presets import presets_for

TASKS = ("metric", "dino")
PRECISIONS = ("auto", "no", "bf16", "fp16")
SCHEDULES = ("cosine", "step", "constant")
HEADS = ("arcface", "cosface")
REPORT_TO = ("none", "tensorboard", "wandb")
HEAD_PARALLEL = ("none", "sharded")
# engine/compile.py; not torch's "eager" backend: with activation checkpointing and symbolic sizes it ran a block's
# graph for another shape class (wrong outputs, torch 2.14.1, docs/compile.md §3)
COMPILE_BACKENDS = ("inductor", "aot_eager")
NECK_NORMS = ("bn", "ln", "none")
MAX_QUERIES, MAX_DN_QUERIES = 5000, 2000
MIN_DETECTION_SIZE = 64  # the coarsest DINO level has stride 64 (presets.py): smaller inputs leave it empty
DEMO_DATA = "demo"  # --data demo: the task's built-in data set (data/demo.py)
# PIL's own decompression-bomb limit (PIL.Image.MAX_IMAGE_PIXELS, 1024^3 / 4 / 3: a 1 GB RGB image at 32 bits per
# pixel); torchvision's decoders have none, so vtrain applies it to every image it decodes (docs/input_limits.md)
DEFAULT_MAX_IMAGE_PIXELS = 89_478_485
MAX_IMAGE_PIXELS_CEILING = 1 << 32  # 12 GiB as uint8 RGB; libjpeg's 65500 x 65500 is 4.29e9 pixels
# sampled held-out pairs of each kind: 10 million resolve FAR 1e-6 with ten false accepts (docs/face.md §5) and
# stay a few hundred MB of indices and scores (docs/input_limits.md)
MAX_SAMPLED_PAIRS = 10_000_000


def _check(cond: bool, flag: str, msg: str) -> None:
    """Raise a ConfigError naming the flag and, for a flag, its config key (`--lr (optim.lr): ...`)."""
    if not cond:
        key = _flag_keys().get(flag)
        raise ConfigError(f"{flag} ({key}): {msg}" if key else f"{flag}: {msg}")


# flags whose name is not the field name with dashes
_FLAG_RENAMES = {"preset": "--model", "path": "--data", "val_path": "--val-data", "pairs_file": "--pairs"}
# fields set only in a --config file (no flag): their errors name the key alone, never a flag that does not exist
CONFIG_ONLY = frozenset({"max_impostor_pairs", "max_genuine_pairs", "betas", "min_lr_ratio", "milestones", "gamma",
                         "fsdp_offload", "fsdp_reshard_after_forward", "ffn_recompute", "ffn_chunk", "compile_backend"})


def check_neck_batch(neck_norm: str, batch_size: int) -> None:
    """The face model's micro-batch against its embedding neck, for `train` and `estimate-memory` alike: BatchNorm in
    training needs two samples per channel (each rank normalises its own micro-batch)."""
    _check(neck_norm != "bn" or batch_size >= 2, "--batch-size",
           "must be >= 2 with the BatchNorm embedding neck (--neck-norm bn); use --neck-norm ln for 1")


def flag_of(name: str) -> str:
    """The `vtrain train` flag of a config field: its name with dashes, or its rename (`path` is --data)."""
    return _FLAG_RENAMES.get(name, "--" + name.replace("_", "-"))


def _where(section: str, name: str) -> str:
    """How an error names a field: `--lr (optim.lr)`, or `optim.betas` for a field without a flag."""
    return f"{section}.{name}" if name in CONFIG_ONLY else f"{flag_of(name)} ({section}.{name})"


def _flag_keys() -> dict[str, str]:
    return {flag_of(name): f"{section}.{name}" for section, names in FLAG_SECTIONS.items() for name in names}


@dataclass
class ModelConfig:
    preset: str = "debug"
    """Backbone preset name (see `vtrain presets`)."""
    pretrained: str | None = None
    """Local weights file (timm backbone or a vtrain model state dict) or a vtrain checkpoint directory to fine-tune
    from (a detector trained on other classes keeps all but its class rows); nothing is downloaded."""
    image_size: int = 112
    """Metric: square input size (face crops are 112). DINO: test short side (800 in the recipe); the training
    scales follow it (480-800 at 800) and the long side is capped at image_size * 1333 / 800."""
    embedding_dim: int = 512
    neck_norm: str = "bn"
    """Embedding neck normalisation: bn (insightface style), ln or none."""
    head: str = "arcface"
    margin: float | None = None
    """Margin m; defaults to 0.5 for ArcFace and 0.4 for CosFace (docs/face.md §1.1)."""
    scale: float = 64.0
    head_parallel: str = "none"
    """Metric head: `none`, one head inside the model (replicated under DDP, partitioned under ZeRO-3/FSDP2);
    `sharded`, each process owns a contiguous class range outside the engine (Partial FC, engine/head_shard.py)."""
    sample_rate: float = 1.0
    """With --head-parallel sharded: positives plus random negatives up to this share of each rank's classes per
    step (Partial FC); 1.0 is the full softmax. Below 1 it needs sharded (the replicated head has no sampling)."""
    drop_path: float | None = None
    grad_ckpt: list[str] = field(default_factory=list)
    """Activation checkpointing: recompute units as `--grad-ckpt` items (vtrain/recompute.py, docs/recompute.md),
    e.g. ["backbone"], ["backbone:stage0-1", "encoder:0-3", "sac:decoder"]; a comma string is read as one value."""
    ffn_recompute: bool = True
    """DINO: the encoder FFNs make their 2048-wide ReLU output again in backward instead of keeping it: 4.1 GiB less
    for Swin-L at 800x1333, batch 2, for one more fc1 matmul per layer (+18% forward FLOPs); docs/recompute.md.
    With `--grad-ckpt auto` the planner decides this per encoder layer instead."""
    memory_budget: float | None = None
    """With `--grad-ckpt auto`: GiB per GPU the planner fits (estimate-memory's total: model states, activations at
    the peak, buffers, 0.5 GiB for the CUDA context). Default on a GPU: its memory minus max(2.5 GiB, 10%) for
    allocator fragmentation (docs/memory_estimate.md); on a CPU it must be given."""
    ffn_chunk: int = 16384
    """DINO, with ffn_recompute: the encoder FFNs run forward and backward over this many tokens at a time, so their
    2048-wide hidden layer and its gradient never exist whole (1.0 GiB less at the peak of Swin-L 800x1333 batch 2
    with the encoder checkpointed, no extra FLOPs); 0 runs all tokens at once. The weight gradients then sum over
    chunks in fp32: within one rounding of their dtype of the unchunked ones (docs/recompute.md §3)."""

    num_queries: int | None = None
    """DINO matching queries (default: the preset's, 900 in the recipe)."""
    dn_queries: int | None = None
    """DINO contrastive-denoising queries (default: the preset's, 100 in the recipe; 0 disables denoising)."""
    pretrained_min_match: float = 0.9
    """Share of the target's tensors (the backbone's for a backbone file, the model's for a full file) that a
    --pretrained file must fill; fewer is an error (a file of another model), unless --allow-partial-pretrained."""
    allow_partial_pretrained: bool = False
    """Load whatever tensors of --pretrained match, however few (the match share is still reported)."""

    def __post_init__(self) -> None:
        _check(self.image_size >= 32 and self.image_size % 16 == 0, "--image-size",
               f"must be a multiple of 16 and >= 32, got {self.image_size}")
        _check(self.embedding_dim > 0, "--embedding-dim", "must be > 0")
        _check(self.neck_norm in NECK_NORMS, "--neck-norm", f"choose one of {NECK_NORMS}")
        _check(self.head in HEADS, "--head", f"choose one of {HEADS}")
        if self.margin is None:
            self.margin = 0.5 if self.head == "arcface" else 0.4
        _check(0.0 <= self.margin < 1.5, "--margin", f"must be in [0, 1.5), got {self.margin}")
        _check(self.scale > 0, "--scale", "must be > 0")
        _check(self.head_parallel in HEAD_PARALLEL, "--head-parallel", f"choose one of {HEAD_PARALLEL}")
        _check(0.0 < self.sample_rate <= 1.0, "--sample-rate", f"must be in (0, 1], got {self.sample_rate}")
        _check(self.sample_rate == 1.0 or self.head_parallel == "sharded", "--sample-rate",
               f"{self.sample_rate} < 1 needs --head-parallel sharded (negative sampling lives in the sharded head)")
        _check(self.drop_path is None or 0.0 <= self.drop_path < 1.0, "--drop-path", "must be in [0, 1)")
        _check(self.ffn_chunk >= 0, "model.ffn_chunk", f"must be >= 0 (0: no chunking), got {self.ffn_chunk}")
        try:
            spec = recompute.parse(self.grad_ckpt)
        except recompute.SpecError as e:
            _check(False, "--grad-ckpt", f"{e}; forms: {recompute.FORMS}")
        self.grad_ckpt = spec.canonical()
        _check(self.memory_budget is None or 0 < self.memory_budget <= 1e6, "--memory-budget",
               f"must be a positive number of GiB, got {self.memory_budget}")
        _check(self.memory_budget is None or spec.auto, "--memory-budget",
               "plans the activation checkpointing: it needs --grad-ckpt auto")
        if self.pretrained is not None:
            _check(Path(self.pretrained).exists(), "--pretrained",
                   f"weights file or checkpoint directory not found: {self.pretrained}")
        # upper bounds: the denoising attention mask and the matcher grow with the square of the query count
        # (recipes use 900 and 100-300; docs/dino.md §1.1), so a typo must not allocate terabytes
        _check(self.num_queries is None or 0 < self.num_queries <= MAX_QUERIES, "--num-queries",
               f"must be in 1..{MAX_QUERIES}, got {self.num_queries}")
        _check(self.dn_queries is None or 0 <= self.dn_queries <= MAX_DN_QUERIES, "--dn-queries",
               f"must be in 0..{MAX_DN_QUERIES}, got {self.dn_queries}")
        _check(self.image_size <= 8192, "--image-size", f"must be <= 8192, got {self.image_size}")
        _check(0.0 <= self.pretrained_min_match <= 1.0, "--pretrained-min-match",
               f"must be in [0, 1], got {self.pretrained_min_match}")


@dataclass
class DataConfig:
    path: str = "demo"
    """`demo` (built-in synthetic data); a directory (metric: an insightface RecordIO dir with train.rec + train.idx +
    property, or train/<identity>/*.jpg (+ val/, pairs.txt); DINO: COCO layout); `hf:PATH`, a Hugging Face datasets
    folder saved with save_to_disk or parquet files; or (metric eval only) a verification `.bin` pack."""
    num_workers: int = 2
    val_path: str | None = None
    """Held-out identity tree for verification; defaults to <data>/val when it exists."""
    pairs_file: str | None = None
    """Verification pairs file (`path1 path2 1|0` per line, paths relative to the file); else pairs are sampled."""
    max_impostor_pairs: int = 200_000
    """Held-out identities: impostor pairs scored, all of them or a seeded uniform sample of this many."""
    max_genuine_pairs: int = 200_000
    """Held-out identities: genuine pairs scored, all of them or a seeded uniform sample of this many (an identity
    with thousands of images has millions; 200,000 measure a TAR to about +-0.1%)."""
    val_targets: list[str] | None = None
    """Metric: verification packs to evaluate on, insightface style: `lfw` is <data>/lfw.bin, `x.bin` a path.
    Default: every *.bin beside a train.rec; [] evaluates on none."""
    train_ann: str | None = None
    """Detection: COCO annotation JSON for training (default: <data>/annotations/instances_train2017.json)."""
    train_images: str | None = None
    """Detection: training image folder (default: <data>/train2017)."""
    val_ann: str | None = None
    """Detection: COCO annotation JSON for evaluation (default: <data>/annotations/instances_val2017.json)."""
    val_images: str | None = None
    """Detection: evaluation image folder (default: <data>/val2017)."""
    max_size: int | None = None
    """Detection: longest image side after resizing (default: image_size * 1333 / 800)."""
    skip_bad_images: bool = False
    """Skip unreadable image files (counted and named in the log at the end of each epoch) instead of stopping."""
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    """Largest image (width x height x frames) decoded; a larger one is refused before decoding, read from its
    header (or skipped with --skip-bad-images). Default: PIL's decompression-bomb limit, 89478485 pixels."""

    def __post_init__(self) -> None:
        _check(0 <= self.num_workers <= 256, "--num-workers", f"must be in 0..256, got {self.num_workers}")
        if self.path.startswith("hf:"):  # a Hugging Face datasets folder or parquet file(s) (data/hf.py)
            _check(Path(self.path[3:]).exists() or bool(glob.glob(self.path[3:])), "--data",
                   f"no such Hugging Face datasets folder or parquet file: {self.path[3:]}")
        elif self.path != DEMO_DATA:
            p = Path(self.path)
            _check(p.is_dir() or (p.is_file() and p.suffix == ".bin"), "--data",
                   f"not a directory (or a verification .bin pack): {self.path}")
        else:  # the demo data is written to the cache: a bad VTRAIN_CACHE is reported now, not after start-up
            cache_root()
        if self.val_targets is not None:  # `lfw, agedb_30` from a flag or YAML; also built directly by `vtrain eval`
            items = self.val_targets.split(",") if isinstance(self.val_targets, str) else self.val_targets
            self.val_targets = [t.strip() for t in items if t.strip()]
        if self.val_path is not None:
            _check(Path(self.val_path).is_dir(), "--val-data", f"not a directory: {self.val_path}")
        if self.pairs_file is not None:
            _check(Path(self.pairs_file).is_file(), "--pairs", f"file not found: {self.pairs_file}")
        for key in ("max_impostor_pairs", "max_genuine_pairs"):  # every rank holds the pairs, rank 0 their scores
            value = getattr(self, key)
            _check(0 < value <= MAX_SAMPLED_PAIRS, f"data.{key}", f"must be in 1..{MAX_SAMPLED_PAIRS}, got {value}")
        for flag, value in (("--train-ann", self.train_ann), ("--val-ann", self.val_ann)):
            if value is not None:
                _check(Path(value).is_file(), flag, f"file not found: {value}")
        for flag, value in (("--train-images", self.train_images), ("--val-images", self.val_images)):
            if value is not None:
                _check(Path(value).is_dir(), flag, f"not a directory: {value}")
        _check(1 <= self.max_image_pixels <= MAX_IMAGE_PIXELS_CEILING, "--max-image-pixels",
               f"must be in 1..{MAX_IMAGE_PIXELS_CEILING} pixels, got {self.max_image_pixels}")
        _check(self.max_size is None or MIN_DETECTION_SIZE <= self.max_size <= 16384, "--max-size",
               f"must be in {MIN_DETECTION_SIZE}..16384 (the coarsest DINO feature stride is 64), got {self.max_size}")


@dataclass
class OptimConfig:
    lr: float = 1e-3
    """Peak learning rate (AdamW)."""
    weight_decay: float = 0.05
    """AdamW weight decay; never applied to norms, biases, position embeddings, tokens."""
    backbone_lr_mult: float = 1.0
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0
    schedule: str = "cosine"
    min_lr_ratio: float = 0.0
    milestones: list[int] = field(default_factory=list)
    """Optimizer steps at which a step schedule multiplies the LR by `gamma` (default: at 11/12 of training,
    the DINO recipe's decay at epoch 11 of 12)."""
    gamma: float = 0.1
    clip_grad: float = 1.0
    """Max global gradient norm; 0 disables clipping."""
    layer_decay: float | None = None
    """Layer-wise LR decay R for timm backbones (ViT, Swin, ResNet): a backbone parameter in timm's layer group i of L
    trains at lr * backbone_lr_mult * R^(L - i) (last block R, stem R^L); the head keeps lr. Unset: no decay."""

    def __post_init__(self) -> None:
        _check(self.lr > 0, "--lr", f"must be > 0, got {self.lr}")
        _check(self.weight_decay >= 0, "--weight-decay", "must be >= 0")
        _check(self.backbone_lr_mult > 0, "--backbone-lr-mult", "must be > 0")
        self.betas = tuple(float(b) for b in self.betas)  # type: ignore[assignment]
        _check(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "optim.betas", "two values in [0, 1)")
        _check(self.warmup_steps >= 0, "--warmup-steps", "must be >= 0")
        _check(self.schedule in SCHEDULES, "--schedule", f"choose one of {SCHEDULES}")
        _check(0 <= self.min_lr_ratio <= 1, "optim.min_lr_ratio", "must be in [0, 1]")
        _check(all(m > 0 for m in self.milestones), "optim.milestones", "must be positive step numbers")
        _check(self.clip_grad >= 0, "--clip-grad", "must be >= 0 (0 disables)")
        _check(self.lr <= 10.0, "--lr", f"must be <= 10, got {self.lr}")
        _check(self.weight_decay <= 10.0, "--weight-decay", f"must be <= 10, got {self.weight_decay}")
        _check(0 < self.gamma <= 1, "optim.gamma", f"must be in (0, 1], got {self.gamma}")
        _check(self.layer_decay is None or 0 < self.layer_decay <= 1, "--layer-decay",
               f"must be in (0, 1], got {self.layer_decay}")


@dataclass
class ParallelConfig:
    mixed_precision: str = "auto"
    """auto (bf16 where supported, else fp16 on CUDA), no, bf16 or fp16. Master weights stay fp32."""
    ds_config: str | None = None
    """DeepSpeed JSON; `auto` values are filled from this config (one owner per knob)."""
    fsdp: bool = False
    """Shard with torch FSDP2 (also chosen by an accelerate config with an FSDP section)."""
    fsdp_offload: bool = False
    fsdp_reshard_after_forward: bool = True

    def __post_init__(self) -> None:
        _check(self.mixed_precision in PRECISIONS, "--mixed-precision", f"choose one of {PRECISIONS}")
        if self.ds_config is not None:
            p = Path(self.ds_config)
            _check(p.is_file(), "--ds-config", f"file not found: {self.ds_config}")
            raw = read_json(self.ds_config, DS_CONFIG_UNREADABLE)
            # the JSON's own structure is checked now (a pure function of the file, no DeepSpeed import), so a
            # typo there is one line before start-up; the values vtrain owns are filled in at launch (plan.py)
            check_structure(raw, self.ds_config)
            _check(not self.fsdp, "--fsdp", "cannot be combined with --ds-config (choose DeepSpeed or FSDP)")


@dataclass
class TrainConfig:
    output_dir: str = "runs/vtrain"
    epochs: int | None = None
    max_steps: int | None = None
    """Optimizer steps to train; takes precedence over --epochs. Default: 1 epoch."""
    batch_size: int = 32
    """Per-device micro-batch size."""
    grad_accum: int = 1
    resume: str | None = None
    """`auto` (newest complete checkpoint in <output-dir>, if any) or a checkpoint directory."""
    resume_weights_only: str | None = None
    """Start a new run (fresh optimizer, schedule, step 0) from a consolidated weights file, loaded strictly."""
    save_every: int = 500
    keep_last: int = 3
    eval_every: int = 0
    """Evaluate every N optimizer steps (0: only at the end)."""
    log_every: int = 10
    seed: int = 42
    max_nonfinite: int = 5
    """Stop after this many consecutive steps with a non-finite loss."""
    overwrite_output_dir: bool = False
    """Start a new run in an --output-dir that holds an earlier run: its checkpoints and logs are deleted."""
    ema_decay: float = 0.0
    """EMA of the weights with this decay (e.g. 0.9998), updated after every applied optimizer step; 0: off.
    Evaluation, `vtrain eval` and `vtrain consolidate` then use the averaged weights."""
    ema_warmup: int = 0
    """EMA decay warm-up TAU in steps: decay_t = D * (1 - exp(-t / TAU)) (YOLOX / detrex use 2000); 0: off."""
    keep_best: str | None = None
    """Keep the checkpoint with the best value of this evaluation metric (e.g. AP, tar@far=1e-3, acc) outside
    --keep-last pruning, recorded in checkpoints/best.json. Higher is better; append :min for a lower-is-better
    metric (loss-like names default to :min)."""
    report_to: str = "none"
    """Also send every logged number and evaluation metric to tensorboard (<output-dir>/tensorboard) or wandb."""
    compile: bool = False
    """Regional torch.compile: each backbone block and each DINO encoder/decoder layer compiled on its own, the rest
    eager, so a new image size recompiles a few small graphs at most, never the whole model (DINO's sizes are
    symbolic from the first compile). Checkpoints keep the eager model's keys (docs/compile.md)."""
    compile_backend: str = "inductor"
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
        _check(self.epochs is None or self.epochs > 0, "--epochs", f"must be > 0, got {self.epochs}")
        _check(self.max_steps is None or self.max_steps > 0, "--max-steps", f"must be > 0, got {self.max_steps}")
        _check(self.batch_size > 0, "--batch-size", f"must be > 0, got {self.batch_size}")
        _check(self.grad_accum > 0, "--grad-accum", f"must be > 0, got {self.grad_accum}")
        _check(self.save_every > 0, "--save-every", f"must be > 0, got {self.save_every}")
        _check(self.keep_last > 0, "--keep-last", f"must be > 0, got {self.keep_last}")
        _check(self.eval_every >= 0, "--eval-every", "must be >= 0")
        _check(self.log_every > 0, "--log-every", f"must be > 0, got {self.log_every}")
        _check(self.max_nonfinite > 0, "--max-nonfinite", "must be > 0")
        _check(0 <= self.seed < 2**32, "--seed", f"must be in 0..2**32-1, got {self.seed}")
        problem = directory_problem(self.output_dir) or utf8_problem(self.output_dir)
        _check(problem is None, "--output-dir", str(problem))
        if self.report_to == "tensorboard":  # found now, not as a traceback from the writer after start-up
            problem = directory_problem(Path(self.output_dir) / "tensorboard")
            _check(problem is None, "--report-to", f"tensorboard writes into <output-dir>/tensorboard, but {problem}")
        _check(not (self.resume and self.resume_weights_only), "--resume-weights-only",
               "cannot be combined with --resume (one continues a run, the other starts a new one from weights)")
        _check(not (self.resume and self.overwrite_output_dir), "--overwrite-output-dir",
               "cannot be combined with --resume (one continues the run in --output-dir, the other deletes it)")
        _check(0.0 <= self.ema_decay < 1.0, "--ema-decay", f"must be in [0, 1) (0: off), got {self.ema_decay}")
        _check(0 <= self.ema_warmup <= 10**7, "--ema-warmup", f"must be in 0..10000000 steps, got {self.ema_warmup}")
        _check(self.ema_warmup == 0 or self.ema_decay > 0, "--ema-warmup", "needs --ema-decay > 0")
        _check(self.report_to in REPORT_TO, "--report-to", f"choose one of {REPORT_TO}")
        _check(0 <= self.threads <= 1024, "--threads", f"must be in 0..1024 (0: torch's default), got {self.threads}")
        _check(self.compile_backend in COMPILE_BACKENDS, "train.compile_backend",
               f"choose one of {COMPILE_BACKENDS}, got {self.compile_backend!r}")
        if self.keep_best is not None:
            name, _, mode = self.keep_best.rpartition(":") if ":" in self.keep_best else (self.keep_best, "", "")
            _check(bool(name.strip()) and mode in ("", "min", "max"), "--keep-best",
                   f"a metric name, optionally with :min or :max, got {self.keep_best!r}")
        if self.resume is not None and self.resume != "auto":
            _check(Path(self.resume).is_dir(), "--resume", f"not a checkpoint directory: {self.resume}")
        if self.resume_weights_only is not None:
            _check(Path(self.resume_weights_only).is_file(), "--resume-weights-only",
                   f"file not found: {self.resume_weights_only}")


@dataclass
class RunConfig:
    task: str = "metric"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        _check(self.task in TASKS, "--task", f"choose one of {TASKS}")
        names = presets_for(self.task)
        _check(self.model.preset in names, "--model",
               f"unknown {self.task} preset {self.model.preset!r}; choose one of: {', '.join(names)}")
        for m in self.optim.milestones:
            _check(self.train.max_steps is None or m <= self.train.max_steps, "optim.milestones",
                   f"milestone {m} is beyond --max-steps {self.train.max_steps}")
        _check(not (self.model.pretrained and self.train.resume_weights_only), "--pretrained",
               "cannot be combined with --resume-weights-only (which replaces every weight)")
        if self.task == "metric":
            check_neck_batch(self.model.neck_norm, self.train.batch_size)
        try:
            recompute.check_parts(recompute.parse(self.model.grad_ckpt), self.task)
        except recompute.SpecError as e:
            _check(False, "--grad-ckpt", str(e))
        _check(self.task == "metric" or self.model.head_parallel == "none", "--head-parallel",
               "sharded is for --task metric (the margin-softmax head)")
        if self.task == "dino":
            _check(self.model.image_size >= MIN_DETECTION_SIZE, "--image-size",
                   f"must be >= {MIN_DETECTION_SIZE} for detection (the coarsest DINO feature stride is 64)")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["optim"]["betas"] = list(d["optim"]["betas"])
        return d

    def save(self, path: str | Path) -> None:
        write_text_atomic(path, yaml.safe_dump(self.to_dict(), sort_keys=False))


_SECTION_CLASSES = {"model": ModelConfig, "data": DataConfig, "optim": OptimConfig,
                    "parallel": ParallelConfig, "train": TrainConfig}

# the fields with a `vtrain train` flag of their own (flag_of names it), per section: all but CONFIG_ONLY
FLAG_SECTIONS: dict[str, tuple[str, ...]] = {section: tuple(f.name for f in fields(cls) if f.name not in CONFIG_ONLY)
                                              for section, cls in _SECTION_CLASSES.items()}

# Defaults that differ per task, applied below the YAML file and the flags.
TASK_DEFAULTS: dict[str, dict[str, dict[str, Any]]] = {
    # insightface ViT recipe uses AdamW lr 1e-3, wd 0.1 (docs/face.md §1.2); our small-batch default keeps lr 1e-3.
    "metric": {"optim": {"lr": 1e-3, "weight_decay": 0.1}},
    # DINO recipe (docs/dino.md §1.1): AdamW 1e-4, wd 1e-4, backbone x0.1, clip 0.1, step decay x0.1, no warm-up;
    # test resize 800 (long side 1333); micro-batch 2 per GPU.
    "dino": {"model": {"image_size": 800},
             "optim": {"lr": 1e-4, "weight_decay": 1e-4, "backbone_lr_mult": 0.1, "clip_grad": 0.1,
                       "schedule": "step", "gamma": 0.1, "warmup_steps": 0},
             "train": {"batch_size": 2}},
}


def build_config(task: str, file_values: dict[str, Any] | None = None,
                 overrides: dict[str, dict[str, Any]] | None = None) -> RunConfig:
    """Merge task defaults < file values < CLI overrides into a validated RunConfig."""
    file_values = dict(file_values or {})
    task = file_values.pop("task", None) if task is None else task
    task = task or "metric"
    merged: dict[str, dict[str, Any]] = {name: {} for name in _SECTION_CLASSES}
    for source in (TASK_DEFAULTS.get(task, {}), file_values, overrides or {}):
        for section, values in source.items():
            if section == "task":
                continue
            if section not in _SECTION_CLASSES:
                raise ConfigError(f"--config: unknown section {shown(section)}; sections are "
                                  f"{', '.join(_SECTION_CLASSES)}")
            if not isinstance(values, dict):
                raise ConfigError(f"--config: section {shown(section)} must be a mapping")
            known = {f.name for f in fields(_SECTION_CLASSES[section])}
            hints = typing.get_type_hints(_SECTION_CLASSES[section])
            for k, v in values.items():
                if k not in known:
                    raise ConfigError(f"--config: unknown key {section}.{str(k)[:80]}; known: "
                                  f"{', '.join(sorted(known))}")
                if v is not None and source is file_values:  # the file as written, even where a flag overrides it
                    coerce(v, hints[k], f"--config {section}.{k}")
                if v is not None:
                    merged[section][k] = v
    if not isinstance(task, str):
        raise ConfigError(f"--config: task must be a string, got {shown(task)}")
    sections = {}
    for name, cls in _SECTION_CLASSES.items():
        hints = typing.get_type_hints(cls)
        values = {k: coerce(v, hints[k], _where(name, k)) for k, v in merged[name].items()}
        sections[name] = cls(**values)
    return RunConfig(task=task, **sections)


def load_run_config(path: str | Path) -> RunConfig:
    """Rebuild the config saved with a run (``config.yaml``), skipping path checks that may no longer hold."""
    data = read_yaml(path, "checkpoint config")
    task = data.pop("task", "metric")
    data.get("model", {}).pop("pretrained", None)  # weights come from the checkpoint
    data.get("train", {}).pop("resume", None)
    data.get("train", {}).pop("resume_weights_only", None)
    data.get("parallel", {}).pop("ds_config", None)
    data.pop("data", None)
    return build_config(task, data)


def replace(cfg: Any, **kw: Any) -> Any:
    return dataclasses.replace(cfg, **kw)
