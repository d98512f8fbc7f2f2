"""Multi-scale deformable attention alone: the PyTorch path against the fused Triton op, time and memory.

Shapes are DINO Swin-L 5-scale at 800x1333 (docs/msda_kernels.md §4.2): the encoder's self-attention
(89,023 queries over 5 levels 200x334 ... 13x21, batch 2, 8 heads x 32 channels, 4 points) and a decoder
cross-attention (1,000 queries over the same value). Value and grad_out are bf16 (or --dtype), sampling locations and
attention weights fp32, as DINO feeds them under autocast. Locations are a reference point per query plus a few
pixels of offset per level and point, as in the encoder, so the memory access pattern is realistic, not uniform.

For each shape and implementation:
- forward ms and forward + backward ms: median over --iters after --warmup (CUDA events on a GPU, perf_counter on a
  CPU);
- saved MiB: the bytes of every distinct storage autograd keeps for backward (saved_tensors_hooks), inputs included
  (the fused op keeps exactly value, locations and weights);
- peak MiB: on a GPU, torch.cuda.max_memory_allocated during forward + backward above what was allocated before it;
  on a CPU, the CPU allocator's peak as torch.profiler records it;
- max |triton - pytorch| of the output, as a sanity check.

    python benchmarks/msda_op.py                       # GPU: encoder and decoder shapes
    python benchmarks/msda_op.py --sweep               # GPU: also the Triton warps and register caps
    TRITON_INTERPRET=1 python benchmarks/msda_op.py    # CPU: a small shape under the Triton interpreter (smoke run)

Writes the table to stdout and, with --out, the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from vtrain.models.dino.msda import ms_deform_attn

MiB = 1024**2
ENCODER_LEVELS = [(200, 334), (100, 167), (50, 84), (25, 42), (13, 21)]  # docs/msda_kernels.md §4.2
SMOKE_LEVELS = [(12, 20), (6, 10), (3, 5), (2, 3), (1, 2)]  # the same layout, small enough for the interpreter


def make_inputs(levels, batch: int, queries: int, heads: int, dim: int, points: int, dtype: torch.dtype,
                device: torch.device, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    s = sum(h * w for h, w in levels)
    value = torch.randn(batch, s, heads, dim, generator=g).to(device, dtype)
    sizes = torch.tensor([[w, h] for h, w in levels], dtype=torch.float32)  # (L, 2) as (x, y)
    ref = torch.rand(batch, queries, 1, 1, 1, 2, generator=g)
    offsets = torch.randn(batch, queries, heads, len(levels), points, 2, generator=g) * 2.0  # pixels
    loc = (ref + offsets / sizes[None, None, None, :, None, :]).to(device)
    attn = torch.rand(batch, queries, heads, len(levels) * points, generator=g).softmax(-1)
    attn = attn.view(batch, queries, heads, len(levels), points).to(device)
    grad_out = torch.randn(batch, queries, heads * dim, generator=g).to(device, dtype)
    return value, loc, attn, grad_out


def saved_bytes(levels, value, loc, attn, impl: str) -> int:
    """Bytes of the distinct storages autograd saves in one forward (inputs included)."""
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t

    leaves = [t.detach().requires_grad_() for t in (value, loc, attn)]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = ms_deform_attn(leaves[0], levels, leaves[1], leaves[2], impl=impl)
    del out
    return sum(seen.values())


def timed(fn, iters: int, warmup: int, cuda: bool) -> float:
    """Median milliseconds of fn()."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure(name: str, levels, queries: int, impl: str, args, device: torch.device) -> dict:
    cuda = device.type == "cuda"
    value, loc, attn, grad_out = make_inputs(levels, args.batch, queries, args.heads, args.dim, args.points,
                                             args.dtype, device)
    leaves = [t.detach().requires_grad_() for t in (value, loc, attn)]

    def fwd():
        with torch.no_grad():
            ms_deform_attn(value, levels, loc, attn, impl=impl)

    def fwd_bwd():
        for t in leaves:
            t.grad = None
        ms_deform_attn(leaves[0], levels, leaves[1], leaves[2], impl=impl).backward(grad_out)

    fwd_ms = timed(fwd, args.iters, args.warmup, cuda)
    fwd_bwd_ms = timed(fwd_bwd, args.iters, args.warmup, cuda)
    for t in leaves:
        t.grad = None
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fwd_bwd()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        for t in leaves:
            t.grad = None
    else:
        from vtrain.memory.trace import profiled_peak

        peak = profiled_peak(fwd_bwd)
    return {"shape": name, "queries": queries, "impl": impl, "dtype": str(args.dtype).removeprefix("torch."),
            "fwd_ms": fwd_ms, "fwd_bwd_ms": fwd_bwd_ms, "saved_mib": saved_bytes(levels, value, loc, attn, impl) / MiB,
            "peak_mib": peak / MiB, "device": torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter)"}


def max_diff(levels, queries: int, args, device: torch.device) -> float:
    value, loc, attn, _ = make_inputs(levels, args.batch, queries, args.heads, args.dim, args.points, args.dtype,
                                      device)
    with torch.no_grad():
        a = ms_deform_attn(value, levels, loc, attn, impl="triton").float()
        b = ms_deform_attn(value, levels, loc, attn, impl="pytorch").float()
    return (a - b).abs().max().item()


def sweep(levels, queries: int, args, device: torch.device) -> list[str]:
    """Forward + backward ms of the fused op for each warp count and register cap (`NUM_WARPS`, `MAXNREG` in
    msda_triton; the tile follows from them in `launch_config`)."""
    from vtrain.models.dino import msda_triton as k

    saved = k.NUM_WARPS, k.MAXNREG
    lines = ["| num_warps | maxnreg | fwd ms | fwd+bwd ms |", "|---|---|---|---|"]
    try:
        for warps in (2, 4, 8):
            for maxnreg in (None, 56, 48):
                k.NUM_WARPS, k.MAXNREG = warps, maxnreg
                r = measure("sweep", levels, queries, "triton", args, device)
                lines.append(f"| {warps} | {maxnreg or 'ptxas'} | {r['fwd_ms']:.2f} | {r['fwd_bwd_ms']:.2f} |")
    finally:
        k.NUM_WARPS, k.MAXNREG = saved
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"], help="value and grad_out dtype")
    ap.add_argument("--batch", type=int, default=None, help="default 2 on a GPU, 1 on a CPU")
    ap.add_argument("--heads", type=int, default=None, help="default 8 on a GPU, 2 on a CPU")
    ap.add_argument("--dim", type=int, default=32, help="channels per head")
    ap.add_argument("--points", type=int, default=4)
    ap.add_argument("--iters", type=int, default=None, help="timed repetitions (default 20 on a GPU, 1 on a CPU)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed repetitions first (default 5 / 0)")
    ap.add_argument("--sweep", action="store_true", help="also time the Triton warps / register caps (encoder)")
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    args.dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    # the interpreter runs every program in Python (minutes for the full smoke shape at 8 heads): keep it small
    args.iters = args.iters or (20 if cuda else 1)
    args.warmup = args.warmup if args.warmup is not None else (5 if cuda else 0)
    args.batch = args.batch or (2 if cuda else 1)
    args.heads = args.heads or (8 if cuda else 2)
    if cuda:
        shapes = [("encoder", ENCODER_LEVELS, sum(h * w for h, w in ENCODER_LEVELS)),
                  ("decoder", ENCODER_LEVELS, 1000)]
    else:
        import os

        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("no GPU: run with TRITON_INTERPRET=1 for the CPU smoke run of the Triton kernels")
        shapes = [("smoke encoder", SMOKE_LEVELS, sum(h * w for h, w in SMOKE_LEVELS)), ("smoke decoder",
                                                                                         SMOKE_LEVELS, 50)]
    rows = []
    print("| shape | queries | impl | value dtype | fwd ms | fwd+bwd ms | saved MiB | peak MiB | max abs diff |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, levels, queries in shapes:
        diff = max_diff(levels, queries, args, device)
        for impl in ("pytorch", "triton"):
            r = measure(name, levels, queries, impl, args, device)
            r["max_abs_diff"] = diff
            rows.append(r)
            print(f"| {name} | {queries:,} | {impl} | {r['dtype']} | {r['fwd_ms']:.2f} | {r['fwd_bwd_ms']:.2f} | "
                  f"{r['saved_mib']:.1f} | {r['peak_mib']:.1f} | {diff:.2e} |", flush=True)
    print(f"\ndevice: {rows[0]['device']}; torch {torch.__version__}")
    if args.sweep:
        if not cuda:
            raise SystemExit("--sweep needs a GPU (interpreter timings say nothing about tilings)")
        print()
        print("\n".join(sweep(ENCODER_LEVELS, sum(h * w for h, w in ENCODER_LEVELS), args, device)))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
