"""`--head-parallel sharded` in real 2-process CPU runs (gloo): the head stays out of DDP / ZeRO, its shards are
checkpointed per rank and re-split for a 1-process resume, consolidation stitches or drops it."""

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.cli import launch, metrics, ok, run_info, vtrain
from vtrain.engine.checkpoint.format import complete_checkpoints

pytestmark = pytest.mark.slow

BASE = ["--num-workers", "0", "--embedding-dim", "32", "--head", "cosface", "--scale", "16", "--lr", "3e-3",
        "--log-every", "1", "--neck-norm", "ln", "--mixed-precision", "no", "--head-parallel", "sharded"]


def _assert_head(info, engine_key):
    ranks = info["ranks"]
    assert [(r["head_class_start"], r["head_num_local"]) for r in ranks] == [(0, 8), (8, 8)]  # 16 identities
    assert all(r[engine_key] for r in ranks)
    assert not any(r["head_partitioned"] for r in ranks)
    assert all(r["head_param_class"] == "Parameter" and r["head_param_dtype"] == "torch.float32" for r in ranks)


def test_ddp_sharded_head_resumes_on_one_process_and_consolidates(faces, tmp_path):
    run = tmp_path / "ddp"
    ok(launch(2, "train", "--data", str(faces), "--output-dir", str(run), *BASE, "--max-steps", "3",
              "--save-every", "2", "--batch-size", "4", "--grad-accum", "2", accelerate_config="ddp.yaml"))
    _assert_head(run_info(run), "ddp_wrapped")
    rows = metrics(run)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    step2 = complete_checkpoints(run)[0]
    manifest = json.loads((step2 / "COMPLETE").read_text())
    heads = sorted(k for k in manifest["files"] if k.startswith("head/"))
    assert len(heads) == 2  # one file per rank, hashed in the manifest

    # 2 -> 1: the same global batch (8 x accum 2 x 1) from step 2 gives the uninterrupted run's step-3 loss
    one = tmp_path / "one"
    one.mkdir()
    shutil.copytree(step2, one / "checkpoints" / step2.name)
    proc = ok(vtrain("train", "--data", str(faces), "--output-dir", str(one), *BASE, "--max-steps", "3",
                     "--save-every", "2", "--batch-size", "8", "--grad-accum", "2", "--resume", "auto"))
    assert "resharded: saved by 2 processes, resumed on 1" in proc.stdout
    assert metrics(one)[-1]["step"] == 3
    assert metrics(one)[-1]["loss"] == pytest.approx(rows[2]["loss"], rel=1e-4)

    # consolidate: the full fp32 head stitched from the shards; --backbone-only drops it; both load strictly
    full, bb = tmp_path / "full.safetensors", tmp_path / "bb.safetensors"
    ok(vtrain("consolidate", str(step2), str(full), "--check-model"))
    ok(vtrain("consolidate", str(step2), str(bb), "--check-model", "--backbone-only"))
    got, backbone = load_file(str(full)), load_file(str(bb))
    shards = [load_file(str(step2 / h))["weight"] for h in heads]
    assert torch.equal(got["head.weight"], torch.cat(shards))
    assert not any(k.startswith("head.") for k in backbone) and set(got) - set(backbone) == {"head.weight"}
    ok(vtrain("eval", "--task", "metric", "--checkpoint", str(run), "--json"))


@pytest.mark.parametrize("ds_config", ["zero2", "zero3_offload"])
def test_zero_keeps_the_sharded_head_out_and_clips_by_one_global_norm(faces, tmp_path, ds_config):
    run, stage = tmp_path / ds_config, int(ds_config[4])
    ok(launch(2, "train", "--data", str(faces), "--output-dir", str(run), *BASE, "--max-steps", "2",
              "--save-every", "2", "--batch-size", "4", "--sample-rate", "0.5", "--ds-config",
              f"ds_configs/{ds_config}.json", accelerate_config="ddp.yaml"))
    info = run_info(run)
    assert info["engine"] == "deepspeed" and all(r["zero_stage"] == stage for r in info["ranks"])
    _assert_head(info, "deepspeed_engine")
    for r in metrics(run):
        assert all(math.isfinite(r[k]) for k in ("loss", "grad_norm", "grad_norm_backbone", "grad_norm_head"))
        # grad_norm is DeepSpeed's own get_global_grad_norm(), the value its ZeRO step clipped the backbone with:
        # it holds the head's norm (without the hook it would equal the backbone's alone)
        assert r["grad_norm_head"] > 0 and r["grad_norm"] > r["grad_norm_backbone"] * (1 + 1e-4)
        assert r["grad_norm"] == pytest.approx(math.hypot(r["grad_norm_backbone"], r["grad_norm_head"]), rel=1e-5)


def test_fsdp2_keeps_the_sharded_head_out_of_fsdp(faces, tmp_path):
    run = tmp_path / "fsdp"
    ok(launch(2, "train", "--data", str(faces), "--output-dir", str(run), *BASE, "--max-steps", "2",
              "--save-every", "2", "--batch-size", "4", "--sample-rate", "0.5", accelerate_config="fsdp.yaml"))
    info = run_info(run)
    assert info["engine"] == "fsdp"
    _assert_head(info, "all_params_dtensor")  # the backbone's parameters are DTensors, the head's are not
    assert all(torch.isfinite(torch.tensor([r["loss"], r["grad_norm"]])).all() for r in metrics(run))
