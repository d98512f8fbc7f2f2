"""The step's timeline (vtrain/memory/timeline.py): totals against real CPU steps counted by the allocator,
the optimizer step traced from torch itself, each engine's gradients, accumulation, and recomputation counted by
what runs."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from tests.helpers.paths import ROOT
from vtrain.memory.engines import BLOCK, BUCKET, KEEP, engine_model
from vtrain.memory.setup import Setup
from vtrain.memory.sizing import estimate, model_facts
from vtrain.memory.step import optimizer_step
from vtrain.memory.timeline import build, device_events
from vtrain.memory.trace import profiled_peak, trace

sys.path.insert(0, str(ROOT / "benchmarks"))
import step_memory  # noqa: E402

DINO = Setup(task="dino", preset="debug", image_size=(96, 128), batch_size=2, precision="no", num_classes=5,
             num_targets=3, autocast_policy="cpu")
MEASURED = dataclasses.replace(DINO, grad_ckpt=("backbone", "encoder"))


def _grouped_facts(setup: Setup):
    from vtrain.engine.step_costs import run_facts

    return run_facts(setup)


@pytest.fixture(scope="module")
def dino_trace():
    """The debug DINO's trace without checkpointing, shared by the tests that only read it (traces are
    deterministic)."""
    return trace(DINO)


@pytest.fixture(scope="module")
def no_recompute_trace():
    return trace(dataclasses.replace(DINO, ffn_recompute=False))


@pytest.fixture(scope="module")
def real_step():
    """One process, the debug DINO (96x128, batch 2, fp32) with checkpointed units: two real steps through vtrain's
    engine in a fresh process, every tensor storage counted by the CPU allocator (benchmarks/step_memory.py), beside
    the estimate of the same setup. Measured once for the tests below; the larger rows (Swin-L DINO, face ViT-B,
    every engine) are benchmarks/estimate_memory_cpu.py's."""
    est = estimate(MEASURED, trace(MEASURED), _grouped_facts(MEASURED))
    row = dict(task="dino", preset="debug", batch_size=2, image_size=list(MEASURED.image_size), precision="no",
               grad_ckpt=list(MEASURED.grad_ckpt), engine="single", world=1, num_classes=5, num_targets=3, steps=2)
    (real,) = step_memory.run_row(row, timeout=900)
    return est, real


def test_predicted_total_is_the_allocators_peak_of_a_real_step(real_step):
    """The second (steady-state) step's peak, and its activation peak, against the timeline."""
    est, real = real_step
    step = real["steps"][-1]
    assert abs(est.total - step["peak"]) <= 0.05 * step["peak"], (est.total, step["peak"])
    assert abs(est.activation_peak - step["activation"]) <= 0.01 * step["activation"]


def test_each_phase_peak_is_the_timelines(real_step):
    est, real = real_step
    step = real["steps"][-1]
    by_phase = {p.phase: p.total for p in est.points}
    for phase in ("forward", "backward", "optimizer"):
        assert abs(by_phase[phase] - step["phase_peaks"][phase]) <= 0.05 * step["phase_peaks"][phase], phase
    # the steady state is the largest: the first step has no optimizer states in its forward
    assert real["steps"][0]["peak"] < step["peak"]


@pytest.mark.parametrize("foreach", [False, True])
def test_the_optimizer_step_traced_is_what_torch_allocates(foreach):
    """clip_grad_norm_ + AdamW on real CPU tensors (foreach forced on, as torch chooses on a GPU), measured by the
    allocator, against the trace of the same step on fake tensors: its temporaries byte for byte."""
    groups = [[(300, 200), (200,), (1000, 500)], [(64,), (700, 300)]]
    cost = optimizer_step(groups, foreach=foreach, granularity=1, host_steps=False)
    params = [[torch.nn.Parameter(torch.randn(s)) for s in g] for g in groups]
    flat = [p for g in params for p in g]
    for p in flat:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW([{"params": g} for g in params], lr=1e-3, weight_decay=0.1, foreach=foreach)
    opt.step()
    states = sum(t.nbytes for s in opt.state.values() for t in s.values())
    assert cost.states == states
    # torch's CPU clip takes the foreach norm, the trace the per-tensor one: the same 0-d results
    real = profiled_peak(lambda: (torch.nn.utils.clip_grad_norm_(flat, 0.1), opt.step()))
    assert abs(real - cost.temporary) <= 64 * len(flat), (real, cost)
    biggest = max(4 * p.numel() for p in flat)
    whole_group = max(sum(4 * p.numel() for p in g) for g in params)
    assert cost.temporary >= (whole_group if foreach else 2 * biggest)


def test_each_engine_places_the_gradients_its_own_way(dino_trace):
    t = dino_trace
    facts = model_facts(DINO)
    grads = sum(d for k, d in t.recording.events if k in t.grad_of and d > 0)
    keep = engine_model(DINO, facts)
    assert keep.grad_rule == KEEP and build(t, DINO, keep).points[-1].parts["gradients"] == grads
    ddp = engine_model(dataclasses.replace(DINO, gpus=2), facts)
    assert ddp.buffers == 4 * facts.trainable  # the reducer's fp32 buckets
    for name, kw in (("zero2", dict(zero=2)), ("zero3", dict(zero=3)), ("fsdp", dict(fsdp=True))):
        s = dataclasses.replace(DINO, gpus=2, **kw)
        em = engine_model(s, facts)
        events = device_events(t, em)
        assert sum(d for _, k, d, part in events if k < 0 and part == "temporary") == 0, name  # all freed
        assert em.grad_rule == (BLOCK if kw.get("fsdp") else BUCKET)
        # this rank keeps its part of the gradients, not all of them
        assert em.grads_at_step < 0.6 * grads, name
    z2 = engine_model(dataclasses.replace(DINO, gpus=2, zero=2), facts)
    assert z2.bucket == 2 * int(DINO.ds_buckets[0]) * 4  # two fp32 reduction buffers with overlap_comm


def test_later_micro_batches_hold_the_windows_gradients(dino_trace):
    t = dino_trace
    em = engine_model(DINO, model_facts(DINO))
    one = build(t, DINO, em)
    four = build(t, dataclasses.replace(DINO, grad_accum=4), em)
    assert len(four.points) == len(one.points) + 2
    later = [p for p in four.points if p.where.startswith("later micro-batch")]
    grads = sum(d for k, d in t.recording.events if k in t.grad_of and d > 0)
    assert all(p.parts["gradients"] >= grads for p in later)
    assert four.total > one.total


@pytest.mark.parametrize("gc", [("backbone", "encoder", "decoder"), ("encoder",), ("sac:encoder",)])
def test_recomputed_flops_are_what_the_plan_executes_beyond_no_recompute(gc, no_recompute_trace):
    """Every op a plan runs again is counted once as recomputation: the recomputed FLOPs are exactly the step's
    FLOPs beyond the same step with nothing recomputed (the FFN remade inside a checkpointed unit included)."""
    base = no_recompute_trace
    plan = trace(dataclasses.replace(DINO, grad_ckpt=gc))
    total = sum(plan.recording.flops.values()) - sum(base.recording.flops.values())
    assert plan.recompute_flops == total > 0
    assert plan.forward_flops == base.forward_flops


@pytest.mark.parametrize("sample_rate,update", [(1.0, "dense"), (0.3, "dense"), (0.3, "sampled")])
def test_the_sharded_heads_update_traced_is_what_it_allocates(sample_rate, update):
    """The head's AdamW (engine/head_shard.py) on real CPU tensors, with the gradient one step leaves (the weight's,
    or the sampled rows' own leaf), against its trace on fake tensors (engine/step_costs.py)."""
    from vtrain.config import build_config
    from vtrain.engine.head_shard import ShardedHead
    from vtrain.engine.step_costs import head_step_bytes, sampled_rows

    s = Setup(task="metric", preset="debug", image_size=(112, 112), batch_size=8, num_classes=1003, gpus=4,
              head_parallel="sharded", embedding_dim=48, sample_rate=sample_rate, head_update=update,
              autocast_policy="cpu")
    cfg = build_config("metric", overrides={"model": {"embedding_dim": 48, "head_parallel": "sharded",
                                                      "sample_rate": sample_rate, "head_update": update}})
    head = ShardedHead(cfg, s.num_classes, 0, s.gpus, torch.device("cpu"))
    w = head.fc.weight
    rows = sampled_rows(w.shape[0], sample_rate)
    if sample_rate >= 1:
        w.grad = torch.randn_like(w)
    else:
        leaf = w.detach()[:rows].clone().requires_grad_(True)
        leaf.grad = torch.randn_like(leaf)
        head.fc.pending.append((torch.arange(rows), leaf))
    real = profiled_peak(lambda: head.step(1.0, torch.ones(()), cfg.optim.clip_grad))
    assert abs(head_step_bytes(s) - real) <= 64, (head_step_bytes(s), real)
    if update == "sampled":  # gathers and scatters of the rows it updates: not negligible at scale
        assert real > 4 * rows * 48
    else:  # torch's fused AdamW in place over the shard (and dense's buffer written in place): next to nothing
        assert real < 4 * rows * 48


def test_the_sharded_heads_update_comes_after_the_models_gradients_are_freed():
    """engines/torch_engine.py steps the sharded head after the model's update and its zero_grad: at the head's update only
    its own gradient is live beside its temporaries (measured: face ViT-B, 100k identities over 2 DDP processes,
    predicted 2390.8 MiB, measured 2390.8 MiB; benchmarks/results/estimate_memory_cpu.md)."""
    from vtrain.engine.step_costs import run_facts
    from vtrain.memory.timeline import resident, step_point

    s = Setup(task="metric", preset="debug", image_size=(112, 112), batch_size=8, num_classes=100_003, gpus=2,
              head_parallel="sharded", embedding_dim=48, autocast_policy="cpu")
    facts = run_facts(s)
    em = engine_model(s, facts)
    head_grads, head_step = em.head_after
    assert head_step == facts.head_step > 0 and em.step_extra == 0
    t = trace(s)
    point = step_point(t, s, em)
    base = sum(resident(t, s, em).values())
    model = base + em.grads_at_step + em.step.temporary
    head = base + head_grads + head_step
    assert point.total == max(model, head)
    # the head's point holds its own gradient, not the model's (counting both at once, as before, overestimated
    # the 100k-identity row by 14.9%); whichever point is larger is the step's
    assert ("sharded head" in point.where) == (head > model)
    if head > model:
        assert point.parts["gradients"] == head_grads
