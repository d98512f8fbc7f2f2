"""Each option is declared once, as a config field (vtrain/config/fields.py): `vtrain train`'s flags, their help and
docs/options.md are made from the fields, and an option declared anywhere else (a hand-written typer.Option, a row
of the README) fails here. The config holds values only: building or reloading one opens no file, and a run's
config.yaml reloads as it was written even where the files it names are gone."""

from __future__ import annotations

import ast
import builtins
import glob
import json
import os
import re
from dataclasses import dataclass, field
from typing import Literal

import pytest

from tests.helpers.paths import ROOT
from vtrain.config.fields import NO_FLAG, Section


def _train_command():
    import typer.main

    from vtrain.cli import app

    return typer.main.get_command(app).commands["train"]


def test_docs_options_md_is_generated_from_the_fields():
    from vtrain.tools.options_doc import render

    assert (ROOT / "docs" / "options.md").read_text() == render(), \
        "docs/options.md is stale: python -m vtrain.tools.options_doc > docs/options.md"


def test_every_train_option_is_a_config_field_with_its_docstring_as_help():
    """The flags are exactly the fields that have one, plus --config (the file itself); each help is its field's
    docstring. A typer.Option written by hand for `train` has no field, or another help."""
    from vtrain.config import options

    fields_with_flag = {o.flag: o for o in options() if o.flag}
    params = {p.opts[0]: p for p in _train_command().params}
    assert set(params) - {"--config"} == set(fields_with_flag)
    for flag, o in fields_with_flag.items():
        assert o.help, f"{o.key} has no docstring (its --help and docs/options.md text)"
        assert params[flag].help == o.help.replace("[", "\\["), flag


def test_the_train_function_declares_no_option_itself():
    """cli.py's `train` takes `**flags` only: its parameters are made from the config fields (cli._train_command)."""
    tree = ast.parse((ROOT / "vtrain" / "cli.py").read_text())
    (train,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "train"]
    a = train.args
    assert not (a.args or a.kwonlyargs or a.posonlyargs or a.vararg) and a.kwarg is not None


def test_every_config_field_has_a_docstring():
    from vtrain.config import options

    missing = [o.key for o in options() if not o.help]
    assert not missing, f"fields without an attribute docstring: {missing}"


def test_the_readme_has_no_table_of_train_options():
    """The README points to `vtrain train --help` and docs/options.md instead of a third copy of the options."""
    from vtrain.config import options

    flags = {o.flag for o in options() if o.flag}
    rows = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("|")]
    listed = sorted({f for line in rows for f in re.findall(r"`(--[a-z0-9-]+)", line) if f in flags})
    assert not listed, f"README tables list `vtrain train` options (docs/options.md is their reference): {listed}"
    assert "docs/options.md" in (ROOT / "README.md").read_text()


def test_train_flags_types_and_defaults_are_those_of_before():
    """Names, value types, flag-ness and defaults of every `vtrain train` option, as the hand-written command had
    them (tests/fixtures/train_options.json, recorded from it): a new option adds an entry here."""
    cmd = _train_command()
    ctx = cmd.make_context("train", [], resilient_parsing=True)
    now = {p.opts[0]: {"opts": p.opts + p.secondary_opts, "type": p.display_type(ctx), "flag": p.is_flag,
                       "default": p.default, "multiple": p.multiple, "required": p.required} for p in cmd.params}
    before = json.loads((ROOT / "tests" / "fixtures" / "train_options.json").read_text())
    assert now == before


def test_flag_and_error_names_come_from_the_field_metadata():
    from vtrain.config import CONFIG_ONLY, FLAG_SECTIONS, ModelConfig, OptimConfig, flag_of
    from vtrain.config.fields import where

    assert [flag_of(n) for n in ("preset", "path", "val_path", "pairs_file", "lr")] == \
        ["--model", "--data", "--val-data", "--pairs", "--lr"]
    assert where(OptimConfig, "lr") == "--lr (optim.lr)" and where(OptimConfig, "betas") == "optim.betas"
    assert where(ModelConfig, "preset") == "--model (model.preset)"
    assert {"ffn_recompute", "ffn_chunk", "betas", "compile_backend"} <= CONFIG_ONLY
    assert not CONFIG_ONLY & {n for names in FLAG_SECTIONS.values() for n in names}


@pytest.fixture
def no_file_access(monkeypatch):
    """Any stat, open or glob fails the test: what runs inside opens no file."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"file access: {args[:1]}")

    monkeypatch.setattr(os, "stat", refuse)
    monkeypatch.setattr(builtins, "open", refuse)
    monkeypatch.setattr(glob, "glob", refuse)


def test_building_a_config_opens_no_file(no_file_access):
    from vtrain.config import resolve

    cfg = resolve("dino", {"model": {"pretrained": "/gone/w.safetensors"}},
                  {"data": {"path": "/gone/coco", "train_ann": "/gone/a.json", "val_images": "/gone/val"},
                   "parallel": {"ds_config": "/gone/ds.json"}, "train": {"resume": "/gone/step_1",
                                                                         "output_dir": "/gone/run"}})
    assert cfg.model.pretrained == "/gone/w.safetensors" and cfg.parallel.ds_config == "/gone/ds.json"


@pytest.mark.parametrize("section,key,value,flag,message", [
    ("model", "pretrained", "/gone/w.safetensors", "--pretrained (model.pretrained)",
     "weights file or checkpoint directory not found"),
    ("data", "path", "/gone/faces", "--data (data.path)", "not a directory (or a verification .bin pack)"),
    ("data", "pairs_file", "/gone/pairs.txt", "--pairs (data.pairs_file)", "file not found"),
    ("parallel", "ds_config", "/gone/ds.json", "--ds-config (parallel.ds_config)", "file not found"),
    ("train", "resume", "/gone/step_1", "--resume (train.resume)", "not a checkpoint directory"),
    ("train", "resume_weights_only", "/gone/w.safetensors", "--resume-weights-only (train.resume_weights_only)",
     "file not found"),
])
def test_a_new_run_checks_its_paths(section, key, value, flag, message):
    from vtrain.config import ConfigError, build_config

    with pytest.raises(ConfigError, match=re.escape(f"{flag}: {message}: {value}")):
        build_config("metric", overrides={section: {key: value}})


def test_a_run_config_reloads_as_written_where_its_files_are_gone(tmp_path):
    from vtrain.config import build_config, load_run_config

    weights, data, ds = tmp_path / "w.safetensors", tmp_path / "faces", tmp_path / "ds.json"
    weights.write_bytes(b"x")
    data.mkdir()
    ds.write_text('{"zero_optimization": {"stage": 2}}')
    cfg = build_config("metric", overrides={
        "model": {"pretrained": str(weights)}, "data": {"path": str(data), "val_targets": "lfw"},
        "parallel": {"ds_config": str(ds)}, "train": {"output_dir": str(tmp_path / "run"), "resume": "auto"}})
    cfg.save(tmp_path / "config.yaml")
    for p in (weights, ds):
        p.unlink()
    data.rmdir()
    assert load_run_config(tmp_path / "config.yaml").to_dict() == cfg.to_dict()


def test_a_checkpoint_config_error_names_the_file(tmp_path):
    from vtrain.config import ConfigError, build_config, load_run_config

    f = tmp_path / "config.yaml"
    build_config("metric").save(f)
    f.write_text(f.read_text().replace("max_image_pixels: 89478485", "max_image_pixels: many"))
    with pytest.raises(ConfigError, match=re.escape(f"checkpoint config {f}: data.max_image_pixels: expected an "
                                                    "integer, got 'many'")):
        load_run_config(f)


@dataclass
class _Extra(Section):
    """A section as docs/architecture.md says to add an option to one."""

    SECTION = "train"

    deterministic: bool = False
    """Use deterministic algorithms."""
    renamed: str = field(default="x", metadata={"flag": "--other-name"})
    """A flag that is not the field's name."""
    hidden: int = field(default=1, metadata=NO_FLAG)
    """A --config key only."""
    pick: Literal["a", "b"] = "a"
    """A choice."""

    def __post_init__(self) -> None:
        self._check(self.hidden > 0, "hidden", "must be > 0")


def test_a_field_with_a_docstring_is_an_option():
    from vtrain.config.fields import options_of
    from vtrain.errors import ConfigError

    got = [(o.flag, o.key, o.help, o.value_type, o.choices, o.default) for o in options_of(_Extra, "train")]
    assert got == [("--deterministic", "train.deterministic", "Use deterministic algorithms.", bool, None, False),
                   ("--other-name", "train.renamed", "A flag that is not the field's name.", str, None, "x"),
                   (None, "train.hidden", "A --config key only.", int, None, 1),
                   ("--pick", "train.pick", "A choice.", str, ("a", "b"), "a")]
    with pytest.raises(ConfigError, match=re.escape("train.hidden: must be > 0")):
        _Extra(hidden=0)
