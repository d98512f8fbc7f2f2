"""How long recomputation takes on a CPU: the rates `--grad-ckpt auto` ranks a CPU run's plans by (planner.py;
docs/recompute.md §4).

FLOPs alone rank plans badly on a CPU: a recomputed region is matrix products (FLOP-bound) and elementwise work,
norms, softmax, deformable attention's sampling and layout copies (memory-bound, which FlopCounterMode counts as
zero). The tracer knows both of a region: its FLOPs and the bytes its ops write (tracker.py). Two rates turn them
into seconds: seconds per FLOP of a matrix product, and seconds per byte written by an elementwise op.

The planner uses the stored table `STORED`, never a measurement taken while it plans: measured at run time on a
shared machine the two rates varied by 3.7x between two runs a second apart (one thread, best of 30), which
changed the chosen plan, so the same command planned differently from run to run. A plan must be a function of its
inputs (every rank plans alike, a plan is reproduced by planning again). The ranking depends only on the ratio of
the two rates (the absolute scale cancels in the plan's time share too). The table was measured on the 2-core
build machine, one thread, with

    OMP_NUM_THREADS=1 python -m vtrain.memory.calibrate

(it prints the measured table; it is not read at run time). Another CPU has other rates: on it the ranking is the
build machine's, an approximation stated in docs/recompute.md. A GPU is ranked by FLOPs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

_REPEATS = 30


@dataclass(frozen=True)
class Rates:
    """Seconds per FLOP of a matrix product and per byte an elementwise op writes."""

    per_flop: float
    per_byte: float

    def seconds(self, flops: int, written: int) -> float:
        return flops * self.per_flop + written * self.per_byte

    def describe(self) -> str:
        return (f"{1e-9 / self.per_flop:.2g} GFLOP/s, {1e-9 / self.per_byte:.2g} GB/s written "
                "(the stored CPU calibration)")


# measured 2026-11-29 on the 2-core build machine (shared, load average ~10), one thread: the least of
# `python -m vtrain.memory.calibrate`'s rates over 3 runs (each the best of 30 repetitions)
STORED = {
    "float32": Rates(per_flop=4.142e-11, per_byte=9.964e-10),  # 24 GFLOP/s, 1.0 GB/s written
    "bfloat16": Rates(per_flop=1.714e-09, per_byte=1.878e-09),  # 0.58 GFLOP/s, 0.53 GB/s written
}


def cpu_rates(dtype: torch.dtype = torch.float32) -> Rates:
    """The stored rates in `dtype` (the run's compute dtype): deterministic, measured once (module docstring)."""
    return STORED["bfloat16" if dtype == torch.bfloat16 else "float32"]


def _best(fn, repeats: int = _REPEATS) -> float:
    fn()  # warm-up: first-touch page faults, kernel selection
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(dtype: torch.dtype = torch.float32, repeats: int = _REPEATS) -> Rates:
    """The two rates on this CPU now, each the best of `repeats` (the least disturbed by other work)."""
    g = torch.Generator().manual_seed(0)
    n = 512 if dtype == torch.float32 else 128  # CPU bf16 products without native support are ~100x slower
    a = torch.randn(n, 1024, generator=g).to(dtype)
    b = torch.randn(1024, n, generator=g).to(dtype)
    mm = _best(lambda: a @ b, repeats) / (2 * n * 1024 * n)
    x = torch.randn(1 << 22, generator=g).to(dtype)
    # a mix of what recomputation runs besides products: an activation, a sum, a norm
    ew = _best(lambda: (torch.nn.functional.gelu(x), x + x, torch.nn.functional.layer_norm(x.view(-1, 256), (256,))),
               repeats)
    return Rates(mm, ew / (3 * x.numel() * x.element_size()))


if __name__ == "__main__":
    torch.set_num_threads(1)
    for name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        r = measure(dt)
        print(f'    "{name}": Rates(per_flop={r.per_flop:.3e}, per_byte={r.per_byte:.3e}),  '
              f'# {1e-9 / r.per_flop:.2g} GFLOP/s, {1e-9 / r.per_byte:.2g} GB/s written')
