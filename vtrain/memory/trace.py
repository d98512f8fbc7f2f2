"""The activation memory of one training step, traced without a GPU (docs/memory_ckpt.md §1; the bare § numbers
below are sections of that page).

One real forward + backward of the actual vtrain model, at the requested batch and resolution, under
FakeTensorMode (no memory, no GPU), recording every storage the step creates and frees, and which module made it
(`LiveBytes`, tracker.py); the peak of live activations and temporaries, gradients excluded (they are counted with
the model states, sizing.py). A sharded face head is traced beside the model as one rank runs it (head.py). The
model is built on `meta` and materialised with `to_empty` inside fake mode (timm's __init__ reads values, §1.3).
CPU autocast keeps layer_norm/group_norm/softmax in bf16 where CUDA autocast runs them in fp32 (§1.3);
`cuda_autocast_policy` applies CUDA's fp32 list on top of CPU autocast so the trace matches a GPU run, and SDPA with a
trainable bias goes through CUDA's memory-efficient kernel where CPU would fall back to the math kernel. DINO's
deformable attention is traced as the op a GPU run calls, the fused Triton custom op: its fake kernel's
output, the three tensors its autograd saves and the fp32 value-gradient accumulator of its backward (the
grid_sample path, which the CPU uses, keeps every sampled value: about 1.8 GB per encoder layer and image).

`allocator_peak` is the independent reference the tests hold the trace against: one real CPU step measured by
the CPU allocator.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.profiler import ProfilerActivity, profile

from vtrain.config import ModelConfig
from vtrain.data.coco import PAD_DIVISOR
from vtrain.memory.head import head_loss, sharded_head, upper_bound_shapes
from vtrain.memory.setup import Setup
from vtrain.memory.tracker import FORWARD, RECOMPUTE, LiveBytes, Recording, Row, rounded
from vtrain.models.recompute_units import recompute_units, set_hidden_recompute
from vtrain.models.dino.msda import auto_impl
from vtrain.tasks.model import build_model as build_task_model

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


def step_inputs(setup: Setup, device: torch.device) -> dict[str, torch.Tensor]:
    """The batch one training step of `setup` gets (random images, one class or `num_targets` boxes each)."""
    h, w = setup.image_size
    b = setup.batch_size
    if setup.task == "dino":
        # batches are padded to a multiple of 32 with a mask, as the data loader does
        ph, pw = -(-h // PAD_DIVISOR) * PAD_DIVISOR, -(-w // PAD_DIVISOR) * PAD_DIVISOR
        masks = torch.ones(b, ph, pw, dtype=torch.bool, device=device)
        masks[:, :h, :w] = False
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
    """The task's real model (tasks.build_model) with the Setup's checkpointing and hidden-layer choice; the face
    model without its head when the head is sharded (memory/head.py traces that head beside it)."""
    size = setup.image_size[0] if setup.task == "metric" else ModelConfig.image_size  # DINO takes any size
    m = ModelConfig(preset=setup.preset, image_size=size, grad_ckpt=list(setup.grad_ckpt),
                    ffn_recompute=setup.ffn_recompute, ffn_chunk=setup.ffn_chunk,
                    embedding_dim=setup.embedding_dim, neck_norm=setup.neck_norm, head_parallel=setup.head_parallel,
                    sample_rate=setup.sample_rate, shared_class_head=setup.shared_class_head,
                    shared_box_head=setup.shared_box_head)
    model = build_task_model(setup.task, m, setup.num_classes)
    if setup.ffn_units is not None:
        set_hidden_recompute(model, setup.ffn_units)
    return model


@contextlib.contextmanager
def one_process():
    """The traced step is one rank's step computed alone (a training run plans on rank 0 while the others wait):
    inside, torch.distributed reports no process group, so the model's collectives (DINO's box-count mean, the
    sharded head's gathers, which head.py emulates) are not called. They would wait for ranks that are not
    tracing, and fake tensors carry no data to send."""
    saved = dist.is_initialized
    dist.is_initialized = lambda: False
    try:
        yield
    finally:
        dist.is_initialized = saved


@dataclass
class StepTrace:
    """One traced training step. `activation`: peak bytes of everything the step creates except gradients
    (saved activations and temporaries together), the estimator's activation figure; `peak`: gradients included,
    as autograd makes them; `grad_of`: each gradient storage's parameter (qualified name; the sharded head's under
    `head.`), which the step's timeline places as the engine keeps them (timeline.py); `recording`: what happened,
    for the breakdown, the timeline and the planner; `units`: the model's recompute units in forward order;
    `input_bytes`: the batch."""

    activation: int
    peak: int
    grad_of: dict[int, str]
    recording: Recording
    units: list[str]
    input_bytes: int = 0

    @property
    def grads(self) -> set[int]:
        return set(self.grad_of)

    def breakdown(self) -> list[Row]:
        """Activation bytes at the peak by (module, phase), largest first; they sum to `activation`."""
        return self.recording.breakdown(self.grads)

    @property
    def forward_flops(self) -> int:
        return self.recording.flops_by(FORWARD)

    def written(self, phase: str) -> int:
        """Bytes of the storages the step made in `phase` (what memory-bound work writes)."""
        rec = self.recording
        return sum(d for k, d in rec.events if k >= 0 and d > 0 and rec.labels[rec.label_of[k]][1] == phase)

    @property
    def recompute_flops(self) -> int:
        """FLOPs run again in backward: checkpointed units and the tensors models/lean.py remakes."""
        return self.recording.flops_by(RECOMPUTE)


def trace(setup: Setup, fake: bool = True) -> StepTrace:
    """One forward + backward of the real model under fake tensors (fake=False: real CPU tensors), recorded by
    `LiveBytes`: every storage, the module that made it, the FLOPs. The process's random state is left as it
    was (a training run plans on rank 0 only, and its own random stream must not depend on that)."""
    with torch.random.fork_rng(devices=[]):
        return _trace(setup, fake)


def _trace(setup: Setup, fake: bool) -> StepTrace:
    torch.manual_seed(0)
    if fake:
        with torch.device("meta"):
            model = build_model(setup)
            head = sharded_head(setup)
    else:
        model, head = build_model(setup), sharded_head(setup)
    units = recompute_units(model)
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    policy = cuda_autocast_policy() if setup.autocast_policy == "cuda" else contextlib.nullcontext()
    kernel = auto_impl(setup.resolved_msda_impl())
    amp = (torch.autocast("cpu", dtype={"bf16": torch.bfloat16, "fp16": torch.float16}[setup.precision])
           if setup.precision != "no" else contextlib.nullcontext())
    shapes = upper_bound_shapes() if head is not None and fake else contextlib.nullcontext()
    torch.manual_seed(0)
    with mode, one_process():
        if fake:
            model.to_empty(device="cpu")
            if head is not None:
                head.to_empty(device="cpu")
        model.train()
        inputs = step_inputs(setup, torch.device("cpu"))
        existing = [*model.parameters(), *model.buffers(), *(t for t in inputs.values() if isinstance(t, torch.Tensor))]
        if head is not None:
            existing += [*head.parameters(), *head.buffers()]
        tracker = LiveBytes(existing, model, units, {"head": head} if head is not None else None,
                            granularity=setup.granularity)
        # the policy and the kernel choice stay on in backward: checkpointed blocks recompute under them
        with tracker, policy, kernel, shapes:
            with amp:
                out = model(**inputs)
                if head is not None:
                    out = head_loss(head, out["embedding"], inputs["labels"], setup.gpus)
                # before autocast's exit empties its cache of 16-bit weight copies (those no backward keeps)
                tracker.forward_end = len(tracker.events)
            loss = out["loss"].float()
            tracker.backward = True
            loss.backward()
        # the sharded head's gradient: of its weight, or with sampling of the sampled rows' own leaves
        named = [*model.named_parameters(), *(head.named_parameters("head") if head is not None else ()),
                 *((f"head.sampled.{i}", leaf) for i, (_, leaf) in enumerate(head.pending if head is not None else ()))]
        grad_of = {tracker.key_of(p.grad): name for name, p in named if p.grad is not None}
        grad_of = {k: name for k, name in grad_of.items() if k is not None and k >= 0}
        input_bytes = sum(rounded(t.untyped_storage().nbytes(), setup.granularity) for t in inputs.values()
                          if isinstance(t, torch.Tensor))
    rec = tracker.recording()
    return StepTrace(rec.live_curve(set(grad_of))[0], rec.live_curve(set())[0], grad_of, rec, list(units),
                     input_bytes)


def trace_step(setup: Setup, fake: bool = True) -> dict[str, int]:
    """The two peaks of `trace`: `Activation` (gradients excluded) and `Peak` (everything the step creates)."""
    t = trace(setup, fake)
    return {"Activation": t.activation, "Peak": t.peak}


def profiled_peak(step) -> int:
    """Peak bytes the CPU allocator held while `step()` ran, from its own allocation/free events as
    torch.profiler records them (profile_memory=True); counted from zero at the start."""
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
    torch.manual_seed(0)
    model = build_model(setup)
    model.train()
    inputs = step_inputs(setup, torch.device("cpu"))

    def step() -> None:
        with auto_impl(setup.resolved_msda_impl()):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=setup.precision == "bf16"):
                out = model(**inputs)
            out["loss"].float().backward()

    return profiled_peak(step)
