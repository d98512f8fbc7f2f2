"""Triton forward and backward of multi-scale deformable attention (the kernels behind `vtrain::ms_deform_attn`).

Only `msda.py` calls this module, through the custom op; it is imported on the op's first real call, so that
`TRITON_INTERPRET=1` (CPU tensors, the tests) can be set before the kernels below are decorated.

Design (docs/msda_kernels.md §7; the bare § numbers below are sections of that page; the tiling and its
machine-code figures: docs/msda_roofline.md §3):
- One program per tile of BLOCK_Q queries x all D channels of one (batch, head); each thread holds a few
  consecutive channels of one query, so a warp gathers whole corner rows (64 B in bf16 at D = 32) of several
  queries per load. `launch_config` chooses the tile. Levels and points are run-time loops (one (level, point)
  per iteration, not unrolled): that keeps the kernels under 64 registers without spills, i.e. at least half of
  the SM's warp slots resident to hide the gathers' latency. The level shapes (H_l, W_l, start_l) are read at
  run time from a small int32 tensor, so a new batch shape does not recompile anything (§4.2: shapes change
  every step with multi-scale training).
- Coordinate math and every sum are fp32 whatever the input dtypes (§1.6: a bf16 pixel coordinate is off by
  whole pixels on a 334-wide level).
- Sampling convention of the PyTorch reference (grid_sample, bilinear, zeros padding, align_corners=False):
  pixel coordinate loc * size - 0.5, four corners masked one by one. There is no whole-sample skip as in the
  Deformable-DETR CUDA op (§1.2), so even a point exactly one pixel outside the map gets grid_sample's one-sided
  gradient.
- Backward recomputes the bilinear samples from (value, locations, weights). The location and weight gradients
  come from four reductions over D per point (registers and warp shuffles, no shared memory, no barriers); the
  value gradient is a scatter, done with fp32 atomic adds into a zeroed fp32 buffer (§7.3) that the caller casts
  to value's dtype.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.standard import _sum_combine


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
    the offset of the top-left corner's row of value from the (batch, head) base (the other corners are +MD,
    +w*MD, +(w+1)*MD), the four corner row masks (a corner outside the map reads as zero) and the four corner
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
    off = (start + y0 * w + x0) * MD
    r00 = in_y0 & in_x0
    r10 = in_y0 & in_x1
    r01 = in_y1 & in_x0
    r11 = in_y1 & in_x1
    p00 = v_base + off[:, None] + d[None, :]
    dm = dmask[None, :]
    v00 = tl.load(p00, mask=r00[:, None] & dm, other=0.0).to(tl.float32)
    v10 = tl.load(p00 + MD, mask=r10[:, None] & dm, other=0.0).to(tl.float32)
    v01 = tl.load(p00 + w * MD, mask=r01[:, None] & dm, other=0.0).to(tl.float32)
    v11 = tl.load(p00 + (w + 1) * MD, mask=r11[:, None] & dm, other=0.0).to(tl.float32)
    return a, x - x0f, y - y0f, off, r00, r10, r01, r11, v00, v10, v01, v11


@triton.jit
def _quarters(x, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr):
    """Columns 4t, 4t + 1, 4t + 2, 4t + 3 of a [BLOCK_Q, BLOCK_D] tile as four [BLOCK_Q, BLOCK_D // 4] tiles. Each
    thread holds 4 consecutive channels, so no data moves between threads."""
    even, odd = tl.split(tl.reshape(x, [BLOCK_Q, BLOCK_D // 4, 2, 2]))  # channel 4t + 2i + j at [:, t, i, j]
    x0, x2 = tl.split(even)
    x1, x3 = tl.split(odd)
    return x0, x1, x2, x3


@triton.jit
def _scatter(base, off, wgt, rmask, g, g4, d, D, BLOCK_D: tl.constexpr, SPLIT_RED: tl.constexpr):
    """grad_value[rows off] += wgt * g for one corner, with atomics. The tile holds 4 consecutive channels per
    thread: on sm_90 one 16-byte vector reduction. Before sm_90 fp32 atomics are scalar and Triton would move
    the tile through shared memory into one channel per thread (registers and barriers, docs/msda_roofline.md
    §3); SPLIT_RED instead adds the four quarters of g (`_quarters`, split once before the loop) with scalar
    atomics, each thread on its own 4 channels."""
    if SPLIT_RED:
        g0, g1, g2, g3 = g4
        t = tl.arange(0, BLOCK_D // 4) * 4
        rows = base + off[:, None]
        rm = rmask[:, None]
        w = wgt[:, None]
        tl.atomic_add(rows + t[None, :], w * g0, mask=rm & (t < D)[None, :], sem="relaxed")
        tl.atomic_add(rows + (t + 1)[None, :], w * g1, mask=rm & (t + 1 < D)[None, :], sem="relaxed")
        tl.atomic_add(rows + (t + 2)[None, :], w * g2, mask=rm & (t + 2 < D)[None, :], sem="relaxed")
        tl.atomic_add(rows + (t + 3)[None, :], w * g3, mask=rm & (t + 3 < D)[None, :], sem="relaxed")
    else:
        tl.atomic_add(base + off[:, None] + d[None, :], wgt[:, None] * g, mask=rmask[:, None] & (d < D)[None, :],
                      sem="relaxed")


@triton.jit
def _put(rows_ptr, j, first, second, qmask, BLOCK_D: tl.constexpr, PAIR: tl.constexpr):
    """rows_ptr[q][j] = first[q] (and rows_ptr[q][j + 1] = second[q] if PAIR; j even): per-query values (reductions
    over D, replicated over the threads of their row) stored from the tile's own layout. A 1-D store would make
    Triton move them through shared memory into a 1-D store layout, with barriers, at every point; here the
    pointers form a [BLOCK_Q, BLOCK_D] tile contiguous along D, like the tile itself, and only the elements at
    columns j (and j + 1) are stored."""
    c = tl.arange(0, BLOCK_D)
    chunk = (j // BLOCK_D) * BLOCK_D  # BLOCK_D is even: j and j + 1 share a chunk
    at_first = c[None, :] == j - chunk
    if PAIR:
        at = at_first | (c[None, :] == j + 1 - chunk)
    else:
        at = at_first
    vals = tl.where(at_first, first[:, None], second[:, None])
    tl.store(rows_ptr[:, None] + chunk + c[None, :], vals.to(rows_ptr.dtype.element_ty), mask=qmask[:, None] & at)


# Q and S change with every batch shape and are only compared and multiplied: specialising on their
# divisibility by 16 would compile up to four variants of each kernel for nothing.
@triton.jit(do_not_specialize=["Q", "S"])
def _fwd_kernel(value_ptr, meta_ptr, loc_ptr, attn_ptr, out_ptr, Q, S, M, D,
                L: tl.constexpr, P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr):
    b, m, row, qmask, d, dmask, MD = _tile(Q, M, D, BLOCK_Q, BLOCK_D)
    v_base = value_ptr + b * S * MD + m * D
    loc_base = loc_ptr + b * Q * M * L * P * 2
    attn_base = attn_ptr + b * Q * M * L * P
    acc = tl.full([BLOCK_Q, BLOCK_D], 0.0, tl.float32)
    # Run-time loops, one (level, point) per iteration: a full unroll keeps every level's gathers in flight and
    # needs hundreds of registers (docs/msda_roofline.md §3).
    for lvl in range(L):
        h, w, start = _level(meta_ptr, lvl)
        for p in range(P):
            k = (row * L + lvl) * P + p
            a, fx, fy, _, _, _, _, _, v00, v10, v01, v11 = _corners(v_base, loc_base, attn_base, k, qmask, h, w,
                                                                    start, MD, d, dmask)
            # the attention weight folded into the four bilinear weights (per query): 4 FMAs per channel
            a0 = a * (1.0 - fy)
            a1 = a * fy
            acc += ((a0 * (1.0 - fx))[:, None] * v00 + (a0 * fx)[:, None] * v10
                    + (a1 * (1.0 - fx))[:, None] * v01 + (a1 * fx)[:, None] * v11)
    out_ptrs = out_ptr + b * Q * MD + row[:, None] * D + d[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=qmask[:, None] & dmask[None, :])


@triton.jit(do_not_specialize=["Q", "S"])
def _bwd_kernel(grad_out_ptr, value_ptr, meta_ptr, loc_ptr, attn_ptr, grad_value_ptr, grad_loc_ptr,
                grad_attn_ptr, Q, S, M, D, L: tl.constexpr, P: tl.constexpr, BLOCK_Q: tl.constexpr,
                BLOCK_D: tl.constexpr, SPLIT_RED: tl.constexpr):
    b, m, row, qmask, d, dmask, MD = _tile(Q, M, D, BLOCK_Q, BLOCK_D)
    v_base = value_ptr + b * S * MD + m * D
    gv_base = grad_value_ptr + b * S * MD + m * D
    loc_base = loc_ptr + b * Q * M * L * P * 2
    attn_base = attn_ptr + b * Q * M * L * P
    gloc_base = grad_loc_ptr + b * Q * M * L * P * 2
    gattn_base = grad_attn_ptr + b * Q * M * L * P
    g = tl.load(grad_out_ptr + b * Q * MD + row[:, None] * D + d[None, :], mask=qmask[:, None] & dmask[None, :],
                other=0.0).to(tl.float32)
    if SPLIT_RED:
        g4 = _quarters(g, BLOCK_Q, BLOCK_D)
    else:
        g4 = (g, g, g, g)  # unused
    for lvl in range(L):
        h, w, start = _level(meta_ptr, lvl)
        for p in range(P):
            k = (row * L + lvl) * P + p
            a, fx, fy, off, r00, r10, r01, r11, v00, v10, v01, v11 = _corners(v_base, loc_base, attn_base, k, qmask,
                                                                              h, w, start, MD, d, dmask)
            gx = 1.0 - fx
            gy = 1.0 - fy
            # sum_d g * corner: the weight gradient is their bilinear mix, the pixel-x / -y gradients their
            # weighted differences (d loc = d pixel * size, pixel = loc * size - 0.5). Four reductions over D
            # in registers and warp shuffles, then per-query arithmetic only.
            s00 = _row_sum(g * v00)
            s10 = _row_sum(g * v10)
            s01 = _row_sum(g * v01)
            s11 = _row_sum(g * v11)
            j = lvl * P + p
            grad_a = gy * (gx * s00 + fx * s10) + fy * (gx * s01 + fx * s11)
            _put(gattn_base + row * (L * P), j, grad_a, grad_a, qmask, BLOCK_D, False)
            grad_x = a * w.to(tl.float32) * (gy * (s10 - s00) + fy * (s11 - s01))
            grad_y = a * h.to(tl.float32) * (gx * (s01 - s00) + fx * (s11 - s10))
            _put(gloc_base + row * (2 * L * P), 2 * j, grad_x, grad_y, qmask, BLOCK_D, True)
            # many (query, point) pairs hit the same pixel: scatter with atomics into the fp32 buffer
            # (docs/msda_kernels.md §7.3)
            a0 = a * gy
            a1 = a * fy
            _scatter(gv_base, off, a0 * gx, r00, g, g4, d, D, BLOCK_D, SPLIT_RED)
            _scatter(gv_base, off + MD, a0 * fx, r10, g, g4, d, D, BLOCK_D, SPLIT_RED)
            _scatter(gv_base, off + w * MD, a1 * gx, r01, g, g4, d, D, BLOCK_D, SPLIT_RED)
            _scatter(gv_base, off + (w + 1) * MD, a1 * fx, r11, g, g4, d, D, BLOCK_D, SPLIT_RED)


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


def _check_sizes(value: torch.Tensor, loc: torch.Tensor) -> None:
    _, s, m, d = value.shape
    _, q, _, lvls, pts, _ = loc.shape
    if s * m * d >= 2**31 or q * m * lvls * pts * 2 >= 2**31:
        raise ValueError("ms_deform_attn: one image's value or locations exceed 2^31 elements (32-bit offsets)")


def empty_output(shape, dtype, device) -> torch.Tensor:
    """Outputs every element of which the kernels write (the tests replace this to poison them)."""
    return torch.empty(shape, dtype=dtype, device=device)


class Launch(NamedTuple):
    """One kernel launch exactly as the op issues it: `kernel[grid](*args, **kwargs)`. Built by `forward_launch` /
    `backward_launch`, run by `forward` / `backward`, and compiled for GPU targets by
    `benchmarks/msda_kernel_report.py` (on meta tensors), so the report always sees what runs."""

    kernel: object
    grid: tuple[int, int]
    args: tuple
    kwargs: dict


# Launch options outside the tiling rule below, for `benchmarks/msda_op.py --sweep` on a GPU: warps per program
# (BLOCK_Q follows) and a register cap (None: ptxas's own choice).
NUM_WARPS = 4
MAXNREG: int | None = None


def launch_config(kind: str, channels: int, value_dtype: torch.dtype, capability: tuple[int, int] | None,
                  queries: int = 0, interpreting: bool = False) -> dict:
    """The tiling of kernel `kind` ("fwd" or "bwd"): constexprs and launch options for D = `channels` per head,
    this value dtype and the GPU's compute capability. The one place the op's tiling is chosen: the launches
    below and `benchmarks/msda_kernel_report.py` both call it. Reasoning: docs/msda_roofline.md §3.

    Each thread holds VEC consecutive channels of one query row, so one warp load instruction gathers whole
    64/128-byte corner rows of several queries, and the per-query coordinate math is repeated by only
    D / VEC threads. Forward: VEC = one 16-byte load per corner (8 bf16/fp16, 4 fp32). Backward: VEC = 4, the
    width of one fp32 vector atomic (16 bytes, sm_90); before sm_90 (no vector fp32 atomics) SPLIT_RED.
    BLOCK_Q = the rows NUM_WARPS warps cover; no software pipelining (the gathers are data-dependent, there is
    nothing to stage)."""
    block_d = max(4, triton.next_power_of_2(channels))  # >= 4: `_quarters`, `_put` pairs
    vec = min(block_d, 16 // value_dtype.itemsize if kind == "fwd" else 4)
    block_q = max(1, 32 * NUM_WARPS * vec // block_d)
    if interpreting:
        # the interpreter runs programs one after another: fewer, larger ones are faster
        block_q = max(block_q, min(256, triton.next_power_of_2(queries)))
    cfg = {"BLOCK_Q": block_q, "BLOCK_D": block_d, "num_warps": NUM_WARPS, "num_stages": 1}
    if MAXNREG:
        cfg["maxnreg"] = MAXNREG
    if kind == "bwd":
        cfg["SPLIT_RED"] = capability is not None and capability < (9, 0)
    return cfg


def _capability(t: torch.Tensor) -> tuple[int, int] | None:
    return torch.cuda.get_device_capability(t.device) if t.device.type == "cuda" else None


def forward_launch(value: torch.Tensor, table: torch.Tensor, loc: torch.Tensor, attn: torch.Tensor,
                   out: torch.Tensor, capability: tuple[int, int] | None = None) -> Launch:
    """The forward's launch; `capability` defaults to value's GPU (the kernel report passes the target's)."""
    b, s, m, d = value.shape
    _, q, _, lvls, pts, _ = loc.shape
    cfg = launch_config("fwd", d, value.dtype, capability or _capability(value), q, _interpreting())
    grid = (triton.cdiv(q, cfg["BLOCK_Q"]), b * m)
    return Launch(_fwd_kernel, grid, (value, table, loc, attn, out, q, s, m, d), dict(L=lvls, P=pts, **cfg))


def backward_launch(grad_out: torch.Tensor, value: torch.Tensor, table: torch.Tensor, loc: torch.Tensor,
                    attn: torch.Tensor, grad_value: torch.Tensor, grad_loc: torch.Tensor, grad_attn: torch.Tensor,
                    capability: tuple[int, int] | None = None) -> Launch:
    b, s, m, d = value.shape
    _, q, _, lvls, pts, _ = loc.shape
    cfg = launch_config("bwd", d, value.dtype, capability or _capability(value), q, _interpreting())
    grid = (triton.cdiv(q, cfg["BLOCK_Q"]), b * m)
    args = (grad_out, value, table, loc, attn, grad_value, grad_loc, grad_attn, q, s, m, d)
    return Launch(_bwd_kernel, grid, args, dict(L=lvls, P=pts, **cfg))


def _run(launch: Launch) -> None:
    launch.kernel[launch.grid](*launch.args, **launch.kwargs)


def forward(value: torch.Tensor, shapes: list[int], loc: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """value (B, S, M, D), shapes [h0, w0, h1, w1, ...], loc (B, Q, M, L, P, 2), attn (B, Q, M, L, P)
    -> (B, Q, M * D) in value's dtype."""
    _check_device(value)
    value, loc, attn = value.contiguous(), loc.contiguous(), attn.contiguous()
    _check_sizes(value, loc)
    b, _, m, d = value.shape
    out = empty_output((b, loc.shape[1], m * d), value.dtype, value.device)
    if out.numel() == 0:
        return out
    _run(forward_launch(value, level_table(tuple(shapes), value.device), loc, attn, out))
    return out


def backward(grad_out: torch.Tensor, value: torch.Tensor, shapes: list[int], loc: torch.Tensor,
             attn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients for value (fp32: the atomic-add accumulator), locations and weights (in their dtypes)."""
    _check_device(value)
    grad_out, value = grad_out.contiguous(), value.contiguous()
    loc, attn = loc.contiguous(), attn.contiguous()
    grad_value = torch.zeros(value.shape, dtype=torch.float32, device=value.device)
    grad_loc = empty_output(loc.shape, loc.dtype, loc.device)
    grad_attn = empty_output(attn.shape, attn.dtype, attn.device)
    if grad_loc.numel() == 0:
        return grad_value, grad_loc, grad_attn
    _run(backward_launch(grad_out, value, level_table(tuple(shapes), value.device), loc, attn, grad_value,
                         grad_loc, grad_attn))
    return grad_value, grad_loc, grad_attn
