"""Machine-code report of the fused deformable-attention kernels, on a CPU: registers, spills, shared memory, PTX
size and register-limited occupancy of every kernel variant as the op launches it.

No GPU is needed: Triton compiles for any CUDA target on a CPU-only machine, and the triton wheel ships `ptxas`.
For each (kernel, value dtype, arch, shape) the script
1. builds the launch exactly as the op does (`msda_triton.forward_launch` / `backward_launch` on meta tensors of
   the real shapes: same kernel, same constexprs and launch options, from the same `launch_config`);
2. specialises the arguments with Triton's own launch-time binder for that target (16-byte alignment of the
   pointers, divisibility of the integers, `do_not_specialize`), so the signature is the one the JIT would build;
3. compiles with `triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))` and runs the wheel's
   `ptxas -v` on the PTX with the flags Triton itself uses (checked against the register count of the cubin
   Triton produced, read back with `cuobjdump -res-usage`);
4. computes the occupancy the registers, warps and shared memory allow (docs/msda_roofline.md §1).

    python benchmarks/msda_kernel_report.py                  # all rows, writes benchmarks/results/msda_kernels.*
    python benchmarks/msda_kernel_report.py --arch 90 --dtype bf16 --shape encoder --no-write

Shapes (docs/msda_kernels.md §4.2): DINO Swin-L 5-scale at 800x1333, batch 2, 8 heads x 32 channels, 5 levels x 4
points; the encoder's self-attention (89,023 queries) and a decoder cross-attention (900 queries + 200 denoising
queries) over the same 89,023-position value.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

LEVELS = [(200, 334), (100, 167), (50, 84), (25, 42), (13, 21)]  # docs/msda_kernels.md §4.2
SHAPES = {"encoder": sum(h * w for h, w in LEVELS), "decoder": 900 + 200}
BATCH, HEADS, CHANNELS, POINTS = 2, 8, 32, 4
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
ARCHS = (80, 90)
KERNELS = ("fwd", "bwd")
OUT = Path(__file__).resolve().parent / "results" / "msda_kernels"

# Per-SM limits of compute capability 8.0 and 9.0 (docs/msda_roofline.md §1).
SM_LIMITS = {
    80: dict(regs=65536, warps=64, blocks=32, smem=167936, smem_reserved=1024),
    90: dict(regs=65536, warps=64, blocks=32, smem=233472, smem_reserved=1024),
}


def occupancy(arch: int, regs: int, num_warps: int, shared: int) -> dict:
    """Resident warps per SM as CUDA's occupancy calculator counts them (docs/msda_roofline.md §1): registers are
    allocated per warp in units of 256 out of each of the 4 sub-partitions' quarter of the register file; blocks
    are further limited by the warp slots, the block slots and shared memory (+1 KiB the system reserves per
    block). Returns the blocks per SM, the fraction of the 64 warp slots used and the limiting resource."""
    lim = SM_LIMITS[arch]
    regs_per_warp = -(-max(regs, 1) * 32 // 256) * 256
    warps_by_regs = (lim["regs"] // 4 // regs_per_warp) * 4
    by = {"registers": warps_by_regs // num_warps, "warps": lim["warps"] // num_warps, "blocks": lim["blocks"],
          "shared": lim["smem"] // (shared + lim["smem_reserved"])}
    limiter = min(by, key=by.get)
    blocks = by[limiter]
    reg_limited = min(by["registers"], by["warps"], by["blocks"]) * num_warps / lim["warps"]
    return {"blocks_per_sm": blocks, "occupancy": blocks * num_warps / lim["warps"],
            "register_limited_occupancy": reg_limited, "limiter": limiter}


def _meta_launch(kernel: str, queries: int, dtype: torch.dtype, arch: int):
    """The op's launch for these shapes on a GPU of compute capability `arch`, on meta tensors (nothing is
    allocated)."""
    from vtrain.models.dino import msda_triton as k

    def t(*shape, dt=torch.float32):
        return torch.empty(*shape, dtype=dt, device="meta")

    s = sum(h * w for h, w in LEVELS)
    value = t(BATCH, s, HEADS, CHANNELS, dt=dtype)
    loc = t(BATCH, queries, HEADS, len(LEVELS), POINTS, 2)
    attn = t(BATCH, queries, HEADS, len(LEVELS), POINTS)
    table = t(3 * len(LEVELS), dt=torch.int32)
    capability = (arch // 10, arch % 10)
    if kernel == "fwd":
        return k.forward_launch(value, table, loc, attn, t(BATCH, queries, HEADS * CHANNELS, dt=dtype), capability)
    return k.backward_launch(t(BATCH, queries, HEADS * CHANNELS, dt=dtype), value, table, loc, attn,
                             t(*value.shape), t(*loc.shape), t(*attn.shape), capability)


def compile_launch(launch, arch: int):
    """Compile one launch for sm_<arch> as the JIT would (Triton's binder gives signature, constexprs and the
    alignment attributes). Returns the compiled kernel and its options."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = launch.kernel
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, launch.kwargs, bound, specialization, options)
    compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
    return compiled, options


def ptxas_stats(ptx: str, cubin: bytes, arch: int) -> dict:
    """`ptxas -v` of the PTX with Triton's flags (registers, stack, spill bytes), cross-checked against the
    register count of Triton's own cubin."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    ptxas = Path(get_ptxas(arch).path)
    with tempfile.TemporaryDirectory() as tmp:
        src, binary = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
        src.write_text(ptx)
        binary.write_bytes(cubin)
        log = subprocess.run([str(ptxas), "-lineinfo", "-v", "--regAllocOptLevel=2",
                              f"--gpu-name={sm_arch_from_capability(arch)}", str(src), "-o", str(Path(tmp) / "v.o")],
                             check=True, capture_output=True, text=True).stderr
        res = subprocess.run([str(ptxas.parent / "cuobjdump"), "-res-usage", str(binary)], check=True,
                             capture_output=True, text=True).stdout

    def grab(pattern: str, text: str) -> int:
        m = re.search(pattern, text)
        if not m:
            raise RuntimeError(f"no {pattern!r} in:\n{text}")
        return int(m.group(1))

    stats = {"registers": grab(r"Used (\d+) registers", log), "stack": grab(r"(\d+) bytes stack frame", log),
             "spill_stores": grab(r"(\d+) bytes spill stores", log),
             "spill_loads": grab(r"(\d+) bytes spill loads", log)}
    cubin_regs = grab(r"REG:(\d+)", res)
    if cubin_regs != stats["registers"]:
        raise RuntimeError(f"ptxas -v says {stats['registers']} registers, Triton's cubin {cubin_regs}: the flags "
                           "of this script no longer match Triton's; update ptxas_stats")
    return stats


def report_row(kernel: str, dtype: str, arch: int, shape: str) -> dict:
    launch = _meta_launch(kernel, SHAPES[shape], DTYPES[dtype], arch)
    t0 = time.perf_counter()
    compiled, options = compile_launch(launch, arch)
    ptx = compiled.asm["ptx"]
    stats = ptxas_stats(ptx, compiled.asm["cubin"], arch)
    shared = int(compiled.metadata.shared)
    occ = occupancy(arch, stats["registers"], options.num_warps, shared)
    consts = {k: v for k, v in launch.kwargs.items() if k.isupper() or k in ("L", "P")}
    return {"kernel": kernel, "dtype": dtype, "arch": f"sm_{arch}", "shape": shape, "queries": SHAPES[shape],
            "constexprs": consts, "num_warps": options.num_warps, "num_stages": options.num_stages,
            "programs": launch.grid[0] * launch.grid[1], **stats, "shared": shared, "ptx_bytes": len(ptx),
            "ptx_global_loads": len(re.findall(r"\bld\.global", ptx)),
            "ptx_atomics": len(re.findall(r"\b(?:red|atom)\.global", ptx)), **occ,
            "compile_s": round(time.perf_counter() - t0, 1)}


def markdown(rows: list[dict]) -> str:
    head = ("| kernel | dtype | arch | shape | tile (constexprs) | warps | programs | registers | spill st/ld B | "
            "shared B | PTX KB | ld.global / atomics in PTX | occupancy (limiter) | register-limited occupancy |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        c = r["constexprs"]
        tile = ", ".join(f"{k}={v}" for k, v in c.items() if k not in ("L", "P"))
        lines.append(f"| {r['kernel']} | {r['dtype']} | {r['arch']} | {r['shape']} ({r['queries']:,} q) | {tile} | "
                     f"{r['num_warps']} | {r['programs']:,} | {r['registers']} | "
                     f"{r['spill_stores']} / {r['spill_loads']} | {r['shared']} | {r['ptx_bytes'] / 1024:.0f} | "
                     f"{r['ptx_global_loads']} / {r['ptx_atomics']} | {r['occupancy']:.1%} ({r['limiter']}) | "
                     f"{r['register_limited_occupancy']:.1%} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernel", choices=KERNELS, action="append", help="default: both")
    ap.add_argument("--dtype", choices=list(DTYPES), action="append", help="value dtype; default: bf16 and fp32")
    ap.add_argument("--arch", type=int, choices=ARCHS, action="append", help="default: 80 and 90")
    ap.add_argument("--shape", choices=list(SHAPES), action="append", help="default: encoder and decoder")
    ap.add_argument("--no-write", action="store_true", help=f"print only; do not write {OUT}.md/.json")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON instead of the table")
    ap.add_argument("--reuse-cache", action="store_true",
                    help="use Triton's kernel cache (default: a fresh one, so every row is compiled by this run)")
    args = ap.parse_args()
    cache = tempfile.TemporaryDirectory(prefix="msda-report-")
    if not args.reuse_cache:
        os.environ["TRITON_CACHE_DIR"] = cache.name  # read by Triton at its first compile
    import triton

    rows = []
    for shape in args.shape or list(SHAPES):
        for kernel in args.kernel or KERNELS:
            for dtype in args.dtype or list(DTYPES):
                for arch in args.arch or ARCHS:
                    rows.append(report_row(kernel, dtype, arch, shape))
                    print(f"compiled {kernel} {dtype} sm_{arch} {shape}: {rows[-1]['registers']} registers, "
                          f"{rows[-1]['compile_s']} s", file=sys.stderr, flush=True)
    cache.cleanup()
    table = markdown(rows)
    env = f"triton {triton.__version__}, torch {torch.__version__}"
    print(json.dumps(rows, indent=1) if args.json else f"{table}\n\n{env}")
    if not args.no_write:
        OUT.parent.mkdir(parents=True, exist_ok=True)
        OUT.with_suffix(".json").write_text(json.dumps({"env": env, "rows": rows}, indent=1) + "\n")
        OUT.with_suffix(".md").write_text(
            "# Deformable-attention kernels: registers, spills, occupancy (`benchmarks/msda_kernel_report.py`)\n\n"
            f"{table}\n\n{env}. Occupancy: docs/msda_roofline.md §1.\n")


if __name__ == "__main__":
    main()
