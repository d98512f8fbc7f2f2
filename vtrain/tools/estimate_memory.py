"""`vtrain estimate-memory` behind the CLI: what it estimates (one training configuration, `Setup`,
memory/setup.py, from a `vtrain train` config file and the command's flags, validated here: the CLI boundary) and
its report (the estimate of that configuration, its alternatives, where the activation bytes at the peak come from,
`--breakdown`, and with `--memory-budget` the recompute plan). Numbers only, from the pure core in vtrain/memory/;
memory_table.py renders them."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from vtrain import recompute
from vtrain.config.estimate import EstimateOptions
from vtrain.config.ds_json import bucket_sizes, check_structure, explicit_16bit, read_json, stage3_sizes, zero_settings
from vtrain.engine.engines.plan import resolve_precision
from vtrain.engine.step_costs import run_facts
from vtrain.errors import VtrainError
from vtrain.memory.planner import Plan, plan as make_plan
from vtrain.memory.setup import Setup, run_setup
from vtrain.memory.sizing import GiB, Estimate, estimate, max_batch_that_fits
from vtrain.memory.trace import StepTrace, trace
from vtrain.tasks.dino import test_sizes


def _ds_fields(path: str) -> dict[str, Any]:
    """The Setup fields a DeepSpeed JSON decides (config/ds_json.py reads it as the training run does)."""
    raw = read_json(path, "--ds-config: cannot read {path} ({error})")
    check_structure(raw, path)  # what training's config validation checks, before any value is read
    zero = zero_settings(raw)
    offload = "all" if zero.offload_params else ("optimizer" if zero.offload_optimizer else "none")
    prefetch, persistence = stage3_sizes(raw)
    return {"zero": zero.stage, "offload": offload, "ds_buckets": bucket_sizes(raw), "overlap_comm": zero.overlap_comm,
            "ds_16bit": bool(explicit_16bit(raw)), "ds_prefetch": prefetch, "ds_persistence": persistence}


def parse_image_size(text: str, task: str) -> tuple[int, int]:
    parts = text.lower().replace("×", "x").split("x")
    try:
        nums = [int(p) for p in parts]
    except ValueError:
        raise VtrainError(f"--image-size: expected HxW or S, got {text!r}") from None
    if len(nums) == 1:
        s = nums[0]
        nums = list(test_sizes(s, None)) if task == "dino" else [s, s]
    if len(nums) != 2 or min(nums) < 32:
        raise VtrainError(f"--image-size: expected HxW or S with sides >= 32, got {text!r}")
    return nums[0], nums[1]


def setup_from(opts: EstimateOptions | None = None, /, **flags: Any) -> Setup:
    """The Setup of estimate-memory's options (`opts`, or `flags` as its fields): the run config resolved and checked
    as `vtrain train` resolves one (EstimateOptions.run_config), then what only this command sets (the traced
    --image-size, the engine of --ds-config, --zero, --offload, --gpus, --num-classes), checked here. A budget
    (`--memory-budget`, or a config's `model.memory_budget` with `grad_ckpt: [auto]`) asks for a recompute plan: the
    Setup's own checkpointing is then empty and the planner fills it."""
    o = opts if opts is not None else EstimateOptions(**flags)
    cfg = o.run_config()
    s = run_setup(cfg, resolve_precision(cfg.parallel.mixed_precision), fsdp=cfg.parallel.fsdp)
    if cfg.parallel.ds_config:
        for k, v in _ds_fields(cfg.parallel.ds_config).items():
            setattr(s, k, v)
    if o.image_size is not None:
        s.image_size = parse_image_size(o.image_size, s.task)
    if recompute.parse(cfg.model.grad_ckpt).auto:
        if cfg.model.memory_budget is None:
            raise VtrainError("--grad-ckpt auto: estimate-memory needs --memory-budget GIB (a training run on a GPU "
                              "takes the device's memory; here there is no device to read)")
        s.memory_budget = float(cfg.model.memory_budget)
    if o.zero is not None:
        s.zero = o.zero
    if s.fsdp and s.zero:
        raise VtrainError("--fsdp: cannot be combined with --zero (choose DeepSpeed or FSDP)")
    if o.offload is not None:
        s.offload = o.offload
    if s.offload == "all" and s.zero != 3:
        raise VtrainError("--offload all: parameter offload needs --zero 3")
    if s.offload != "none" and not s.zero:
        raise VtrainError("--offload: offloading needs DeepSpeed (--zero 1-3)")
    s.gpus = o.gpus
    if o.num_classes is not None:
        s.num_classes = o.num_classes
    if s.head_parallel == "sharded" and s.num_classes < s.gpus:
        raise VtrainError(f"--head-parallel sharded: {s.num_classes} identities cannot be split over {s.gpus} GPUs")
    return s


# ---- the report ------------------------------------------------------------------------------------------------------

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
