"""`vtrain estimate-memory` against real CUDA peak memory for DINO Swin-L (needs one GPU).

For each row of the AMP x GC-backbone x GC-encoder matrix (batch 2, 800x1333, 5-scale Swin-L, as mmdetection's
table in ../shared/reference/dino.md §2), runs two training steps of the real vtrain model on the GPU with AdamW,
reads torch.cuda.max_memory_allocated, and prints it next to the estimate (parameters + gradients + optimizer +
activations + temporaries; the fixed CUDA-context allowance is left out because max_memory_allocated does not
see it either).

    python benchmarks/estimate_memory_vs_cuda.py [--preset swin-l] [--out benchmarks/ESTIMATE_MEMORY.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import time
from pathlib import Path

import torch

from vtrain.engine.memory import GiB, Setup, _inputs, build_model, estimate


def measure(setup: Setup) -> float:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    model = build_model(setup).cuda().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    inputs = {k: (v.cuda() if k != "num_targets" else v) for k, v in _inputs(setup, torch.device("cpu")).items()}
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(setup.precision)
    for _ in range(2):  # the second step has optimizer states
        with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
            out = model(**inputs)
        out["loss"].float().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / GiB
    del model, opt, inputs, out
    return peak


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="swin-l")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a GPU")
    rows = ["| AMP (bf16) | GC backbone | GC encoder | estimate GiB | measured GiB | error | trace s |",
            "|---|---|---|---|---|---|---|"]
    for amp, gc_b, gc_e in itertools.product([False, True], repeat=3):
        gc = tuple(p for p, on in (("backbone", gc_b), ("encoder", gc_e)) if on)
        setup = Setup(task="dino", preset=args.preset, batch_size=2, image_size=(800, 1333),
                      precision="bf16" if amp else "no", grad_ckpt=gc)
        t0 = time.perf_counter()
        est = estimate(setup)
        secs = time.perf_counter() - t0
        predicted = (est.total - est.overhead) / GiB
        try:
            real = measure(dataclasses.replace(setup))
            err = f"{100 * (predicted - real) / real:+.1f}%"
            real_s = f"{real:.2f}"
        except torch.OutOfMemoryError:
            real_s, err = "OOM", "-"
        rows.append(f"| {'yes' if amp else 'no'} | {'yes' if gc_b else 'no'} | {'yes' if gc_e else 'no'} | "
                    f"{predicted:.2f} | {real_s} | {err} | {secs:.0f} |")
        print(rows[-1], flush=True)
    text = f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}\n\n" + "\n".join(rows) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
