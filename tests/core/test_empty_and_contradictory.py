"""Empty and contradictory values (docs/safety.md, "Empty values are refused"; docs/input_limits.md §11): a path or
text option given '' or blanks, as an unset shell variable passes it, is one `error:` line naming it, for `vtrain
train` (every text field, flag or --config key: config/fields.py `Section._check_text`) and for every other command
(cli_rules.text/path, through each command's own Click parser); `--max-size` at or below `--image-size` is one config
error for a new run (flags and YAML), for a run's config.yaml reloaded by eval and predict, and for their own flags
(config/run.py `check_resize`). Each case goes through the CLI's own parser and error mapping in this process
(tests/helpers/fuzz.py `contract`) and leaves its folder unchanged."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import typer
import yaml

from tests.helpers.fuzz import contract
from vtrain.cli import app
from vtrain.config import config_from_flags
from vtrain.config import build_config, load_run_config
from vtrain.tasks.dino import chosen_test_sizes


@functools.cache
def _commands():
    return typer.main.get_command(app).commands  # (built once: Typer makes every command's Click parameters)


def _parse(command: str, argv: list[str]):
    ctx = _commands()[command].make_context(command, argv)
    return config_from_flags(ctx.params) if command == "train" else ctx.params


TRAIN = {  # argv -> the words of its one line
    ("--output-dir", ""): "--output-dir (train.output_dir): must not be empty",
    ("--pretrained", ""): "--pretrained (model.pretrained): must not be empty",
    ("--resume", ""): "--resume (train.resume): must not be empty",
    ("--resume-weights-only", "  "): "--resume-weights-only (train.resume_weights_only): must not be empty",
    ("--data", ""): "--data (data.path): must not be empty",
    ("--ds-config", ""): "--ds-config (parallel.ds_config): must not be empty",
    ("--keep-best", " "): "--keep-best (train.keep_best): must not be empty",
    ("--model", ""): "--model (model.preset): must not be empty",
    ("--config", ""): "Invalid value for '--config': must not be empty",
    ("--task", "dino", "--image-size", "128", "--max-size", "64"):
        "--max-size (data.max_size): must be above the short side 128 (--image-size), got 64",
    ("--task", "dino", "--image-size", "128", "--max-size", "128"): "must be above the short side 128",
}


@pytest.mark.parametrize("argv", list(TRAIN), ids=lambda a: " ".join(repr(x) for x in a))
def test_train_refuses_empty_and_contradictory_values(tmp_path, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)  # '' would have been this folder
    out = contract(_parse, "train", [*argv], watch=[tmp_path])
    assert TRAIN[argv] in out.line, out.line


YAML = {  # the same from a --config file
    "output_dir: ''": ("train", {"output_dir": ""}, "--output-dir (train.output_dir): must not be empty"),
    "pretrained: ''": ("model", {"pretrained": ""}, "--pretrained (model.pretrained): must not be empty"),
    "val_ann: ' '": ("data", {"val_ann": " "}, "--val-ann (data.val_ann): must not be empty"),
    "max_size below image_size": ("data", {"max_size": 96}, "must be above the short side 128"),
}


@pytest.mark.parametrize("name", list(YAML))
def test_a_config_file_refuses_the_same(tmp_path, name):
    section, values, words = YAML[name]
    doc = {"task": "dino", "model": {"image_size": 128}, section: values}
    if section == "model":
        doc["model"] = {**doc["model"], **values}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(doc))
    out = contract(_parse, "train", ["--config", str(tmp_path / "c.yaml")], watch=[tmp_path])
    assert words in out.line, out.line


OTHER = {  # command argv (with '' somewhere) -> the option named
    ("eval", "--checkpoint", ""): "--checkpoint",
    ("eval", "--checkpoint", "x", "--save-predictions", ""): "--save-predictions",
    ("eval", "--checkpoint", "x", "--val-ann", " "): "--val-ann",
    ("predict", "--checkpoint", "x", "--images", "a.jpg", "--out", ""): "--out",
    ("predict", "--checkpoint", "x", "--images", "", "--out", "o"): "--images",
    ("consolidate", "", "out.safetensors"): "ckpt",
    ("consolidate", "run", ""): "out",
    ("export", "run", ""): "out",
    ("estimate-memory", "--ds-config", ""): "--ds-config",
    ("convert", "a.pth", "", "--from", "idea-dino"): "out",
}


@pytest.mark.parametrize("argv", list(OTHER), ids=lambda a: " ".join(repr(x) for x in a))
def test_other_commands_refuse_empty_paths(tmp_path, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)
    out = contract(_parse, argv[0], list(argv[1:]), watch=[tmp_path])
    assert f"Invalid value for '{OTHER[argv]}': must not be empty" in out.line, out.line


def test_an_empty_list_stays_allowed():
    params = _parse("eval", ["--checkpoint", "x", "--val-targets", ""])
    assert params["val_targets"] == ""  # evaluates on no pack (docs/options.md)
    cfg = build_config("metric", overrides={"model": {"grad_ckpt": ""}, "train": {"output_dir": "runs/x"}})
    assert cfg.model.grad_ckpt == []


def _saved_run_config(root: Path, model: dict, data: dict) -> Path:
    cfg = build_config("dino", overrides={"model": {"image_size": 128}, "train": {"output_dir": str(root)}})
    doc = cfg.to_dict()
    doc["model"].update(model)
    doc["data"].update(data)
    (root / "config.yaml").write_text(yaml.safe_dump(doc))
    return root / "config.yaml"


def test_a_run_config_of_a_contradictory_size_is_one_line(tmp_path):
    """What `vtrain eval` and `predict` reload: the same rule, naming the file."""
    path = _saved_run_config(tmp_path, {}, {"max_size": 64})
    out = contract(load_run_config, path, watch=[tmp_path])
    assert out.line.startswith(f"error: checkpoint config {path}: --max-size (data.max_size): must be above the "
                               "short side 128"), out.line


def test_a_run_config_written_with_an_empty_optional_value_reads_it_as_unset(tmp_path):
    path = _saved_run_config(tmp_path, {"pretrained": ""}, {})
    assert load_run_config(path).model.pretrained is None


@pytest.mark.parametrize(("size", "longest", "run_size", "run_max", "words"), [
    (None, 100, 128, None, "(the run's --image-size)"),
    (800, 800, 128, None, "(--image-size)"),
])
def test_eval_and_predict_flags_use_the_same_rule(size, longest, run_size, run_max, words):
    out = contract(chosen_test_sizes, size, longest, run_size, run_max)
    assert out.line.startswith("error: --max-size: must be above the short side") and words in out.line, out.line
