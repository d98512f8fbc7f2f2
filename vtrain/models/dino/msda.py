"""Multi-scale deformable attention (Deformable-DETR): one op with two implementations, and the module.

`ms_deform_attn(..., impl=)` is the single entry point:
- `triton`: the fused forward/backward in `msda_triton.py`, registered as the torch custom op
  `vtrain::ms_deform_attn` (fake kernel + autograd), so FakeTensorMode (`vtrain estimate-memory`),
  torch.compile and activation checkpointing all see one op that saves only value, sampling locations and
  attention weights for backward (docs/msda_kernels.md §1.4, §7.4).
- `pytorch`: one bilinear `grid_sample` per level (zeros padding, align_corners=False), as the reference
  fallbacks in docs/dino.md §3; the reference for the tests and the CPU path. It keeps every sampled value for
  backward (about 1.8 GB per encoder layer and image at 800x1333, 5 scales).
- `export`: the torch custom op `vtrain::ms_deform_attn_export`, the PyTorch path behind one opaque op with a fake
  kernel: what `vtrain export` traces (symbolic level sizes pass through it untouched, and the trace does not
  walk grid_sample's decomposition at every level), lowered to ONNX operators by msda_onnx.py (GridSample per
  level, or gathers for runtimes without GridSample). Never used in training.
- `auto`: Triton for CUDA tensors in fp32/bf16/fp16 when the kernels can run there, the PyTorch path otherwise
  (`auto_impl` changes that choice, for the memory estimator tracing a GPU run on CPU). Whether they can run is
  decided once per process, on the first CUDA call, and agreed by every rank (`_triton_usable`); a fallback is
  announced by one warning line naming the reason. `triton` never falls back: it raises.

Both compute in fp32 (fp64 for fp64 inputs in the PyTorch path) and return value's dtype, so the op needs no
fp32 island around it: sampling locations stay fp32 (coordinate math must, docs/msda_kernels.md §1.6), value and
output may be bf16.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vtrain.dist import all_true as _all_true  # module-level name: tests/models/test_msda.py stands in for the ranks' verdict
from vtrain.models.lean import autocast_input, remat, remat_in_checkpoint

IMPLS = ("auto", "triton", "pytorch", "export")
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Triton's own floor for NVIDIA GPUs, and the first architecture with bf16 arithmetic and the tiling the kernels
# were checked for (docs/msda_roofline.md §4).
MIN_CAPABILITY = (8, 0)
_auto_override: str | None = None  # what impl="auto" resolves to inside `auto_impl`
_fallback_reason: str | None = None  # None: not decided yet; "": the Triton kernels run; else why they do not
_triton_reason: str | None = None  # impl="triton" on a GPU: None unchecked, "" fine, else why it cannot run
_log = logging.getLogger(__name__)


@contextlib.contextmanager
def auto_impl(impl: str) -> Iterator[None]:
    """Make `impl="auto"` mean `impl` inside the block, on every thread (the backward of checkpointed blocks
    recomputes the forward on the autograd engine's threads). The memory estimator traces a CUDA run on fake
    CPU tensors, where `auto` would otherwise pick the PyTorch path; `vtrain export` traces the model with the
    op an ONNX graph carries (`export`) whatever the device."""
    global _auto_override
    if impl not in ("triton", "pytorch", "export"):
        raise ValueError(f"auto_impl: choose 'triton', 'pytorch' or 'export', got {impl!r}")
    saved, _auto_override = _auto_override, impl
    try:
        yield
    finally:
        _auto_override = saved


def resolve_impl(impl: str, value: Tensor, sampling_locations: Tensor, attention_weights: Tensor) -> str:
    if impl not in IMPLS:
        raise ValueError(f"ms_deform_attn: impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    supported = all(t.dtype in KERNEL_DTYPES for t in (value, sampling_locations, attention_weights))
    if impl == "auto":
        if _auto_override:
            return _auto_override
        gpu = _on_gpu(value) and supported
        return "triton" if gpu and _triton_usable(value, sampling_locations, attention_weights) else "pytorch"
    if impl == "triton" and not supported:
        raise ValueError("ms_deform_attn(impl='triton'): inputs must be fp32, bf16 or fp16, got "
                         f"{value.dtype}, {sampling_locations.dtype}, {attention_weights.dtype}")
    if impl == "triton" and _on_gpu(value):
        if _triton_reason is None:
            _check_triton(value)
        if _triton_reason:
            raise RuntimeError(f"ms_deform_attn(impl='triton'): {_triton_reason} (impl='auto' would use the PyTorch "
                               "path)")
    return impl


def ms_deform_attn(value: Tensor, spatial_shapes: Sequence[tuple[int, int]], sampling_locations: Tensor,
                   attention_weights: Tensor, impl: str = "auto") -> Tensor:
    """Deformable attention over a flattened multi-level feature map.

    value: (B, S, M, D) with S = sum(h*w) over levels, each level row-major, in level order; padded positions
      are expected to be zeroed by the caller (the op takes no mask, docs/msda_kernels.md §4.1);
    spatial_shapes: [(h, w)] per level;
    sampling_locations: (B, Q, M, L, P, 2) as (x, y) in [0, 1] of each level's (padded) map; values outside
      sample zeros;
    attention_weights: (B, Q, M, L, P), softmax-normalised over L*P by the caller.
    Returns (B, Q, M*D) in value's dtype, computed in fp32 (fp64 for fp64 inputs on the PyTorch path).
    """
    loc, attn = sampling_locations, attention_weights
    if value.dim() != 4 or loc.dim() != 6 or loc.shape[-1] != 2 or (loc.shape[0], loc.shape[2]) != \
            (value.shape[0], value.shape[2]) or attn.shape != loc.shape[:-1]:
        raise ValueError(f"ms_deform_attn: expected value (B, S, M, D), locations (B, Q, M, L, P, 2) and weights "
                         f"(B, Q, M, L, P), got {tuple(value.shape)}, {tuple(loc.shape)}, {tuple(attn.shape)}")
    # the level sizes may be symbolic (torch.export with a dynamic image size, tools/export.py): the check below
    # holds for every size, so it adds no guard, and only the Triton op needs them as plain ints
    if len(spatial_shapes) != loc.shape[3] or sum(h * w for h, w in spatial_shapes) != value.shape[1]:
        raise ValueError(f"ms_deform_attn: spatial_shapes {list(spatial_shapes)} do not match value "
                         f"{tuple(value.shape)} and {loc.shape[3]} levels of locations")
    chosen = resolve_impl(impl, value, loc, attn)
    if chosen == "triton":
        return torch.ops.vtrain.ms_deform_attn(value, [int(x) for hw in spatial_shapes for x in hw], loc, attn)
    if chosen == "export":
        return torch.ops.vtrain.ms_deform_attn_export(value, [x for hw in spatial_shapes for x in hw], loc, attn)
    return ms_deform_attn_pytorch(value, spatial_shapes, loc, attn)


def ms_deform_attn_pytorch(value: Tensor, spatial_shapes: Sequence[tuple[int, int]], sampling_locations: Tensor,
                           attention_weights: Tensor) -> Tensor:
    """The reference: one `grid_sample` per level, levels accumulated one at a time (only one level's sampled
    values alive at once), autocast off."""
    b, _, heads, dim = value.shape
    _, q, _, _, points, _ = sampling_locations.shape
    wide = any(t.dtype == torch.float64 for t in (value, sampling_locations, attention_weights))
    compute = torch.float64 if wide else torch.float32
    with torch.autocast(device_type=value.device.type, enabled=False):
        v_all = value.to(compute)
        grids = 2.0 * sampling_locations.to(compute) - 1.0  # grid_sample works in [-1, 1]
        weights = attention_weights.to(compute)
        out = v_all.new_zeros(b * heads, dim, q)
        start = 0
        for lvl, (h, w) in enumerate(spatial_shapes):
            # (B, h*w, M, D) -> (B*M, D, h, w)
            v = v_all[:, start:start + h * w].permute(0, 2, 3, 1).reshape(b * heads, dim, h, w)
            start += h * w
            g = grids[:, :, :, lvl].transpose(1, 2).reshape(b * heads, q, points, 2)
            sampled = F.grid_sample(v, g, mode="bilinear", padding_mode="zeros", align_corners=False)  # (BM, D, Q, P)
            wl = weights[:, :, :, lvl].transpose(1, 2).reshape(b * heads, 1, q, points)
            out = out + (sampled * wl).sum(-1)
        return out.view(b, heads * dim, q).transpose(1, 2).contiguous().to(value.dtype)


# ---- impl="auto" on a GPU: can the Triton kernels run here? -------------------------------------------------------
def _on_gpu(t: Tensor) -> bool:
    return t.device.type == "cuda"


def _gpu_capability(t: Tensor) -> tuple[int, int]:
    return torch.cuda.get_device_capability(t.device)


def _import_reason() -> str | None:
    try:
        from vtrain.models.dino import msda_triton  # noqa: F401  (triton itself, and the kernels' decoration)
    except Exception as e:  # ImportError, or a triton that fails while importing
        return f"Triton is not importable ({type(e).__name__}: {e})"
    return None


def _capability_reason(value: Tensor) -> str | None:
    cap = _gpu_capability(value)
    if tuple(cap) < MIN_CAPABILITY:
        return (f"the GPU has compute capability {cap[0]}.{cap[1]}, the Triton kernels need "
                f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer")
    return None


def _launch_reason(value: Tensor, loc: Tensor, attn: Tensor) -> str | None:
    """One tiny forward and backward through the custom ops with this call's dtypes, heads, channels, levels and
    points: it compiles the kernel variants the run will launch (Triton caches them) and surfaces compile and
    launch errors here, synchronised, rather than in the middle of a step."""
    _, _, m, d = value.shape
    levels, points = loc.shape[3], loc.shape[4]
    like = {"device": value.device}
    try:
        with torch.no_grad():
            v = torch.zeros(1, 4 * levels, m, d, dtype=value.dtype, **like)
            lc = torch.full((1, 1, m, levels, points, 2), 0.5, dtype=loc.dtype, **like)
            a = torch.full((1, 1, m, levels, points), 1.0 / (levels * points), dtype=attn.dtype, **like)
            out = torch.ops.vtrain.ms_deform_attn(v, [2, 2] * levels, lc, a)
            torch.ops.vtrain.ms_deform_attn_backward(torch.ones_like(out), v, [2, 2] * levels, lc, a)
            if value.device.type == "cuda":
                torch.cuda.synchronize(value.device)
    except Exception as e:  # triton's CompilationError, an out-of-resources launch, a driver error...
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return f"compiling or launching the Triton kernels failed ({type(e).__name__}: {first})"
    return None


@torch.compiler.disable
def _check_triton(value: Tensor) -> None:
    """impl="triton" on a GPU: the import and the capability, checked once per process (a failure raises)."""
    global _triton_reason
    _triton_reason = _import_reason() or _capability_reason(value) or ""


def _triton_usable(value: Tensor, loc: Tensor, attn: Tensor) -> bool:
    """Whether impl="auto" runs the Triton kernels: decided on the first call (`_decide`) and kept for the process.
    After that a plain read of a module global, which torch.compile folds into its graph without a break."""
    if _fallback_reason is None:
        _decide(value, loc, attn)
    return _fallback_reason == ""


@torch.compiler.disable  # run eagerly, on real tensors: never traced into a compiled graph
def _decide(value: Tensor, loc: Tensor, attn: Tensor) -> None:
    """Reasons not to run the kernels, checked in order: Triton is not importable, the GPU is older than
    MIN_CAPABILITY, the first compile and launch fail. Every rank takes part in one MIN all-reduce of its verdict
    before any rank uses the kernels, so all ranks run the same implementation (one falling back alone would
    run different code, with different memory). A fallback is announced with one warning line naming the
    reason."""
    global _fallback_reason
    from torch._subclasses.fake_tensor import is_fake

    if _fallback_reason is not None or is_fake(value):
        return  # decided already, or traced under FakeTensorMode (nothing runs): decide on a real call
    reason = _import_reason() or _capability_reason(value) or _launch_reason(value, loc, attn)
    if not _all_true(reason is None, value.device) and reason is None:
        reason = "the Triton kernels cannot run on another rank of this job"
    _fallback_reason = reason or ""
    if reason:
        _log.warning("ms_deform_attn(impl='auto') falls back to the PyTorch path for this run: %s", reason)


# ---- the custom op (Triton kernels behind it) -------------------------------------------------------------------
# spatial_shapes travel as a flat [h0, w0, h1, w1, ...] int list: the kernels read them from a small device
# table at run time, so a new batch shape recompiles nothing.
@torch.library.custom_op("vtrain::ms_deform_attn", mutates_args=())
def _op(value: Tensor, spatial_shapes: list[int], sampling_locations: Tensor, attention_weights: Tensor) -> Tensor:
    from vtrain.models.dino import msda_triton  # imported on first use: TRITON_INTERPRET is read at import

    return msda_triton.forward(value, spatial_shapes, sampling_locations, attention_weights)


@_op.register_fake
def _op_fake(value, spatial_shapes, sampling_locations, attention_weights):
    b, _, m, d = value.shape
    return value.new_empty(b, sampling_locations.shape[1], m * d)


@torch.library.custom_op("vtrain::ms_deform_attn_backward", mutates_args=())
def _op_backward(grad_out: Tensor, value: Tensor, spatial_shapes: list[int], sampling_locations: Tensor,
                 attention_weights: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of value (fp32, the atomic-add accumulator), locations and weights (their own dtypes)."""
    from vtrain.models.dino import msda_triton

    return msda_triton.backward(grad_out, value, spatial_shapes, sampling_locations, attention_weights)


@_op_backward.register_fake
def _op_backward_fake(grad_out, value, spatial_shapes, sampling_locations, attention_weights):
    return (value.new_empty(value.shape, dtype=torch.float32), sampling_locations.new_empty(sampling_locations.shape),
            attention_weights.new_empty(attention_weights.shape))


def _setup_context(ctx, inputs, output) -> None:
    value, spatial_shapes, sampling_locations, attention_weights = inputs
    ctx.save_for_backward(value, sampling_locations, attention_weights)  # the samples are recomputed
    ctx.spatial_shapes = spatial_shapes


def _backward(ctx, grad_out: Tensor):
    value, loc, attn = ctx.saved_tensors
    grad_value, grad_loc, grad_attn = torch.ops.vtrain.ms_deform_attn_backward(grad_out, value, ctx.spatial_shapes,
                                                                               loc, attn)
    # the fp32 accumulator is freed as soon as it is cast (a transient B*S*M*D*4 bytes at the backward's peak)
    return grad_value.to(value.dtype), None, grad_loc, grad_attn


_op.register_autograd(_backward, setup_context=_setup_context)


def _level_sizes(spatial_shapes: Sequence[tuple[int, int]], device: torch.device) -> Tensor:
    """(L, 2) fp32 (w, h) of each level. Symbolic sizes (torch.export with a dynamic image size) are made into
    tensors in the graph rather than read as constants (`torch.tensor` would bake the traced sizes in)."""
    if all(isinstance(x, int) for hw in spatial_shapes for x in hw):
        return torch.tensor([[w, h] for h, w in spatial_shapes], dtype=torch.float32, device=device)
    return torch.stack([torch.stack([torch.full((), w, dtype=torch.float32, device=device),
                                     torch.full((), h, dtype=torch.float32, device=device)])
                        for h, w in spatial_shapes])


# ---- the op an exported graph carries (tools/export_detection.py lowers it with msda_onnx.py) -------------------
# spatial_shapes is a SymInt[]: the sizes of a dynamic export stay symbolic
@torch.library.custom_op("vtrain::ms_deform_attn_export", mutates_args=())
def _export_op(value: Tensor, spatial_shapes: list[int], sampling_locations: Tensor,
               attention_weights: Tensor) -> Tensor:
    return ms_deform_attn_pytorch(value, list(zip(spatial_shapes[0::2], spatial_shapes[1::2])), sampling_locations,
                                  attention_weights)


@_export_op.register_fake
def _export_op_fake(value, spatial_shapes, sampling_locations, attention_weights):
    b, _, m, d = value.shape
    return value.new_empty(b, sampling_locations.shape[1], m * d)


# ---- the module ------------------------------------------------------------------------------------------------
HEAD_CHUNK = 4  # heads sampled per call of the op (MSDeformAttn.forward)


def _sample(value: Tensor, spatial_shapes: list[tuple[int, int]], loc: Tensor, weights: Tensor) -> Tensor:
    return ms_deform_attn(value, spatial_shapes, loc, weights)


def _query_copy(query: Tensor, query_pos: Tensor | Callable[[], Tensor] | None) -> Tensor:
    """The query (plus its positions) as both projections take it: one 16-bit copy for the two (lean.py)."""
    if query_pos is not None:
        query = query + (query_pos() if callable(query_pos) else query_pos)
    return autocast_input(query)


class MSDeformAttn(nn.Module):
    """Sampling offsets and weights predicted from the query; values projected from the flattened memory.

    reference_points: (B, Q, L, 2) normalised centres (encoder), or (B, Q, L, 4) boxes (decoder), where the
    offsets are scaled by half the box size per point (Deformable-DETR / DINO decoder).

    Precision: the projections run in the compute dtype (bf16 under autocast), the attention weights are a
    fp32 softmax, the sampling locations are fp32 (fp32 reference points + offsets: a bf16 location is off by
    whole pixels on large levels, docs/msda_kernels.md §1.6), and the op returns value's dtype."""

    def __init__(self, dim: int = 256, levels: int = 4, heads: int = 8, points: int = 4) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} not divisible by heads {heads}")
        self.dim, self.levels, self.heads, self.points = dim, levels, heads, points
        self.sampling_offsets = nn.Linear(dim, heads * levels * points * 2)
        self.attention_weights = nn.Linear(dim, heads * levels * points)
        self.value_proj = nn.Linear(dim, dim)
        self.output_proj = nn.Linear(dim, dim)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Deformable-DETR init: offsets start on a ring of directions, k-th point k steps out; uniform weights.
        nn.init.constant_(self.sampling_offsets.weight, 0.0)
        theta = torch.arange(self.heads, dtype=torch.float32) * (2.0 * math.pi / self.heads)
        grid = torch.stack([theta.cos(), theta.sin()], -1)
        grid = (grid / grid.abs().max(-1, keepdim=True)[0]).view(self.heads, 1, 1, 2)
        grid = grid.repeat(1, self.levels, self.points, 1)
        grid = grid * torch.arange(1, self.points + 1, dtype=torch.float32).view(1, 1, -1, 1)
        with torch.no_grad():
            self.sampling_offsets.bias.copy_(grid.reshape(-1))
        nn.init.constant_(self.attention_weights.weight, 0.0)
        nn.init.constant_(self.attention_weights.bias, 0.0)
        nn.init.xavier_uniform_(self.value_proj.weight)
        nn.init.constant_(self.value_proj.bias, 0.0)
        nn.init.xavier_uniform_(self.output_proj.weight)
        nn.init.constant_(self.output_proj.bias, 0.0)

    def forward(self, query: Tensor, reference_points: Tensor, value: Tensor, spatial_shapes: list[tuple[int, int]],
                padding_mask: Tensor | None = None, query_pos: Tensor | Callable[[], Tensor] | None = None) -> Tensor:
        """`query_pos` is added to the query for the offsets and weights: a tensor, or a function that makes it (the
        encoder's positions, made where needed instead of kept)."""
        b, q, _ = query.shape
        s = value.shape[1]
        # inside a checkpointed layer, whose recomputation keeps the layer's input anyway, the 16-bit copies the
        # projections keep for their weight gradients are made again from it (lean.py)
        v = remat_in_checkpoint(self.value_proj, (autocast_input, (value,)))
        if padding_mask is not None:
            v = v.masked_fill(padding_mask[..., None], 0.0)
        # the sampling runs HEAD_CHUNK heads at a time: heads sample their own channels only, so each output and
        # gradient element is computed as before, and its fp32 locations, weights and their gradients exist a chunk
        # at a time (inside a checkpointed encoder layer they were the peak of its backward). Not where the
        # reference points take a gradient (DINO's never do): theirs would sum the heads in two parts.
        chunk = self.heads if reference_points.requires_grad else HEAD_CHUNK
        v = v.view(b, s, self.heads, self.dim // self.heads).split(chunk, 2)
        v = [part.contiguous() for part in v] if len(v) > 1 else v
        offsets, logits = remat_in_checkpoint(self._project, (_query_copy, (query, query_pos)))
        ref = reference_points.float()
        if ref.shape[-1] not in (2, 4):
            raise ValueError(f"reference_points must end in 2 or 4 values, got {tuple(ref.shape)}")
        # the op keeps the fp32 locations and weights for backward; they are made again there from the 16-bit
        # offsets and logits (half the bytes), the same ops on the same tensors (lean.py)
        outs = [remat(functools.partial(_sample, vh, spatial_shapes), (self._locations, (ref, off, spatial_shapes)),
                      (self._weights, (lg,)))
                for vh, off, lg in zip(v, offsets.split(chunk, 2), logits.split(chunk, 2))]
        del v
        out = outs[0] if len(outs) == 1 else torch.cat(outs, -1)
        del outs
        # out is in v's dtype, which is what output_proj computes in (autocast's dtype, or its own weights')
        return self.output_proj(out)

    def _project(self, query: Tensor) -> tuple[Tensor, Tensor]:
        b, q = query.shape[:2]
        return (self.sampling_offsets(query).view(b, q, self.heads, self.levels, self.points, 2),
                self.attention_weights(query).view(b, q, self.heads, self.levels * self.points))

    def _weights(self, logits: Tensor) -> Tensor:
        b, q = logits.shape[:2]
        return logits.float().softmax(-1).view(b, q, logits.shape[2], self.levels, self.points)

    def _locations(self, ref: Tensor, offsets: Tensor, spatial_shapes: list[tuple[int, int]]) -> Tensor:
        # fp32 reference points promote the (possibly bf16) offsets: the locations are fp32 without a copy
        if ref.shape[-1] == 2:
            # offsets are in pixels of each level: normalise by (w, h)
            norm = _level_sizes(spatial_shapes, ref.device)
            return ref[:, :, None, :, None, :] + offsets / norm[None, None, None, :, None, :]
        return ref[:, :, None, :, None, :2] + offsets / self.points * ref[:, :, None, :, None, 2:] * 0.5
