"""Learning-rate schedules and parameter groups (vtrain/engine/optim.py)."""

import pytest

from vtrain.config import OptimConfig
from vtrain.engine.optim import lr_lambda, param_groups
from vtrain.models.metric import MetricModel


def test_schedules():
    f = lr_lambda(OptimConfig(lr=1.0, warmup_steps=4, schedule="cosine"), total_steps=14)
    assert [round(f(s), 3) for s in range(4)] == [0.2, 0.4, 0.6, 0.8]
    assert f(4) == pytest.approx(1.0) and f(9) == pytest.approx(0.5) and f(14) == pytest.approx(0.0)
    g = lr_lambda(OptimConfig(lr=1.0, schedule="step", milestones=[5, 8], gamma=0.1), total_steps=10)
    assert [g(s) for s in (0, 4, 5, 7, 8, 9)] == pytest.approx([1, 1, 0.1, 0.1, 0.01, 0.01])
    c = lr_lambda(OptimConfig(lr=1.0, schedule="cosine", min_lr_ratio=0.1), total_steps=10)
    assert c(10) == pytest.approx(0.1)


def test_param_groups_no_decay_and_backbone_multiplier():
    model = MetricModel("debug", num_classes=4, embedding_dim=16)
    groups = param_groups(model, OptimConfig(lr=1e-3, weight_decay=0.1, backbone_lr_mult=0.1))
    by = {g["group"]: g for g in groups}
    assert set(by) == {"backbone", "backbone/no_decay", "head", "head/no_decay"}
    assert by["backbone"]["lr"] == pytest.approx(1e-4) and by["head"]["lr"] == pytest.approx(1e-3)
    assert by["backbone/no_decay"]["weight_decay"] == 0.0 and by["head"]["weight_decay"] == 0.1
    ids = {id(p): g["group"] for g in groups for p in g["params"]}
    named = dict(model.named_parameters())
    assert ids[id(named["backbone.pos_embed"])] == "backbone/no_decay"
    assert ids[id(named["backbone.cls_token"])] == "backbone/no_decay"
    assert ids[id(named["neck.norm.weight"])] == "head/no_decay"
    assert ids[id(named["head.weight"])] == "head"
    assert sum(len(g["params"]) for g in groups) == len(named)


def test_a_resume_names_a_changed_face_head_training():
    from vtrain.config import ModelConfig, RunConfig
    from vtrain.engine.checkpoint.resume_settings import head_notes

    def cfg(**model):
        return RunConfig(task="metric", model=ModelConfig(head_parallel="sharded", **model))

    assert head_notes(cfg(), cfg()) == []
    notes = head_notes(cfg(arcface_grad="chain", head_update="sampled"), cfg())
    assert notes == ["--arcface-grad chain -> straight on resume: the head trains on with straight (docs/face_head.md)",
                     "--head-update sampled -> dense on resume: the head trains on with dense (docs/face_head.md)"]
