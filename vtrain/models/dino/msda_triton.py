"""Triton forward and backward of multi-scale deformable attention (the kernels behind `vtrain::ms_deform_attn`).

Only `msda.py` calls this module, through the custom op; it is imported on the op's first real call, so that
`TRITON_INTERPRET=1` (CPU tensors, the tests) can be set before the kernels below are decorated.

Design (docs/msda_kernels.md §7, H100 in mind; the bare § numbers below are sections of that page):
- One program per tile of BLOCK_Q queries x all D channels of one (batch, head). A corner gather is then one
  contiguous row of D values per query (64 B in bf16 at D = 32). Levels and points are constexpr loops; the
  level shapes (H_l, W_l, start_l) are read at run time from a small int32 tensor, so a new batch shape does not
  recompile anything (§4.2: shapes change every step with multi-scale training).
- Coordinate math and every sum are fp32 whatever the input dtypes (§1.6: a bf16 pixel coordinate is off by
  whole pixels on a 334-wide level).
- Sampling convention of the PyTorch reference (grid_sample, bilinear, zeros padding, align_corners=False):
  pixel coordinate loc * size - 0.5, four corners masked one by one. There is no whole-sample skip as in the
  Deformable-DETR CUDA op (§1.2), so even a point exactly one pixel outside the map gets grid_sample's one-sided
  gradient.
- Backward recomputes the bilinear samples from (value, locations, weights). The location and weight gradients
  are reductions over D inside one program (no shared memory, no barriers); the value gradient is a scatter,
  done with fp32 atomic adds into a zeroed fp32 buffer (§7.3) that the caller casts to value's dtype.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.standard import _sum_combine

# Elements of the [BLOCK_Q, BLOCK_D] fp32 tile per program. The backward keeps five tiles alive (grad_out and
# four corners) against the forward's two, hence the smaller tile. Not tuned on a GPU yet (no GPU was
# available when this was written); `benchmarks/msda_op.py --sweep` measures the alternatives.
FWD_TILE = 4096
BWD_TILE = 2048
NUM_WARPS = 4


@triton.jit
def _row_sum(x):
    # tl.reduce with triton's own sum combiner is tl.sum; tl.sum itself (like tl.zeros) is a @triton.jit function
    # of triton's library, compiled or interpreted as TRITON_INTERPRET was when triton was first imported (torch
    # imports it early), while this builtin follows the kernel's own mode. The interpreter runs this combiner as
    # one numpy sum (any other combiner would be called element by element).
    return tl.reduce(x, 1, _sum_combine)


@triton.jit
def _tile(Q, M, D, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's tile: batch b and head m, the flat (query, head) rows of its BLOCK_Q queries, the D channel
    indices, their masks, and M * D (the stride of one value or output row)."""
    pid_bm = tl.program_id(1)
    b = (pid_bm // M).to(tl.int64)  # the batch offset in 64 bits; offsets inside one image fit in 32
    m = pid_bm % M
    q = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    d = tl.arange(0, BLOCK_D)
    return b, m, q * M + m, q < Q, d, d < D, M * D


@triton.jit
def _level(meta_ptr, lvl):
    """(H, W, start) of one level from the int32 level table (see `level_table`)."""
    return tl.load(meta_ptr + 3 * lvl), tl.load(meta_ptr + 3 * lvl + 1), tl.load(meta_ptr + 3 * lvl + 2)


@triton.jit
def _corners(v_base, loc_ptr, attn_ptr, k, qmask, h, w, start, MD, d, dmask):
    """The bilinear gather of one (level, point) for a row of queries, shared by forward and backward: its
    attention weight, the bilinear fractions in fp32 pixel coordinates (align_corners=False: loc * size - 0.5),
    the offset of the top-left corner's D channels from the (batch, head) base of value (the other corners are
    +MD, +w*MD, +(w+1)*MD), the four corner masks (a corner outside the map reads as zero) and the four corner
    rows of value in fp32, in the order top-left, top-right, bottom-left, bottom-right."""
    hf = h.to(tl.float32)
    wf = w.to(tl.float32)
    lx = tl.load(loc_ptr + 2 * k, mask=qmask, other=0.0).to(tl.float32)
    ly = tl.load(loc_ptr + 2 * k + 1, mask=qmask, other=0.0).to(tl.float32)
    a = tl.load(attn_ptr + k, mask=qmask, other=0.0).to(tl.float32)
    # Clamping to [-2, size + 1] changes nothing (every corner of a point further out is outside the map and
    # contributes zero) but keeps the float -> int conversion and the offsets defined for wild locations.
    x = tl.minimum(tl.maximum(lx * wf - 0.5, -2.0), wf + 1.0)
    y = tl.minimum(tl.maximum(ly * hf - 0.5, -2.0), hf + 1.0)
    x0f = tl.floor(x)
    y0f = tl.floor(y)
    x0 = x0f.to(tl.int32)
    y0 = y0f.to(tl.int32)
    in_x0 = (x0 >= 0) & (x0 < w)
    in_x1 = (x0 >= -1) & (x0 < w - 1)
    in_y0 = qmask & (y0 >= 0) & (y0 < h)
    in_y1 = qmask & (y0 >= -1) & (y0 < h - 1)
    off = ((start + y0 * w + x0) * MD)[:, None] + d[None, :]
    dm = dmask[None, :]
    m00 = (in_y0 & in_x0)[:, None] & dm
    m10 = (in_y0 & in_x1)[:, None] & dm
    m01 = (in_y1 & in_x0)[:, None] & dm
    m11 = (in_y1 & in_x1)[:, None] & dm
    p00 = v_base + off
    v00 = tl.load(p00, mask=m00, other=0.0).to(tl.float32)
    v10 = tl.load(p00 + MD, mask=m10, other=0.0).to(tl.float32)
    v01 = tl.load(p00 + w * MD, mask=m01, other=0.0).to(tl.float32)
    v11 = tl.load(p00 + (w + 1) * MD, mask=m11, other=0.0).to(tl.float32)
    return a, x - x0f, y - y0f, off, m00, m10, m01, m11, v00, v10, v01, v11


@triton.jit
def _fwd_kernel(value_ptr, meta_ptr, loc_ptr, attn_ptr, out_ptr, Q, S, M, D,
                L: tl.constexpr, P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr):
    b, m, row, qmask, d, dmask, MD = _tile(Q, M, D, BLOCK_Q, BLOCK_D)
    v_base = value_ptr + b * S * MD + m * D
    loc_base = loc_ptr + b * Q * M * L * P * 2
    attn_base = attn_ptr + b * Q * M * L * P
    acc = tl.full([BLOCK_Q, BLOCK_D], 0.0, tl.float32)
    for lvl in tl.static_range(L):
        h, w, start = _level(meta_ptr, lvl)
        for p in tl.static_range(P):
            k = (row * L + lvl) * P + p
            a, fx, fy, _, _, _, _, _, v00, v10, v01, v11 = _corners(v_base, loc_base, attn_base, k, qmask, h, w,
                                                                    start, MD, d, dmask)
            gx = 1.0 - fx
            top = gx[:, None] * v00 + fx[:, None] * v10
            bottom = gx[:, None] * v01 + fx[:, None] * v11
            acc += (a * (1.0 - fy))[:, None] * top + (a * fy)[:, None] * bottom
    out_ptrs = out_ptr + b * Q * MD + row[:, None] * D + d[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=qmask[:, None] & dmask[None, :])


@triton.jit
def _bwd_kernel(grad_out_ptr, value_ptr, meta_ptr, loc_ptr, attn_ptr, grad_value_ptr, grad_loc_ptr,
                grad_attn_ptr, Q, S, M, D,
                L: tl.constexpr, P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr):
    b, m, row, qmask, d, dmask, MD = _tile(Q, M, D, BLOCK_Q, BLOCK_D)
    v_base = value_ptr + b * S * MD + m * D
    gv_base = grad_value_ptr + b * S * MD + m * D
    loc_base = loc_ptr + b * Q * M * L * P * 2
    attn_base = attn_ptr + b * Q * M * L * P
    gloc_base = grad_loc_ptr + b * Q * M * L * P * 2
    gattn_base = grad_attn_ptr + b * Q * M * L * P
    g = tl.load(grad_out_ptr + b * Q * MD + row[:, None] * D + d[None, :], mask=qmask[:, None] & dmask[None, :],
                other=0.0).to(tl.float32)
    for lvl in tl.static_range(L):
        h, w, start = _level(meta_ptr, lvl)
        for p in tl.static_range(P):
            k = (row * L + lvl) * P + p
            a, fx, fy, off, m00, m10, m01, m11, v00, v10, v01, v11 = _corners(v_base, loc_base, attn_base, k, qmask,
                                                                              h, w, start, MD, d, dmask)
            gx = 1.0 - fx
            gy = 1.0 - fy
            top = gx[:, None] * v00 + fx[:, None] * v10
            bottom = gx[:, None] * v01 + fx[:, None] * v11
            # d out / d weight = the bilinear sample; d out / d pixel-x and -y are the weighted differences
            # of the corners; d loc = d pixel * size (pixel = loc * size - 0.5). One program owns these
            # outputs: reductions over D in registers, plain stores.
            sample = gy[:, None] * top + fy[:, None] * bottom
            dx = gy[:, None] * (v10 - v00) + fy[:, None] * (v11 - v01)
            dy = bottom - top
            tl.store(gattn_base + k, _row_sum(g * sample).to(grad_attn_ptr.dtype.element_ty), mask=qmask)
            tl.store(gloc_base + 2 * k, (a * _row_sum(g * dx) * w.to(tl.float32))
                     .to(grad_loc_ptr.dtype.element_ty), mask=qmask)
            tl.store(gloc_base + 2 * k + 1, (a * _row_sum(g * dy) * h.to(tl.float32))
                     .to(grad_loc_ptr.dtype.element_ty), mask=qmask)
            # many (query, point) pairs hit the same pixel: scatter with atomics into the fp32 buffer
            # (docs/msda_kernels.md §7.3)
            ag0 = (a * gy)[:, None] * g
            ag1 = (a * fy)[:, None] * g
            q00 = gv_base + off
            tl.atomic_add(q00, gx[:, None] * ag0, mask=m00, sem="relaxed")
            tl.atomic_add(q00 + MD, fx[:, None] * ag0, mask=m10, sem="relaxed")
            tl.atomic_add(q00 + w * MD, gx[:, None] * ag1, mask=m01, sem="relaxed")
            tl.atomic_add(q00 + (w + 1) * MD, fx[:, None] * ag1, mask=m11, sem="relaxed")


# ---- launchers ----------------------------------------------------------------------------------------------
def _interpreting() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_fwd_kernel, InterpretedFunction)


def _check_device(t: torch.Tensor) -> None:
    if t.device.type == "cpu" and not _interpreting():
        raise RuntimeError("ms_deform_attn(impl='triton') on CPU tensors needs the Triton interpreter: set "
                           "TRITON_INTERPRET=1 before the first call (or use impl='pytorch')")


@functools.lru_cache(maxsize=32)
def level_table(shapes: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """(H, W, start) per level as int32 on the device. Cached: within a step every layer has the same shapes,
    so the host-to-device copy (a stream sync) happens once per new batch shape, not once per layer."""
    rows, start = [], 0
    for h, w in zip(shapes[0::2], shapes[1::2]):
        rows += [h, w, start]
        start += h * w
    return torch.tensor(rows, dtype=torch.int32, device=device)


def _blocks(q: int, d: int, tile: int) -> tuple[int, int]:
    block_d = triton.next_power_of_2(d)
    block_q = max(1, min(128, tile // block_d))
    if _interpreting():
        # the interpreter runs programs one after another: fewer, larger ones are faster
        block_q = max(block_q, min(256, triton.next_power_of_2(q)))
    return block_q, block_d


def _check_sizes(value: torch.Tensor, loc: torch.Tensor) -> None:
    _, s, m, d = value.shape
    _, q, _, lvls, pts, _ = loc.shape
    if s * m * d >= 2**31 or q * m * lvls * pts * 2 >= 2**31:
        raise ValueError("ms_deform_attn: one image's value or locations exceed 2^31 elements (32-bit offsets)")


def empty_output(shape, dtype, device) -> torch.Tensor:
    """Outputs every element of which the kernels write (the tests replace this to poison them)."""
    return torch.empty(shape, dtype=dtype, device=device)


def forward(value: torch.Tensor, shapes: list[int], loc: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """value (B, S, M, D), shapes [h0, w0, h1, w1, ...], loc (B, Q, M, L, P, 2), attn (B, Q, M, L, P)
    -> (B, Q, M * D) in value's dtype."""
    _check_device(value)
    value, loc, attn = value.contiguous(), loc.contiguous(), attn.contiguous()
    _check_sizes(value, loc)
    b, s, m, d = value.shape
    _, q, _, lvls, pts, _ = loc.shape
    out = empty_output((b, q, m * d), value.dtype, value.device)
    if out.numel() == 0:
        return out
    block_q, block_d = _blocks(q, d, FWD_TILE)
    grid = (triton.cdiv(q, block_q), b * m)
    _fwd_kernel[grid](value, level_table(tuple(shapes), value.device), loc, attn, out, q, s, m, d,
                      L=lvls, P=pts, BLOCK_Q=block_q, BLOCK_D=block_d, num_warps=NUM_WARPS)
    return out


def backward(grad_out: torch.Tensor, value: torch.Tensor, shapes: list[int], loc: torch.Tensor,
             attn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients for value (fp32: the atomic-add accumulator), locations and weights (in their dtypes)."""
    _check_device(value)
    grad_out, value = grad_out.contiguous(), value.contiguous()
    loc, attn = loc.contiguous(), attn.contiguous()
    b, s, m, d = value.shape
    _, q, _, lvls, pts, _ = loc.shape
    grad_value = torch.zeros(value.shape, dtype=torch.float32, device=value.device)
    grad_loc = empty_output(loc.shape, loc.dtype, loc.device)
    grad_attn = empty_output(attn.shape, attn.dtype, attn.device)
    if grad_loc.numel() == 0:
        return grad_value, grad_loc, grad_attn
    block_q, block_d = _blocks(q, d, BWD_TILE)
    grid = (triton.cdiv(q, block_q), b * m)
    _bwd_kernel[grid](grad_out, value, level_table(tuple(shapes), value.device), loc, attn, grad_value, grad_loc,
                      grad_attn, q, s, m, d, L=lvls, P=pts, BLOCK_Q=block_q, BLOCK_D=block_d,
                      num_warps=NUM_WARPS)
    return grad_value, grad_loc, grad_attn
