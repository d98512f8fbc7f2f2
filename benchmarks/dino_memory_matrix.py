"""DINO training-step memory and speed against `vtrain estimate-memory`: precision x checkpointing x engine.

Each row runs in its own process (an engine owns process-global state: the process group, DeepSpeed), builds the
real vtrain model (`vtrain.memory.trace.build_model`, the constructor `vtrain train` and estimate-memory use),
wraps it with vtrain's own engine (`resolve_plan`, `build_accelerator`, `build_engine(...).shard/prepare`,
`build_optimizer`, as the Trainer does), feeds the estimator's own inputs (batch 2, 800x1333 padded to a multiple
of 32, --targets boxes per image) and times forward + backward + optimizer step through the engine: --warmup steps
first (the first one creates the optimizer states), then the median of --steps. Beside each row: estimate-memory's
total for the same engine flags without its fixed CUDA-context allowance (max_memory_allocated does not see the
context either). DINO's deformable attention is what `impl="auto"` picks on the device (the fused Triton op on
CUDA), or --msda.

Engines: single (one process), fsdp2 (--fsdp), zero2 (ds_configs/zero2.json), zero3-offload
(ds_configs/zero3_offload.json, DeepSpeed CPU Adam: compiled once, about 2 min on a new machine), all with one
process, as far as one GPU allows.

- GPU: Swin-L 5-scale at 800x1333 (mmdetection's table, docs/dino.md §2); peak = the allocator's
  max_memory_allocated / max_memory_reserved over the timed steps.
- CPU: the `debug` preset at 128x160, so the script runs everywhere; peak = the CPU allocator's peak during one
  step as torch.profiler records it, plus the CPU tensors alive before it (parameters, buffers, optimizer states,
  engine buffers: every tensor the garbage collector can see); no reserved figure.

    python benchmarks/dino_memory_matrix.py [--preset swin-l] [--image-size 800x1333] [--engine single,fsdp2,...]

Writes benchmarks/results/dino_memory_matrix_<cuda|cpu>.md and .json (keys: precision, gc, engine, peak_gib,
reserved_gib, s_per_iter, images_per_s, estimate_gib, device, ...). Replaces estimate_memory_vs_cuda.py, which left
`num_targets` on the CPU and crashed in build_denoising on a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
GiB = 1024**3
GC_CHOICES = {"none": (), "backbone": ("backbone",), "backbone+encoder": ("backbone", "encoder")}
# engine -> the `vtrain train` / `vtrain estimate-memory` flags that select it
ENGINES = {"single": {}, "fsdp2": {"fsdp": True}, "zero2": {"ds_config": "ds_configs/zero2.json"},
           "zero3-offload": {"ds_config": "ds_configs/zero3_offload.json"}}


def _setup(row: dict):
    """estimate-memory's Setup for a row, through the CLI's own constructor."""
    from vtrain.tools.estimate_memory import setup_from

    h, w = row["image_size"]
    flags = ENGINES[row["engine"]]
    s = setup_from(model=row["preset"], task="dino", batch_size=row["batch_size"], image_size=f"{h}x{w}",
                   mixed_precision=row["precision"], grad_ckpt=",".join(GC_CHOICES[row["gc"]]) or None,
                   fsdp=flags.get("fsdp"), ds_config=str(ROOT / flags["ds_config"]) if "ds_config" in flags else None)
    return dataclasses.replace(s, num_targets=row["targets"], msda_impl=row["msda"],
                               autocast_policy="cuda" if torch.cuda.is_available() else "cpu")


def _alive_cpu_bytes() -> int:
    """Bytes of the distinct CPU storages of every tensor the garbage collector tracks."""
    seen = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and not obj.is_meta:
            try:
                st = obj.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
            except (RuntimeError, NotImplementedError):  # DTensor wrappers; storages FSDP2 has freed (resized to 0)
                continue
    return sum(seen.values())


def child(row: dict) -> dict:
    """One row, measured in this process with vtrain's engine; returns the measurements."""
    from vtrain.config import ModelConfig, OptimConfig, ParallelConfig, RunConfig, TrainConfig
    from vtrain.memory.trace import build_model, profiled_peak, step_inputs
    from vtrain.engine.optim import build_optimizer
    from vtrain.engine.engines.accelerator import build_accelerator
    from vtrain.engine.engines.build import build_engine
    from vtrain.engine.engines.plan import resolve_plan
    from vtrain.models.dino.msda import auto_impl

    setup = _setup(row)
    flags = ENGINES[row["engine"]]
    cfg = RunConfig(task="dino", model=ModelConfig(preset=row["preset"], grad_ckpt=list(GC_CHOICES[row["gc"]])),
                    optim=OptimConfig(lr=1e-4, weight_decay=1e-4, clip_grad=0.1),
                    parallel=ParallelConfig(mixed_precision=row["precision"], fsdp=flags.get("fsdp", False),
                                            ds_config=str(ROOT / flags["ds_config"]) if "ds_config" in flags else None),
                    train=TrainConfig(batch_size=row["batch_size"], output_dir="/tmp/vtrain-dino-matrix"))
    plan = resolve_plan(cfg)
    accelerator = build_accelerator(plan, 1)
    engine = build_engine(plan, accelerator)
    device = accelerator.device
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    model = engine.shard(build_model(setup))
    model, _ = engine.prepare(model, build_optimizer(model, cfg.optim, plan))
    model.train()
    # every input on the device, num_targets too (estimate_memory_vs_cuda.py left it on the CPU and crashed)
    inputs = {k: v.to(device) for k, v in step_inputs(setup, torch.device("cpu")).items()}
    inputs["images"] = inputs["images"].to(engine.input_dtype)

    phase_peaks: dict[str, float] = {}

    def mark(phase: str | None) -> None:
        """On a GPU: the allocator's peak of the phase that ended (forward, backward, optimizer), then a new one."""
        if not cuda:
            return
        if phase is not None:
            phase_peaks[phase] = max(phase_peaks.get(phase, 0.0), torch.cuda.max_memory_allocated() / GiB)
        torch.cuda.reset_peak_memory_stats()

    def step() -> None:
        mark(None)
        with auto_impl(row["msda"]), engine.sync_context(True):
            with engine.forward_context():
                out = model(**inputs)
            mark("forward")
            engine.backward(out["loss"], 1)
            mark("backward")
        engine.step(cfg.optim.clip_grad)
        mark("optimizer")

    for _ in range(row["warmup"]):
        step()
    times, peak, reserved = [], None, None
    phase_peaks.clear()  # the warm-up steps (the first one makes the optimizer's states) are not measured
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    else:
        # the profiler slows a step down: it measures one extra step, which is not timed. It counts from zero,
        # so what was alive before the step is added, as max_memory_allocated includes it on a GPU
        gc.collect()
        peak = (_alive_cpu_bytes() + profiled_peak(step)) / GiB
    for _ in range(row["steps"]):
        t0 = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    if cuda:
        # every phase was measured on its own (the peak statistics are reset between phases): the step's peak is
        # the largest of them
        peak = max(phase_peaks.values())
        reserved = torch.cuda.max_memory_reserved() / GiB
    sec = statistics.median(times)
    at = max(phase_peaks, key=phase_peaks.get) if phase_peaks else None
    return {"peak_gib": peak, "reserved_gib": reserved, "s_per_iter": sec, "images_per_s": row["batch_size"] / sec,
            "phase_peaks_gib": phase_peaks or None, "peak_phase": at}


def run_row(row: dict) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # each child is its own one-process world
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(row)], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1])
    err = (proc.stderr.strip().splitlines() or ["exit code %d" % proc.returncode])[-1]
    return {"peak_gib": None, "reserved_gib": None, "s_per_iter": None, "images_per_s": None,
            "error": "OOM" if "OutOfMemoryError" in proc.stderr else err[-200:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default=None, help="default swin-l on a GPU, debug on a CPU")
    ap.add_argument("--image-size", default=None, help="HxW, default 800x1333 on a GPU, 128x160 on a CPU")
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--targets", type=int, default=10, help="boxes per image")
    ap.add_argument("--precision", default="no,bf16", help="comma list of no, bf16")
    ap.add_argument("--gc", default=",".join(GC_CHOICES), help=f"comma list of {', '.join(GC_CHOICES)}")
    ap.add_argument("--engine", default=",".join(ENGINES), help=f"comma list of {', '.join(ENGINES)}")
    ap.add_argument("--msda", default="auto", choices=["auto", "triton", "pytorch"],
                    help="deformable attention (auto: Triton on CUDA, PyTorch on CPU)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 6 on a GPU, 3 on a CPU)")
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))), flush=True)
        return
    from vtrain.engine.step_costs import run_facts
    from vtrain.memory.sizing import estimate

    cuda = torch.cuda.is_available()
    preset = args.preset or ("swin-l" if cuda else "debug")
    h, w = (int(x) for x in (args.image_size or ("800x1333" if cuda else "128x160")).split("x"))
    steps = args.steps or (6 if cuda else 3)
    name = torch.cuda.get_device_name() if cuda else "cpu"
    msda = args.msda if args.msda != "auto" else ("triton" if cuda else "pytorch")
    if msda == "triton" and not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--msda triton on a CPU needs TRITON_INTERPRET=1")

    rows = []
    header = ("| precision | GC | engine | deformable attn | peak allocated GiB | reserved GiB | s/iter | images/s | "
              "estimate GiB | estimate error | peak at (estimate / measured) |")
    lines = [header, "|---" * (header.count("|") - 1) + "|"]
    print("\n".join(lines), flush=True)
    for engine, precision, gc_parts in itertools.product(args.engine.split(","), args.precision.split(","),
                                                         args.gc.split(",")):
        row = {"precision": precision, "gc": gc_parts, "engine": engine, "msda": msda, "preset": preset,
               "image_size": [h, w], "batch_size": args.batch_size, "targets": args.targets,
               "warmup": args.warmup, "steps": steps}
        setup = _setup(row)
        est = estimate(setup, facts=run_facts(setup))
        # estimate-memory's total and its timeline, without the fixed CUDA-context allowance (max_memory_allocated
        # does not see the context either)
        row["estimate_gib"] = (est.total - est.overhead) / GiB
        row["estimate_peak_at"] = est.peak_at
        row["estimate_phase"] = next(p.phase for p in est.points if p.where == est.peak_at)
        row["estimate_phases_gib"] = {p.phase: (p.total - p.parts["overhead"]) / GiB for p in est.points
                                      if not p.where.startswith("later")}
        m = run_row(row)
        row.update(m, device=name, torch=torch.__version__)
        rows.append(row)

        def f(x, fmt):
            return m.get("error", "-") if m["peak_gib"] is None else ("-" if x is None else format(x, fmt))

        err = "-" if m["peak_gib"] is None else \
            f"{100 * (row['estimate_gib'] - m['peak_gib']) / m['peak_gib']:+.1f}%"
        lines.append(f"| {precision} | {gc_parts} | {engine} | {msda} | {f(m['peak_gib'], '.3f')} | "
                     f"{f(m['reserved_gib'], '.3f')} | {f(m['s_per_iter'], '.3f')} | {f(m['images_per_s'], '.2f')} | "
                     f"{row['estimate_gib']:.3f} | {err} | {row['estimate_phase']} / {m.get('peak_phase') or '-'} |")
        print(lines[-1], flush=True)
    title = (f"DINO {preset}, batch {args.batch_size}, {h}x{w}, {args.targets} boxes/image, {name}, torch "
             f"{torch.__version__}; median of {steps} steps after {args.warmup}\n\n"
             f"command: python benchmarks/dino_memory_matrix.py --preset {preset} --image-size {h}x{w} "
             f"--precision {args.precision} --gc {args.gc} --engine {args.engine} --msda {args.msda}\n\n")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / f"dino_memory_matrix_{'cuda' if cuda else 'cpu'}"
    stem.with_suffix(".md").write_text(title + "\n".join(lines) + "\n")
    stem.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    print(f"\nwrote {stem}.md and .json")


if __name__ == "__main__":
    main()
