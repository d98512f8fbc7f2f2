"""`vtrain estimate-memory`'s report: the estimate of one configuration, its alternatives, where the activation
bytes at the peak come from (`--breakdown`) and, with `--memory-budget`, the recompute plan. Numbers only, from
the pure core in vtrain/memory/; memory_table.py renders them."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from vtrain.engine.step_costs import run_facts
from vtrain.memory.planner import Plan, plan as make_plan
from vtrain.memory.setup import Setup
from vtrain.memory.sizing import GiB, Estimate, estimate, max_batch_that_fits
from vtrain.memory.trace import StepTrace, trace

ENGINES = [dict(zero=0, fsdp=False, offload="none"), dict(zero=1, fsdp=False, offload="none"),
           dict(zero=2, fsdp=False, offload="none"), dict(zero=3, fsdp=False, offload="none"),
           dict(zero=3, fsdp=False, offload="optimizer"), dict(zero=3, fsdp=False, offload="all"),
           dict(zero=0, fsdp=True, offload="none")]


def _gib(est: Estimate) -> dict[str, float]:
    keys = ("parameters", "gradients", "optimizer", "activations", "temporary", "overhead", "total", "cpu_offloaded",
            "activation_peak")
    d = est.to_dict()
    return {k: round(d[k] / GiB, 3) for k in keys}


def breakdown(t: StepTrace, top: int) -> dict[str, Any]:
    """The activation bytes live at the peak by module (qualified name; "" is the model's own forward) and phase
    (forward; recompute: made again in backward; backward: gradients and temporaries of the backward): the `top`
    largest rows, the rest as one "other" entry, and the same bytes per recompute unit. Everything sums exactly to
    the activation figure."""
    rows = t.breakdown()
    unit_names = t.units + ["(outside units)"]
    by_unit = [0] * len(unit_names)
    for r in rows:
        by_unit[r.unit] += r.bytes
    shown, rest = rows[:top], rows[top:]
    return {"activation_bytes": t.activation,
            "rows": [{"module": r.module, "phase": r.phase, "bytes": r.bytes, "unit": unit_names[r.unit]}
                     for r in shown],
            "other": {"rows": len(rest), "bytes": sum(r.bytes for r in rest)},
            "by_unit": [{"unit": u, "bytes": n} for u, n in zip(unit_names, by_unit) if n]}


def planned(setup: Setup, p: Plan) -> Setup:
    """The Setup with a plan's checkpointing and FFN choice, as the planned run executes it."""
    return dataclasses.replace(setup, grad_ckpt=tuple(p.items()), ffn_units=tuple(p.ffn_units), memory_budget=None)


def estimate_report(setup: Setup, gpu_memory_gib: float = 24.0, compare_gc: bool = True,
                    breakdown_rows: int = 0) -> dict[str, Any]:
    """The chosen configuration (with `setup.memory_budget`: the planner's), its alternatives (checkpointing
    choices: traced; engines and offload: the same trace under other engines), the largest batch within
    `gpu_memory_gib` (or the budget), the step's timeline, and with `breakdown_rows` the activation breakdown at
    the activation peak."""
    t0 = time.perf_counter()
    facts = run_facts(setup)
    p = make_plan(setup, facts=facts) if setup.memory_budget is not None else None
    if p is not None:
        setup, main = planned(setup, p), p.trace
        gpu_memory_gib = setup_budget = p.budget / GiB
    else:
        main = trace(setup)
        setup_budget = None
    seconds = time.perf_counter() - t0
    chosen = estimate(setup, main, facts)
    gc_choices = [(), ("backbone",), ("backbone", "encoder"), ("backbone", "encoder", "decoder")] \
        if setup.task == "dino" else [(), ("backbone",)]
    rows = []
    if compare_gc:
        for gc in gc_choices:
            if gc == tuple(setup.grad_ckpt) and setup.ffn_units is None:
                continue
            alt = dataclasses.replace(setup, grad_ckpt=gc, ffn_units=None)
            rows.append(("checkpointing", alt, estimate(alt, trace(alt), facts)))
    for kw in ENGINES:
        alt = dataclasses.replace(setup, **kw)
        if (alt.zero, alt.fsdp, alt.offload) == (setup.zero, setup.fsdp, setup.offload):
            continue
        rows.append(("engine", alt, estimate(alt, main, facts)))
    budget = int(gpu_memory_gib * GiB)
    report = {
        "setup": dataclasses.asdict(setup),
        "params_total": chosen.params_total, "params_trainable": chosen.params_trainable,
        "estimate_gib": _gib(chosen), "peak_at": chosen.peak_at,
        "timeline": [{"where": pt.where, "phase": pt.phase, **{k: round(v / GiB, 3) for k, v in pt.parts.items()},
                      "total": round(pt.total / GiB, 3)} for pt in chosen.points],
        "notes": chosen.notes,
        "max_batch_size": max_batch_that_fits(chosen, budget), "gpu_memory_gib": gpu_memory_gib,
        "alternatives": [{"kind": kind, "label": alt.label(), **_gib(est),
                          "max_batch_size": max_batch_that_fits(est, budget)} for kind, alt, est in rows],
        "trace_seconds": round(seconds, 1),
    }
    if p is not None:
        least = estimate(setup, p.least_trace, facts)
        report["plan"] = {**p.to_dict(), "max_batch_size": max_batch_that_fits(least, budget),
                          "max_batch_grad_ckpt": p.least_spec}
        report["memory_budget_gib"] = setup_budget
    if breakdown_rows:
        report["breakdown"] = breakdown(main, breakdown_rows)
    return report
