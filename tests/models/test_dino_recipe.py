"""DINO trained as the published recipe states it (docs/detection.md "Training as the references do"): a stated
drop-path rate always honoured, class and box heads shared by the decoder layers as IDEA DINO trains them (and
found in its checkpoints by `vtrain convert`), weight decay on every parameter as IDEA and mmdetection apply it."""

from __future__ import annotations

import argparse

import pytest
import timm
import torch

from tests.helpers.batches import dino_batch
from tests.helpers.paths import FIXTURES
from vtrain.config import ModelConfig, OptimConfig, RunConfig
from vtrain.config.run import resolve
from vtrain.engine.checkpoint.content import describe
from vtrain.engine.optim import param_groups
from vtrain.errors import VtrainError
from vtrain.models.dino import DINO, DinoOptions
from vtrain.models.dino.adapters import idea
from vtrain.models.formats import unwrap
from vtrain.presets import DINO_PRESETS
from vtrain.io.safeio import load_published
from vtrain.tasks.model import build_model


# ---- drop-path ------------------------------------------------------------------------------------------------
def test_drop_path_zero_is_honoured_where_timm_defaults_to_more():
    """timm's Swin defaults to drop_path_rate 0.1; the `debug` preset (a Swin, preset rate 0.0), --drop-path 0 and a
    config value 0.0 all build a model without stochastic depth, and the log line says the rate in force."""
    p = DINO_PRESETS["debug"]()
    timm_default = timm.create_model(p.timm_name, pretrained=False, num_classes=0, **p.kwargs)
    assert max(m.drop_prob for m in timm_default.modules() if isinstance(m, timm.layers.DropPath)) > 0  # the trap
    for rate in (None, 0.0):
        model = build_model("dino", ModelConfig(preset="debug", drop_path=rate), 3)
        assert model.backbone.drop_path == 0.0
        assert not any(m.drop_prob for m in model.modules() if isinstance(m, timm.layers.DropPath))
        assert "drop-path rate 0;" in model.describe()
    model = build_model("dino", ModelConfig(preset="debug", drop_path=0.3), 3)
    assert model.backbone.drop_path == pytest.approx(0.3) and "drop-path rate 0.3;" in model.describe()
    swin_l = DINO_PRESETS["swin-l"]()
    assert swin_l.drop_path == 0.2  # the recipe's (docs/dino.md §1.2), passed as it is


# ---- shared class and box heads ---------------------------------------------------------------------------------
def _shared(cls: bool = True, box: bool = True, **kw) -> DINO:
    torch.manual_seed(0)
    return DINO("debug-resnet", 3, options=DinoOptions(shared_class_head=cls, shared_box_head=box), **kw)


def test_shared_heads_are_one_module_for_every_decoder_layer():
    model, per_layer = _shared(), DINO("debug-resnet", 3)
    layers = model.preset.dec_layers
    assert len(model.cls_heads) == len(model.reg_heads) == 2 and len(per_layer.cls_heads) == layers + 1
    assert all(model.cls_head(i) is model.cls_heads[0] and model.box_head(i) is model.reg_heads[0]
               for i in range(layers))
    assert model.cls_heads[-1] is not model.cls_heads[0]  # the encoder-proposal head is its own
    saved = sum(p.numel() for p in per_layer.parameters()) - sum(p.numel() for p in model.parameters())
    head = sum(p.numel() for p in per_layer.cls_heads[0].parameters()) + sum(
        p.numel() for p in per_layer.reg_heads[0].parameters())
    assert saved == (layers - 1) * head
    assert "class head shared by the 2 decoder layers, box head shared by the 2 decoder layers" in model.describe()
    # one class head shared, one box head per layer: each option on its own
    mixed = _shared(cls=True, box=False)
    assert len(mixed.cls_heads) == 2 and len(mixed.reg_heads) == layers + 1


def test_shared_heads_train_every_layer_into_one_head():
    """A training step with shared heads: finite loss, gradients in the shared class head and in the shared box
    head's last layer (it starts at zero, so the layers before it get none on the first step)."""
    model = _shared().train()
    out = model(**dino_batch())
    out["loss"].backward()
    assert torch.isfinite(out["loss"])
    g = model.cls_heads[0].weight.grad
    assert g is not None and g.abs().sum() > 0 and model.reg_heads[0].layers[-1].weight.grad.abs().sum() > 0


def test_the_head_layout_is_part_of_the_recorded_model():
    """A checkpoint of shared heads and a run with heads per layer hold other tensors: content.describe says so (a
    resume or eval is refused in one line, engine/content.same_model), and an older config without the fields is
    the per-layer model it was."""
    shared = RunConfig(task="dino", model=ModelConfig(preset="debug-resnet", shared_class_head=True,
                                                      shared_box_head=True))
    plain = RunConfig(task="dino", model=ModelConfig(preset="debug-resnet"))
    assert describe(shared, 3)["class_head"] == "shared" and describe(plain, 3)["box_head"] == "per layer"
    assert set(_shared().state_dict()) != set(DINO("debug-resnet", 3).state_dict())


# ---- vtrain convert --from idea-dino finds IDEA's shared heads ----------------------------------------------------
def _idea_state():
    whole = load_published(FIXTURES / "idea" / "checkpoint.pth")
    return dict(unwrap(whole)[0]), whole


def test_idea_shared_heads_are_found_and_recorded():
    """The fixture (IDEA's own model, its published config: dec_pred_*_embed_share=True) stores its one class head
    and one box head under each decoder layer's name: convert reads them once and records the options, from the
    file's args or, without args, from the tied values."""
    sd, whole = _idea_state()
    for w in (whole, None):
        c = idea.from_idea(sd, w)
        assert c.model["shared_class_head"] and c.model["shared_box_head"]
        assert "cls_heads.2.weight" not in c.tensors and "reg_heads.1.layers.0.weight" in c.tensors
        assert torch.equal(c.tensors["reg_heads.1.layers.2.bias"], sd["transformer.enc_out_bbox_embed.layers.2.bias"])
        assert "a copy of the shared head class_embed.0.weight" == c.unused["class_embed.1.weight"]
    # the converted tensors fill the shared model exactly (convert's own check, convert.fill)
    from vtrain.tools.convert import fill
    from tests.helpers.peers import TINY
    with torch.device("meta"):
        own = DINO(TINY, 80, options=DinoOptions(**{k: v for k, v in c.model.items()
                                                    if k in DinoOptions.__dataclass_fields__})).state_dict()
    assert len(fill(own, c.tensors, "peer-tiny")) == len(own)


def test_fine_tuning_a_converted_idea_model_trains_shared_heads(monkeypatch, tmp_path):
    """`vtrain convert --from idea-dino` writes the options into the run's config.yaml; a run fine-tuning from that
    checkpoint takes them (engine/pretrained.py) and builds IDEA's parameterisation, which the converted weights
    fill exactly (one class head and one box head for the decoder layers, not 2 untied copies)."""
    from safetensors.torch import load_file

    from tests.helpers.peers import TINY
    from vtrain.engine.pretrained import inherit_model_options
    from vtrain.tools.convert import convert

    monkeypatch.setitem(DINO_PRESETS, "peer-tiny", lambda: TINY)
    out = tmp_path / "idea"
    convert(FIXTURES / "idea" / "checkpoint.pth", out, "idea-dino", "peer-tiny")
    cfg = resolve("dino", overrides={"model": {"preset": "peer-tiny", "pretrained": str(out)}})
    note = inherit_model_options(cfg)
    assert cfg.model.shared_class_head and cfg.model.shared_box_head, note
    assert "shared_class_head=True" in note and "shared_box_head=True" in note
    model = build_model("dino", cfg.model, 80)
    model.load_state_dict(load_file(str(out / "checkpoints" / "step_0" / "model.safetensors")), strict=True)
    assert len(model.cls_heads) == 2 and model.cls_head(0) is model.cls_head(1)


def test_idea_heads_per_layer_stay_per_layer():
    """A file whose args say the heads are not shared (dec_pred_*_embed_share=False) converts to one head per layer;
    without args, heads that differ between layers are per layer too; args saying shared over heads that differ is
    a file that contradicts itself (one error line)."""
    sd, whole = _idea_state()
    args = argparse.Namespace(**{**vars(whole["args"]), "dec_pred_class_embed_share": False,
                                 "dec_pred_bbox_embed_share": False})
    untied = {k: (v + 1 if k.startswith(("class_embed.1.", "bbox_embed.1.", "transformer.decoder.class_embed.1.",
                                          "transformer.decoder.bbox_embed.1.")) else v) for k, v in sd.items()}
    for state, w in ((sd, {**whole, "args": args}), (untied, None), (untied, {**whole, "args": args})):
        c = idea.from_idea(state, w)
        assert not c.model["shared_class_head"] and not c.model["shared_box_head"]
        assert {"cls_heads.0.weight", "cls_heads.1.weight", "cls_heads.2.weight"} <= set(c.tensors)
    with pytest.raises(VtrainError, match=r"_embed\.1\.\S+ differs from \w+_embed\.0\."):
        idea.from_idea(untied, whole)


# ---- weight decay ------------------------------------------------------------------------------------------------
def test_dino_recipe_decays_every_parameter_and_keeps_the_group_layout():
    """The dino task's default: weight decay 1e-4 on every parameter (IDEA util/get_param_dicts.py 'default',
    mmdetection's AdamW without paramwise decay rules); `--weight-decay-skip norms` keeps the exemptions (the face
    recipe's default). Both make the same groups, so a checkpoint's optimizer state fits either way."""
    cfg = resolve("dino")
    assert cfg.optim.weight_decay_skip == "none" and resolve("metric").optim.weight_decay_skip == "norms"
    model = DINO("debug-resnet", 3)
    every = param_groups(model, cfg.optim)
    assert {g["weight_decay"] for g in every} == {1e-4}
    assert sum(len(g["params"]) for g in every) == sum(1 for p in model.parameters() if p.requires_grad)
    norms = param_groups(model, OptimConfig(weight_decay=1e-4, weight_decay_skip="norms"))
    assert [len(g["params"]) for g in norms] == [len(g["params"]) for g in every]
    assert {g["group"]: g["weight_decay"] for g in norms} == {"backbone": 1e-4, "backbone/no_decay": 0.0,
                                                              "head": 1e-4, "head/no_decay": 0.0}
    with pytest.raises(Exception, match="weight_decay_skip"):
        OptimConfig(weight_decay_skip="biases")
