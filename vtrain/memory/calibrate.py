"""How long recomputation takes on this CPU: a short calibration for `--grad-ckpt auto` on a CPU run
(planner.py; docs/recompute.md §4).

FLOPs alone rank plans badly on a CPU: a recomputed region is matrix products (FLOP-bound) and elementwise work,
norms, softmax, deformable attention's sampling and layout copies (memory-bound, which FlopCounterMode counts as
zero). The tracer knows both of a region: its FLOPs and the bytes its ops write (tracker.py). Two rates measured
here once per process turn them into seconds: seconds per FLOP of a matrix product, and seconds per byte written
by an elementwise op, each the best of a few repetitions (the least disturbed by other work on the machine).
A GPU cannot be measured from here: plans for a GPU are ranked by FLOPs.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch

_REPEATS = 5


@dataclass(frozen=True)
class Rates:
    """Seconds per FLOP of a matrix product and per byte an elementwise op writes, on this CPU."""

    per_flop: float
    per_byte: float

    def seconds(self, flops: int, written: int) -> float:
        return flops * self.per_flop + written * self.per_byte

    def describe(self) -> str:
        return f"{1e-9 / self.per_flop:.0f} GFLOP/s, {1e-9 / self.per_byte:.1f} GB/s written (CPU calibration)"


def _best(fn, repeats: int = _REPEATS) -> float:
    fn()  # warm-up: first-touch page faults, kernel selection
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


@functools.cache
def cpu_rates(dtype: torch.dtype = torch.float32) -> Rates:
    """The two rates in `dtype` (the run's compute dtype), about 0.3 s of measurement, once per process."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(512, 1024, generator=g).to(dtype)
    b = torch.randn(1024, 512, generator=g).to(dtype)
    mm = _best(lambda: a @ b) / (2 * 512 * 1024 * 512)
    x = torch.randn(1 << 22, generator=g).to(dtype)
    # a mix of what recomputation runs besides products: an activation, a sum, a norm
    ew = _best(lambda: (torch.nn.functional.gelu(x), x + x, torch.nn.functional.layer_norm(x.view(-1, 256), (256,))))
    return Rates(mm, ew / (3 * x.numel() * x.element_size()))
