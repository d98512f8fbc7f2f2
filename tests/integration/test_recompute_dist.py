"""A mixed `--grad-ckpt` spec on 2 CPU processes under DDP, FSDP2 and DeepSpeed ZeRO-3: it is what run_info.json
reports as active on every rank, and two steps give the same losses, gradient norms and weights as the same run
without checkpointing, bit for bit."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.cli import final_weights, launch, metrics, ok, run_info
from tests.helpers.paths import ROOT

pytestmark = pytest.mark.slow

SPEC = "backbone:stage0,encoder:0,sac:decoder"  # one of each kind: a Swin stage, an encoder layer, selective
ENGINES = {"ddp": ("ddp.yaml", []), "fsdp": ("fsdp.yaml", []), "zero3": ("deepspeed.yaml", ["--ds-config"])}


@pytest.fixture(scope="module")
def train_only(tmp_path_factory) -> list[str]:
    """8 demo training images, no validation split (no evaluation: the runs only train)."""
    from vtrain.data.demo_shapes import ensure_demo_shapes

    demo = ensure_demo_shapes()
    d = json.loads((demo / "annotations" / "instances_train2017.json").read_text())
    ids = {im["id"] for im in d["images"][:8]}
    sub = {"images": d["images"][:8], "annotations": [a for a in d["annotations"] if a["image_id"] in ids],
           "categories": d["categories"]}
    ann = tmp_path_factory.mktemp("eight") / "train.json"
    ann.write_text(json.dumps(sub))
    return ["--train-ann", str(ann), "--train-images", str(demo / "train2017")]


@pytest.mark.parametrize("engine", list(ENGINES))
def test_mixed_spec_is_active_and_changes_nothing(engine, train_only, tmp_path):
    acc_cfg, flags = ENGINES[engine]
    if engine == "zero3":
        # ds_configs/zero3.json, but every parameter partitioned (the debug model's are all below its 1e5
        # persistence threshold): recomputation must gather them again, in checkpointed units and in the encoder
        # FFN's remade hidden layer (models/lean.py) alike
        ds = json.loads((ROOT / "ds_configs" / "zero3.json").read_text())
        ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        (tmp_path / "zero3.json").write_text(json.dumps(ds))
        flags = [*flags, str(tmp_path / "zero3.json")]
    args = ["train", "--task", "dino", "--model", "debug", "--num-workers", "0", "--mixed-precision", "no",
            "--image-size", "128", "--batch-size", "1", "--max-steps", "2", "--log-every", "1", "--save-every", "2",
            "--num-queries", "50", *train_only, *flags]
    runs = {}
    for spec in (SPEC, "none"):
        out = tmp_path / spec.replace(",", "+").replace(":", "_")
        ok(launch(2, *args, "--grad-ckpt", spec, "--output-dir", str(out), accelerate_config=acc_cfg))
        runs[spec] = out
        info = run_info(out)
        assert info["world_size"] == 2 and info["engine"] == {"zero3": "deepspeed"}.get(engine, engine)
        assert [r["grad_ckpt"] for r in info["ranks"]] == [spec, spec]
    rows = {spec: [(r["loss"], r["grad_norm"]) for r in metrics(out)] for spec, out in runs.items()}
    assert len(rows[SPEC]) == 2 and rows[SPEC] == rows["none"]
    got, want = final_weights(runs[SPEC]), final_weights(runs["none"])
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
