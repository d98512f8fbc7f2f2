"""`vtrain estimate-memory`'s fake-tensor trace against real CPU runs (the figures of the README's CPU accuracy
table; tests/memory/test_memory.py asserts the same cases within 10%).

    OMP_NUM_THREADS=1 python benchmarks/estimate_memory_cpu.py
"""

from __future__ import annotations

import itertools

from vtrain.memory.setup import Setup
from vtrain.memory.trace import allocator_peak, trace_step

CASES = [("dino", "debug", (128, 160), 2, ("backbone", "encoder")), ("metric", "debug", (112, 112), 8, ("backbone",))]


def main() -> None:
    print("| model, input | precision | checkpointing | traced MiB | real MiB | error |")
    print("|---|---|---|---|---|---|")
    for (task, preset, size, batch, gc_parts), precision, gc in itertools.product(CASES, ["no", "bf16"], [False, True]):
        s = Setup(task=task, preset=preset, image_size=size, batch_size=batch, precision=precision,
                  grad_ckpt=gc_parts if gc else (), num_classes=5 if task == "dino" else 50, num_targets=3,
                  autocast_policy="cpu")
        traced, real = trace_step(s)["Peak"], allocator_peak(s)
        print(f"| {task} {preset} {size[0]}x{size[1]}, b{batch} | {'fp32' if precision == 'no' else precision} | "
              f"{'+'.join(s.grad_ckpt) or 'none'} | {traced / 2**20:.1f} | {real / 2**20:.1f} | "
              f"{100 * (traced - real) / real:+.1f}% |", flush=True)


if __name__ == "__main__":
    main()
