"""`--grad-ckpt auto` in a training run: the recompute plan for this run's memory budget, made before the model
is built and the same on every rank (the planner itself: vtrain/memory/planner.py, docs/recompute.md §4).

The plan is made on rank 0 and broadcast: the traces are deterministic, but a plan computed once cannot disagree
with itself, and the other ranks need not spend a minute of CPU each on it. Every rank then applies it to its
own model and reports what its live blocks do (run_info.json), so a disagreement would show there.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vtrain import recompute
from vtrain.config import RunConfig
from vtrain.dist import broadcast_from_main
from vtrain.engine.engines.build import engine_class
from vtrain.engine.engines.plan import Plan as LaunchPlan
from vtrain.engine.step_costs import run_facts
from vtrain.errors import VtrainError
from vtrain.memory.planner import Plan, plan as make_plan
from vtrain.memory.setup import Setup, run_setup
from vtrain.memory.sizing import GiB
from vtrain.models.recompute_units import active_hidden_recompute, apply_recompute, set_hidden_recompute

# What the default budget leaves free on a GPU: the caching allocator reserves more than the tensors it holds
# (fragmentation). vtrain's H100 measurement (docs/gpu_h100.md §1) saw reserved exceed the peak allocated by
# 0.9-2.4 GiB, up to 20% of it on the smallest row, so: the larger of 2.5 GiB and 10% of the device.
MARGIN_BYTES = int(2.5 * GiB)
MARGIN_SHARE = 0.10


def default_budget(device: torch.device) -> int:
    """Bytes the planner may fill on `device` (a GPU): its memory less the fragmentation margin."""
    total = torch.cuda.get_device_properties(device).total_memory
    return total - max(MARGIN_BYTES, int(MARGIN_SHARE * total))


def run_setup_for(cfg: RunConfig, launch: LaunchPlan, num_classes: int, device: torch.device) -> Setup:
    """The estimator's Setup of this very run: model, micro-batch, largest input, precision, engine and its
    partitioning over the launched processes, the class count of the data, and the device's autocast rules."""
    engine: dict[str, Any] = {"gpus": launch.world_size, "num_classes": num_classes,
                              "autocast_policy": "cuda" if device.type == "cuda" else "cpu",
                              **engine_class(launch).estimator_fields(launch)}
    return run_setup(cfg, launch.precision, **engine)


def choose(cfg: RunConfig, launch: LaunchPlan, num_classes: int, device: torch.device) -> Plan | None:
    """The plan of a `--grad-ckpt auto` run (None otherwise), made on rank 0 and broadcast (a user error, e.g.
    nothing fits, reaches every rank and is printed once). Collective when the run is `auto`."""
    if not recompute.parse(cfg.model.grad_ckpt).auto:
        return None

    def make() -> Plan:
        budget = cfg.model.memory_budget
        if budget is None and device.type != "cuda":
            raise VtrainError("--grad-ckpt auto: give --memory-budget GIB on a CPU (there is no device memory to "
                              "read; the budget is per process, in estimate-memory's terms)")
        setup = run_setup_for(cfg, launch, num_classes, device)
        p = make_plan(setup, int(budget * GiB) if budget is not None else default_budget(device),
                      facts=run_facts(setup, cfg.optim))
        p.trace = p.least_trace = None  # the recordings stay here: only the decision travels
        return p

    return broadcast_from_main(make)


def apply(model: nn.Module, p: Plan) -> None:
    """Put the plan on a built model (before any engine wraps it)."""
    apply_recompute(model, p.modes)
    set_hidden_recompute(model, p.ffn_units)


def report(model: nn.Module, p: Plan) -> dict[str, Any]:
    """For run_info.json: the plan this rank received, and which FFN units its live modules remake (the
    checkpointed units are read back beside it, as `grad_ckpt`)."""
    return {"memory_plan": p.to_dict(), "ffn_recompute": recompute.compact(active_hidden_recompute(model)) or "none"}
