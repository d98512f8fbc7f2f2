"""Per-GPU training memory, predicted without a GPU: pure functions, no rendering (the CLI draws the table).

Two parts (the bare § numbers below are sections of docs/memory_ckpt.md):
- Model states: exact byte counts from the real model built on the meta device, partitioned as in the ZeRO paper
  (§2.1): mixed-precision Adam is 16 bytes/param unsharded: 2 (16-bit params) + 2 (16-bit grads) + 12 (fp32
  master, momentum, variance). vtrain's own engines keep fp32 parameters and gradients (4 + 4 + 8 = 16 bytes too).
  Stage 1 divides the optimizer states by the number of GPUs, stage 2 the gradients too, stage 3 the parameters
  too; FSDP2 is stage 3. Offload moves optimizer states (and with `all`, parameters) to CPU.
- Activations: one real forward + backward of the actual vtrain model, at the requested batch and resolution, under
  FakeTensorMode (no memory, no GPU), recording every storage the step creates and frees (`LiveBytes`); the peak
  of live activations and temporaries, gradients excluded (they are counted with the model states). The model is
  built on `meta` and materialised with `to_empty` inside fake mode (timm's __init__ reads values, §1.3).
  CPU autocast keeps layer_norm/group_norm/softmax in bf16 where CUDA autocast runs them in fp32 (§1.3); a
  TorchFunctionMode applies CUDA's fp32 list on top of CPU autocast so the trace matches a GPU run, and SDPA with a
  trainable bias goes through CUDA's memory-efficient kernel where CPU would fall back to the math kernel. DINO's
  deformable attention is traced as the op a GPU run calls, the fused Triton custom op: its fake kernel's
  output, the three tensors its autograd saves and the fp32 value-gradient accumulator of its backward (the
  grid_sample path, which the CPU uses, keeps every sampled value: about 1.8 GB per encoder layer and image).
- Buffers that no tracer sees: DeepSpeed's communication buckets (§2.2: with overlap_comm 4.5 x (reduce +
  allgather) bucket elements x 2 bytes) and the CUDA context / library workspaces (a fixed allowance).
"""

from __future__ import annotations

import contextlib
import time
import weakref
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

GiB = 2**30
CUDA_CONTEXT_BYTES = int(0.5 * GiB)  # CUDA context + cuBLAS/cuDNN workspaces + NCCL: an allowance, not traced
DEFAULT_DS_BUCKET = 5e8  # DeepSpeed's own reduce/allgather bucket default, in elements (docs/memory_ckpt.md §2.2)
VTRAIN_DS_BUCKET = 5e7  # the bucket size of vtrain's ds_configs/*.json


@dataclass
class Setup:
    """What to estimate: one training configuration."""

    task: str = "dino"
    preset: str = "swin-l"
    batch_size: int = 2
    image_size: tuple[int, int] = (800, 1333)
    precision: str = "bf16"  # no | bf16 | fp16
    grad_ckpt: tuple[str, ...] = ()
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


@dataclass
class Estimate:
    setup: dict[str, Any]
    params_total: int
    params_trainable: int
    parameters: int  # bytes per GPU
    gradients: int
    optimizer: int
    activations: int
    temporary: int
    overhead: int
    cpu_offloaded: int
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations + self.temporary + self.overhead

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["total"] = self.total
        return d


# ---- model states --------------------------------------------------------------------------------------------
def model_state_bytes(trainable: int, frozen: int, zero: int, fsdp: bool, offload: str, gpus: int,
                      ds_16bit: bool = False) -> dict[str, int]:
    """Per-GPU bytes of parameters, gradients and optimizer states, and what is offloaded to CPU.

    vtrain's engines keep fp32 parameters and gradients and run the forward under autocast (DDP, FSDP2 and
    DeepSpeed's torch_autocast mode): 4 + 4 bytes plus 8 bytes of Adam moments. An explicit DeepSpeed bf16/fp16
    JSON (`ds_16bit`) keeps 16-bit parameters with a 12-byte fp32 master + moments partition and, as DeepSpeed's
    own estimator counts it, 16-bit plus fp32 gradient partitions (2 + 18/N bytes at stage 1/2, 18/N at stage 3).
    Partitioning over N GPUs: stage 1 the optimizer states, stage 2 also the gradients, stage 3 (and FSDP2) also
    the parameters. Offloading the optimizer moves its states and the gradient partitions to CPU; `all` also the
    parameters (stage 3)."""
    n = max(gpus, 1)
    stage = 3 if fsdp else zero
    if ds_16bit and stage:
        params = 2 * (trainable + frozen)
        grads = 6 * trainable if stage < 3 else 4 * trainable
        opt = 12 * trainable
        grads //= n  # DeepSpeed's estimate divides all gradient bytes at stages 1-3
    else:
        params = 4 * (trainable + frozen)
        grads = 4 * trainable
        opt = 8 * trainable
        if stage >= 2:
            grads //= n
    if stage >= 1:
        opt //= n
    if stage >= 3:
        params //= n
    cpu = 0
    if offload in ("optimizer", "all") and stage >= 1:
        cpu += opt + grads
        opt = grads = 0
    if offload == "all" and stage >= 3:
        cpu += params
        params = 0
    return {"parameters": params, "gradients": grads, "optimizer": opt, "cpu": cpu}


def deepspeed_reference(total_params: int, largest_layer: int, zero: int, offload: str, gpus: int) -> int:
    """DeepSpeed's own model-state estimate (GPU bytes) for the same counts; for the tests and the docs."""
    if zero == 3:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

        return estimate_zero3_model_states_mem_needs(total_params, largest_layer, gpus, 1,
                                                     cpu_offload=offload != "none",
                                                     cpu_offload_params=offload == "all")[1]
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    return estimate_zero2_model_states_mem_needs(total_params, gpus, 1, cpu_offload=offload != "none")[1]


def comm_buffer_bytes(zero: int, buckets: tuple[float, float], overlap_comm: bool, precision: str) -> int:
    """DeepSpeed's flat communication buffers (docs/memory_ckpt.md §2.2): with overlap_comm about 4.5 x the reduce +
    allgather bucket sizes (HF's DeepSpeed docs: 5e8 -> 9 GB in 16-bit), else one of each."""
    if zero == 0:
        return 0
    elem = 2 if precision != "no" else 4
    reduce, allgather = buckets
    factor = 4.5 if overlap_comm else 1.0
    return int(factor * (reduce + allgather) * elem)


# ---- activations ----------------------------------------------------------------------------------------------
# CUDA autocast's fp32 list, for the functions these models call (torch.amp "CUDA Ops that can autocast to
# float32"); CPU autocast leaves them in bf16 (docs/memory_ckpt.md §1.3).
_CUDA_FP32 = [(F, "layer_norm"), (F, "group_norm"), (F, "softmax"), (F, "log_softmax"), (F, "normalize"),
              (F, "cross_entropy"), (F, "l1_loss"), (F, "binary_cross_entropy_with_logits"),
              (torch.Tensor, "softmax"), (torch.Tensor, "log_softmax")]


@contextlib.contextmanager
def cuda_autocast_policy():
    """On top of CPU autocast, run CUDA's fp32-list functions on fp32 inputs, as CUDA autocast does. The
    functions are swapped for the duration of the trace (not a TorchFunctionMode: checkpointed blocks recompute
    inside the autograd engine, where such modes are not active, and the recomputation must match)."""
    def upcast(fn):
        def wrapper(*args, **kwargs):
            def up(x):
                return x.float() if isinstance(x, torch.Tensor) and x.dtype in (torch.bfloat16, torch.float16) else x

            return fn(*(up(a) for a in args), **{k: up(v) for k, v in kwargs.items()})

        return wrapper

    saved = [(owner, name, getattr(owner, name)) for owner, name in _CUDA_FP32]
    sdpa = F.scaled_dot_product_attention
    try:
        for owner, name, fn in saved:
            setattr(owner, name, upcast(fn))
        F.scaled_dot_product_attention = _cuda_sdpa(sdpa)
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
        F.scaled_dot_product_attention = sdpa


def _cuda_sdpa(sdpa):
    """SDPA as a CUDA run picks its kernel. With a float bias that needs a gradient (Swin's relative-position bias,
    models/swin_attention.py) CPU falls back to the math kernel, which materialises the attention matrix in fp32;
    CUDA runs the memory-efficient kernel (torch's priority order: flash, which takes no bias, then
    memory-efficient), which takes the bias broadcast (stride 0) and saves q, k, v, out and the log-sum-exp. Traced through that kernel's own
    op, whose fake kernel runs on CPU tensors; the bias cast to the compute dtype as CUDA autocast casts it."""
    def wrapper(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
        if attn_mask is None or attn_mask.dtype == torch.bool or not attn_mask.requires_grad or kwargs:
            return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **kwargs)
        if torch.is_autocast_enabled("cpu"):
            q, k, v = (t.to(torch.get_autocast_dtype("cpu")) for t in (q, k, v))
        bias = attn_mask.to(q.dtype).expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, dropout_p, is_causal,
                                                                       scale=scale)[0]

    return wrapper


def _inputs(setup: Setup, device: torch.device) -> dict[str, torch.Tensor]:
    h, w = setup.image_size
    b = setup.batch_size
    if setup.task == "dino":
        from vtrain.data.coco import PAD_DIVISOR

        # batches are padded to a multiple of 32 with a mask, as the data loader does
        ph, pw = -(-h // PAD_DIVISOR) * PAD_DIVISOR, -(-w // PAD_DIVISOR) * PAD_DIVISOR
        masks = torch.ones(b, ph, pw, dtype=torch.bool, device=device)
        masks[:, :h, :w] = False
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        t = setup.num_targets
        with unset_fake_temporarily():  # a real host tensor: the model reads the per-image counts from it
            counts = torch.full((b,), t)
        boxes = torch.rand(b, t, 4, device=device) * 0.4 + 0.3
        return {"images": torch.randn(b, 3, ph, pw, device=device), "masks": masks,
                "labels": torch.zeros(b, t, dtype=torch.long, device=device), "boxes": boxes,
                "num_targets": counts}
    return {"images": torch.randn(b, 3, h, w, device=device),
            "labels": torch.zeros(b, dtype=torch.long, device=device)}


def build_model(setup: Setup) -> nn.Module:
    """The task's real model (tasks.build_model), default head settings, the Setup's checkpointing."""
    from vtrain.config import ModelConfig
    from vtrain.tasks import build_model as build_task_model

    size = setup.image_size[0] if setup.task == "metric" else ModelConfig.image_size  # DINO takes any size
    return build_task_model(setup.task, ModelConfig(preset=setup.preset, image_size=size,
                                                    grad_ckpt=list(setup.grad_ckpt)), setup.num_classes)


class LiveBytes(TorchDispatchMode):
    """Every storage an op creates, with its size, and when it dies: O(1) per op (torch's MemTracker rescans all
    live storages on every op, which takes minutes for Swin-L DINO). Sizes are rounded up to 512 bytes like the
    CUDA caching allocator. Storages that existed before (parameters, buffers, inputs) are not counted."""

    def __init__(self, existing: list[torch.Tensor]) -> None:
        super().__init__()
        self.events: list[tuple[int, int]] = []  # (key, +bytes) on creation, (key, -bytes) on release
        self.keys = WeakIdKeyDictionary()
        self.next_key = 0
        # views of what already exists (`weight.t()` in every fp32 linear) are not new memory
        for t in existing:
            self.keys[t.untyped_storage()] = -1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                if st not in self.keys:
                    key, n = self.next_key, -(-st.nbytes() // 512) * 512
                    self.next_key += 1
                    self.keys[st] = key
                    self.events.append((key, n))
                    weakref.finalize(st, self.events.append, (key, -n))
        return out

    def key_of(self, t: torch.Tensor) -> int | None:
        return self.keys.get(t.untyped_storage())

    def peak(self, exclude: set[int]) -> int:
        live = peak = 0
        for key, n in self.events:
            if key not in exclude and key >= 0:
                live += n
                peak = max(peak, live)
        return peak


def trace_step(setup: Setup, fake: bool = True) -> dict[str, int]:
    """One forward + backward of the real model under fake tensors. Returns the peak bytes of everything the
    step creates except gradients (`Activation`: saved activations and temporaries together) and the peak of
    everything the step creates (`Peak`, gradients included). fake=False runs real CPU tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vtrain.models.dino.msda import auto_impl

    torch.manual_seed(0)
    if fake:
        with torch.device("meta"):
            model = build_model(setup)
    else:
        model = build_model(setup)
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    policy = cuda_autocast_policy() if setup.autocast_policy == "cuda" else contextlib.nullcontext()
    kernel = auto_impl(setup.resolved_msda_impl())
    amp = (torch.autocast("cpu", dtype={"bf16": torch.bfloat16, "fp16": torch.float16}[setup.precision])
           if setup.precision != "no" else contextlib.nullcontext())
    torch.manual_seed(0)
    with mode:
        if fake:
            model.to_empty(device="cpu")
        model.train()
        inputs = _inputs(setup, torch.device("cpu"))
        tracker = LiveBytes([*model.parameters(), *model.buffers(),
                             *(t for t in inputs.values() if isinstance(t, torch.Tensor))])
        # the policy and the kernel choice stay on in backward: checkpointed blocks recompute under them
        with tracker, policy, kernel:
            with amp:
                out = model(**inputs)
            out["loss"].float().backward()
        grads = {tracker.key_of(p.grad) for p in model.parameters() if p.grad is not None} - {None}
    return {"Activation": tracker.peak(grads), "Peak": tracker.peak(set())}


def profiled_peak(step) -> int:
    """Peak bytes the CPU allocator held while `step()` ran, from its own allocation/free events as
    torch.profiler records them (profile_memory=True); counted from zero at the start."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, n in events:
        live += n
        peak = max(peak, live)
    return peak


def allocator_peak(setup: Setup) -> int:
    """The validation reference for `trace_step`'s `Peak`, independent of it: one real step on CPU tensors,
    measured by the CPU allocator (`profiled_peak`). Peak of the bytes the step allocated, gradients included.
    (torch's MemTracker was tried first: it agrees without checkpointing, but under checkpointing reports about
    30% below the allocator, its documented attribution limit.) CPU autocast only: compare with
    autocast_policy="cpu". With msda_impl="triton" the fused op runs in the Triton interpreter
    (TRITON_INTERPRET=1), whose launchers allocate exactly what they do on a GPU."""
    from vtrain.models.dino.msda import auto_impl

    torch.manual_seed(0)
    model = build_model(setup)
    model.train()
    inputs = _inputs(setup, torch.device("cpu"))

    def step() -> None:
        with auto_impl(setup.resolved_msda_impl()):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=setup.precision == "bf16"):
                out = model(**inputs)
            out["loss"].float().backward()

    return profiled_peak(step)


@dataclass
class ModelFacts:
    trainable: int
    frozen: int
    largest_layer: int  # most parameters held directly by one module (DeepSpeed's "largest layer")
    largest_block: int  # most parameters in one FSDP2 unit (engine/fsdp.py shard_units)


def model_facts(setup: Setup) -> ModelFacts:
    """Parameter counts of the real model on the meta device (one build; checkpointing and engines do not
    change them)."""
    from vtrain.engine.fsdp import shard_units

    with torch.device("meta"):
        model = build_model(setup)
    params = list(model.parameters())
    units = shard_units(model) or [model]
    return ModelFacts(trainable=sum(p.numel() for p in params if p.requires_grad),
                      frozen=sum(p.numel() for p in params if not p.requires_grad),
                      largest_layer=max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()),
                      largest_block=max(sum(p.numel() for p in u.parameters()) for u in units))


def untraced_temporary(setup: Setup, facts: ModelFacts) -> int:
    """Temporaries no trace sees: FSDP2 gathers one block's full parameters at a time (two with prefetch) in the
    compute dtype; DeepSpeed's communication buckets, and under ZeRO-3 the gathered largest layer, as DeepSpeed's
    estimator counts it."""
    extra = 0
    if setup.fsdp:
        extra += 2 * facts.largest_block * (2 if setup.precision != "no" else 4)
    if setup.zero:
        extra += comm_buffer_bytes(setup.zero, setup.ds_buckets, setup.overlap_comm, setup.precision)
        if setup.zero == 3:
            extra += 4 * facts.largest_layer
    return extra


def estimate(setup: Setup, trace: dict[str, int] | None = None, facts: ModelFacts | None = None) -> Estimate:
    """Assemble the per-GPU estimate; the trace and the parameter counts are computed when not given."""
    facts = facts or model_facts(setup)
    trace = trace if trace is not None else trace_step(setup)
    states = model_state_bytes(facts.trainable, facts.frozen, setup.zero, setup.fsdp, setup.offload, setup.gpus,
                               setup.ds_16bit)
    notes = []
    if setup.task == "dino":
        notes.append("deformable attention traced as " + (
            "the fused Triton op (saves value, locations and weights)" if setup.resolved_msda_impl() == "triton"
            else "the PyTorch grid_sample path (keeps every sampled value)"))
    if setup.zero:
        notes.append(f"DeepSpeed buckets: reduce {setup.ds_buckets[0]:.0e}, allgather {setup.ds_buckets[1]:.0e} "
                     f"elements, overlap_comm {setup.overlap_comm}")
    return Estimate(setup=asdict(setup), params_total=facts.trainable + facts.frozen,
                    params_trainable=facts.trainable, parameters=states["parameters"],
                    gradients=states["gradients"], optimizer=states["optimizer"], activations=trace["Activation"],
                    temporary=untraced_temporary(setup, facts), overhead=CUDA_CONTEXT_BYTES,
                    cpu_offloaded=states["cpu"], notes=notes)


def max_batch_that_fits(est: Estimate, budget_bytes: int) -> int:
    """Largest micro-batch within a budget: activations scale linearly with the batch (from the traced batch),
    model states, temporaries and overhead are taken as fixed. 0 when even one sample does not fit."""
    per_sample = est.activations / est.setup["batch_size"]
    room = budget_bytes - (est.total - est.activations)
    if per_sample <= 0 or room < per_sample:
        return 0
    return int(room // per_sample)


# ---- from flags / a run config ----------------------------------------------------------------------------------
def _ds_fields(path: str) -> dict[str, Any]:
    import json
    from pathlib import Path

    from vtrain.errors import VtrainError

    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise VtrainError(f"--ds-config: cannot read {path} ({e})") from None
    z = raw.get("zero_optimization", {}) or {}
    stage = int(z.get("stage", 0))

    def size(key: str) -> float:
        v = z.get(key, DEFAULT_DS_BUCKET)
        return DEFAULT_DS_BUCKET if v == "auto" else float(v)

    off_opt = (z.get("offload_optimizer") or {}).get("device", "none") != "none"
    off_par = (z.get("offload_param") or {}).get("device", "none") != "none"
    sixteen = any(isinstance(raw.get(k), dict) and raw[k].get("enabled") is True for k in ("bf16", "fp16"))
    return {"zero": stage, "offload": "all" if off_par else ("optimizer" if off_opt else "none"),
            "ds_buckets": (size("reduce_bucket_size"), size("allgather_bucket_size")),
            "overlap_comm": bool(z.get("overlap_comm", stage == 3)), "ds_16bit": sixteen}


def parse_image_size(text: str, task: str) -> tuple[int, int]:
    from vtrain.errors import VtrainError

    parts = text.lower().replace("×", "x").split("x")
    try:
        nums = [int(p) for p in parts]
    except ValueError:
        raise VtrainError(f"--image-size: expected HxW or S, got {text!r}") from None
    if len(nums) == 1:
        s = nums[0]
        nums = [s, round(s * 1333 / 800)] if task == "dino" else [s, s]
    if len(nums) != 2 or min(nums) < 32:
        raise VtrainError(f"--image-size: expected HxW or S with sides >= 32, got {text!r}")
    return nums[0], nums[1]


def setup_from(*, model=None, task=None, batch_size=None, image_size=None, precision=None, grad_ckpt=None,
               zero=None, fsdp=None, offload=None, gpus=1, num_classes=None, config=None, ds_config=None) -> Setup:
    """A Setup from `vtrain train`'s config file (if any), then explicit flags; validated here (CLI boundary)."""
    from vtrain.config import build_config, read_yaml
    from vtrain.engine.plan import resolve_precision
    from vtrain.errors import VtrainError
    from vtrain.presets import presets_for

    s = Setup()
    if config is not None:
        cfg = build_config(None, read_yaml(config))
        s.task, s.preset, s.batch_size = cfg.task, cfg.model.preset, cfg.train.batch_size
        size = cfg.model.image_size
        s.image_size = (size, cfg.data.max_size or round(size * 1333 / 800)) if cfg.task == "dino" else (size, size)
        s.precision = resolve_precision(cfg.parallel.mixed_precision)
        s.grad_ckpt = tuple(cfg.model.grad_ckpt)
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
    if grad_ckpt is not None:
        s.grad_ckpt = tuple(p for p in grad_ckpt.split(",") if p)
    allowed = ("backbone", "encoder", "decoder") if s.task == "dino" else ("backbone",)
    bad = [p for p in s.grad_ckpt if p not in allowed]
    if bad:
        raise VtrainError(f"--grad-ckpt: unknown part {bad[0]!r} for --task {s.task}; parts: {', '.join(allowed)}")
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


def _gib(est: Estimate) -> dict[str, float]:
    keys = ("parameters", "gradients", "optimizer", "activations", "temporary", "overhead", "total", "cpu_offloaded")
    d = est.to_dict()
    return {k: round(d[k] / GiB, 3) for k in keys}


def estimate_report(setup: Setup, gpu_memory_gib: float = 24.0, compare_gc: bool = True) -> dict[str, Any]:
    """The chosen configuration, its alternatives (checkpointing choices: traced; engines and offload: the same
    trace with other model-state partitions) and the largest batch within `gpu_memory_gib`."""
    import dataclasses

    t0 = time.perf_counter()
    facts = model_facts(setup)
    traces = {tuple(setup.grad_ckpt): trace_step(setup)}
    seconds = time.perf_counter() - t0
    chosen = estimate(setup, traces[tuple(setup.grad_ckpt)], facts)
    gc_choices = [(), ("backbone",), ("backbone", "encoder")] if setup.task == "dino" else [(), ("backbone",)]
    rows = []
    if compare_gc:
        for gc in gc_choices:
            if gc == tuple(setup.grad_ckpt):
                continue
            alt = dataclasses.replace(setup, grad_ckpt=gc)
            traces[gc] = trace_step(alt)
            rows.append(("checkpointing", alt, estimate(alt, traces[gc], facts)))
    engines = [dict(zero=0, fsdp=False, offload="none"), dict(zero=1, fsdp=False, offload="none"),
               dict(zero=2, fsdp=False, offload="none"), dict(zero=3, fsdp=False, offload="none"),
               dict(zero=3, fsdp=False, offload="optimizer"), dict(zero=3, fsdp=False, offload="all"),
               dict(zero=0, fsdp=True, offload="none")]
    for kw in engines:
        alt = dataclasses.replace(setup, **kw)
        if (alt.zero, alt.fsdp, alt.offload) == (setup.zero, setup.fsdp, setup.offload):
            continue
        rows.append(("engine", alt, estimate(alt, traces[tuple(setup.grad_ckpt)], facts)))
    budget = int(gpu_memory_gib * GiB)
    return {
        "setup": dataclasses.asdict(setup),
        "params_total": chosen.params_total, "params_trainable": chosen.params_trainable,
        "estimate_gib": _gib(chosen), "notes": chosen.notes,
        "max_batch_size": max_batch_that_fits(chosen, budget), "gpu_memory_gib": gpu_memory_gib,
        "alternatives": [{"kind": kind, "label": alt.label(), **_gib(est),
                          "max_batch_size": max_batch_that_fits(est, budget)} for kind, alt, est in rows],
        "trace_seconds": round(seconds, 1),
    }
