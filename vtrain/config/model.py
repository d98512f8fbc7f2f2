"""The `model` section: backbone preset, input size, the metric head and neck, DINO's queries, recomputation."""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass, field
from typing import Literal

from vtrain import recompute
from vtrain.config.fields import DINO_ONLY, METRIC_ONLY, NO_FLAG, Section

NeckNorm = Literal["bn", "ln", "none"]
Head = Literal["arcface", "cosface"]
ArcfaceGrad = Literal["straight", "chain"]
HeadParallel = Literal["none", "sharded"]
HeadUpdate = Literal["dense", "sampled"]
NECK_NORMS: tuple[str, ...] = typing.get_args(NeckNorm)
HEADS: tuple[str, ...] = typing.get_args(Head)
HEAD_PARALLEL: tuple[str, ...] = typing.get_args(HeadParallel)
ARCFACE_GRADS: tuple[str, ...] = typing.get_args(ArcfaceGrad)
HEAD_UPDATES: tuple[str, ...] = typing.get_args(HeadUpdate)
MAX_QUERIES, MAX_DN_QUERIES = 5000, 2000
MIN_DETECTION_SIZE = 64  # the coarsest DINO level has stride 64 (presets.py): smaller inputs leave it empty


@dataclass
class ModelConfig(Section):
    SECTION = "model"

    preset: str = field(default="debug", metadata={"flag": "--model"})
    """Backbone preset (see `vtrain presets`). Metric: `debug`, `vit-t/s/b/l`, `swin-t/b/l`, `resnet50`; DINO:
    `debug`, `debug-resnet`, `demo-resnet` (make demo's), `swin-l` (5-scale), `swin-l-4scale`, `swin-b`, `swin-t`,
    `resnet50`."""
    pretrained: str | None = None
    """Local weights file (`.safetensors` or `.pt`; nothing is downloaded): a timm backbone (position embeddings
    resampled by timm's own filter) or a vtrain model state dict; or a vtrain checkpoint directory (or a run's
    newest) to fine-tune from: a model of other classes keeps all but its class rows (detection: rows of
    same-named classes kept, docs/detection.md); any other tensor that does not fit is an error, unless
    --allow-partial-pretrained."""
    image_size: int = 112
    """Metric: square input size (face crops are 112). DINO: test short side (800 in the recipe); the training
    scales follow it (480-800 at 800) and the long side is capped at image_size * 1333 / 800."""
    embedding_dim: int = field(default=512, metadata=METRIC_ONLY)
    """Metric: embedding size."""
    neck_norm: NeckNorm = field(default="bn", metadata=METRIC_ONLY)
    """Metric: embedding neck normalisation: bn (insightface style; needs a micro-batch >= 2), ln or none."""
    head: Head = field(default="arcface", metadata=METRIC_ONLY)
    """Metric: margin head, arcface or cosface."""
    margin: float | None = field(default=None, metadata=METRIC_ONLY)
    """Metric: margin m; defaults to 0.5 for ArcFace and 0.4 for CosFace (docs/face.md §1.1)."""
    scale: float = field(default=64.0, metadata=METRIC_ONLY)
    """Metric: logit scale s."""
    arcface_grad: ArcfaceGrad = field(default="straight", metadata=METRIC_ONLY)
    """ArcFace's gradient: `straight`, the margin added to theta without a gradient, so the target logit's
    gradient passes through unchanged, and cos(theta + m) for every theta (arcface_torch since Dec. 2022, commit
    657ae30e); `chain`, the gradient of cos(theta + m), with cos(theta) - m sin(m) where theta + m > pi
    (arcface_torch of Jan. 2022, commit 2e2e8c97). docs/face_head.md."""
    head_parallel: HeadParallel = field(default="none", metadata=METRIC_ONLY)
    """Metric head: `none`, one head inside the model (replicated under DDP, partitioned under ZeRO-3/FSDP2);
    `sharded`, each process owns a contiguous class range outside the engine (Partial FC, engine/head_shard.py,
    docs/face_head.md)."""
    sample_rate: float = field(default=1.0, metadata=METRIC_ONLY)
    """With --head-parallel sharded: positives plus random negatives up to this share of each rank's classes per
    step (Partial FC); 1.0 is the full softmax. Below 1 it needs sharded (the replicated head has no sampling)."""
    head_update: HeadUpdate = field(default="dense", metadata=METRIC_ONLY)
    """With --head-parallel sharded: `dense`, every class centre takes an AdamW step every step, its weight decay
    and momentum included, sampled or not (arcface_torch's PartialFC_V2 and optimizer); `sampled`, only the rows
    sampled in the step are updated (their own step counts; others keep weight and moments), at a cost that
    follows the sampled rows. docs/face_head.md."""
    drop_path: float | None = None
    """Stochastic depth rate of the backbone (default: the preset's)."""
    grad_ckpt: list[str] = field(default_factory=list)
    """Activation checkpointing (non-reentrant), a comma list of PART or PART:SEL with PART backbone, encoder or
    decoder; SEL N, N-M (encoder/decoder layers), stageN[-M] (Swin/ResNet stages), blockN[-M] (ViT blocks); the
    prefix sac: for selective checkpointing (keeps matmul outputs), e.g. backbone:stage0-1,encoder:0-3,sac:decoder.
    `auto`: the planner chooses per unit (none, full, sac:, DINO's FFN hidden layer remade) what fits
    --memory-budget with the fewest recomputed FLOPs, traced on rank 0 before the first step and applied on every
    rank. The active units (and the plan) are recorded in run_info.json (docs/recompute.md). In a --config file a
    list of items; default none."""
    ffn_recompute: bool = field(default=True, metadata={**NO_FLAG, **DINO_ONLY})
    """DINO: the encoder FFNs make their 2048-wide ReLU output again in backward instead of keeping it: 4.1 GiB less
    for Swin-L at 800x1333, batch 2, for one more fc1 matmul per layer (+18% forward FLOPs); docs/recompute.md.
    With `--grad-ckpt auto` the planner decides this per encoder layer instead."""
    memory_budget: float | None = None
    """With `--grad-ckpt auto`: GiB per GPU the planner fits (estimate-memory's total: model states, activations at
    the peak, buffers, 0.5 GiB for the CUDA context). Default on a GPU: its memory minus max(2.5 GiB, 10%) for
    allocator fragmentation (docs/memory_estimate.md); on a CPU it must be given. Nothing fitting is one error line
    naming the smallest peak."""
    ffn_chunk: int = field(default=16384, metadata={**NO_FLAG, **DINO_ONLY})
    """DINO, with ffn_recompute: the encoder FFNs run forward and backward over this many tokens at a time, so their
    2048-wide hidden layer and its gradient never exist whole (1.0 GiB less at the peak of Swin-L 800x1333 batch 2
    with the encoder checkpointed, no extra FLOPs); 0 runs all tokens at once. The weight gradients then sum over
    chunks in fp32: within one rounding of their dtype of the unchunked ones (docs/recompute.md §3)."""

    num_queries: int | None = field(default=None, metadata=DINO_ONLY)
    """DINO matching queries (default: the preset's, 900 in the recipe)."""
    dn_queries: int | None = field(default=None, metadata=DINO_ONLY)
    """DINO contrastive-denoising queries (default: the preset's, 100 in the recipe; 0 disables denoising)."""
    # ---- DINO model options a faithful import of a published detector needs (docs/detection.md "Model options");
    # the defaults are vtrain's recipe, `vtrain convert` writes the source codebase's values
    neck_bias: bool = field(default=False, metadata={**NO_FLAG, **DINO_ONLY})
    """DINO: the neck's convolutions (1x1 per backbone level, 3x3 stride-2 extra levels) carry a bias, as IDEA
    DINO's and detrex's `input_proj.*.0` do; mmdetection's ChannelMapper has none (the default)."""
    pos_temperature: float = field(default=20.0, metadata={**NO_FLAG, **DINO_ONLY})
    """DINO: temperature of the encoder's sine positions (20: IDEA DINO and mmdetection's base config; 10000:
    detrex and mmdetection's improved config)."""
    pos_offset: float = field(default=0.0, metadata={**NO_FLAG, **DINO_ONLY})
    """DINO: offset added to the cumulative position before normalising it (0: IDEA DINO, mmdetection's base
    config; -0.5: detrex, mmdetection's improved config)."""
    pos_normalize: bool = field(default=True, metadata={**NO_FLAG, **DINO_ONLY})
    """DINO: sine positions normalised to the valid region and scaled by 2*pi (all DINO recipes); False uses the
    raw pixel index (DETR's unnormalised form; the offset then does not apply)."""
    mask_invalid_proposals: bool = field(default=True, metadata={**NO_FLAG, **DINO_ONLY})
    """DINO: encoder tokens whose proposal is invalid (padding, or a box outside (0.01, 0.99)) are never chosen
    among the top-k (score -inf). False: they are scored by the proposal head on their zeroed memory and can be
    chosen, as IDEA DINO, detrex and mmdetection do."""
    refine_eps: float = field(default=1e-3, metadata={**NO_FLAG, **DINO_ONLY})
    """DINO: eps of the inverse sigmoid of the reference boxes in the decoder's refinement (1e-3 in IDEA DINO,
    detrex and mmdetection)."""
    box_eps: float = field(default=1e-3, metadata={**NO_FLAG, **DINO_ONLY})
    """DINO: eps of the inverse sigmoid of the reference boxes in the final box predictions (IDEA DINO and detrex
    1e-3; mmdetection's head 1e-5)."""
    clip_boxes: bool = field(default=False, metadata={**NO_FLAG, **DINO_ONLY})
    """DINO: post-processed boxes are clipped to the image (detrex, mmdetection); IDEA DINO does not clip."""
    shared_class_head: bool = False
    """DINO: one class head for every decoder layer, as IDEA DINO's published configs train
    (`dec_pred_class_embed_share=True`); default one per layer (mmdetection, detrex). The encoder-proposal head is
    its own either way. `vtrain convert --from idea-dino` sets it from the file."""
    shared_box_head: bool = False
    """DINO: one box head (which also refines the reference boxes) for every decoder layer, as IDEA DINO's
    published configs train (`dec_pred_bbox_embed_share=True`); default one per layer (mmdetection, detrex)."""
    pretrained_min_match: float = 0.9
    """Share of the target's tensors (the backbone's for a backbone file, the model's for a full file) that a
    --pretrained file must fill; fewer is an error (a file of another model), unless --allow-partial-pretrained."""
    allow_partial_pretrained: bool = False
    """Load whatever tensors of --pretrained match, however few (the match share is still reported)."""

    def __post_init__(self) -> None:
        self._check_text()
        check = self._check
        check(self.image_size >= 32 and self.image_size % 16 == 0, "image_size",
              f"must be a multiple of 16 and >= 32, got {self.image_size}")
        check(self.embedding_dim > 0, "embedding_dim", "must be > 0")
        check(self.neck_norm in NECK_NORMS, "neck_norm", f"choose one of {NECK_NORMS}")
        check(self.head in HEADS, "head", f"choose one of {HEADS}")
        if self.margin is None:
            self.margin = 0.5 if self.head == "arcface" else 0.4
        check(0.0 <= self.margin < 1.5, "margin", f"must be in [0, 1.5), got {self.margin}")
        check(self.scale > 0, "scale", "must be > 0")
        check(self.head_parallel in HEAD_PARALLEL, "head_parallel", f"choose one of {HEAD_PARALLEL}")
        check(0.0 < self.sample_rate <= 1.0, "sample_rate", f"must be in (0, 1], got {self.sample_rate}")
        check(self.sample_rate == 1.0 or self.head_parallel == "sharded", "sample_rate",
              f"{self.sample_rate} < 1 needs --head-parallel sharded (negative sampling lives in the sharded head)")
        check(self.arcface_grad in ARCFACE_GRADS, "arcface_grad", f"choose one of {ARCFACE_GRADS}")
        check(self.arcface_grad == "straight" or self.head == "arcface", "arcface_grad",
              f"{self.arcface_grad} needs --head arcface (CosFace's margin is a constant: one gradient)")
        check(self.head_update in HEAD_UPDATES, "head_update", f"choose one of {HEAD_UPDATES}")
        check(self.head_update == "dense" or self.head_parallel == "sharded", "head_update",
              f"{self.head_update} needs --head-parallel sharded (the replicated head is one dense parameter of "
              "the model's optimizer)")
        check(self.drop_path is None or 0.0 <= self.drop_path < 1.0, "drop_path", "must be in [0, 1)")
        check(math.isfinite(self.pos_temperature) and self.pos_temperature > 0, "pos_temperature",
              f"must be a positive number, got {self.pos_temperature}")
        check(math.isfinite(self.pos_offset) and abs(self.pos_offset) <= 1, "pos_offset",
              f"must be in [-1, 1], got {self.pos_offset}")
        check(0 < self.refine_eps < 0.5, "refine_eps", f"must be in (0, 0.5), got {self.refine_eps}")
        check(0 < self.box_eps < 0.5, "box_eps", f"must be in (0, 0.5), got {self.box_eps}")
        check(self.ffn_chunk >= 0, "ffn_chunk", f"must be >= 0 (0: no chunking), got {self.ffn_chunk}")
        try:
            spec = recompute.parse(self.grad_ckpt)
        except recompute.SpecError as e:
            check(False, "grad_ckpt", f"{e}; forms: {recompute.FORMS}")
        self.grad_ckpt = spec.canonical()
        check(self.memory_budget is None or 0 < self.memory_budget <= 1e6, "memory_budget",
              f"must be a positive number of GiB, got {self.memory_budget}")
        check(self.memory_budget is None or spec.auto, "memory_budget",
              "plans the activation checkpointing: it needs --grad-ckpt auto")
        # upper bounds: the denoising attention mask and the matcher grow with the square of the query count
        # (recipes use 900 and 100-300; docs/dino.md §1.1), so a typo must not allocate terabytes
        check(self.num_queries is None or 0 < self.num_queries <= MAX_QUERIES, "num_queries",
              f"must be in 1..{MAX_QUERIES}, got {self.num_queries}")
        check(self.dn_queries is None or 0 <= self.dn_queries <= MAX_DN_QUERIES, "dn_queries",
              f"must be in 0..{MAX_DN_QUERIES}, got {self.dn_queries}")
        check(self.image_size <= 8192, "image_size", f"must be <= 8192, got {self.image_size}")
        check(0.0 <= self.pretrained_min_match <= 1.0, "pretrained_min_match",
              f"must be in [0, 1], got {self.pretrained_min_match}")
