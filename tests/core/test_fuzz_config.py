"""The fuzz lane for what configures a run (docs/testing.md, "The fuzz lane"): hostile variants of a `--config` YAML
(a resolved config with values of other types, huge and non-finite numbers, nesting 100,000 deep, unknown keys,
YAML's own tags, aliases and anchors; text truncated or flipped), of a DeepSpeed JSON (read by config validation,
filled at launch and read by `estimate-memory`), and of every `vtrain train` option's value given on the command
line (parsed by the command's own Click parser). Each goes through the code the CLI runs, in this process, and must
meet the contract (tests/helpers/fuzz.py): a config, or one `error:` line by the CLI's own error mapping."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import typer
import yaml
from hypothesis import given
from hypothesis import strategies as st

from tests.helpers.fuzz import contract, corrupt, dumps, mutate, strategies
from tests.helpers.paths import ROOT
from vtrain.cli import app
from vtrain.config import config_from_flags
from vtrain.config import build_config, options, read_yaml
from vtrain.config.paths import check_parallel
from vtrain.config.parallel import ParallelConfig
from vtrain.engine.engines.ds_config import fill_ds_config
from vtrain.tools.estimate_memory import _ds_fields

pytestmark = pytest.mark.fuzz

YAML_SNIPPETS = ["!!python/object/apply:os.system ['echo x']", "&a [*a]", "*nowhere", "!!binary AAAA",
                 "<<: {lr: 1}", "{? [1, 2]: 3}", "2001-13-40", "0b101", "1_000", "0o17", "- - - -", "'\\x00'",
                 "9" * 5000]


def _config_doc(task: str) -> dict:
    cfg = build_config(task, overrides={"train": {"output_dir": "runs/fuzz"}})
    return cfg.to_dict()


def _yaml_text(data, doc) -> str:
    if data.draw(st.booleans(), label="as JSON text"):
        return dumps(doc)
    try:
        text = yaml.safe_dump(doc, allow_unicode=True)
    except (yaml.YAMLError, TypeError, ValueError):  # a deep placeholder, a value PyYAML will not write
        return dumps(doc)
    if data.draw(st.booleans(), label="YAML snippet"):
        lines = text.splitlines()
        i = data.draw(st.integers(0, len(lines) - 1), label="line")
        key = lines[i].split(":")[0] if ":" in lines[i] else "  lr"
        lines[i] = f"{key}: {data.draw(st.sampled_from(YAML_SNIPPETS), label='snippet')}"
        text = "\n".join(lines)
    return text


def _read_config(path: Path, task: str):
    return build_config(task, read_yaml(path), {})


@given(st.data(), st.sampled_from(["metric", "dino"]))
def test_config_yaml(data, task):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.yaml"
        raw = _yaml_text(data, mutate(data, _config_doc(task))).encode("utf-8", "surrogatepass")
        if data.draw(st.booleans(), label="corrupt"):
            raw = corrupt(data, raw)
        path.write_bytes(raw)
        contract(_read_config, path, task, watch=[Path(tmp)], input_bytes=len(raw))


DS_DOC = json.loads((ROOT / "ds_configs" / "zero3_offload.json").read_text())


def _fill(path: Path) -> None:
    """The launch: the JSON as validation let it through, filled with the run's values."""
    check_parallel(ParallelConfig(ds_config=str(path)))
    fill_ds_config(json.loads(path.read_text()), str(path), batch_size=2, grad_accum=1, world_size=2, clip_grad=1.0,
                   precision="bf16", precision_explicit=False)


# each reader of a DeepSpeed JSON on its own (one behind another would hide the second's problems)
DS_READERS = {"config validation": lambda p: check_parallel(ParallelConfig(ds_config=str(p))),
              "estimate-memory": lambda p: _ds_fields(str(p)), "launch": _fill}


@given(st.data(), st.sampled_from(sorted(DS_READERS)))
def test_deepspeed_json(data, reader):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ds.json"
        raw = dumps(mutate(data, DS_DOC)).encode("utf-8", "surrogatepass")
        if data.draw(st.booleans(), label="corrupt"):
            raw = corrupt(data, raw)
        path.write_bytes(raw)
        contract(DS_READERS[reader], path, watch=[Path(tmp)], input_bytes=len(raw))


TRAIN_FLAGS = [o.flag for o in options() if o.flag]
VALUES = st.sampled_from(["", " ", "0", "-1", "1e309", "nan", "-inf", "1" * 400, "2" * 5000, "true", "no", "auto",
                          "a,b,,c", "..", "/dev/null", "\0x", "\udc80", "debug", "dino", "x" * 300, "1.5",
                          "9223372036854775808", "backbone:stage9-1", "demo"])


# what the lane found, kept as table rows: estimate-memory read a DeepSpeed JSON before checking its structure
FOUND = {'[]': "top level must be a JSON object",
         '{"zero_optimization": {"reduce_bucket_size": "abc"}}': "reduce_bucket_size must be",
         '{"zero_optimization": {"allgather_bucket_size": 1e400}}': "allgather_bucket_size must be"}


@pytest.mark.parametrize("text", list(FOUND))
def test_found(tmp_path, text):
    (tmp_path / "ds.json").write_text(text)
    out = contract(_ds_fields, str(tmp_path / "ds.json"), watch=[tmp_path])
    assert FOUND[text] in out.line, out.line


TRAIN = typer.main.get_command(app).commands["train"]  # (built once: Typer makes every option's Click parameter)


def _parse_and_build(argv: list[str]):
    ctx = TRAIN.make_context("train", argv)
    return config_from_flags(ctx.params)


@given(st.lists(st.tuples(st.sampled_from(TRAIN_FLAGS), VALUES | strategies().text), min_size=1, max_size=4))
def test_train_option_values(pairs):
    with tempfile.TemporaryDirectory() as tmp:
        argv = ["--output-dir", str(Path(tmp) / "run")]
        for flag, value in pairs:
            argv += [flag, value]
        contract(_parse_and_build, argv, watch=[Path(tmp)])
