"""Every command's options from the same fields (issue 36 §3): an option estimate-memory, eval or predict shares with
`vtrain train` is train's field (its flag, type, choices and check), and estimate-memory's run is resolved as train
resolves one. In-process, no model built."""

from __future__ import annotations

import typing
from enum import Enum
from dataclasses import fields

import pytest
import yaml

from vtrain.config import ConfigError, options, resolve
from vtrain.config.estimate import DEFAULTS, EstimateOptions


def _params(name: str) -> dict:
    import typer.main

    from vtrain.cli import app

    command = typer.main.get_command(app).commands[name]  # type: ignore[attr-defined]
    return {p.name: p for p in command.params}


def _choices(p) -> list[str] | None:
    """The values a Click choice takes (Typer keeps it as the Enum it was given), None for another type."""
    kind = p.type_descriptor.annotation
    return [m.value for m in kind] if isinstance(kind, type) and issubclass(kind, Enum) else None


def test_shared_options_are_trains_fields():
    train = {o.key: o for o in options()}
    shared = [f for f in fields(EstimateOptions) if "same" in f.metadata]
    assert len(shared) == 12
    params = _params("estimate-memory")
    for f in shared:
        o = train[f.metadata["same"]]
        p = params[f.name]
        assert p.opts == [o.flag], f.name
        assert p.help == f.metadata.get("help", o.help).replace("[", r"\["), f.name
        if o.choices and o.cli_choice:
            assert _choices(p) == list(o.choices), f.name


def test_a_literal_is_a_choice_everywhere():
    params = _params("estimate-memory")
    hints = typing.get_type_hints(EstimateOptions)
    for name in ("zero", "offload"):
        assert _choices(params[name]) == [str(v) for v in typing.get_args(typing.get_args(hints[name])[0])]
    with pytest.raises(ConfigError, match="--zero: choose one of 0, 1, 2, 3"):
        EstimateOptions(zero=5)  # type: ignore[arg-type]


def test_estimate_resolves_a_run_as_train_does(tmp_path):
    doc = {"task": "metric", "model": {"preset": "debug", "neck_norm": "ln"}, "train": {"batch_size": 3}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(doc))
    got = EstimateOptions(config=tmp_path / "c.yaml", grad_accum=4).run_config()
    assert got == resolve(None, dict(doc), {"train": {"grad_accum": 4}})
    assert EstimateOptions().run_config() == resolve("dino", DEFAULTS["dino"])
    for bad, words in [(dict(batch_size=0), "--batch-size (train.batch_size): must be >= 1, got 0"),
                       (dict(task="metric", model="debug", batch_size=1), "BatchNorm"),
                       (dict(sample_rate=0.5, task="metric"), "--sample-rate (model.sample_rate)")]:
        with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
            EstimateOptions(**bad).run_config()
