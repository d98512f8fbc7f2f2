"""`vtrain estimate-memory` against real training steps on CPU: the predicted total (the largest point of the
step's timeline) and activation peak beside what the CPU allocator counted (benchmarks/step_memory.py: every
tensor storage of the run, from before the model is built), row by row.

Rows (fp32 on this CPU, the estimate for a CPU run: CPU autocast rules, the PyTorch deformable attention, no
CUDA allowance):
- DINO Swin-L 5-scale, batch 1, at 512x683 and 320x427, four recompute plans each, one process (the study of
  issue 34; `auto@B`: the plan `--grad-ckpt auto --memory-budget B` chooses);
- face ViT-B at 112x112, batch 8 per process, a dense head of 10,000 identities: one process, DDP, ZeRO-2 and
  ZeRO-3 on 2 gloo processes; and `--head-parallel sharded` with 100,000 identities on 2 processes (DDP);
- the debug presets (the test's cases).
Every rank is measured; the table shows rank 0 and the largest rank. Step times are the median of the steps
after the first, on a shared machine: compare them only within a group (the same model and size).

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/estimate_memory_cpu.py [--only NAME,...] [--list] [--predict-only]

`--predict-only` prints the rows' plans and predictions (the planner's choice for `auto@B`) and measures nothing.

Results: benchmarks/results/estimate_memory_cpu.json (rows kept across runs, replaced by name) and .md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import step_memory  # noqa: E402  (the sibling script: run as `python benchmarks/estimate_memory_cpu.py`)

RESULTS = HERE / "results" / "estimate_memory_cpu"
MiB = 2**20
SWIN = dict(task="dino", preset="swin-l", batch_size=1, precision="no", num_classes=80, num_targets=10, steps=2,
            engine="single", world=1)
FULL = ["backbone", "encoder", "decoder"]
FACE = dict(task="metric", preset="vit-b", batch_size=8, image_size=[112, 112], precision="no", num_classes=10_000,
            steps=3, grad_ckpt=[])
DEBUG = dict(task="dino", preset="debug", batch_size=2, image_size=[128, 160], num_classes=5, num_targets=3, steps=3,
             engine="single", world=1)


def rows() -> list[dict]:
    out = []
    for size, budgets in (([512, 683], (5.3, 6.2, 7.5)), ([320, 427], (3.7, 4.2, None))):
        group = f"Swin-L DINO {size[0]}x{size[1]}"
        plans = [("full", dict(grad_ckpt=FULL))] + [(f"auto@{b}", dict(budget=b, grad_ckpt=[])) for b in budgets if b]
        if size[0] == 320:
            plans.insert(0, ("default", dict(grad_ckpt=[])))  # no checkpointing, FFN hidden layers remade
        for name, extra in plans:
            out.append({**SWIN, "image_size": size, "group": group, "name": f"swinl-{size[0]}-{name}", **extra})
    for engine, world in (("single", 1), ("ddp", 2), ("zero2", 2), ("zero3", 2)):
        out.append({**FACE, "engine": engine, "world": world, "group": "face ViT-B 112, dense 10k",
                    "name": f"vitb-dense-{engine}"})
    out.append({**FACE, "engine": "ddp", "world": 2, "num_classes": 100_000, "head_parallel": "sharded",
                "group": "face ViT-B 112, sharded 100k", "name": "vitb-sharded-ddp"})
    for precision in ("no", "bf16"):
        for gc in ([], ["backbone", "encoder"]):
            out.append({**DEBUG, "precision": precision, "grad_ckpt": gc, "group": "DINO debug 128x160",
                        "name": f"debug-{precision}-{'ckpt' if gc else 'none'}"})
    return out


def facts_for(setup):
    from vtrain.engine.step_costs import run_facts

    return run_facts(setup)


def predict(row: dict) -> tuple[dict, dict]:
    """The row's plan (the planner's for `auto@B`) and estimate-memory's prediction for it."""
    from vtrain.memory.planner import plan
    from vtrain.memory.sizing import GiB, estimate
    from vtrain.memory.trace import trace

    setup = step_memory.row_setup(row)
    facts = facts_for(setup)
    info = {}
    t0 = time.perf_counter()
    if "budget" in row:
        p = plan(setup, int(row["budget"] * GiB), facts=facts)
        row = {**row, "grad_ckpt": p.items(), "ffn_units": list(p.ffn_units)}
        setup = step_memory.row_setup(row)
        info["plan_line"] = p.describe()
        info["why"] = p.why()
        t = p.trace
    else:
        t = trace(setup)
    est = estimate(setup, t, facts)
    base = trace(dataclasses.replace(setup, grad_ckpt=(), ffn_units=(), ffn_recompute=False)) \
        if row["task"] == "dino" else t
    info.update(total=est.total, activation=est.activation_peak, peak_at=est.peak_at,
                points=[{"where": p.where, "total": p.total} for p in est.points],
                recompute_flops=t.recompute_flops - base.recompute_flops, forward_flops=base.forward_flops,
                seconds=round(time.perf_counter() - t0, 1))
    return row, info


def measure(row: dict) -> dict:
    ranks = step_memory.run_row(row)
    # the steady state: every step after the first (which makes the optimizer's states); its largest peak (with
    # gloo's asynchronous reductions the steps of an engine differ a little: the run needs the largest)
    steady = [max(r["steps"][1:], key=lambda s: s["peak"]) for r in ranks]
    times = [s for r in ranks[:1] for s in r["seconds"][1:]]
    return {"total": steady[0]["peak"], "total_max_rank": max(s["peak"] for s in steady), "phase": steady[0]["phase"],
            "activation": steady[0]["activation"], "first_step": ranks[0]["steps"][0]["peak"],
            "steps": [[s["peak"] for s in r["steps"]] for r in ranks],
            "step_seconds": statistics.median(times) if times else None, "active": ranks[0]["engine_active"]}


def run(row: dict) -> dict:
    planned, pred = predict(row)
    print(f"[{row['name']}] predicted {pred['total'] / MiB:.1f} MiB at {pred['peak_at']}", flush=True)
    real = measure(planned)
    out = {"name": row["name"], "group": row["group"], "row": planned, "predicted": pred, "measured": real,
           "total_error": (pred["total"] - real["total"]) / real["total"],
           "activation_error": (pred["activation"] - real["activation"]) / real["activation"],
           "when": time.strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__}
    print(f"[{row['name']}] measured {real['total'] / MiB:.1f} MiB ({real['phase']}): total {100 * out['total_error']:+.2f}%, "
          f"activations {100 * out['activation_error']:+.2f}%", flush=True)
    return out


def _plan(r: dict) -> str:
    row = r["row"]
    spec = ",".join(row.get("grad_ckpt") or []) or "none"
    ffn = row.get("ffn_units")
    if row["task"] == "dino":
        spec += "; FFN remade: " + (("all" if row.get("ffn_recompute", True) else "none") if ffn is None
                                    else (",".join(ffn) or "none"))
    return (f"auto@{row['budget']}: `{spec}`" if "budget" in row else f"`{spec}`")


def render(results: list[dict], names: list[str] | None = None) -> str:
    lines = ["# estimate-memory against real CPU steps", "",
             "Generated by `OMP_NUM_THREADS=1 nice -n 10 python benchmarks/estimate_memory_cpu.py` "
             f"({platform.machine()}, torch {torch.__version__}; a shared 2-core machine under load: times are "
             "comparable within a group only). Measured = the CPU allocator's peak of live tensor storage bytes in "
             "the last (steady-state) step, counted from before the model is built (benchmarks/step_memory.py); "
             "activations = the step's own allocations during forward and backward, gradients left out. "
             "Predicted = `vtrain estimate-memory` for a CPU run (no CUDA allowance). MiB = 2^20 bytes.", "",
             "| group | engine | plan | predicted MiB | measured MiB (max rank) | error | activations pred. / meas. "
             "MiB | error | predicted peak at / measured phase | extra fwd FLOPs | step s | time vs group's first |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    first: dict[str, float] = {}
    for r in results:
        p, m, row = r["predicted"], r["measured"], r["row"]
        eng = row["engine"] + (f" x{row['world']}" if row["world"] > 1 else "")
        flops = 100 * p["recompute_flops"] / max(p["forward_flops"], 1)
        t = m.get("step_seconds")
        step, ratio = "-", "-"
        if t:
            first.setdefault(r["group"], t)
            step, ratio = f"{t:.1f}", f"{t / first[r['group']]:.2f}"
        lines.append(f"| {r['group']} | {eng} | {_plan(r)} | {p['total'] / MiB:.1f} | {m['total'] / MiB:.1f} "
                     f"({m['total_max_rank'] / MiB:.1f}) | {100 * r['total_error']:+.2f}% | {p['activation'] / MiB:.1f}"
                     f" / {m['activation'] / MiB:.1f} | {100 * r['activation_error']:+.2f}% | {p['peak_at']} / "
                     f"{m['phase']} | +{flops:.1f}% | {step} | {ratio} |")
    worst = max((abs(r["total_error"]) for r in results), default=0)
    worst_a = max((abs(r["activation_error"]) for r in results), default=0)
    lines += ["", f"Largest error: totals {100 * worst:.2f}%, activations {100 * worst_a:.2f}% ({len(results)} rows)."]
    lines += ["", "Measured at (rows are kept across runs; benchmarks/step_memory.py's DeepSpeed marking covers every hook "
              "DeepSpeed registers since 2026-11-29 03:00): " + "; ".join(f"{r['name']} {r['when']}" for r in results)]
    missing = [n for n in (names or []) if n not in {r["name"] for r in results}]
    if missing:
        lines += ["", f"Rows not measured yet ({len(missing)}; run with `--only NAME,...`): {', '.join(missing)}. "
                  "A Swin-L DINO row is one real CPU step at a time of about 7-10 GB and minutes per step."]
    plans = [r for r in results if r["predicted"].get("plan_line")]
    if plans:
        lines += ["", "Plans chosen by `--grad-ckpt auto` (the planner's own line and why):", ""]
        lines += [f"- {r['name']}: {r['predicted']['plan_line']}; {r['predicted']['why']}" for r in plans]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default=None, help="comma list of row names")
    ap.add_argument("--list", action="store_true", help="print the row names and exit")
    ap.add_argument("--predict-only", action="store_true",
                    help="print each row's plan and prediction, measure nothing, write no results")
    a = ap.parse_args()
    all_rows = rows()
    if a.list:
        print("\n".join(r["name"] for r in all_rows))
        return
    path = RESULTS.with_suffix(".json")
    kept = {r["name"]: r for r in json.loads(path.read_text())} if path.exists() else {}
    wanted = set(a.only.split(",")) if a.only else None
    for row in all_rows:
        if wanted is not None and row["name"] not in wanted:
            continue
        if a.predict_only:
            planned, pred = predict(row)
            print(f"[{row['name']}] {_plan({'row': planned})}: predicted {pred['total'] / MiB:.1f} MiB at "
                  f"{pred['peak_at']}, +{100 * pred['recompute_flops'] / max(pred['forward_flops'], 1):.1f}% forward "
                  f"FLOPs" + (f"; {pred['plan_line']}" if "plan_line" in pred else ""), flush=True)
            continue
        kept[row["name"]] = run(row)
        ordered = [kept[r["name"]] for r in all_rows if r["name"] in kept]
        path.write_text(json.dumps(ordered, indent=1))
        RESULTS.with_suffix(".md").write_text(render(ordered, [r["name"] for r in all_rows]))


if __name__ == "__main__":
    main()
