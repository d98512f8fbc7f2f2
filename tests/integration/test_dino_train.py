"""`vtrain train --task dino` end to end: overfitting a handful of demo images, `vtrain eval`, user errors, and
2-process DeepSpeed ZeRO-3 + offload and FSDP2 runs through `accelerate launch -m vtrain train --task dino`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.cli import final_weights, launch, metrics, ok, run_info, vtrain
from tests.helpers.paths import ROOT

FAST = ["--task", "dino", "--model", "debug", "--num-workers", "0", "--mixed-precision", "no"]


@pytest.fixture(scope="module")
def few_images(tmp_path_factory) -> dict[str, str]:
    """The first 4 demo training images as their own COCO file (train = val: an overfitting check)."""
    from vtrain.data.demo_shapes import ensure_demo_shapes

    demo = ensure_demo_shapes()
    d = json.loads((demo / "annotations" / "instances_train2017.json").read_text())
    ids = {im["id"] for im in d["images"][:4]}
    sub = {"images": d["images"][:4], "annotations": [a for a in d["annotations"] if a["image_id"] in ids],
           "categories": d["categories"]}
    ann = tmp_path_factory.mktemp("few") / "four.json"
    ann.write_text(json.dumps(sub))
    images = str(demo / "train2017")
    return {"ann": str(ann), "images": images}


def _data_flags(d: dict[str, str]) -> list[str]:
    return ["--train-ann", d["ann"], "--train-images", d["images"], "--val-ann", d["ann"], "--val-images", d["images"]]


def test_debug_dino_overfits_a_handful_of_images_and_eval_reproduces_it(few_images, tmp_path):
    run = tmp_path / "overfit"
    ok(vtrain("train", *FAST, *_data_flags(few_images), "--output-dir", str(run), "--image-size", "192",
              "--batch-size", "4", "--max-steps", "200", "--lr", "1e-3", "--backbone-lr-mult", "1",
              "--clip-grad", "1.0", "--log-every", "50", "--save-every", "200", timeout=900))
    rows = metrics(run)
    assert rows[-1]["loss"] < 0.7 * rows[0]["loss"]
    ev = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()][-1]
    # 4 images, 10 boxes, 200 steps: measured AP 0.55 / AP50 0.96 (an untrained model scores 0.0)
    assert ev["AP50"] >= 0.8 and ev["AP"] >= 0.4, ev
    preds = tmp_path / "preds.json"
    proc = ok(vtrain("eval", "--task", "dino", "--checkpoint", str(run), "--json", "--save-predictions",
                     str(preds)))
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["AP"] == pytest.approx(ev["AP"], abs=1e-6)  # same weights, data and post-processing
    dets = json.loads(preds.read_text())
    assert len(dets) == 4 * 300 and {"image_id", "category_id", "bbox", "score"} <= set(dets[0])


@pytest.mark.parametrize("args,message", [
    (["--model", "vit-b"], "unknown dino preset 'vit-b'"),
    (["--grad-ckpt", "head"], "unknown part 'head' for --task dino"),
    (["--data", "/nonexistent"], "--data (data.path): not a directory"),
    (["--train-ann", "/nonexistent.json"], "--train-ann (data.train_ann): file not found"),
])
def test_dino_user_errors_are_one_line(args, message):
    proc = vtrain("train", "--task", "dino", "--max-steps", "1", *args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_data_dir_without_coco_layout_is_a_clear_error(tmp_path):
    proc = vtrain("train", "--task", "dino", "--data", str(tmp_path), "--max-steps", "1")
    assert proc.returncode == 2 and "not in COCO layout" in proc.stderr and "Traceback" not in proc.stderr


# ---- two processes ----------------------------------------------------------------------------------------------
DIST = [*FAST, "--image-size", "128", "--batch-size", "1", "--max-steps", "4", "--log-every", "1",
        "--save-every", "4", "--num-queries", "50"]


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["zero3_offload", "fsdp"])
def test_two_process_dino_runs_on_the_engine_it_reports(engine, few_images, tmp_path):
    run = tmp_path / engine
    if engine == "fsdp":
        proc = launch(2, "train", *DIST, *_data_flags(few_images), "--output-dir", str(run),
                      accelerate_config="fsdp.yaml")
    else:
        proc = launch(2, "train", *DIST, *_data_flags(few_images), "--output-dir", str(run),
                      "--ds-config", "ds_configs/zero3_offload.json", "--mixed-precision", "bf16",
                      accelerate_config="deepspeed.yaml")
    ok(proc)
    info = run_info(run)
    ranks = info["ranks"]
    assert info["world_size"] == 2 and [r["accelerate_is_main"] for r in ranks] == [True, False]
    assert not set(ranks[0]["first_batch_indices"]) & set(ranks[1]["first_batch_indices"])
    if engine == "fsdp":
        assert info["engine"] == "fsdp"
        assert all(r["all_params_dtensor"] and r["fsdp_units"] >= 4 for r in ranks)  # swin + encoder/decoder blocks
        assert sum(r["local_param_fraction"] for r in ranks) == pytest.approx(1.0)
    else:
        assert info["engine"] == "deepspeed" and info["zero_stage"] == 3
        assert all(r["deepspeed_engine"] and r["offload_optimizer"] and r["offload_params"] for r in ranks)
        assert all(r["torch_autocast"] and r["param_dtype"] == "torch.float32" for r in ranks)
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["loss"] == r["loss"] and r["grad_norm"] == r["grad_norm"] for r in rows)  # finite, not NaN
    ev = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]
    assert ev and "AP" in ev[-1] and ev[-1]["images"] == 4
    # the sharded checkpoint consolidates to the live model's weights
    cons = tmp_path / "dino.safetensors"
    ok(vtrain("consolidate", str(run), str(cons), "--check-model"))
    got, live = load_file(str(cons)), final_weights(run)
    assert got.keys() == live.keys() and all(torch.equal(got[k], live[k]) for k in live)
