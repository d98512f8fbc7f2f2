"""What `vtrain estimate-memory` estimates: one training configuration (`Setup`), from a `vtrain train` config
file and the command's flags, validated here (the CLI boundary)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vtrain import recompute
from vtrain.config import ModelConfig, build_config, read_yaml
from vtrain.ds_json import bucket_sizes, explicit_16bit, read_json, zero_settings
from vtrain.engine.plan import resolve_precision
from vtrain.errors import VtrainError
from vtrain.presets import presets_for
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
    ffn_chunk: int = ModelConfig.ffn_chunk  # ...a chunk of tokens at a time (ModelConfig.ffn_chunk)
    zero: int = 0  # 0 = DDP, 1-3 = ZeRO stage
    fsdp: bool = False
    offload: str = "none"  # none | optimizer | all
    gpus: int = 1
    num_classes: int = 80
    num_targets: int = 10  # boxes per image (DINO: sets the denoising query count)
    ds_buckets: tuple[float, float] = (VTRAIN_DS_BUCKET, VTRAIN_DS_BUCKET)  # reduce, allgather (elements)
    overlap_comm: bool = True
    ds_16bit: bool = False  # a DeepSpeed JSON with bf16/fp16 enabled (16-bit params); else torch_autocast / fp32
    autocast_policy: str = "cuda"  # cuda | cpu (the CPU tests compare against real CPU runs)
    # DINO's deformable attention: auto = the implementation a run on the target device uses, i.e. the fused
    # Triton op for the cuda policy (traced through its fake kernel and what its autograd saves) and the
    # PyTorch path for cpu; or triton | pytorch
    msda_impl: str = "auto"

    def resolved_msda_impl(self) -> str:
        if self.msda_impl != "auto":
            return self.msda_impl
        return "triton" if self.autocast_policy == "cuda" else "pytorch"

    def label(self) -> str:
        gc = "+".join(self.grad_ckpt) if self.grad_ckpt else "none"
        eng = "FSDP" if self.fsdp else (f"ZeRO-{self.zero}" if self.zero else "DDP")
        return f"{eng}, offload {self.offload}, GC {gc}"


def _ds_fields(path: str) -> dict[str, Any]:
    """The Setup fields a DeepSpeed JSON decides (ds_json.py reads it as the training run does)."""
    raw = read_json(path, "--ds-config: cannot read {path} ({error})")
    zero = zero_settings(raw)
    offload = "all" if zero.offload_params else ("optimizer" if zero.offload_optimizer else "none")
    return {"zero": zero.stage, "offload": offload, "ds_buckets": bucket_sizes(raw), "overlap_comm": zero.overlap_comm,
            "ds_16bit": bool(explicit_16bit(raw))}


def parse_image_size(text: str, task: str) -> tuple[int, int]:
    parts = text.lower().replace("×", "x").split("x")
    try:
        nums = [int(p) for p in parts]
    except ValueError:
        raise VtrainError(f"--image-size: expected HxW or S, got {text!r}") from None
    if len(nums) == 1:
        s = nums[0]
        nums = list(test_sizes(s, None)) if task == "dino" else [s, s]
    if len(nums) != 2 or min(nums) < 32:
        raise VtrainError(f"--image-size: expected HxW or S with sides >= 32, got {text!r}")
    return nums[0], nums[1]


def setup_from(*, model=None, task=None, batch_size=None, image_size=None, precision=None, grad_ckpt=None,
               zero=None, fsdp=None, offload=None, gpus=1, num_classes=None, config=None, ds_config=None) -> Setup:
    """A Setup from `vtrain train`'s config file (if any), then explicit flags; validated here (CLI boundary)."""
    s = Setup()
    if config is not None:
        cfg = build_config(None, read_yaml(config))
        s.task, s.preset, s.batch_size = cfg.task, cfg.model.preset, cfg.train.batch_size
        size = cfg.model.image_size
        s.image_size = test_sizes(size, cfg.data.max_size) if cfg.task == "dino" else (size, size)
        s.precision = resolve_precision(cfg.parallel.mixed_precision)
        s.grad_ckpt = tuple(cfg.model.grad_ckpt)
        s.ffn_recompute, s.ffn_chunk = cfg.model.ffn_recompute, cfg.model.ffn_chunk
        s.fsdp = cfg.parallel.fsdp
        ds_config = ds_config or cfg.parallel.ds_config
        if cfg.task == "metric":
            s.num_classes = 10_000
    elif task == "metric":
        s.task, s.preset, s.image_size, s.batch_size, s.num_classes = "metric", "vit-b", (112, 112), 128, 10_000
    if task is not None and task != s.task:
        s.task = task
    if ds_config:
        for k, v in _ds_fields(ds_config).items():
            setattr(s, k, v)
    if model is not None:
        s.preset = model
    names = presets_for(s.task)
    if s.preset not in names:
        raise VtrainError(f"--model: unknown {s.task} preset {s.preset!r}; choose one of: {', '.join(names)}")
    if batch_size is not None:
        if batch_size < 1:
            raise VtrainError("--batch-size: must be >= 1")
        s.batch_size = batch_size
    if image_size is not None:
        s.image_size = parse_image_size(image_size, s.task)
    if precision is not None:
        s.precision = resolve_precision(precision)
    try:
        spec = recompute.parse(grad_ckpt if grad_ckpt is not None else s.grad_ckpt)
        recompute.check_parts(spec, s.task)
    except recompute.SpecError as e:
        raise VtrainError(f"--grad-ckpt: {e}; forms: {recompute.FORMS}") from None
    if spec.auto:
        raise VtrainError("--grad-ckpt auto: the memory planner is not in this version; name the units")
    s.grad_ckpt = tuple(spec.canonical())
    if zero is not None:
        if zero not in (0, 1, 2, 3):
            raise VtrainError("--zero: choose 0, 1, 2 or 3")
        s.zero = zero
    if fsdp:
        s.fsdp = True
    if s.fsdp and s.zero:
        raise VtrainError("--fsdp: cannot be combined with --zero (choose DeepSpeed or FSDP)")
    if offload is not None:
        if offload not in ("none", "optimizer", "all"):
            raise VtrainError("--offload: choose none, optimizer or all")
        s.offload = offload
    if s.offload == "all" and s.zero != 3:
        raise VtrainError("--offload all: parameter offload needs --zero 3")
    if s.offload != "none" and not s.zero:
        raise VtrainError("--offload: offloading needs DeepSpeed (--zero 1-3)")
    if gpus < 1:
        raise VtrainError("--gpus: must be >= 1")
    s.gpus = gpus
    if num_classes is not None:
        if num_classes < 1:
            raise VtrainError("--num-classes: must be >= 1")
        s.num_classes = num_classes
    return s

