"""DINO training-step memory and speed against `vtrain estimate-memory`: precision x activation checkpointing.

Each row builds the real vtrain model (`vtrain.engine.memory.build_model`, as estimate-memory does), feeds the
estimator's own inputs (batch 2, 800x1333 padded to a multiple of 32, --targets boxes per image), and times
forward + backward + AdamW (fused on CUDA): --warmup steps first (the first one creates the optimizer states), then
the median of --steps. Beside each measurement: estimate-memory's total without its fixed CUDA-context allowance
(max_memory_allocated does not see the context either). DINO's deformable attention is whatever `impl="auto"` picks
on the device (the fused Triton op on CUDA), or --msda.

- GPU: Swin-L 5-scale at 800x1333 (mmdetection's table, ../shared/reference/dino.md §2); peak = the allocator's
  max_memory_allocated / max_memory_reserved over the timed steps.
- CPU: the `debug` preset at 128x160, so the script runs everywhere; peak = the CPU allocator's peak during one
  step as torch.profiler records it, plus the parameters, buffers and AdamW states alive before it (no reserved
  figure).

Engine: only `single` (one process, no sharding) so far; FSDP2 / ZeRO rows need a launcher per row and are not
measured by this script yet.

    python benchmarks/dino_memory_matrix.py [--preset swin-l] [--image-size 800x1333] [--msda auto|triton|pytorch]

Writes benchmarks/results/dino_memory_matrix_<device>.md and .json (keys: precision, gc, engine, peak_gib,
reserved_gib, s_per_iter, images_per_s, estimate_gib, device, ...). Replaces estimate_memory_vs_cuda.py, which left
`num_targets` on the CPU and crashed in build_denoising on a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import statistics
import time
from pathlib import Path

import torch

from vtrain.engine.memory import GiB, Setup, _inputs, build_model, estimate, profiled_peak
from vtrain.models.dino.msda import auto_impl

GC_CHOICES = {"none": (), "backbone": ("backbone",), "backbone+encoder": ("backbone", "encoder")}
AMP = {"no": None, "bf16": torch.bfloat16}


def run_steps(setup: Setup, device: torch.device, warmup: int, steps: int, msda: str) -> dict:
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    model = build_model(setup).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    # every input on the device, num_targets too (the model reads its counts on the host once per step)
    inputs = {k: v.to(device) for k, v in _inputs(setup, torch.device("cpu")).items()}
    dtype = AMP[setup.precision]
    kernel = auto_impl(msda) if msda != "auto" else contextlib.nullcontext()

    def step() -> None:
        with kernel:
            with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
                out = model(**inputs)
            out["loss"].float().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    times, peak, reserved = [], None, None
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for _ in range(steps):
        t0 = time.perf_counter()
        if cuda or peak is not None:
            step()
        else:
            # the profiler slows the step down: it measures the first timed step, which is not timed. It counts
            # from zero, so what was alive before the step (parameters, buffers, AdamW states) is added, as
            # max_memory_allocated includes it on a GPU
            alive = [*model.parameters(), *model.buffers(),
                     *(t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor))]
            before = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in alive}.values())
            peak = (before + profiled_peak(step)) / GiB
            continue
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    if cuda:
        peak = torch.cuda.max_memory_allocated() / GiB
        reserved = torch.cuda.max_memory_reserved() / GiB
    del model, opt, inputs
    if cuda:
        torch.cuda.empty_cache()
    s = statistics.median(times)
    return {"peak_gib": peak, "reserved_gib": reserved, "s_per_iter": s, "images_per_s": setup.batch_size / s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default=None, help="default swin-l on a GPU, debug on a CPU")
    ap.add_argument("--image-size", default=None, help="HxW, default 800x1333 on a GPU, 128x160 on a CPU")
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--targets", type=int, default=10, help="boxes per image")
    ap.add_argument("--precision", default="no,bf16", help="comma list of no, bf16")
    ap.add_argument("--gc", default=",".join(GC_CHOICES), help=f"comma list of {', '.join(GC_CHOICES)}")
    ap.add_argument("--msda", default="auto", choices=["auto", "triton", "pytorch"],
                    help="deformable attention (auto: Triton on CUDA, PyTorch on CPU)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 6 on a GPU, 3 on a CPU)")
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    preset = args.preset or ("swin-l" if cuda else "debug")
    h, w = (int(x) for x in (args.image_size or ("800x1333" if cuda else "128x160")).split("x"))
    steps = args.steps or (6 if cuda else 3)
    name = torch.cuda.get_device_name() if cuda else "cpu"
    msda = args.msda if args.msda != "auto" else ("triton" if cuda else "pytorch")
    if msda == "triton" and not cuda:
        import os

        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--msda triton on a CPU needs TRITON_INTERPRET=1")

    rows = []
    header = ("| precision | GC | engine | deformable attn | peak allocated GiB | reserved GiB | s/iter | images/s | "
              "estimate GiB | estimate error |")
    lines = [header, "|---" * (header.count("|") - 1) + "|"]
    print("\n".join(lines), flush=True)
    for precision, gc in itertools.product(args.precision.split(","), args.gc.split(",")):
        setup = Setup(task="dino", preset=preset, batch_size=args.batch_size, image_size=(h, w), precision=precision,
                      grad_ckpt=GC_CHOICES[gc], num_targets=args.targets, msda_impl=msda,
                      autocast_policy="cuda" if cuda else "cpu")
        est = estimate(setup)
        estimate_gib = (est.total - est.overhead) / GiB
        try:
            m = run_steps(setup, device, args.warmup, steps, args.msda)
        except torch.OutOfMemoryError:
            m = {"peak_gib": None, "reserved_gib": None, "s_per_iter": None, "images_per_s": None}
            torch.cuda.empty_cache()
        row = {"precision": precision, "gc": gc, "engine": "single", "msda": msda, **m, "estimate_gib": estimate_gib,
               "preset": preset, "image_size": [h, w], "batch_size": args.batch_size, "device": name,
               "torch": torch.__version__}
        rows.append(row)

        def f(x, fmt):
            return "OOM" if x is None and m["peak_gib"] is None else ("-" if x is None else format(x, fmt))

        err = "-" if m["peak_gib"] is None else f"{100 * (estimate_gib - m['peak_gib']) / m['peak_gib']:+.1f}%"
        lines.append(f"| {precision} | {gc} | single | {msda} | {f(m['peak_gib'], '.3f')} | "
                     f"{f(m['reserved_gib'], '.3f')} | {f(m['s_per_iter'], '.3f')} | {f(m['images_per_s'], '.2f')} | "
                     f"{estimate_gib:.3f} | {err} |")
        print(lines[-1], flush=True)
    title = (f"DINO {preset}, batch {args.batch_size}, {h}x{w}, {args.targets} boxes/image, {name}, torch "
             f"{torch.__version__}; median of {steps} steps after {args.warmup}\n\n"
             f"command: python benchmarks/dino_memory_matrix.py --preset {preset} --image-size {h}x{w} "
             f"--msda {args.msda}\n\n")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / f"dino_memory_matrix_{'cuda' if cuda else 'cpu'}"
    stem.with_suffix(".md").write_text(title + "\n".join(lines) + "\n")
    stem.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    print(f"\nwrote {stem}.md and .json")


if __name__ == "__main__":
    main()
