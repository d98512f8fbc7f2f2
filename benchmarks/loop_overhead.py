"""vtrain's training loop vs a minimal hand-written loop on the same model, data and settings.

Per case, in one run of this script:
- **vtrain**: `python -m vtrain train ...` (the real CLI, one process), timed by its own log: the `samples_per_s`
  of the last `--log-every` window, so the first window (start-up, first batches, allocator warm-up) is left out;
- **bare**: the same config's task, model (`task.build_model`), dataset, collate function and DataLoader settings,
  the same AdamW parameter groups (`build_optimizer`) and the same autocast precision; per step only
  `to(device)` -> forward -> backward -> `optimizer.step()` -> `zero_grad`, with no logging, no clipping and no
  host read of anything; timed over the same number of steps after the same warm-up, with a device
  synchronisation at both ends.

The ratio vtrain / bare is the loop's efficiency (goals on one H100: >= 0.92 face ViT-B, >= 0.97 DINO
Swin-L). With `--compile` both loops compile the model's blocks the same way (`vtrain train --compile`, and
`engine.compile.apply_compile` on the bare loop's model), the warm-up steps include the compilation (and DINO's one
recompile with dynamic sizes), and the rows carry `"compile": true`; compare their images/s with a run without
`--compile` for what compiling buys (docs/compile.md). Usage (from the repository root):

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/loop_overhead.py            # CPU cases
    PYTHONPATH=$PWD python benchmarks/loop_overhead.py --gpu                        # the issue's GPU cases
    PYTHONPATH=$PWD python benchmarks/loop_overhead.py --gpu --compile              # the same, regional compile
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parent.parent

# (name, task, flags); the CPU cases are small enough for a 2-core machine, the GPU ones are the settings
CPU_CASES = [
    ("face debug", "metric", ["--model", "debug", "--batch-size", "32", "--num-workers", "2"]),
    ("dino debug", "dino", ["--model", "debug", "--batch-size", "2", "--image-size", "256", "--num-workers", "2"]),
]
GPU_CASES = [
    ("face vit-b", "metric", ["--model", "vit-b", "--batch-size", "256", "--num-workers", "12",
                              "--mixed-precision", "bf16"]),
    ("dino swin-l", "dino", ["--model", "swin-l", "--batch-size", "2", "--image-size", "800", "--num-workers", "8",
                             "--mixed-precision", "bf16"]),
]


def _flags_to_overrides(task: str, flags: list[str]) -> dict[str, dict]:
    """The config's own flag -> field mapping (each field declares its flag: vtrain/config/), so both loops read one
    config; `resolve` coerces the values as it does a --config file's."""
    from vtrain.config import FLAG_SECTIONS, flag_of

    by_flag = {flag_of(n): (section, n) for section, names in FLAG_SECTIONS.items() for n in names}
    out: dict[str, dict] = {section: {} for section in FLAG_SECTIONS}
    for flag, value in zip(flags[::2], flags[1::2]):
        section, name = by_flag[flag]
        out[section][name] = value
    return out


def run_vtrain(task: str, flags: list[str], warmup: int, steps: int, out: Path) -> float:
    """images/s of the last log window (`steps` steps after `warmup`), through the real CLI."""
    args = [sys.executable, "-m", "vtrain", "train", "--task", task, "--data", "demo", "--output-dir", str(out),
            "--max-steps", str(warmup + steps), "--log-every", str(steps), "--save-every", "100000", *flags]
    if warmup % steps:
        raise SystemExit("--warmup must be a multiple of --steps (one log window per measurement)")
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    if proc.returncode != 0:
        raise SystemExit(f"vtrain train failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return rows[-1]["samples_per_s"]


def run_bare(task: str, flags: list[str], warmup: int, steps: int, compile_blocks: bool = False) -> float:
    """images/s of the minimal loop over `steps` steps after `warmup`, same model/data/optimizer/precision (and the
    same compiled blocks with `compile_blocks`)."""
    from vtrain.config import build_config
    from vtrain.engine.compile import apply_compile
    from vtrain.engine.optim import build_optimizer
    from vtrain.engine.engines.plan import resolve_plan
    from vtrain.engine.precision import autocast
    from vtrain.tasks import build_task

    overrides = _flags_to_overrides(task, flags)
    overrides["train"]["output_dir"] = tempfile.mkdtemp(prefix="bare-")
    cfg = build_config(task, None, overrides)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    plan = resolve_plan(cfg)  # one process: the single-process plan, its resolved precision
    precision = plan.precision
    torch.manual_seed(cfg.train.seed)
    t = build_task(cfg)
    dataset = t.train_dataset()
    model = t.build_model().to(device).train()
    if compile_blocks:
        apply_compile(model, sizes_vary=t.input_sizes_vary)  # as `vtrain train --compile` does
    optimizer = build_optimizer(model, cfg.optim, plan)  # the same AdamW parameter groups as vtrain
    workers = cfg.data.num_workers
    loader = DataLoader(dataset, batch_size=cfg.train.batch_size, shuffle=True, drop_last=True,
                        num_workers=workers, collate_fn=t.collate_fn, persistent_workers=workers > 0,
                        pin_memory=device.type == "cuda")

    def batches():
        while True:
            yield from loader

    stream = batches()

    def step() -> None:
        inputs = {k: v.to(device, non_blocking=True) for k, v in t.model_inputs(next(stream)).items()}
        with autocast(device.type, precision):
            loss = model(**inputs)["loss"]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    return steps * cfg.train.batch_size / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpu", action="store_true", help="the issue's GPU cases (face ViT-B, DINO Swin-L)")
    ap.add_argument("--warmup", type=int, default=10, help="steps before timing (a multiple of --steps)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps")
    ap.add_argument("--only", default=None, help="run only the case whose name contains this")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    ap.add_argument("--compile", action="store_true",
                    help="both loops with regional torch.compile (`vtrain train --compile`); rows marked compile")
    a = ap.parse_args()
    if a.gpu and not torch.cuda.is_available():
        raise SystemExit("--gpu: no CUDA device")
    cases = [c for c in (GPU_CASES if a.gpu else CPU_CASES) if a.only is None or a.only in c[0]]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    rows = []
    print(f"device: {device}; warm-up {a.warmup} steps, timed {a.steps} steps; torch {torch.__version__}"
          + ("; regional torch.compile" if a.compile else ""))
    print("| case | flags | bare images/s | vtrain images/s | vtrain / bare |")
    print("|---|---|---|---|---|")
    for name, task, flags in cases:
        bare = run_bare(task, flags, a.warmup, a.steps, a.compile)
        with tempfile.TemporaryDirectory() as tmp:
            ours = run_vtrain(task, flags + (["--compile"] if a.compile else []), a.warmup, a.steps,
                              Path(tmp) / "run")
        rows.append({"case": name, "task": task, "flags": flags, "compile": a.compile, "bare_images_per_s": bare,
                     "vtrain_images_per_s": ours, "ratio": ours / bare, "device": device})
        shown = " ".join(flags) + (" --compile" if a.compile else "")
        print(f"| {name} | `{shown}` | {bare:.1f} | {ours:.1f} | {ours / bare:.3f} |", flush=True)
    if a.json is not None:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
