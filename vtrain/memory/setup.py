"""What a memory estimate or plan is about: one training configuration (`Setup`), and the Setup of a run config.

`vtrain estimate-memory` builds one from flags (tools/estimate_memory.py, the CLI boundary); a training run with
`--grad-ckpt auto` builds one from its own config and launch plan (engine/autoplan.py) through `run_setup`, so both
read a run config the same way."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vtrain import recompute
from vtrain.config import ModelConfig, RunConfig
from vtrain.tasks.dino import test_sizes

VTRAIN_DS_BUCKET = 5e7  # the bucket size of vtrain's ds_configs/*.json


@dataclass
class Setup:
    """What to estimate: one training configuration."""

    task: str = "dino"
    preset: str = "swin-l"
    batch_size: int = 2
    image_size: tuple[int, int] = (800, 1333)
    precision: str = "bf16"  # no | bf16 | fp16
    grad_ckpt: tuple[str, ...] = ()  # --grad-ckpt items (vtrain/recompute.py), e.g. ("backbone", "encoder:0-2")
    ffn_recompute: bool = True  # DINO encoder FFNs remake their hidden layer in backward (ModelConfig.ffn_recompute)
    # the planner's per-unit choice instead of the model-wide flag: exactly these units remake their FFN hidden
    # layer (models/recompute_units.set_hidden_recompute); None: ffn_recompute decides
    ffn_units: tuple[str, ...] | None = None
    ffn_chunk: int = ModelConfig.ffn_chunk  # DINO encoder FFNs over this many tokens at a time (ModelConfig.ffn_chunk)
    layer_decay: float | None = None  # the run's --layer-decay: splits the optimizer's groups per backbone layer
    grad_accum: int = 1  # micro-batches per optimizer step (gradients of the window stay live across them)
    zero: int = 0  # 0 = DDP, 1-3 = ZeRO stage
    fsdp: bool = False
    offload: str = "none"  # none | optimizer | all
    gpus: int = 1
    num_classes: int = 80
    num_targets: int = 10  # boxes per image (DINO: sets the denoising query count)
    embedding_dim: int = 512  # metric: the embedding the head sees
    neck_norm: str = ModelConfig.neck_norm  # metric: the embedding neck's norm (bn needs a micro-batch >= 2)
    head_parallel: str = "none"  # metric: none | sharded (the Partial FC head outside the model, memory/head.py)
    shared_class_head: bool = False  # DINO: one class head for every decoder layer (ModelConfig.shared_class_head)
    shared_box_head: bool = False  # DINO: one box head for every decoder layer (ModelConfig.shared_box_head)
    sample_rate: float = 1.0  # metric, sharded head: share of each rank's classes per step
    head_update: str = ModelConfig.head_update  # metric, sharded head: dense | sampled (its gradient's size)
    ds_buckets: tuple[float, float] = (VTRAIN_DS_BUCKET, VTRAIN_DS_BUCKET)  # reduce, allgather (elements)
    overlap_comm: bool = True
    ds_prefetch: float = 5e7  # ZeRO-3: stage3_prefetch_bucket_size (elements gathered ahead)
    ds_persistence: float = 1e5  # ZeRO-3: stage3_param_persistence_threshold (smaller parameters stay gathered)
    ds_16bit: bool = False  # a DeepSpeed JSON with bf16/fp16 enabled (16-bit params); else torch_autocast / fp32
    autocast_policy: str = "cuda"  # cuda | cpu (the CPU tests compare against real CPU runs)
    # DINO's deformable attention: auto = the implementation a run on the target device uses, i.e. the fused
    # Triton op for the cuda policy (traced through its fake kernel and what its autograd saves) and the
    # PyTorch path for cpu; or triton | pytorch
    msda_impl: str = "auto"
    # --grad-ckpt auto: the budget (GiB per GPU, the estimator's total) the recompute planner fits; None: no plan
    memory_budget: float | None = None

    def resolved_msda_impl(self) -> str:
        if self.msda_impl != "auto":
            return self.msda_impl
        return "triton" if self.autocast_policy == "cuda" else "pytorch"

    @property
    def on_gpu(self) -> bool:
        """Whether the estimate is for a GPU run (CUDA autocast rules, the caching allocator's 512-byte blocks,
        torch's foreach optimizer, the CUDA context allowance) or for a run on this CPU (the validation)."""
        return self.autocast_policy == "cuda"

    @property
    def granularity(self) -> int:
        """The allocator's block: the CUDA caching allocator rounds every block up to 512 bytes; the CPU allocator
        allocates what is asked."""
        return 512 if self.on_gpu else 1

    @property
    def sharded_head(self) -> bool:
        return self.task == "metric" and self.head_parallel == "sharded"

    def label(self) -> str:
        gc = "+".join(self.grad_ckpt) if self.grad_ckpt else "none"
        eng = "FSDP" if self.fsdp else (f"ZeRO-{self.zero}" if self.zero else "DDP")
        return f"{eng}, offload {self.offload}, GC {gc}"


def run_setup(cfg: RunConfig, precision: str, **engine: Any) -> Setup:
    """The Setup of a run config: its task, model, micro-batch, largest input and checkpointing; `precision` is the
    resolved one (bf16/fp16/no), `engine` the Setup fields the launch decides (zero, fsdp, offload, gpus,
    ds_buckets, ...). DINO is traced at the largest image its transforms produce: short side image_size, long side
    max_size (data/coco.py: every training scale is at most image_size, every long side at most max_size)."""
    m = cfg.model
    size = test_sizes(m.image_size, cfg.data.max_size) if cfg.task == "dino" else (m.image_size, m.image_size)
    spec = recompute.parse(m.grad_ckpt)
    s = Setup(task=cfg.task, preset=m.preset, batch_size=cfg.train.batch_size, image_size=size, precision=precision,
              grad_ckpt=() if spec.auto else tuple(spec.canonical()), ffn_recompute=m.ffn_recompute, ffn_chunk=m.ffn_chunk,
              embedding_dim=m.embedding_dim, neck_norm=m.neck_norm, head_parallel=m.head_parallel,
              sample_rate=m.sample_rate, head_update=m.head_update, shared_class_head=m.shared_class_head,
              shared_box_head=m.shared_box_head, layer_decay=cfg.optim.layer_decay, grad_accum=cfg.train.grad_accum,
              **engine)
    if cfg.task == "metric" and "num_classes" not in engine:
        s.num_classes = 10_000
    return s
