"""The fuzz lane's whole-command property (docs/testing.md, "The fuzz lane"): every command but `train` (whose option
values tests/core/test_fuzz_config.py drives through its own parser in-process) run as a real `vtrain` process
through the fork server, with generated values for its options and arguments, hostile ones (empty, blank, huge
numbers, NaN, NUL, undecodable bytes, paths to a FIFO, a folder, a checkpoint's own file) mixed with valid ones
(a small detector and face checkpoint, images, a COCO set). Each run must exit 0 or 2 with exactly one `error:` line
and no traceback, stay under the memory limit, and leave the inputs and a decoy folder byte-identical."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import typer
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.checkpoints import debug_detector, debug_face_model
from tests.helpers.cli import tree_hash
from tests.helpers.fork_server import PEAK_LIMIT_MB, Cli
from tests.helpers.fuzz import strategies
from vtrain.cli import app

pytestmark = pytest.mark.fuzz
COMMANDS = ["convert", "export", "consolidate", "predict", "estimate-memory", "eval"]
EXAMPLES = int(os.environ.get("VTRAIN_FUZZ_CLI_EXAMPLES", 120 if os.environ.get("VTRAIN_FUZZ") else 4))


class _World(dict):
    def __repr__(self) -> str:
        return "world"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz_cli")
    det = debug_detector(root / "det", {"0.jpg": (64, 48), "1.jpg": (48, 64)})
    face = debug_face_model(root)
    decoy = root / "decoy"
    decoy.mkdir()
    (decoy / "keep.txt").write_text("mine")
    os.mkfifo(root / "fifo")
    logs = root / "logs"
    logs.mkdir()
    cli = Cli(logs)
    yield _World(root=root, det=det, face=face, decoy=decoy, cli=cli)
    cli.close()


COMMAND_PARAMS = {c: [p for p in typer.main.get_command(app).commands[c].params if p.name != "help"]
                  for c in COMMANDS}


def _params(command: str) -> list:
    return COMMAND_PARAMS[command]


def _value(data, w) -> str:
    det, face = w["det"], w["face"]
    valid = [str(det["ckpt"]), str(det["ckpt"].parent.parent), str(face), str(det["ann"]), str(det["val"]),
             str(det["val"] / "0.jpg"), "dino", "metric", "2", "64", "128", "fp32", "ema", "model", "0.5",
             str(w["root"] / "out" / "x.safetensors"), str(w["root"] / "out" / "m.onnx"), str(w["root"] / "out")]
    hostile = [str(w["root"] / "fifo"), str(det["ckpt"] / "model.safetensors"), str(w["decoy"]),
               str(w["decoy"] / "keep.txt"), "", " ", "-1", "0", "nan", "1e309", "9" * 400, "\0", "\udc80",
               "x" * 300, "/dev/null", "1x100000", "idea-dino", "arcface-vit"]
    return data.draw(st.sampled_from(valid + hostile) | strategies().text, label="value")


# where a command would otherwise do long valid work by default (trace a Swin-L DINO, check an ONNX export with
# onnxruntime), the smallest valid choice first; the generated options come after and may replace it
SMALL = {"estimate-memory": ["--model", "debug", "--image-size", "128", "--no-compare-gc"], "export": ["--no-verify"]}


def _argv(data, w) -> list[str]:
    command = data.draw(st.sampled_from(COMMANDS), label="command")
    argv = [command, *SMALL.get(command, [])]
    params = _params(command)
    for p in params:
        if p.param_type_name == "argument":
            argv.append(_value(data, w))
    options = [p for p in params if p.param_type_name == "option"]
    required = [p for p in options if p.required]
    chosen = required + data.draw(st.lists(st.sampled_from(options), max_size=4), label="options")
    for p in chosen:
        flag = p.opts[0]
        if p.is_flag:
            argv.append(flag if not p.secondary_opts or data.draw(st.booleans()) else p.secondary_opts[0])
        else:
            argv += [flag, _value(data, w)]
    return argv


@settings(max_examples=EXAMPLES)
@given(st.data())
def test_commands_with_generated_values(world, data):
    argv = _argv(data, world)
    before = {k: tree_hash(world[k] if k == "decoy" else world["det"][k]) for k in ("decoy", "val", "ckpt")}
    face = tree_hash(world["face"])
    rc, out, err, peak = world["cli"].run([a.encode("utf-8", "surrogateescape").decode("utf-8", "surrogateescape")
                                           for a in argv])
    assert rc in (0, 2) and "Traceback" not in err, (argv, rc, err[-3000:])
    if rc == 2:
        assert len([x for x in err.splitlines() if x.startswith("error:")]) == 1, (argv, err[-3000:])
    assert peak < PEAK_LIMIT_MB, (argv, peak)
    after = {k: tree_hash(world[k] if k == "decoy" else world["det"][k]) for k in ("decoy", "val", "ckpt")}
    assert after == before and tree_hash(world["face"]) == face, argv
