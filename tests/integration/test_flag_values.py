"""Every flag value honoured or refused, and work bounded by what a value really names.

- `--grad-ckpt` ranges are resolved against the model's units as intervals: a range of 10^11 units, a number of 18
  digits or thousands of comma items cost what the model's units cost, and a unit the model lacks is one line
  naming how many it has (train, estimate-memory, a config file).
- A value that would be silently replaced (`eval --batch-size 0` taken for "not given"), silently unused (another
  task's flag) or fail deep in a library (`export --opset 99`, BatchNorm at batch 1 in estimate-memory) is refused
  in one line.
- Resuming with changed settings: what the new config.yaml records is what the run uses, and each change is said in
  one log line (the LR read back from metrics.jsonl and the optimizer state, the batch from train_state.json).

Every command runs through the fork server (helpers/cli_server.py, torch imported once), under the data-segment
limit of test_hostile_data.py, its peak resident memory checked.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.helpers.cli import reseal, tree_hash
from tests.helpers.checkpoints import relabelled_as_dino
from tests.helpers.fork_server import Cli, PEAK_LIMIT_MB
from tests.helpers.scaffold import served, shown, verdict

BASE = ["--num-workers", "0", "--embedding-dim", "16", "--mixed-precision", "no", "--schedule", "constant",
        "--warmup-steps", "0", "--log-every", "1", "--val-targets", ""]


@dataclass
class Prior:
    cli: Cli
    faces: Path
    run: Path
    """A finished metric run (BatchNorm neck, batch 4, lr 1e-3 constant): checkpoints step_1, step_2."""


@pytest.fixture(scope="module")
def prior(tmp_path_factory) -> Prior:
    from vtrain.data.demo_faces import write_identity_tree

    with served(tmp_path_factory, "flags") as (root, cli):
        write_identity_tree(root / "faces" / "train", 0, 3, 4, seed=3)
        run = root / "run"
        rc, out, err, _ = cli.run(["train", "--data", str(root / "faces"), "--output-dir", str(run), "--batch-size",
                                   "4", "--max-steps", "2", "--save-every", "1", "--lr", "1e-3", *BASE])
        assert rc == 0, out[-3000:] + err[-3000:]
        yield Prior(cli, root / "faces", run)


@dataclass
class Ctx:
    prior: Prior
    inputs: Path
    out: Path

    def train(self, *args: str) -> list[str]:
        return ["train", "--data", str(self.prior.faces), "--output-dir", str(self.out), "--batch-size", "4",
                "--max-steps", "1", *BASE, *args]

    def yaml(self, doc: dict) -> str:
        p = self.inputs / "c.yaml"
        p.write_text(yaml.safe_dump(doc))
        return str(p)

    def run_copy(self) -> Path:
        dst = self.inputs / "run"
        shutil.copytree(self.prior.run, dst, symlinks=True)
        return dst


CASES: dict[str, tuple[Callable[[Ctx], list[str]], tuple[str, ...]]] = {}


def case(name: str, build: Callable[[Ctx], list[str]], *needles: str) -> None:
    assert name not in CASES
    CASES[name] = (build, needles)


EM = ["estimate-memory", "--no-compare-gc"]
# ---- --grad-ckpt: ranges as intervals against the model's units --------------------------------------------------
case("estimate-dino-stage-range-1e11", lambda c: [*EM, "--model", "debug", "--grad-ckpt",
                                                  "backbone:stage0-99999999999"],
     "--grad-ckpt", "no unit backbone.stage4", "this model has 4 backbone units", "backbone:stage0-3")
case("estimate-metric-block-range-1e11", lambda c: [*EM, "--task", "metric", "--model", "debug", "--grad-ckpt",
                                                    "backbone:block0-99999999999"],
     "no unit backbone.block2", "this model has 2 backbone units")
case("estimate-18-digit-encoder-range-then-decoder", lambda c: [
    *EM, "--model", "debug", "--grad-ckpt", "encoder:0-999999999999999999,decoder:0-5"],
     "encoder:0-999999999999999999", "no unit encoder.2", "2 encoder units")
case("estimate-20-digit-unit-number", lambda c: [*EM, "--model", "debug", "--grad-ckpt",
                                                 "encoder:3-" + "9" * 20], "at most 18 digits")
case("estimate-5000-digit-unit-number", lambda c: [*EM, "--model", "debug", "--grad-ckpt",
                                                   "decoder:" + "7" * 5000], "at most 18 digits", "(5000 characters)")
case("estimate-20000-comma-items", lambda c: [*EM, "--model", "debug", "--grad-ckpt",
                                              "encoder:" + ",".join(["0", "1"] * 10000 + ["7"])],
     "no unit encoder.7", "(40009 characters)")
case("estimate-config-range-1e11", lambda c: [*EM, "--config", c.yaml(
    {"task": "metric", "model": {"preset": "debug", "grad_ckpt": ["backbone:block1-99999999999"]}})],
     "no unit backbone.block2", "2 backbone units")
case("train-metric-block-range-1e11", lambda c: c.train("--grad-ckpt", "backbone:block0-99999999999"),
     "--grad-ckpt", "no unit backbone.block2", "2 backbone units")
case("train-metric-sac-range-beyond", lambda c: c.train("--grad-ckpt", "sac:backbone:block1-4"),
     "no unit backbone.block2")

# ---- values replaced or unused, and values a library fails on deep inside ----------------------------------------
case("eval-batch-size-0", lambda c: ["eval", "--checkpoint", str(c.prior.run), "--batch-size", "0"],
     "--batch-size", "must be >= 1, got 0")
case("eval-batch-size-negative", lambda c: ["eval", "--checkpoint", str(c.prior.run), "--batch-size", "-3"],
     "--batch-size", "got -3")
case("predict-batch-size-0", lambda c: ["predict", "--checkpoint", str(c.prior.run), "--images",
                                        str(c.prior.faces), "--out", str(c.out / "e.safetensors"),
                                        "--batch-size", "0"], "--batch-size", "got 0")
case("export-opset-99", lambda c: ["export", str(c.prior.run), str(c.out / "m.onnx"), "--opset", "99"],
     "--opset 99", "writes opsets 18 to")
case("export-opset-17", lambda c: ["export", str(c.prior.run), str(c.out / "m.onnx"), "--opset", "17"],
     "--opset 17", "writes opsets 18 to")
case("estimate-metric-batch-1-batchnorm", lambda c: [*EM, "--task", "metric", "--model", "debug",
                                                     "--batch-size", "1"], "--batch-size", "BatchNorm")
case("estimate-config-metric-batch-1-batchnorm", lambda c: [*EM, "--config", c.yaml(
    {"task": "metric", "model": {"preset": "debug"}, "train": {"batch_size": 1}})], "--batch-size", "BatchNorm")
case("estimate-dino-neck-norm", lambda c: [*EM, "--model", "debug", "--neck-norm", "ln"], "--neck-norm",
     "--task metric")
case("estimate-breakdown-rows-without-breakdown", lambda c: [*EM, "--model", "debug", "--breakdown-rows", "3"],
     "--breakdown-rows", "without --breakdown")
case("eval-metric-checkpoint-val-ann", lambda c: ["eval", "--checkpoint", str(c.prior.run), "--val-ann",
                                                  str(c.prior.run / "config.yaml")],
     "--val-ann", "only for detection", "metric checkpoint")
case("eval-metric-checkpoint-save-predictions", lambda c: ["eval", "--checkpoint", str(c.prior.run),
                                                           "--save-predictions", str(c.out / "p.json")],
     "--save-predictions", "only for detection")
case("predict-metric-score-threshold", lambda c: ["predict", "--checkpoint", str(c.prior.run), "--images",
                                                  str(c.prior.faces), "--out", str(c.out / "e.safetensors"),
                                                  "--score-threshold", "0.5"], "--score-threshold", "detection")
case("consolidate-max-shard-size-0", lambda c: ["consolidate", str(c.prior.run), str(c.out / "m.safetensors"),
                                                "--max-shard-size", "0"], "--max-shard-size", "at least 1 byte")
case("yaml-max-impostor-pairs-huge", lambda c: c.train("--config", c.yaml({"data": {"max_impostor_pairs": 10**9}})),
     "data.max_impostor_pairs", "must be in 1..")
case("yaml-max-genuine-pairs-0", lambda c: c.train("--config", c.yaml({"data": {"max_genuine_pairs": 0}})),
     "data.max_genuine_pairs", "got 0")


def _dino_labelled_copy(c: Ctx) -> list[str]:
    """The metric run's checkpoint, its config.yaml saying dino (resealed): --backbone-only is refused on what the
    checkpoint records, before a tensor is read."""
    run = c.run_copy()
    step = run / "checkpoints" / "step_2"
    doc = relabelled_as_dino(yaml.safe_load((step / "config.yaml").read_text()))
    (step / "config.yaml").write_text(yaml.safe_dump(doc))
    reseal(step)
    return ["consolidate", str(step), str(c.out / "m.safetensors"), "--backbone-only"]


case("consolidate-backbone-only-dino", _dino_labelled_copy, "--backbone-only", "dino checkpoint")


@pytest.mark.parametrize("name", list(CASES))
def test_refused_in_one_line_with_bounded_memory(name, prior, tmp_path):
    from vtrain.engine.checkpoint.format import complete_checkpoints

    build, needles = CASES[name]
    c = Ctx(prior, tmp_path / "inputs", tmp_path / "out")
    c.inputs.mkdir()
    argv = build(c)
    before = tree_hash(c.inputs), tree_hash(prior.run)
    rc, out, err, peak_mb = prior.cli.run(argv)
    show = shown(rc, out, err, peak_mb, err_tail=3000)
    line = verdict(rc, out, err, needles, False, show)
    assert rc == 2, show
    assert len(line) < 400, line[:1000]  # a value is cut for the message, never printed whole
    assert (tree_hash(c.inputs), tree_hash(prior.run)) == before
    assert not complete_checkpoints(c.out) and not (c.out / "m.onnx").exists()
    assert peak_mb < PEAK_LIMIT_MB, show


def test_every_case_is_distinct():
    assert len(CASES) >= 25 and len({id(b) for b, _ in CASES.values()}) == len(CASES)


def test_batch_1_is_estimated_with_a_layernorm_neck(prior):
    """The BatchNorm rule refuses only what training refuses: batch 1 with --neck-norm ln is estimated."""
    rc, out, err, _ = prior.cli.run([*EM, "--task", "metric", "--model", "debug", "--batch-size", "1",
                                     "--neck-norm", "ln", "--json"])
    assert rc == 0, err[-3000:]
    assert json.loads(out.strip().splitlines()[-1])["setup"]["batch_size"] == 1


# ---- resuming with changed settings -----------------------------------------------------------------------------
def _resume(prior: Prior, tmp_path: Path, *args: str) -> tuple[Path, str]:
    run = tmp_path / "run"
    shutil.copytree(prior.run, run, symlinks=True)
    rc, out, err, _ = prior.cli.run(["train", "--data", str(prior.faces), "--output-dir", str(run), "--resume", "auto",
                                     "--save-every", "1", *BASE, *args])
    assert rc == 0 and "Traceback" not in out + err, out[-3000:] + err[-3000:]
    return run, out + err


def _lrs(run: Path) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def _groups(checkpoint: Path) -> list[dict]:
    import torch

    return torch.load(checkpoint / "accelerate" / "optimizer.bin", weights_only=True)["param_groups"]


def _train_state(checkpoint: Path) -> dict:
    return json.loads((checkpoint / "train_state.json").read_text())


@pytest.mark.parametrize("lr", [5e-4, 2e-3])
def test_a_changed_lr_is_the_lr_used_and_said(prior, tmp_path, lr):
    run, log = _resume(prior, tmp_path, "--batch-size", "4", "--max-steps", "4", "--lr", str(lr))
    assert f"--lr 0.001 -> {lr} on resume" in log
    assert _lrs(run) == {1: 1e-3, 2: 1e-3, 3: lr, 4: lr}  # the constant schedule at the new peak
    assert yaml.safe_load((run / "config.yaml").read_text())["optim"]["lr"] == lr
    state = _train_state(run / "checkpoints" / "step_4")
    assert set(state["scheduler"]["base_lrs"]) == {lr}  # a further resume keeps it
    assert {g["lr"] for g in _groups(run / "checkpoints" / "step_4")} == {lr}


def test_a_changed_weight_decay_reaches_the_optimizer(prior, tmp_path):
    old = yaml.safe_load((prior.run / "config.yaml").read_text())["optim"]["weight_decay"]
    run, log = _resume(prior, tmp_path, "--batch-size", "4", "--max-steps", "3", "--weight-decay", "0.25")
    assert f"--weight-decay {old} -> 0.25 on resume" in log
    assert {g["weight_decay"] for g in _groups(run / "checkpoints" / "step_3")} == {0.0, 0.25}  # no-decay groups: 0
    assert {g["weight_decay"] for g in _groups(prior.run / "checkpoints" / "step_2")} == {0.0, old}


def test_a_changed_global_batch_is_applied_and_said(prior, tmp_path):
    run, log = _resume(prior, tmp_path, "--batch-size", "2", "--grad-accum", "3", "--max-steps", "4")
    assert "global batch 4 (batch 4 x accum 1 x 1 processes) -> 6 (batch 2 x accum 3 x 1) on resume" in log
    assert "data goes on at sample 8" in log
    assert _train_state(run / "checkpoints" / "step_4")["consumed_samples"] == 2 * 4 + 2 * 6
    cfg = yaml.safe_load((run / "config.yaml").read_text())["train"]
    assert (cfg["batch_size"], cfg["grad_accum"]) == (2, 3)


def test_an_unchanged_resume_says_nothing_and_keeps_the_lr(prior, tmp_path):
    run, log = _resume(prior, tmp_path, "--batch-size", "4", "--max-steps", "3")
    assert "on resume" not in log
    assert _lrs(run) == {1: 1e-3, 2: 1e-3, 3: 1e-3}
