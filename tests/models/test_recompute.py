"""`--grad-ckpt`: the grammar (vtrain/recompute.py), the units of built models and their application
(models/recompute_units.py), and that every unit, full or selective, gives today's loss and gradients bit for bit."""

from __future__ import annotations

import dataclasses
import tracemalloc

import pytest
import torch

from tests.helpers.batches import dino_batch as _batch
from vtrain import recompute
from vtrain.config import build_config
from vtrain.engine.engines.ds_config import fill_ds_config
from vtrain.engine.engines.fsdp_units import shard_units
from vtrain.errors import ConfigError, VtrainError
from vtrain.models.recompute_units import (active_recompute, apply_recompute, apply_spec, recompute_summary,
                                         recompute_units)
from vtrain.models.dino import DINO
from vtrain.models.metric import MetricModel
from vtrain.memory.setup import Setup
from vtrain.memory.trace import trace_step

DINO_UNITS = ["backbone.stage0", "backbone.stage1", "backbone.stage2", "backbone.stage3", "encoder.0", "encoder.1",
              "decoder.0", "decoder.1"]


# ---- grammar --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value,canonical", [
    ("", []), ("none", []), (",", []), ([], []), (None, []),
    ("backbone", ["backbone"]), ("backbone,encoder", ["backbone", "encoder"]),
    (["backbone", "encoder", "decoder"], ["backbone", "encoder", "decoder"]),
    ("encoder:0-3", ["encoder:0-3"]), ("decoder:2,5", ["decoder:2,5"]), ("encoder.3", ["encoder:3"]),
    ("backbone:stage0-1,encoder:0-2,sac:decoder", ["backbone:stage0-1", "encoder:0-2", "sac:decoder"]),
    ("backbone:stage0-stage2", ["backbone:stage0-2"]), ("sac:backbone:block0-5,8", ["sac:backbone:block0-5,block8"]),
    (["backbone:stage1", "decoder:2,5"], ["backbone:stage1", "decoder:2,5"]), ("auto", ["auto"]),
])
def test_valid_values_parse_to_a_canonical_form_that_parses_back(value, canonical):
    spec = recompute.parse(value)
    assert spec.canonical() == canonical
    assert recompute.parse(",".join(canonical)) == spec


@pytest.mark.parametrize("value,message", [
    ("encoder:x", "a selector is"), ("backbone:3", "backbone units are stageN or blockN"),
    ("encoder:stage1", "encoder units are layer numbers"), ("auto,backbone", "auto stands alone"),
    ("encoder:3-1", "empty range"), ("3", "names no part"), ("encoder:", "nothing after"), (":3", "not PART"),
    ("encoder,,decoder", "empty item"), ("backbone:stage1-block2", "a selector is"),
])
def test_malformed_values_say_what_is_wrong(value, message):
    with pytest.raises(recompute.SpecError, match=message):
        recompute.parse(value)


UNITS = [f"backbone.block{i}" for i in range(12)] + ["encoder.0", "encoder.1", "decoder.0", "decoder.1"]


@pytest.mark.parametrize("value,message", [
    ("backbone:block0-99999999999", "backbone:block0-99999999999: no unit backbone.block12; this model has 12 "
                                    "backbone units: backbone:block0-11"),
    ("encoder:0-999999999999999999,decoder:0", "no unit encoder.2; this model has 2 encoder units: encoder:0-1"),
    ("decoder:1,3-999999999999", "no unit decoder.3;"),
    ("sac:backbone:block11-12", "no unit backbone.block12;"),
    ("backbone:block5,stage0-99999999999", "no unit backbone.stage0;"),
    ("encoder:" + ",".join(["0", "1"] * 20000) + ",9", "... (80009 characters): no unit encoder.9;"),
])
def test_a_range_beyond_the_model_is_refused_without_listing_its_units(value, message):
    """A range is checked as an interval: resolving 10^11 or 10^18 units, or 40,000 items, holds no more than the
    model's units (tracemalloc), and the message cuts a long value."""
    tracemalloc.start()
    try:
        with pytest.raises(recompute.SpecError) as e:
            recompute.resolve(recompute.parse(value), UNITS)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert message in str(e.value) and len(str(e.value)) < 300
    assert peak < 16 * 2**20, f"{peak / 2**20:.1f} MB"


@pytest.mark.parametrize("value,chosen", [
    ("backbone:block3-5,block4", {f"backbone.block{i}": "full" for i in (3, 4, 5)}),
    ("encoder:" + ",".join(["1", "0"] * 20000), {"encoder.0": "full", "encoder.1": "full"}),
    ("sac:backbone:block10-11,encoder", {"backbone.block10": "sac", "backbone.block11": "sac", "encoder.0": "full",
                                         "encoder.1": "full"}),
])
def test_ranges_within_the_model_resolve_in_unit_order(value, chosen):
    assert recompute.resolve(recompute.parse(value), UNITS) == chosen
    assert list(recompute.resolve(recompute.parse(value), UNITS)) == [u for u in UNITS if u in chosen]


def test_config_checks_syntax_and_parts_naming_the_flag_and_the_forms():
    assert build_config("dino", overrides={"model": {"grad_ckpt": "backbone,encoder:0"}}).model.grad_ckpt == \
        ["backbone", "encoder:0"]
    for task, value, message in [("metric", "encoder", "unknown part 'encoder' for --task metric"),
                                 ("dino", "head", "unknown part 'head' for --task dino"),
                                 ("dino", "encoder:x", "forms: PART")]:
        with pytest.raises(ConfigError, match="--grad-ckpt") as e:
            build_config(task, overrides={"model": {"grad_ckpt": value}})
        assert message in str(e.value)
    # auto is the planner's (tests/memory/test_planner.py); its budget goes with it only
    assert build_config("dino", overrides={"model": {"grad_ckpt": "auto", "memory_budget": 22}}).model.grad_ckpt == \
        ["auto"]
    with pytest.raises(ConfigError, match="--memory-budget .*needs --grad-ckpt auto"):
        build_config("dino", overrides={"model": {"grad_ckpt": "backbone", "memory_budget": 22}})


@pytest.mark.parametrize("old", ["backbone", "encoder", "decoder", "backbone,encoder", "backbone,encoder,decoder"])
def test_every_old_value_checkpoints_every_block_of_its_parts(old):
    """The old comma list meant per-block checkpointing of every block of each part named: still so."""
    model = DINO("debug", 3)
    apply_spec(model, old)
    parts = old.split(",")
    blocks = {"backbone": [b for s in model.backbone.body.layers for b in s.blocks],
              "encoder": list(model.encoder.layers), "decoder": list(model.decoder.layers)}
    for part, mods in blocks.items():
        assert all((m.__dict__.get("_vtrain_recompute") == "full") == (part in parts) for m in mods), part
    assert recompute_summary(model) == old
    assert not any(getattr(s, "grad_checkpointing", False) for s in model.backbone.body.layers)  # timm's own: off


# ---- units of built models -----------------------------------------------------------------------------------
def test_units_have_stable_names_and_line_up_with_fsdp_shard_units():
    with torch.device("meta"):
        dino, resnet = DINO("debug", 3), DINO("debug-resnet", 3)
        metric = MetricModel("debug", 10)
    assert list(recompute_units(dino)) == DINO_UNITS
    assert list(recompute_units(resnet))[:4] == ["backbone.stage1", "backbone.stage2", "backbone.stage3",
                                                 "backbone.stage4"]  # ResNet layerN = timm feature index N
    assert list(recompute_units(metric)) == ["backbone.block0", "backbone.block1"]  # ViT: one unit per block
    for model in (dino, resnet, metric):
        blocks = [b for bs in recompute_units(model).values() for b in bs]
        # each checkpointed block is one FSDP2 unit (engine/engines/fsdp_units.py): its hooks gather it before the recompute
        assert blocks == [u for u in shard_units(model) if any(u is b for b in blocks)]
        assert len(blocks) == len({id(b) for b in blocks})


def test_apply_replaces_the_previous_choice_and_summary_reads_the_live_blocks():
    model = DINO("debug", 3)
    assert apply_recompute(model, {"decoder.1": "sac", "backbone.stage0": "full"}) == \
        {"backbone.stage0": "full", "decoder.1": "sac"}
    assert recompute_summary(model) == "backbone:stage0,sac:decoder:1"
    apply_spec(model, "backbone:stage0-1,encoder:0,sac:decoder")
    assert active_recompute(model) == {"backbone.stage0": "full", "backbone.stage1": "full", "encoder.0": "full",
                                       "decoder.0": "sac", "decoder.1": "sac"}
    assert recompute_summary(model) == "backbone:stage0-1,encoder:0,sac:decoder"
    apply_recompute(model, {})
    assert recompute_summary(model) == "none" and all("forward" not in m.__dict__ for m in model.modules())
    with pytest.raises(VtrainError, match=r"--grad-ckpt: encoder:5: no unit encoder.5; .*encoder:0-1"):
        apply_spec(model, "encoder:5")
    with pytest.raises(ValueError, match="no recompute unit"):
        apply_recompute(model, {"neck": "full"})


# ---- same loss and gradients ---------------------------------------------------------------------------------
def _dino_step(chosen):
    torch.manual_seed(0)
    model = DINO("debug", 3, drop_path=0.2)  # drop-path: the recomputation must replay the same random draws
    apply_recompute(model, chosen)
    torch.manual_seed(1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(**_batch())
    out["loss"].backward()
    return out["loss"].detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(got, want):
    (loss, grads), (loss0, grads0) = got, want
    assert torch.equal(loss, loss0)
    assert grads.keys() == grads0.keys()
    for n in grads0:
        assert torch.equal(grads[n], grads0[n]), n


@pytest.mark.parametrize("mode", ["full", "sac"])
def test_every_dino_unit_gives_the_same_loss_and_gradients_bitwise(mode):
    """bf16 autocast, drop-path on: checkpointing replays the same ops on the same inputs, so nothing moves."""
    base = _dino_step({})
    for unit in DINO_UNITS:
        _assert_same(_dino_step({unit: mode}), base)
    _assert_same(_dino_step(dict.fromkeys(DINO_UNITS, mode)), base)


@pytest.mark.parametrize("spec", ["backbone", "sac:backbone", "backbone:block1,sac:backbone:block0"])
def test_metric_units_give_the_same_loss_and_gradients_bitwise(spec):
    def step(value):
        torch.manual_seed(0)
        model = MetricModel("debug", num_classes=10, embedding_dim=32, drop_path=0.1)
        apply_spec(model, value)
        torch.manual_seed(1)
        x, y = torch.randn(4, 3, 112, 112), torch.randint(0, 10, (4,))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x, y)["loss"]
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    _assert_same(step(spec), step(""))


def test_selective_mode_keeps_less_than_nothing_recomputed_and_more_than_full():
    """In the estimator's trace: the selective mode is really active and really keeps the matmul outputs."""
    base = Setup(task="dino", preset="debug", image_size=(128, 160), batch_size=2, precision="bf16", num_classes=5,
                 num_targets=3, autocast_policy="cpu")
    act = {gc: trace_step(dataclasses.replace(base, grad_ckpt=gc))["Activation"]
           for gc in [(), ("encoder",), ("sac:encoder",), ("encoder:0",)]}
    assert act[("encoder",)] < act[("sac:encoder",)] < act[()]
    assert act[("encoder",)] < act[("encoder:0",)] < act[()]


def test_zero3_uses_torchs_linear_so_selective_checkpointing_keeps_its_matmul_outputs_intact():
    """DeepSpeed's memory-efficient linear adds the bias in place to the kept matmul output (wrong gradients)."""
    common = dict(batch_size=1, grad_accum=1, world_size=2, clip_grad=0.1, precision="no", precision_explicit=True)
    ds, _ = fill_ds_config({"zero_optimization": {"stage": 3}}, "z3.json", **common)
    assert ds["zero_optimization"]["memory_efficient_linear"] is False
    with pytest.raises(ConfigError, match="memory_efficient_linear=true cannot be combined"):
        fill_ds_config({"zero_optimization": {"stage": 3, "memory_efficient_linear": True}}, "z3.json",
                       selective_recompute=True, **common)
