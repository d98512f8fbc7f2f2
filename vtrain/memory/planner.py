"""`--grad-ckpt auto`: the recompute plan that fits a memory budget with the fewest recomputed FLOPs
(docs/recompute.md §4 has the design and its figures).

Choices per recompute unit (models/recompute_units.py): run plainly (`none`), checkpoint it fully (`full`) or
selectively (`sac`), and for a unit whose FFN can remake its hidden layer (DINO's encoder layers, models/lean.py)
`ffn`: plain, but that hidden layer made again in backward. Everything is measured by the estimator's tracer
(trace.py); nothing is assumed about a model.

1. **Measure** (3 traces, 4 with FFN units): every unit `none`, every unit `full`, every unit `sac`, every FFN unit
   `ffn`. Each trace's timeline is cut where a unit's forward or backward begins (tracker.py's marks); for each unit
   and mode: `keep`, the bytes the unit holds when the backward begins; `peak`, the most bytes live during its own
   forward or backward segments beyond what the units before it keep; the FLOPs and bytes its recomputation adds
   in backward.
2. **Predict**: peak(plan) = max over units u of [sum of `keep` of the units before u + `peak` of u], in each
   unit's chosen mode (the units before u still hold what they keep while u runs; the units after it are done
   in backward or have not run in forward). For a measured plan this is exactly its traced peak; for mixed plans
   an estimate, because savings are not additive (the peak moves).
3. **Search**: a dynamic program over the units in forward order (state: bytes kept so far, peak so far; Rotor's
   idea for chains, Beaumont et al. 2019) gives the predicted Pareto frontier of (recomputed FLOPs, then
   recomputed bytes) against the peak, independent of the budget.
4. **Verify**: walk the frontier from the cheapest plan; skip plans predicted (or traced) above the budget; trace
   the first candidate; accept it if its trace fits, else go on. The answer is always a traced plan, so it is
   exact with respect to the tracer. A larger budget accepts a plan at the same place or earlier on the frontier,
   so it never recomputes more (monotone), unless the cap of MAX_VERIFY traces is reached, after which the
   cheapest traced plan that fits is taken.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from vtrain import recompute
from vtrain.errors import VtrainError
from vtrain.memory.setup import Setup
from vtrain.memory.sizing import GiB, ModelFacts, model_facts
from vtrain.memory.engines import EngineModel, engine_model
from vtrain.memory.timeline import build as build_timeline, device_events, resident, step_point, window_grads
from vtrain.memory.trace import StepTrace, build_model, trace
from vtrain.memory.calibrate import Rates, cpu_rates
from vtrain.memory.tracker import FORWARD, RECOMPUTE
from vtrain.models.recompute_units import hidden_units, recompute_units

NONE, FULL, SAC, FFN = "none", "full", "sac", "ffn"
MAX_VERIFY = 6  # verification traces after the measurement traces (Swin-L DINO: ~15-25 s each on 2 CPU cores)
BUCKETS = 2048  # the search merges states whose keeps and peak agree to (units / BUCKETS) of the largest term


@dataclass
class Option:
    """One unit in one mode, as measured: the bytes it holds while later units run forward (`keep_f`, at the end
    of the forward: autocast still caches 16-bit weight copies there) and backward (`keep_b`, when the backward
    begins), its peak terms over those (`peak_f`, `peak_b`) and what recomputing it adds (FLOPs, bytes)."""

    keep_f: int
    keep_b: int
    peak_f: int
    peak_b: int
    flops: int
    rebytes: int


@dataclass
class Profile:
    pre: int  # peak before the first unit runs
    units: list[Option]


@dataclass
class Plan:
    """A recompute plan and what the tracer says of it (bytes per GPU, FLOPs of one step)."""

    modes: dict[str, str]  # unit -> full | sac, forward order
    ffn_units: list[str]  # units that remake their FFN hidden layer
    units: list[str]
    budget: int
    total: int  # the estimator's total with this plan (model states + activations + buffers + allowance)
    activation: int
    extra_flops: int  # FLOPs recomputed in backward
    forward_flops: int
    traces: int
    seconds: float
    least_activation: int  # the smallest activation peak any traced plan reached (for the largest batch) ...
    least_spec: str  # ... and that plan's --grad-ckpt
    trace: StepTrace | None = field(default=None, repr=False, compare=False)
    least_trace: StepTrace | None = field(default=None, repr=False, compare=False)  # the least-activation plan's
    peak_at: str = ""  # where the chosen plan's step peaks (the timeline's point)
    frontier: int = 0  # plans on the predicted frontier
    rates: Rates | None = None  # a CPU run: the calibration that ranked the plans by time
    extra_seconds: float | None = None  # ... the chosen plan's predicted recomputation time
    forward_seconds: float | None = None  # ... and the forward's, without recomputation
    fits: int = 0  # frontier plans traced and found within the budget
    rejected: list = field(default_factory=list)  # cheaper frontier plans whose trace did not fit: (choice, total)

    def items(self) -> list[str]:
        """The plan's checkpointing as `--grad-ckpt` items (its FFN choice is not part of that language)."""
        return recompute.from_units(self.modes, self.units).canonical()

    def spec(self) -> str:
        return ",".join(self.items()) or "none"

    def describe(self) -> str:
        """One line: what is recomputed, the predicted total against the budget, the FLOPs it adds."""
        parts = []
        for mode, verb in ((FULL, "recompute"), (SAC, "selective")):
            names = {u: FULL for u, m in self.modes.items() if m == mode}
            if names:
                parts.append(f"{verb} {recompute.from_units(names, self.units)}")
        if self.ffn_units:
            parts.append(f"FFN hidden layer remade in {recompute.from_units(dict.fromkeys(self.ffn_units, FULL))}")
        line = (f"{' + '.join(parts) or 'recompute nothing'}: predicted {gib(self.total)} GiB of "
                f"{gib(self.budget)}, +{100 * self.extra_flops / max(self.forward_flops, 1):.1f}% forward FLOPs")
        if self.extra_seconds is not None and self.forward_seconds:
            line += f", +{100 * self.extra_seconds / self.forward_seconds:.1f}% forward time"
        return line

    def why(self) -> str:
        """Why this plan: what it was ranked by, and what the cheaper plans on the frontier peaked at."""
        by = f"the least predicted recompute time ({self.rates.describe()})" if self.rates else "the fewest recomputed FLOPs"
        out = f"of the {self.frontier} plans on the predicted frontier, the one with {by} whose traced step peak fits"
        if self.rejected:
            over = ", ".join(f"{gib(t)}" for _, t in self.rejected[:3])
            out += f"; {len(self.rejected)} cheaper one(s) traced above the budget ({over} GiB)"
        return out + f"; the peak is at {self.peak_at}" if self.peak_at else out

    def to_dict(self) -> dict[str, Any]:
        return {"grad_ckpt": self.spec(), "units": self.modes, "ffn_units": self.ffn_units,
                "budget_gib": round(self.budget / GiB, 3), "predicted_gib": round(self.total / GiB, 3),
                "activation_gib": round(self.activation / GiB, 3), "extra_forward_flops": self.extra_flops,
                "forward_flops": self.forward_flops,
                "extra_flops_pct": round(100 * self.extra_flops / max(self.forward_flops, 1), 2),
                "traces": self.traces, "seconds": round(self.seconds, 1), "summary": self.describe(),
                "why": self.why(), "peak_at": self.peak_at,
                "extra_time_pct": (round(100 * self.extra_seconds / self.forward_seconds, 2)
                                   if self.extra_seconds is not None and self.forward_seconds else None)}


# ---- 1. measure ----------------------------------------------------------------------------------------------
def profile(t: StepTrace, em: EngineModel, later: bool = False) -> Profile:
    """Per-unit keeps, peak terms and recompute cost of one trace (the module docstring, step 1), over the device's
    view of the step (timeline.device_events: the gradients where the engine keeps them, its own buffers), so that
    the predicted curve is the timeline's forward and backward. A unit's keeps
    are what it holds at the end of the forward and when the backward begins; a segment's peak term is measured
    against the keeps of the units before it (forward keeps in the forward, backward keeps in the backward), so
    that for the traced plan itself the prediction is its traced peak exactly. (What lives only for a while, e.g.
    a unit's output until the next unit is done with it, is then part of the next unit's term: its size does not
    depend on the modes.)"""
    rec, n = t.recording, len(t.units)
    unit_of_label = [rec.unit_of[m] for m, _ in rec.labels]
    unit_of_key = [unit_of_label[label] for label in rec.label_of]
    # A tensor handed from one unit to the next only is the next unit's to keep or not: a checkpointed unit keeps
    # its input, a plain one may keep only what it computes from it. It is charged to its one consumer, so that
    # a unit's keep depends on its own mode, not on its neighbour's.
    for key, consumers in rec.inputs.items():
        if len(consumers) == 1:
            unit_of_key[key] = consumers[0]
    counted = [(i, key, d) for i, key, d, _ in device_events(t, em, later)]
    backward_at = next((i for i, direction, _ in rec.marks if direction == 1), len(rec.events))
    forward_end = rec.forward_end if 0 <= rec.forward_end <= backward_at else backward_at
    keep_f, keep_b, flops, rebytes = [0] * n, [0] * n, [0] * n, [0] * n
    for i, key, d in counted:
        w = unit_of_key[key] if key >= 0 else -1
        if w < 0:
            continue
        if i < forward_end:
            keep_f[w] += d
        if i < backward_at:
            keep_b[w] += d
        if d > 0 and rec.labels[rec.label_of[key]][1] == RECOMPUTE:
            rebytes[w] += d
    for (module, phase), f in rec.flops.items():
        if phase == RECOMPUTE and rec.unit_of[module] >= 0:
            flops[rec.unit_of[module]] += f
    before_f = [sum(keep_f[:u]) for u in range(n)]
    before_b = [sum(keep_b[:u]) for u in range(n)]
    peak_f, peak_b = [0] * n, [0] * n
    pre = live = 0
    unit = -1  # the unit whose segment runs: -1 before the first one; outside units the segment before continues
    marks = iter(rec.marks)
    mark = next(marks, None)
    for i, key, d in counted:
        while mark is not None and mark[0] <= i:
            unit = mark[2] if mark[2] >= 0 else unit
            mark = next(marks, None)
        live += d
        if unit < 0:
            pre = max(pre, live)
        elif i < backward_at:
            peak_f[unit] = max(peak_f[unit], live - before_f[unit])
        else:
            peak_b[unit] = max(peak_b[unit], live - before_b[unit])
    return Profile(pre, [Option(keep_f[u], keep_b[u], peak_f[u], peak_b[u], flops[u], rebytes[u]) for u in range(n)])


# ---- 2-3. predict and search -----------------------------------------------------------------------------------
@dataclass(order=True)
class Candidate:
    cost: tuple[int, int]  # (recomputed FLOPs or predicted ns, recomputed bytes)
    predicted: int  # activation bytes at the peak
    choice: tuple[str, ...]  # one mode per unit


def frontier(pre: int, options: list[dict[str, Option]], rates: Rates | None = None) -> list[Candidate]:
    """Plans on the predicted Pareto frontier, cheapest first, each predicted below every cheaper one. States
    (forward keeps, backward keeps, peak so far) that agree to the bucket size keep only their cheapest plan.
    The cost is the recomputed FLOPs, or with `rates` (a CPU run) the recomputation's predicted time."""
    def work(o: Option) -> int:
        return o.flops if rates is None else round(1e9 * rates.seconds(o.flops, o.rebytes))

    scale = max([pre] + [o.peak_f + o.peak_b + o.keep_f for opts in options for o in opts.values()])
    q = scale * max(len(options), 1) // BUCKETS + 1
    State = tuple[tuple[int, int], int, int, int, tuple[str, ...]]  # cost, keep_f, keep_b, peak, choice
    states: dict[tuple[int, int, int], State] = {(0, 0, 0): ((0, 0), 0, 0, pre, ())}
    for opts in options:
        new: dict[tuple[int, int, int], State] = {}
        for cost, kf, kb, peak, choice in states.values():
            for mode, o in opts.items():
                s = ((cost[0] + work(o), cost[1] + o.rebytes), kf + o.keep_f, kb + o.keep_b,
                     max(peak, kf + o.peak_f, kb + o.peak_b), choice + (mode,))
                key = (s[1] // q, s[2] // q, s[3] // q)
                old = new.get(key)
                if old is None or (s[0], s[3], s[4]) < (old[0], old[3], old[4]):
                    new[key] = s
        states = new
    out: list[Candidate] = []
    for cand in sorted(Candidate(cost, peak, choice) for cost, _, _, peak, choice in states.values()):
        if not out or cand.predicted < out[-1].predicted:
            out.append(cand)
    return out


# ---- 4. verify -------------------------------------------------------------------------------------------------
def _setup_for(setup: Setup, units: list[str], choice: tuple[str, ...]) -> Setup:
    modes = {u: m for u, m in zip(units, choice) if m in (FULL, SAC)}
    return dataclasses.replace(setup, grad_ckpt=tuple(recompute.from_units(modes, units).canonical()),
                               ffn_units=tuple(u for u, m in zip(units, choice) if m == FFN), memory_budget=None)


def plan(setup: Setup, budget: int | None = None, max_verify: int = MAX_VERIFY,
         cache: dict[tuple[str, ...], StepTrace] | None = None, facts: ModelFacts | None = None) -> Plan:
    """The cheapest traced plan whose step peaks within `budget` bytes per GPU (default: the Setup's memory_budget
    in GiB), or a VtrainError naming the smallest peak found and what else would help. `cache`: traces by plan
    from earlier calls with the same Setup (a budget sweep); the traces are deterministic, so reusing them changes
    nothing. `facts`: the model's facts with the run's optimizer groups (sizing.model_facts)."""
    t0 = time.perf_counter()
    budget = budget if budget is not None else int(setup.memory_budget * GiB)
    facts = facts or model_facts(setup)
    em = engine_model(setup, facts)
    later = setup.grad_accum > 1  # the later micro-batches of a window hold its gradients: they peak higher
    with torch.device("meta"):
        model = build_model(dataclasses.replace(setup, grad_ckpt=(), ffn_units=()))
    units, hidden = list(recompute_units(model)), set(hidden_units(model))
    traced: dict[tuple[str, ...], StepTrace] = cache if cache is not None else {}
    totals: dict[tuple[str, ...], int] = {}

    def run(choice: tuple[str, ...]) -> StepTrace:
        if choice not in traced:
            traced[choice] = trace(_setup_for(setup, units, choice))
        return traced[choice]

    def total(choice: tuple[str, ...]) -> int:
        if choice not in totals:
            totals[choice] = build_timeline(run(choice), setup, em).total
        return totals[choice]

    def extra_work(t: StepTrace) -> float:
        return t.recompute_flops if rates is None else rates.seconds(t.recompute_flops, t.written(RECOMPUTE))

    uniform = {m: tuple((m if (m != FFN or u in hidden) else NONE) for u in units)
               for m in (NONE, FULL, SAC, FFN) if m != FFN or hidden}
    profiles = {m: profile(run(c), em, later) for m, c in uniform.items()}
    base = profiles[NONE]
    options = []
    for i, u in enumerate(units):
        opts = {}
        for m, p in profiles.items():
            if m == FFN and u not in hidden:
                continue
            o = p.units[i]
            opts[m] = dataclasses.replace(o, flops=max(o.flops - base.units[i].flops, 0),
                                          rebytes=max(o.rebytes - base.units[i].rebytes, 0))
        options.append(opts)
    pre = max(p.pre for p in profiles.values())
    none_trace = traced[uniform[NONE]]
    # the plan-independent parts: what is resident through forward and backward, and the optimizer step
    constant = sum(resident(none_trace, setup, em).values()) + (
        max(window_grads(none_trace, em) - em.resident_grads, 0) if later else 0)
    floor = step_point(none_trace, setup, em).total
    measured = len(traced)  # the cap counts the traces this call adds
    chosen = None
    rates = None if setup.on_gpu else cpu_rates(torch.bfloat16 if setup.precision == "bf16" else torch.float32)
    frontier_plans = frontier(pre, options, rates)
    for cand in frontier_plans:
        predicted = total(cand.choice) if cand.choice in traced else max(constant + cand.predicted, floor)
        if predicted > budget:
            continue
        if cand.choice not in traced and len(traced) - measured >= max_verify:
            break
        if total(cand.choice) <= budget:
            chosen = cand.choice
            break
    if chosen is None:  # the cap was reached, or nothing predicted to fit did: the cheapest traced plan that fits
        fits = [c for c in traced if total(c) <= budget]
        chosen = min(fits, key=lambda c: (extra_work(traced[c]), c), default=None)
        if chosen is None:
            smallest = min(traced, key=lambda c: (total(c), c))
            raise NothingFits(total(smallest), budget, _setup_for(setup, units, smallest), setup)
    t = traced[chosen]
    tl = build_timeline(t, setup, em)
    none = traced[uniform[NONE]]
    least = min(traced, key=lambda c: (traced[c].activation, c))
    return Plan(modes={u: m for u, m in zip(units, chosen) if m in (FULL, SAC)},
                ffn_units=[u for u, m in zip(units, chosen) if m == FFN], units=units, budget=budget,
                total=tl.total, activation=t.activation,
                extra_flops=t.recompute_flops - none.recompute_flops, forward_flops=none.forward_flops,
                traces=len(traced), seconds=time.perf_counter() - t0, least_activation=traced[least].activation,
                least_spec=",".join(_setup_for(setup, units, least).grad_ckpt) or "none", trace=t,
                least_trace=traced[least],
                peak_at=tl.peak.where, frontier=len(frontier_plans), rates=rates,
                extra_seconds=rates.seconds(t.recompute_flops - none.recompute_flops,
                                            t.written(RECOMPUTE) - none.written(RECOMPUTE)) if rates else None,
                forward_seconds=rates.seconds(none.forward_flops, none.written(FORWARD)) if rates else None,
                fits=sum(1 for c in frontier_plans if c.choice in totals and totals[c.choice] <= budget),
                rejected=[(c.choice, totals[c.choice]) for c in frontier_plans
                          if c.choice in totals and totals[c.choice] > budget])


def gib(n: int) -> str:
    """GiB with two decimals, three below 1 GiB (the debug presets)."""
    return f"{n / GiB:.2f}" if n >= GiB else f"{n / GiB:.3f}"


class NothingFits(VtrainError):
    """No traced plan fits the budget: the message names the smallest peak and what else would help."""

    def __init__(self, smallest: int, budget: int, best: Setup, setup: Setup) -> None:
        helps = ["a smaller --batch-size"]
        if not (setup.zero == 3 and setup.offload == "all"):
            helps.append("ZeRO-3 with offload (--ds-config ds_configs/zero3_offload.json)")
        if setup.sharded_head:
            helps.append("more GPUs for the sharded head (each holds 1/N of its rows)")
        gc = ",".join(best.grad_ckpt) or "none"
        super().__init__(f"--memory-budget {budget / GiB:g}: nothing fits: the smallest predicted peak is "
                         f"{gib(smallest)} GiB per GPU (--grad-ckpt {gc}); what else would help: "
                         f"{', '.join(helps)}")
        self.smallest = smallest
