"""Where the activation bytes at the peak come from (`--breakdown`), the sharded face head in the
estimate, and the recompute planner (`--grad-ckpt auto --memory-budget`): within budget by the tracer's own
count, monotone in the budget, deterministic, one clear error when nothing fits or no budget is known."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from tests.helpers.cli import ok, vtrain
from vtrain.config import build_config
from vtrain.engine.head_shard import ShardedHead
from vtrain.memory.head import head_state_bytes
from vtrain.memory.planner import NothingFits, plan
from vtrain.memory.setup import Setup
from vtrain.memory.engines import engine_model
from vtrain.memory.sizing import GiB, estimate, model_facts
from vtrain.memory.trace import build_model, trace
from vtrain.tools.estimate_memory import breakdown, planned

DINO = Setup(task="dino", preset="debug", image_size=(96, 128), batch_size=2, num_classes=5, num_targets=3)
SHARDED = Setup(task="metric", preset="debug", image_size=(112, 112), batch_size=8, num_classes=1003, gpus=4,
                head_parallel="sharded", embedding_dim=48)


def one_error_line(proc) -> str:
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return errors[0]


# ---- --breakdown ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("setup", [DINO, dataclasses.replace(DINO, grad_ckpt=("backbone", "sac:encoder")), SHARDED,
                                   dataclasses.replace(SHARDED, sample_rate=0.25)],
                         ids=["dino", "dino-ckpt", "metric-sharded", "metric-sampled"])
def test_breakdown_sums_exactly_to_the_activation_total(setup):
    t = trace(setup)
    rows = t.breakdown()
    assert sum(r.bytes for r in rows) == t.activation
    shown = breakdown(t, 3)
    assert len(shown["rows"]) == 3
    assert sum(r["bytes"] for r in shown["rows"]) + shown["other"]["bytes"] == t.activation
    assert sum(u["bytes"] for u in shown["by_unit"]) == t.activation
    phases = {r.phase for r in rows}
    assert "forward" in phases and phases <= {"forward", "recompute", "backward"}
    rec = t.recording
    if setup.grad_ckpt:  # checkpointed units: what they make again in backward is marked so, and costs FLOPs
        assert t.recompute_flops > 0
        assert any(phase == "recompute" and rec.unit_of[m] >= 0 for m, phase in rec.labels)
    if setup.sharded_head:  # the head made the cosines of the global batch (4 x 8) over its (sampled) rows
        rows_here = 251 if setup.sample_rate == 1 else int(setup.sample_rate * 251)
        made = [n for key, n in rec.events if key >= 0 and n > 0
                and rec.modules[rec.labels[rec.label_of[key]][0]].startswith("head")]
        assert -(-(4 * 8 * rows_here * 4) // 512) * 512 in made


@pytest.mark.parametrize("chunk", [0, 64], ids=["one-chunk", "chunked"])
def test_the_ffn_hidden_layer_remade_in_backward_is_counted_as_recomputation(chunk):
    """The encoder FFN remakes its hidden layer inside its own autograd Function's backward, where no module
    forward runs: the planner must see that fc1 matmul as recomputed FLOPs, or it takes the remake as free."""
    kept, remade = (trace(dataclasses.replace(DINO, ffn_recompute=on, ffn_chunk=chunk)) for on in (False, True))
    assert kept.recompute_flops == 0
    fc1 = sum(layer.ffn.fc1.in_features * layer.ffn.fc1.out_features for layer in _encoder_layers())
    assert remade.recompute_flops > 0 and remade.recompute_flops % fc1 == 0  # 2 x tokens x fc1 per layer
    assert remade.forward_flops == kept.forward_flops


def _encoder_layers():
    return build_model(DINO).encoder.layers


@pytest.mark.integration
def test_breakdown_command_prints_and_writes_json():
    proc = ok(vtrain("estimate-memory", "--model", "debug", "--image-size", "96x128", "--no-compare-gc",
                     "--breakdown", "--breakdown-rows", "4", "--json"))
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    b = report["breakdown"]
    assert len(b["rows"]) == 4 and b["activation_bytes"] == sum(r["bytes"] for r in b["rows"]) + b["other"]["bytes"]
    assert abs(b["activation_bytes"] / GiB - report["estimate_gib"]["activations"]) < 1e-3
    proc = ok(vtrain("estimate-memory", "--model", "debug", "--image-size", "96x128", "--no-compare-gc",
                     "--breakdown"))
    assert "by the module whose forward made them" in proc.stdout and "per recompute unit" in proc.stdout


# ---- the sharded head -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sample_rate,update", [(1.0, "dense"), (0.3, "dense"), (0.3, "sampled")])
def test_sharded_head_states_are_exactly_the_real_objects(sample_rate, update):
    """Rank 0 of 4 (the largest shard of 1003 identities: 251 rows), built for real on CPU and stepped once; with
    sampling the gradient is the sampled rows' (75 of 251), plus the shard-sized buffer of `dense`."""
    s = dataclasses.replace(SHARDED, sample_rate=sample_rate, head_update=update)
    cfg = build_config("metric", overrides={"model": {"embedding_dim": 48, "head_parallel": "sharded",
                                                      "sample_rate": sample_rate, "head_update": update}})
    head = ShardedHead(cfg, s.num_classes, 0, s.gpus, torch.device("cpu"))
    emb = torch.randn(s.batch_size, 48, requires_grad=True)
    head.loss({"embedding": emb}, torch.arange(s.batch_size))["loss"].backward()
    w = head.fc.weight
    grads = [w.grad] if w.grad is not None else [leaf.grad for _, leaf in head.fc.pending]
    grads += [head._dense_grad] if head._dense_grad is not None else []
    real = {"parameters": w.nbytes, "gradients": sum(g.nbytes for g in grads),
            "optimizer": head.exp_avg.nbytes + head.exp_avg_sq.nbytes + head.row_steps.nbytes}
    head.step(1.0, None, 0.0)  # the step allocates no new state
    real_after = head.exp_avg.nbytes + head.exp_avg_sq.nbytes + head.row_steps.nbytes
    assert head_state_bytes(s) == real and real_after == real["optimizer"]
    # in the estimate: beside the model's own states, never partitioned (ZeRO-3 divides only the model's)
    facts = model_facts(s)
    for zero in (0, 3):
        em = engine_model(dataclasses.replace(s, zero=zero), facts)
        whole = sum(-(-4 * math.prod(facts.shapes[n]) // 512) * 512 for n in facts.trainable_names)
        model_grads = em.resident_grads if zero else whole  # ZeRO-3: its flat fp32 gradient partition buffer
        assert em.grads_at_step == model_grads + real["gradients"]


def test_sharded_head_trace_matches_real_tensors():
    """With every identity in the softmax the head's shapes do not depend on the labels: the fake trace and the
    same step on real CPU tensors record the same activation peak (logits of the 4 x 8 global batch)."""
    fake, real = trace(SHARDED), trace(SHARDED, fake=False)
    assert fake.activation == real.activation


# ---- the planner ------------------------------------------------------------------------------------------------
# At 96x128 every plan of the debug DINO peaks at its optimizer step (gradients, AdamW's states and the update's
# temporaries: 570.2 MB of the step's timeline, beside 12.5 MB of activations without recompute, 6.4 MB with all),
# so no recompute lowers its total. At 192x256 the forward and backward peak above the step (587.7 MB without
# recompute, 575.8 MB with all, 571.2 MB the step): a budget sweep crosses several plans.
PLANNED = dataclasses.replace(DINO, image_size=(192, 256))


@pytest.fixture(scope="module")
def dino_plans():
    """Plans of the DINO debug model over a budget sweep, sharing traces (they are deterministic)."""
    facts = model_facts(PLANNED)
    none, full = (dataclasses.replace(PLANNED, grad_ckpt=gc, ffn_units=()) for gc in ((), ("backbone", "encoder",
                                                                                      "decoder")))
    none_trace = trace(none)
    hi, lo = estimate(none, none_trace, facts).total, estimate(full, trace(full), facts).total
    cache: dict = {}
    # from the least memory (every unit recomputed) to no recompute at all, smallest budget first
    budgets = [int(lo * (1 - f) + hi * f) for f in (0.0, 0.1, 0.3, 0.5, 0.7, 0.9)] + [hi]
    return lo, cache, [(b, plan(PLANNED, b, cache=cache)) for b in budgets], none_trace.recompute_flops


def test_plans_fit_by_the_tracers_own_count(dino_plans):
    _, _, plans, none_flops = dino_plans
    for budget, p in plans:
        assert p.total <= budget
    for budget, p in plans[1:4]:
        again = trace(planned(PLANNED, p))  # the plan as a run executes it, traced afresh
        assert again.activation == p.activation and p.extra_flops == again.recompute_flops - none_flops
        assert estimate(planned(PLANNED, p), again).total == p.total  # the step's timeline peak
    assert plans[-1][1].modes == {} and plans[-1][1].ffn_units == [] and plans[-1][1].extra_flops == 0


def test_a_larger_budget_never_recomputes_more(dino_plans):
    _, _, plans, _ = dino_plans
    flops = [p.extra_flops for _, p in plans]
    assert flops == sorted(flops, reverse=True), flops
    assert flops[0] > flops[-1] == 0 and len(set(flops)) >= 4  # the sweep crosses several plans


def test_the_plan_is_deterministic(dino_plans):
    budget, first = dino_plans[2][2]
    again = plan(PLANNED, budget)  # fresh traces
    assert (again.modes, again.ffn_units, again.total, again.extra_flops) == \
        (first.modes, first.ffn_units, first.total, first.extra_flops)


def test_the_plan_line_names_units_budget_and_flops(dino_plans):
    _, _, plans, _ = dino_plans
    p = plans[1][1]
    line = p.describe()
    assert f"of {p.budget / GiB:.3f}" in line and "forward FLOPs" in line
    assert any(u.split(".")[0] in line for u in p.modes) or "FFN" in line
    assert json.loads(json.dumps(p.to_dict()))["grad_ckpt"] == p.spec()


def test_nothing_fits_names_the_smallest_peak_and_what_would_help(dino_plans):
    lo, cache, _, _ = dino_plans
    with pytest.raises(NothingFits) as e:
        plan(PLANNED, lo - 1024, cache=cache)
    msg = str(e.value)
    assert "smallest predicted peak" in msg and "--batch-size" in msg and "zero3_offload.json" in msg
    assert e.value.smallest == lo
    head = dataclasses.replace(SHARDED, gpus=2)
    with pytest.raises(NothingFits, match="more GPUs for the sharded head"):
        plan(head, sum(head_state_bytes(head).values()))


@pytest.mark.integration
def test_estimate_memory_budget_prints_the_plan_and_the_largest_batch():
    proc = ok(vtrain("estimate-memory", "--model", "debug", "--image-size", "96x128", "--batch-size", "2",
                     "--no-compare-gc", "--memory-budget", "0.6", "--json"))
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    p = report["plan"]
    assert p["predicted_gib"] <= 0.6 and report["estimate_gib"]["total"] <= 0.6
    assert p["max_batch_size"] >= 2 and p["grad_ckpt"] == (",".join(report["setup"]["grad_ckpt"]) or "none")
    line = one_error_line(vtrain("estimate-memory", "--model", "debug", "--image-size", "96x128",
                                 "--no-compare-gc", "--memory-budget", "0.3"))
    assert "nothing fits" in line and "smallest predicted peak" in line
    line = one_error_line(vtrain("estimate-memory", "--model", "debug", "--grad-ckpt", "auto"))
    assert "--memory-budget" in line
    line = one_error_line(vtrain("estimate-memory", "--model", "debug", "--grad-ckpt", "backbone",
                                 "--memory-budget", "1"))
    assert "--memory-budget" in line and "--grad-ckpt" in line


@pytest.mark.integration
def test_cpu_training_without_a_budget_is_one_error_line(tmp_path):
    line = one_error_line(vtrain("train", "--task", "dino", "--model", "debug", "--num-workers", "0",
                                 "--image-size", "96", "--batch-size", "1", "--max-steps", "1",
                                 "--grad-ckpt", "auto", "--output-dir", str(tmp_path / "run")))
    assert "--memory-budget" in line and "CPU" in line
    line = one_error_line(vtrain("train", "--task", "dino", "--model", "debug", "--grad-ckpt", "backbone",
                                 "--memory-budget", "8", "--output-dir", str(tmp_path / "run2")))
    assert "--memory-budget" in line and "auto" in line


@pytest.mark.slow
def test_every_rank_runs_the_same_plan(tmp_path):
    """2 CPU processes (DDP, gloo), `--grad-ckpt auto` with a budget between "recompute everything" and "recompute
    nothing": rank 0 plans, both ranks apply it; run_info.json shows the same plan on both, and what their live
    blocks do is that plan."""
    from tests.helpers.cli import launch, run_info
    from vtrain.data.demo_shapes import ensure_demo_shapes
    from vtrain.memory.setup import run_setup

    demo = ensure_demo_shapes()
    args = ["--task", "dino", "--model", "debug", "--num-workers", "0", "--mixed-precision", "no", "--image-size",
            "128", "--batch-size", "1", "--num-queries", "50"]
    cfg = build_config("dino", overrides={"model": {"preset": "debug", "image_size": 128, "num_queries": 50},
                                          "train": {"batch_size": 1}})
    classes = len(json.loads((demo / "annotations" / "instances_train2017.json").read_text())["categories"])
    s = run_setup(cfg, "no", gpus=2, num_classes=classes, autocast_policy="cpu")
    none = estimate(dataclasses.replace(s, ffn_units=())).total
    full = estimate(dataclasses.replace(s, grad_ckpt=("backbone", "encoder", "decoder"))).total
    budget = (none + full) / 2 / GiB
    out = tmp_path / "run"
    ok(launch(2, "train", *args, "--max-steps", "1", "--log-every", "1", "--save-every", "1", "--grad-ckpt", "auto",
              "--memory-budget", f"{budget:.6f}", "--output-dir", str(out), accelerate_config="ddp.yaml"))
    ranks = run_info(out)["ranks"]
    plans = [r["memory_plan"] for r in ranks]
    assert len(ranks) == 2 and plans[0] == plans[1]
    assert plans[0]["units"] and plans[0]["predicted_gib"] <= budget + 1e-3 and plans[0]["traces"] >= 4
    assert [r["grad_ckpt"] for r in ranks] == [plans[0]["grad_ckpt"]] * 2  # read back from the live blocks
    want = recompute_compact(plans[0]["ffn_units"])
    assert [r["ffn_recompute"] for r in ranks] == [want] * 2


def recompute_compact(units: list[str]) -> str:
    from vtrain import recompute

    return recompute.compact(units) or "none"
