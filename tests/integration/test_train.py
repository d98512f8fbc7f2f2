"""One-process runs of the real CLI: learning, logs, checkpoints, crash-and-resume, eval, non-finite stop."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.cli import final_weights, metrics, ok, run_info, vtrain
from vtrain.engine.checkpoint.format import complete_checkpoints

COMMON = ["--batch-size", "8", "--log-every", "1", "--num-workers", "0", "--embedding-dim", "32",
          "--head", "cosface", "--scale", "16", "--lr", "3e-3"]


def test_trains_logs_checkpoints_and_evaluates(faces, tmp_path):
    run = tmp_path / "run"
    proc = ok(vtrain("train", "--data", str(faces), "--output-dir", str(run), "--max-steps", "24", "--save-every",
                     "8", "--keep-last", "2", "--eval-every", "12", *COMMON))
    assert "engine: single process" in proc.stdout
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 25))
    for key in ("step", "epoch", "loss", "lr", "time", "data_time", "samples_per_s", "rss_gb", "eta_s"):
        assert key in rows[0], key
    first, last = sum(r["loss"] for r in rows[:3]) / 3, sum(r["loss"] for r in rows[-3:]) / 3
    assert last < first - 1.0, (first, last)  # learning, not noise
    evals = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [12, 24]
    assert evals[-1]["genuine_pairs"] == 36 and evals[-1]["impostor_pairs"] == 240
    assert [p.name for p in complete_checkpoints(run)] == ["step_16", "step_24"]  # keep-last 2
    assert (run / "config.yaml").is_file() and run_info(run)["engine"] == "single"
    # eval of the saved checkpoint reproduces the in-training numbers
    proc = ok(vtrain("eval", "--checkpoint", str(run), "--data", str(faces), "--json"))
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["balanced_accuracy"] == pytest.approx(evals[-1]["balanced_accuracy"], abs=1e-3)
    assert got["TAR@FAR=0.1"] == pytest.approx(evals[-1]["TAR@FAR=0.1"], abs=0.03)
    # a pairs file (paths relative to it): 1 genuine and 2 impostor pairs over the held-out identities
    ids = sorted((faces / "val").iterdir())
    pairs = tmp_path / "pairs.txt"
    rel = lambda p: p.relative_to(faces)  # noqa: E731
    pairs.write_text(f"# comment\n{rel(ids[0] / '000.jpg')} {rel(ids[0] / '001.jpg')} 1\n"
                     f"{rel(ids[0] / '000.jpg')} {rel(ids[1] / '000.jpg')} 0\n"
                     f"{rel(ids[2] / '002.jpg')} {rel(ids[3] / '003.jpg')} 0\n")
    (tmp_path / "val").symlink_to(faces / "val")
    proc = ok(vtrain("eval", "--checkpoint", str(run), "--data", str(faces), "--pairs", str(pairs), "--json"))
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["genuine_pairs"] == 1 and got["impostor_pairs"] == 2
    assert got["TAR@FAR=0.1/resolvable"] is False  # 2 impostor pairs cannot measure FAR 0.1
    pairs.write_text("a.jpg b.jpg yes\n")
    proc = vtrain("eval", "--checkpoint", str(run), "--pairs", str(pairs))
    assert proc.returncode == 2 and "expected 'path1 path2 0|1'" in proc.stderr and "Traceback" not in proc.stderr


SHARDED = {"dense": ["--head-parallel", "sharded", "--sample-rate", "0.5"],
           "sampled": ["--head-parallel", "sharded", "--sample-rate", "0.5", "--head-update", "sampled"]}


@pytest.mark.parametrize("precision,head", [("bf16", "dense"), ("fp16", "sampled")])
def test_crash_and_resume_matches_uninterrupted_run(precision, head, faces, tmp_path):
    """With the sharded head (Partial FC at rate 0.5) under both updates: its shards equal bit for bit. (The
    replicated head's crash and resume: tests/integration/test_ema.py.)"""
    args = ["--data", str(faces), "--max-steps", "8", "--save-every", "2", "--grad-accum", "2",
            "--mixed-precision", precision, *COMMON, *SHARDED[head]]
    ok(vtrain("train", "--output-dir", str(tmp_path / "full"), *args))
    crashed = tmp_path / "crashed"
    proc = vtrain("train", "--output-dir", str(crashed), *args, extra_env={"VTRAIN_DEBUG_CRASH_AT_STEP": "6"})
    assert proc.returncode == 17  # hard kill while training step 6
    assert [p.name for p in complete_checkpoints(crashed)] == ["step_2", "step_4"]
    proc = ok(vtrain("train", "--output-dir", str(crashed), "--resume", "auto", *args))
    assert "resumed from" in proc.stdout and "step_4" in proc.stdout
    a, b = final_weights(tmp_path / "full"), final_weights(crashed)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)
    # the head's rows, moments and per-row steps of the last checkpoint: bit-equal
    last = [complete_checkpoints(r)[-1] / "head" for r in (tmp_path / "full", crashed)]
    names = sorted(p.name for p in last[0].iterdir())
    assert names == sorted(p.name for p in last[1].iterdir()) and names
    for name in names:
        x, y = (load_file(str(d / name)) for d in last)
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), name
    steps = x["row_steps"]
    assert bool((steps == steps[0]).all()) == (head == "dense")  # dense: every row took every step
    # the resumed run logs the same losses for the steps after the checkpoint
    full = {r["step"]: r["loss"] for r in metrics(tmp_path / "full")}
    resumed = {r["step"]: r["loss"] for r in metrics(crashed)}
    for step in (5, 6, 7, 8):
        assert resumed[step] == pytest.approx(full[step], abs=1e-5)
    if precision == "fp16":  # dynamic loss scaling: the scaler state is checkpointed and restored
        state = json.loads((complete_checkpoints(crashed)[-1] / "train_state.json").read_text())
        assert state["scaler"]["scale"] > 0
        assert "overflow_skips" in metrics(crashed)[-1]
        assert metrics(crashed)[-1]["overflow_skips"] == metrics(tmp_path / "full")[-1]["overflow_skips"]


def test_crash_mid_save_keeps_previous_checkpoint(faces, tmp_path):
    run = tmp_path / "run"
    args = ["--data", str(faces), "--output-dir", str(run), "--max-steps", "6", "--save-every", "2", *COMMON]
    proc = vtrain("train", *args, extra_env={"VTRAIN_DEBUG_CRASH_IN_SAVE": "4"})
    assert proc.returncode == 17
    assert [p.name for p in complete_checkpoints(run)] == ["step_2"]
    assert (run / "checkpoints" / ".tmp-step_4").is_dir()  # the half-written one is not a checkpoint
    proc = ok(vtrain("train", *args, "--resume", "auto"))
    assert "step_2" in proc.stdout
    assert [p.name for p in complete_checkpoints(run)] == ["step_2", "step_4", "step_6"]
    assert not (run / "checkpoints" / ".tmp-step_4").exists()


def test_nonfinite_loss_is_skipped_counted_and_stops(faces, tmp_path):
    run = tmp_path / "run"
    proc = vtrain("train", "--data", str(faces), "--output-dir", str(run), "--max-steps", "20", "--batch-size", "8",
                  "--num-workers", "0", "--log-every", "1", "--max-nonfinite", "3", "--mixed-precision", "no",
                  extra_env={"VTRAIN_DEBUG_NONFINITE": "loss@2"})
    assert proc.returncode == 2
    assert "consecutive steps with a non-finite loss" in proc.stderr and "Traceback" not in proc.stderr
    rows = metrics(run)
    assert rows[-1]["skipped"] == 3 and math.isfinite(rows[0]["loss"])


def test_nonfinite_parameters_stop_the_run_before_anything_is_saved(faces, tmp_path):
    """A step that leaves inf/NaN weights with a finite loss (an overflowing update) must not end in exit 0 with
    a NaN model on disk: the run stops at the next log or save, and the last good checkpoint stays."""
    run = tmp_path / "run"
    proc = vtrain("train", "--data", str(faces), "--output-dir", str(run), "--max-steps", "6", "--batch-size", "8",
                  "--num-workers", "0", "--log-every", "3", "--save-every", "2", "--mixed-precision", "no",
                  extra_env={"VTRAIN_DEBUG_NONFINITE": "param@3"})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "parameters became inf/NaN by step 3" in proc.stderr and "step_2" in proc.stderr
    assert [p.name for p in complete_checkpoints(run)] == ["step_2"]
    assert all(torch.isfinite(v).all() for v in final_weights(run).values())


def test_pretrained_backbone_file_is_loaded(faces, tmp_path):
    from vtrain.models.backbones import build_backbone

    bb = build_backbone("debug", 112)
    torch.nn.init.constant_(bb.patch_embed.proj.weight, 0.125)
    path = tmp_path / "bb.pt"
    torch.save(bb.state_dict(), path)
    run = tmp_path / "run"
    proc = ok(vtrain("train", "--data", str(faces), "--output-dir", str(run), "--max-steps", "1", "--pretrained",
                     str(path), "--lr", "1e-12", "--batch-size", "4", "--num-workers", "0"))
    assert "loaded backbone" in proc.stdout and "missing 0" in proc.stdout
    w = final_weights(run)["backbone.patch_embed.proj.weight"]
    assert torch.allclose(w, torch.full_like(w, 0.125), atol=1e-6)
