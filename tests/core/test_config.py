import json

import pytest

from tests.helpers.paths import ROOT
from vtrain.config import build_config, read_yaml
from vtrain.engine.engines.ds_config import fill_ds_config
from vtrain.errors import ConfigError


def test_defaults_and_task_defaults():
    cfg = build_config("metric")
    assert cfg.model.preset == "debug" and cfg.optim.lr == 1e-3 and cfg.optim.weight_decay == 0.1
    assert cfg.model.margin == 0.5  # ArcFace default
    assert build_config("metric", overrides={"model": {"head": "cosface"}}).model.margin == 0.4


@pytest.mark.parametrize("section,key,value,flag", [
    ("train", "grad_accum", 0, "--grad-accum"),
    ("train", "batch_size", -1, "--batch-size"),
    ("optim", "lr", 0.0, "--lr"),
    ("model", "preset", "vit-xxl", "--model"),
    ("model", "image_size", 100, "--image-size"),
    ("parallel", "mixed_precision", "fp8", "--mixed-precision"),
    ("optim", "schedule", "linear", "--schedule"),
    ("data", "path", "/nonexistent/faces", "--data"),
    ("parallel", "ds_config", "/nonexistent.json", "--ds-config"),
])
def test_invalid_values_name_the_flag(section, key, value, flag):
    with pytest.raises(ConfigError, match=flag):
        build_config("metric", overrides={section: {key: value}})


def test_dino_defaults_follow_the_recipe():
    cfg = build_config("dino")
    # docs/dino.md §1.1: AdamW 1e-4, wd 1e-4, backbone lr x0.1, clip 0.1, step decay x0.1, no warm-up, 800 test size
    o = cfg.optim
    assert (o.lr, o.weight_decay, o.backbone_lr_mult, o.clip_grad, o.schedule, o.gamma, o.warmup_steps) == \
        (1e-4, 1e-4, 0.1, 0.1, "step", 0.1, 0)
    assert cfg.model.image_size == 800 and cfg.train.batch_size == 2 and cfg.data.path == "demo"
    from vtrain.engine.optim import lr_lambda

    f = lr_lambda(o, total_steps=120)  # no milestones: one decay at 11/12 of training (epoch 11 of 12)
    assert f(109) == 1.0 and f(110) == pytest.approx(0.1)
    with pytest.raises(ConfigError, match="unknown dino preset 'vit-b'"):
        build_config("dino", overrides={"model": {"preset": "vit-b"}})
    assert build_config("dino", overrides={"model": {"preset": "swin-l"}}).model.preset == "swin-l"


def test_yaml_then_flags_precedence(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("model: {preset: vit-t, head: cosface}\ntrain: {batch_size: 16, grad_accum: 4}\n")
    cfg = build_config(None, read_yaml(f), {"train": {"grad_accum": 2}})
    assert (cfg.model.preset, cfg.model.head, cfg.train.batch_size, cfg.train.grad_accum) == ("vit-t", "cosface", 16, 2)


def test_bad_yaml_and_unknown_keys(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        read_yaml(bad)
    with pytest.raises(ConfigError, match="unknown key train.batchsize"):
        build_config("metric", {"train": {"batchsize": 3}})
    with pytest.raises(ConfigError, match="unknown section"):
        build_config("metric", {"trainer": {}})


def test_invalid_ds_json(tmp_path):
    f = tmp_path / "ds.json"
    f.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        build_config("metric", overrides={"parallel": {"ds_config": str(f)}})


def fill(raw, **kw):
    args = dict(batch_size=4, grad_accum=2, world_size=2, clip_grad=1.0, precision="bf16", precision_explicit=False)
    args.update(kw)
    return fill_ds_config(raw, "test.json", **args)


def test_ds_auto_values_are_filled_and_bf16_becomes_torch_autocast():
    ds, info = fill({"train_batch_size": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
                     "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}})
    assert ds["train_micro_batch_size_per_gpu"] == 4 and ds["gradient_accumulation_steps"] == 2
    assert ds["train_batch_size"] == 16 and ds["gradient_clipping"] == 1.0
    assert ds["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"}
    assert ds["bf16"]["enabled"] is False and ds["fp16"]["enabled"] is False
    assert info == {"stage": 3, "offload_optimizer": True, "offload_params": False, "mode": "torch_autocast",
                    "precision": "bf16"}


def test_ds_contradictions_are_errors():
    with pytest.raises(ConfigError, match="gradient_accumulation_steps=8 contradicts --grad-accum"):
        fill({"gradient_accumulation_steps": 8})
    with pytest.raises(ConfigError, match="remove the 'optimizer' section"):
        fill({"optimizer": {"type": "Adam"}})
    with pytest.raises(ConfigError, match="offload_param needs"):
        fill({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})
    with pytest.raises(ConfigError, match="contradicts --mixed-precision"):
        fill({"fp16": {"enabled": True}}, precision="bf16", precision_explicit=True)


def test_ds_explicit_full_bf16_is_respected():
    ds, info = fill({"bf16": {"enabled": True}})
    assert info["mode"] == "bf16" and ds["bf16"]["enabled"] is True and ds["torch_autocast"]["enabled"] is False


def test_shipped_ds_configs_fill_cleanly():
    from pathlib import Path

    root = ROOT / "ds_configs"
    stages = {}
    for name in ("zero1", "zero2", "zero2_offload", "zero3", "zero3_offload"):
        ds, info = fill(json.loads((root / f"{name}.json").read_text()))
        stages[name] = (info["stage"], info["offload_optimizer"], info["offload_params"])
    assert stages == {"zero1": (1, False, False), "zero2": (2, False, False), "zero2_offload": (2, True, False),
                      "zero3": (3, False, False), "zero3_offload": (3, True, True)}


def test_every_flag_section_field_is_a_train_option():
    """cli.FLAG_SECTIONS is derived from the config dataclasses (every field but CONFIG_ONLY): each of those fields
    must be a `vtrain train` option under the name errors give it (flag_of), and each option a field, --task or
    --config."""
    import typer.main

    from vtrain.cli import FLAG_SECTIONS, app
    from vtrain.config import flag_of

    train = typer.main.get_command(app).commands["train"]
    options = {o for p in train.params for o in p.opts}
    with_flag = {flag_of(n) for names in FLAG_SECTIONS.values() for n in names}
    assert with_flag <= options, f"fields without a `vtrain train` option: {sorted(with_flag - options)}"
    assert options - with_flag == {"--task", "--config"}
