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
from vtrain.config import NECK_NORMS, ModelConfig, build_config, check_neck_batch, read_yaml
from vtrain.config.ds_json import bucket_sizes, check_structure, explicit_16bit, read_json, stage3_sizes, zero_settings
from vtrain.engine.engines.plan import resolve_precision
from vtrain.engine.step_costs import run_facts
from vtrain.errors import VtrainError
from vtrain.memory.planner import Plan, plan as make_plan
from vtrain.memory.setup import Setup, run_setup
from vtrain.memory.sizing import GiB, Estimate, estimate, max_batch_that_fits
from vtrain.memory.trace import StepTrace, trace
from vtrain.presets import presets_for
from vtrain.tasks.dino import test_sizes


def _at_least_one(value: int, flag: str) -> int:
    """A count option's value (batch size, accumulation, GPUs, classes): one error line below 1."""
    if value < 1:
        raise VtrainError(f"{flag}: must be >= 1")
    return value


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


def setup_from(*, model=None, task=None, batch_size=None, image_size=None, precision=None, grad_ckpt=None,
               zero=None, fsdp=None, offload=None, gpus=1, num_classes=None, config=None, ds_config=None,
               head_parallel=None, sample_rate=None, memory_budget=None, neck_norm=None, grad_accum=None) -> Setup:
    """A Setup from `vtrain train`'s config file (if any), then explicit flags; validated here (CLI boundary).
    `memory_budget` (GiB; or the config's `model.memory_budget` with `grad_ckpt: [auto]`) asks for a recompute
    plan: the Setup's own checkpointing is then empty and the planner fills it."""
    s = Setup()
    auto = False
    if config is not None:
        cfg = build_config(None, read_yaml(config))
        s = run_setup(cfg, resolve_precision(cfg.parallel.mixed_precision), fsdp=cfg.parallel.fsdp)
        auto = recompute.parse(cfg.model.grad_ckpt).auto
        memory_budget = memory_budget if memory_budget is not None else cfg.model.memory_budget
        ds_config = ds_config or cfg.parallel.ds_config
    elif task == "metric":
        s.task, s.preset, s.image_size, s.batch_size, s.num_classes = "metric", "vit-b", (112, 112), 128, 10_000
    if task is not None and task != s.task:
        s.task = task
    if ds_config:
        for k, v in _ds_fields(ds_config).items():
            setattr(s, k, v)
    if model is not None:
        s.preset = model
    names = presets_for(s.task)
    if s.preset not in names:
        raise VtrainError(f"--model: unknown {s.task} preset {s.preset!r}; choose one of: {', '.join(names)}")
    if batch_size is not None:
        s.batch_size = _at_least_one(batch_size, "--batch-size")
    if grad_accum is not None:
        s.grad_accum = _at_least_one(grad_accum, "--grad-accum")
    if image_size is not None:
        s.image_size = parse_image_size(image_size, s.task)
    if precision is not None:
        s.precision = resolve_precision(precision)
    try:
        spec = recompute.parse(grad_ckpt if grad_ckpt is not None else s.grad_ckpt)
        recompute.check_parts(spec, s.task)
    except recompute.SpecError as e:
        raise VtrainError(f"--grad-ckpt: {e}; forms: {recompute.FORMS}") from None
    auto = spec.auto or (auto and grad_ckpt is None)
    s.grad_ckpt = () if spec.auto else tuple(spec.canonical())
    if memory_budget is not None:
        if not 0 < memory_budget < float("inf"):
            raise VtrainError(f"--memory-budget: must be a positive number of GiB, got {memory_budget}")
        if s.grad_ckpt:
            raise VtrainError(f"--memory-budget: plans the checkpointing itself; leave out --grad-ckpt "
                              f"{','.join(s.grad_ckpt)} (or give --grad-ckpt auto)")
        s.memory_budget = float(memory_budget)
    elif auto:
        raise VtrainError("--grad-ckpt auto: estimate-memory needs --memory-budget GIB (a training run on a GPU "
                          "takes the device's memory; here there is no device to read)")
    if zero is not None:
        if zero not in (0, 1, 2, 3):
            raise VtrainError("--zero: choose 0, 1, 2 or 3")
        s.zero = zero
    if fsdp:
        s.fsdp = True
    if s.fsdp and s.zero:
        raise VtrainError("--fsdp: cannot be combined with --zero (choose DeepSpeed or FSDP)")
    if offload is not None:
        if offload not in ("none", "optimizer", "all"):
            raise VtrainError("--offload: choose none, optimizer or all")
        s.offload = offload
    if s.offload == "all" and s.zero != 3:
        raise VtrainError("--offload all: parameter offload needs --zero 3")
    if s.offload != "none" and not s.zero:
        raise VtrainError("--offload: offloading needs DeepSpeed (--zero 1-3)")
    s.gpus = _at_least_one(gpus, "--gpus")
    if num_classes is not None:
        s.num_classes = _at_least_one(num_classes, "--num-classes")
    if head_parallel is not None:
        if head_parallel not in ("none", "sharded"):
            raise VtrainError("--head-parallel: choose none or sharded")
        s.head_parallel = head_parallel
    if sample_rate is not None:
        if not 0 < sample_rate <= 1:
            raise VtrainError(f"--sample-rate: must be in (0, 1], got {sample_rate}")
        s.sample_rate = sample_rate
    if s.head_parallel == "sharded" and s.task != "metric":
        raise VtrainError("--head-parallel sharded: the sharded head is the face (metric) head; add --task metric")
    if s.sample_rate < 1 and s.head_parallel != "sharded":
        raise VtrainError(f"--sample-rate {s.sample_rate}: negative sampling needs --head-parallel sharded")
    if s.head_parallel == "sharded" and s.num_classes < s.gpus:
        raise VtrainError(f"--head-parallel sharded: {s.num_classes} identities cannot be split over {s.gpus} GPUs")
    if neck_norm is not None:
        if neck_norm not in NECK_NORMS:
            raise VtrainError(f"--neck-norm: choose one of {', '.join(NECK_NORMS)}")
        if s.task != "metric":
            raise VtrainError("--neck-norm: the embedding neck is the face model's; add --task metric")
        s.neck_norm = neck_norm
    if s.task == "metric":
        check_neck_batch(s.neck_norm, s.batch_size)  # the rule `vtrain train` applies to the same run
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
