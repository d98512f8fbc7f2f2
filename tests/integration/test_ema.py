"""EMA of weights, best-checkpoint keeping and TensorBoard curves, through the real CLI on one process.

The multi-process cases (EMA sharded under FSDP2 / ZeRO-3, kept across a resume on another number of processes)
are folded into tests/integration/test_distributed.py.
"""

import importlib.util
import json
import math

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tests.helpers.cli import metrics, ok, vtrain
from vtrain.config import build_config
from vtrain.engine.checkpoint.format import complete_checkpoints
from vtrain.tools.consolidate import consolidate
from vtrain.errors import ConfigError, VtrainError
from vtrain.tools.evaluate import evaluate_checkpoint, load_model

COMMON = ["--batch-size", "8", "--log-every", "1", "--num-workers", "0", "--embedding-dim", "32",
          "--head", "cosface", "--scale", "16", "--lr", "3e-3", "--mixed-precision", "no"]
DECAY, TAU = 0.8, 3


def _ema(checkpoint):
    return load_file(str(checkpoint / "ema.safetensors"))


def _state(checkpoint):
    return json.loads((checkpoint / "train_state.json").read_text())


def test_ema_follows_the_update_rule_survives_a_crash_and_is_what_eval_uses(faces, tmp_path):
    args = ["--data", str(faces), "--max-steps", "4", "--save-every", "1", "--keep-last", "10",
            "--ema-decay", str(DECAY), "--ema-warmup", str(TAU), *COMMON]
    full = tmp_path / "full"
    proc = ok(vtrain("train", "--output-dir", str(full), *args))
    assert "eval @ step 4 (EMA weights)" in proc.stdout
    ckpts = complete_checkpoints(full)
    assert [p.name for p in ckpts] == [f"step_{i}" for i in range(1, 5)]
    # the update rule between consecutive checkpoints: ema_k = d_k ema_{k-1} + (1 - d_k) w_k, d_k with warm-up
    for prev, cur in zip(ckpts, ckpts[1:]):
        k = _state(cur)["ema"]["updates"]
        assert k == _state(cur)["step"]
        d = DECAY * (1 - math.exp(-k / TAU))
        e0, e1, w1 = _ema(prev), _ema(cur), load_file(str(cur / "model.safetensors"))
        assert e1.keys() == w1.keys()  # a complete model: buffers come from the model
        for name in w1:
            if name.endswith(("running_mean", "running_var", "num_batches_tracked")):
                assert torch.equal(e1[name], w1[name]), name
            else:
                torch.testing.assert_close(e1[name], d * e0[name] + (1 - d) * w1[name], rtol=0, atol=1e-6)
    last_ema, last_w = _ema(ckpts[-1]), load_file(str(ckpts[-1] / "model.safetensors"))
    assert any(not torch.equal(last_ema[k], last_w[k]) for k in last_w if k.endswith("weight"))

    # a hard kill while training step 3, resumed from step_2: EMA equal to the uninterrupted run's
    crashed = tmp_path / "crashed"
    proc = vtrain("train", "--output-dir", str(crashed), *args, extra_env={"VTRAIN_DEBUG_CRASH_AT_STEP": "3"})
    assert proc.returncode == 17
    ok(vtrain("train", "--output-dir", str(crashed), "--resume", "auto", *args))
    got = _ema(complete_checkpoints(crashed)[-1])
    for name in last_ema:
        torch.testing.assert_close(got[name], last_ema[name], rtol=0, atol=1e-6, msg=name)
    assert _state(complete_checkpoints(crashed)[-1])["ema"]["updates"] == 4

    # `vtrain eval` uses the EMA weights by default and says so; --weights model evaluates the raw ones, and the
    # EMA evaluation reproduces the in-training one (which ran on the EMA weights)
    in_training = [json.loads(x) for x in (full / "eval.jsonl").read_text().splitlines()][-1]
    ema_eval = json.loads(ok(vtrain("eval", "--checkpoint", str(full), "--json")).stdout.strip().splitlines()[-1])
    _, raw_eval = evaluate_checkpoint(full, {}, weights_choice="model")  # in-process: the CLI path is above
    assert ema_eval["weights"] == "ema" and raw_eval["weights"] == "model"
    assert ema_eval["balanced_accuracy"] == pytest.approx(in_training["balanced_accuracy"], abs=1e-3)
    assert ema_eval["TAR@FAR=0.1"] != raw_eval["TAR@FAR=0.1"] or \
        ema_eval["accuracy_threshold"] != raw_eval["accuracy_threshold"]
    # consolidate writes the EMA weights by default (the model's with --weights model:
    # tests/integration/test_distributed.py)
    report = consolidate(full, tmp_path / "ema.safetensors", check_model=True)
    assert "EMA weights" in report.source.description
    ema_out = load_file(str(tmp_path / "ema.safetensors"))
    assert ema_out.keys() == last_ema.keys() and all(torch.equal(ema_out[k], last_ema[k]) for k in last_ema)
    # `vtrain predict` and `vtrain export` load through load_model: the EMA weights by default, as eval
    loaded = load_model(full, device=torch.device("cpu"))
    assert loaded.weights == "ema"
    assert all(torch.equal(v, last_ema[k]) for k, v in loaded.model.state_dict().items())
    assert load_model(full, device=torch.device("cpu"), weights_choice="model").weights == "model"


def test_ema_skips_nonfinite_steps_and_an_unknown_best_metric_is_one_line(faces, tmp_path):
    run = tmp_path / "run"
    proc = vtrain("train", "--data", str(faces), "--output-dir", str(run), "--max-steps", "4", "--max-nonfinite", "5",
                  "--ema-decay", "0.9", "--keep-best", "mAP", *COMMON, extra_env={"VTRAIN_DEBUG_NONFINITE": "loss@3"})
    # the last step is saved before its evaluation, which then finds no such metric
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--keep-best mAP: evaluation reports no such metric; choose one of balanced_accuracy" in proc.stderr
    proc = vtrain("eval", "--checkpoint", str(run), "--best")
    assert proc.returncode == 2 and "best.json is missing" in proc.stderr and "Traceback" not in proc.stderr
    state = _state(complete_checkpoints(run)[-1])
    assert state["skipped_steps"] == 2 and state["ema"]["updates"] == 2  # steps 3 and 4 were not updates
    with safe_open(str(complete_checkpoints(run)[-1] / "ema.safetensors"), "pt") as f:
        assert f.metadata()["updates"] == "2"


def test_keep_best_survives_pruning_and_tensorboard_gets_every_number(faces, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    # evaluation every 2 steps, checkpoints every 5: the evaluated steps get one anyway; keep-last 1
    ok(vtrain("train", "--data", str(faces), "--output-dir", str(run), "--max-steps", "8", "--eval-every", "2",
              "--save-every", "5", "--keep-last", "1", "--keep-best", "tar@far=1e-1", "--report-to", "tensorboard",
              *COMMON))
    evals = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [2, 4, 6, 8]
    best = json.loads((run / "checkpoints" / "best.json").read_text())
    want = max(evals, key=lambda e: e["TAR@FAR=0.1"])  # first of equals: later ties do not replace it
    assert best["step"] == want["step"] and best["metric"] == "TAR@FAR=0.1" and best["mode"] == "max"
    assert best["value"] == pytest.approx(want["TAR@FAR=0.1"])
    names = [p.name for p in complete_checkpoints(run)]
    assert names == sorted({f"step_{best['step']}", "step_8"}, key=lambda n: int(n[5:]))
    # eval / consolidate --best pick it
    proc = ok(vtrain("eval", "--checkpoint", str(run), "--best", "--json"))
    assert f"best checkpoint: {run / 'checkpoints' / ('step_' + str(best['step']))}" in proc.stdout
    assert json.loads(proc.stdout.strip().splitlines()[-1])["TAR@FAR=0.1"] == pytest.approx(best["value"], abs=0.03)
    report = consolidate(run, tmp_path / "best.safetensors", best=True)
    assert f"step_{best['step']} (" in report.source.description
    # the run had no EMA: asking for its EMA weights is a user error
    with pytest.raises(VtrainError, match="has no EMA weights"):
        consolidate(run, tmp_path / "x.safetensors", weights="ema")

    # TensorBoard: every log-line number and eval metric is a scalar, the config is in the hyper-parameters
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("train/loss", "train/lr", "train/rss_gb", "train/grad_norm", "train/samples_per_s",
                "eval/TAR@FAR=0.1", "eval/balanced_accuracy"):
        assert tag in tags, (tag, sorted(tags))
    losses = {e.step: e.value for e in acc.Scalars("train/loss")}
    assert losses == pytest.approx({r["step"]: r["loss"] for r in metrics(run)}, rel=1e-6)
    assert [e.step for e in acc.Scalars("eval/TAR@FAR=0.1")] == [2, 4, 6, 8]
    hparams = list(run.glob("tensorboard/*/hparams.yml"))
    assert hparams and "train.keep_best: tar@far=1e-1" in hparams[0].read_text()


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed")
def test_report_to_a_tracker_that_is_not_installed_is_a_user_error():
    from vtrain.engine.logging import tracker_name

    with pytest.raises(VtrainError, match=r"--report-to wandb: the wandb package is not installed \(pip install "
                                          r"wandb\), or use --report-to none"):
        tracker_name("wandb")
    assert tracker_name("tensorboard") == "tensorboard" and tracker_name("none") is None


@pytest.mark.parametrize("override, message", [
    ({"ema_decay": 1.0}, "--ema-decay (train.ema_decay): must be in [0, 1)"),
    ({"ema_warmup": 100}, "--ema-warmup (train.ema_warmup): needs --ema-decay > 0"),
    ({"report_to": "mlflow"}, "--report-to (train.report_to): choose one of"),
    ({"keep_best": "AP:lowest"}, "--keep-best (train.keep_best): a metric name, optionally with :min or :max"),
])
def test_config_bounds(override, message):
    with pytest.raises(ConfigError, match=__import__("re").escape(message)):
        build_config("metric", {}, {"train": override})


def test_best_metric_names_and_directions():
    from vtrain.engine.checkpoint.best import parse, pick

    assert parse("AP") == ("AP", "max") and parse("loss") == ("loss", "min") and parse("AP50:min") == ("AP50", "min")
    m = {"TAR@FAR=0.001": 0.5, "balanced_accuracy": 0.9, "AP": None, "TAR@FAR=0.001/resolvable": True}
    assert pick(m, "tar@far=1e-3") == ("TAR@FAR=0.001", 0.5)
    assert pick(m, "acc") == ("balanced_accuracy", 0.9)
    assert pick(m, "ap") == ("AP", None)
