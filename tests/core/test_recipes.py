"""The recipe files in configs/ resolve through `vtrain train`'s own config resolution (config_from_flags: the
file, then the command line's --data and --output-dir), and a run's config.yaml holds its task's options only and
reloads exactly."""

from __future__ import annotations

from dataclasses import fields

import pytest
import yaml

from tests.helpers.paths import ROOT
from vtrain.config import ConfigError, ModelConfig, config_from_flags, load_run_config, resolve
from vtrain.config.data import DEMO_TRAIN_IMAGES

RECIPES = sorted((ROOT / "configs").rglob("*.yaml"))


def test_there_are_recipes_for_both_tasks():
    assert {p.parent.name for p in RECIPES} == {"dino", "face"}
    assert ROOT / "configs" / "dino" / "swin-l_5scale_12e.yaml" in RECIPES


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_a_recipe_resolves_as_train_resolves_it(path, tmp_path):
    cfg = config_from_flags({"config": path, "path": str(tmp_path), "output_dir": str(tmp_path / "run")})
    written = yaml.safe_load(path.read_text())
    assert cfg.task == written["task"]
    for section in ("model", "optim", "train"):
        for key, value in written.get(section, {}).items():
            got = getattr(getattr(cfg, section), key)
            assert (list(got) if isinstance(got, (list, tuple)) else got) == value, f"{section}.{key}"
    if cfg.task == "dino":  # the published Swin-L recipe (docs/dino.md §1.1-1.2)
        assert (cfg.model.preset, cfg.train.epochs, cfg.optim.lr, cfg.optim.schedule) == ("swin-l", 12, 1e-4, "step")
    else:  # arcface_torch's ViT recipes (docs/face.md §1.2): a global batch of 24,576 on their GPU count
        gpus = 8 if "8gpu" in path.name else 64
        assert cfg.train.batch_size * cfg.train.grad_accum * gpus == 24576
        assert (cfg.model.head, cfg.model.margin, cfg.model.sample_rate) == ("cosface", 0.4, 0.3)


@pytest.mark.parametrize("task,other", [("dino", ("head", "margin", "scale", "neck_norm", "embedding_dim")),
                                        ("metric", ("num_queries", "dn_queries", "neck_bias", "clip_boxes"))])
def test_config_yaml_holds_its_task_options_and_reloads_exactly(task, other, tmp_path):
    cfg = resolve(task, {}, {"train": {"output_dir": str(tmp_path)}})
    cfg.save(tmp_path / "config.yaml")
    text = (tmp_path / "config.yaml").read_text()
    saved = yaml.safe_load(text)
    assert not set(other) & set(saved["model"])
    assert ("val_ann" in saved["data"]) == (task == "dino") and ("val_targets" in saved["data"]) == (task == "metric")
    again = load_run_config(tmp_path / "config.yaml")
    assert again == cfg
    again.save(tmp_path / "again.yaml")
    assert (tmp_path / "again.yaml").read_text() == text


def test_an_old_config_yaml_with_every_key_still_reloads(tmp_path):
    """config.yaml of a DINO run written before the task split holds the face options at their defaults."""
    full = {f.name: getattr(ModelConfig(), f.name) for f in fields(ModelConfig)}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"task": "dino", "model": {**full, "image_size": 192}}))
    assert load_run_config(tmp_path / "config.yaml").model.image_size == 192


def test_an_option_of_the_other_task_is_refused():
    with pytest.raises(ConfigError, match=r"--num-queries \(model.num_queries\): applies to --task dino only"):
        resolve("metric", {}, {"model": {"num_queries": 300}})
    with pytest.raises(ConfigError, match=r"--val-data \(data.val_path\): applies to --task metric only"):
        resolve("dino", {}, {"data": {"val_path": "/x"}})


def test_the_demo_sizes_the_early_batch_check_uses():
    from vtrain.data import demo_faces, demo_shapes

    assert DEMO_TRAIN_IMAGES == {"metric": demo_faces.TRAIN_IDS * demo_faces.TRAIN_PER_ID,
                                 "dino": demo_shapes.SPLITS["train"]}
