"""`vtrain convert --from arcface-vit`: arcface_torch's own ViT (tests/fixtures/arcface/, made by
make_arcface_fixture.py from insightface's code) gives the same embeddings through vtrain; every full-size preset's
tensors map; bad files and outputs are one line each, nothing written."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from tests.helpers.cli import final_weights, ok
from tests.helpers.paths import FIXTURES
from tests.helpers.scaffold import served
from vtrain.errors import VtrainError
from vtrain.models.metric import MetricModel
from vtrain.models.metric_adapters.arcface import from_arcface_vit
from vtrain.tools.convert import check_fill, convert, fill

FIXTURE = FIXTURES / "arcface"
# fp32 on both sides; what differs is the attention kernel (timm's scaled_dot_product_attention against
# arcface_torch's explicit softmax(q k^T) v) and summation order: about 1e-6 on embeddings of magnitude ~3.
# Every negative case below differs by more than 1000x this.
TOL = 1e-5


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    """`vtrain ARGS` as a fork of one server that imported torch and vtrain once (helpers/fork_server.py): the
    module's commands do not pay ~10 s of imports each."""
    with served(tmp_path_factory, "convert-cli") as (_, server):
        yield server


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("conv") / "af"
    report = convert(FIXTURE / "model.pt", out, "arcface-vit")
    assert report.preset == "debug-af" and report.filled == 39 and list(report.unused) == ["mask_token"]
    return out


def _embed(weights: dict, change=None) -> torch.Tensor:
    model = MetricModel("debug-af", 0)
    if change is not None:
        change(model)
    model.load_state_dict(weights)
    expected = load_file(str(FIXTURE / "expected.safetensors"))
    with torch.no_grad():
        return (model.eval()(expected["input"])["embedding"] - expected["embedding"]).abs().max().item()


def _act(cls):
    def change(model):
        for b in model.backbone.blocks:
            b.mlp.act = cls()
    return change


def _ln_eps(model):
    for m in model.modules():
        if isinstance(m, nn.LayerNorm):
            m.eps = 1e-6  # timm's ViT default, where arcface_torch keeps nn.LayerNorm's 1e-5


def test_embeddings_equal_arcface_torch(converted):
    from vtrain.tools.evaluate import load_model

    loaded = load_model(converted, "metric", device=torch.device("cpu"))  # what eval, predict and export load
    assert loaded.cfg.model.preset == "debug-af" and loaded.model.head is None
    expected = load_file(str(FIXTURE / "expected.safetensors"))
    with torch.no_grad():
        got = loaded.model(expected["input"])["embedding"]
    assert (got - expected["embedding"]).abs().max().item() <= TOL


def test_full_training_checkpoint_gives_the_same_weights(tmp_path, converted):
    """arcface_torch's checkpoint_gpu_<rank>.pt (train_v2.py, save_all_states): the backbone under
    `state_dict_backbone`, beside this rank's Partial FC shard, optimizer and scheduler states."""
    sd = torch.load(FIXTURE / "model.pt", weights_only=True)
    torch.save({"epoch": 3, "global_step": 120, "state_dict_backbone": sd,
                "state_dict_softmax_fc": {"weight": torch.randn(10, 512)},
                "state_optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(3)}},
                                    "param_groups": [{"lr": 0.1, "params": [0]}]},
                "state_lr_scheduler": {"base_lrs": [0.1], "last_epoch": 3}}, tmp_path / "checkpoint_gpu_0.pt")
    convert(tmp_path / "checkpoint_gpu_0.pt", tmp_path / "out", "arcface-vit")
    got = load_file(str(tmp_path / "out" / "checkpoints" / "step_0" / "model.safetensors"))
    want = load_file(str(converted / "checkpoints" / "step_0" / "model.safetensors"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("what,change", [("GELU instead of ReLU6", _act(nn.GELU)),
                                         ("ReLU instead of ReLU6", _act(nn.ReLU)),
                                         ("LayerNorm eps 1e-6", _ln_eps)])
def test_each_setting_matters(converted, what, change):
    weights = load_file(str(converted / "checkpoints" / "step_0" / "model.safetensors"))
    assert _embed(weights) <= TOL
    assert _embed(weights, change) > 1000 * TOL, what


def test_class_token_model_is_not_filled():
    """A ViT with a class token (vtrain's vit-* presets) has a tensor arcface_torch's file cannot fill."""
    import timm

    sd = torch.load(FIXTURE / "model.pt", weights_only=True)
    conv = from_arcface_vit(sd)
    with torch.device("meta"):
        model = MetricModel("debug-af", 0)
        model.backbone = timm.create_model("vit_base_patch16_224", num_classes=0, img_size=112, patch_size=9,
                                           embed_dim=24, depth=2, num_heads=4, qkv_bias=False, global_pool="")
    with pytest.raises(VtrainError, match=r"leaves 1 of the model's .* empty: backbone.cls_token"):
        fill(model.state_dict(), conv.tensors, "--model with-class-token")


@pytest.mark.parametrize("preset", ["vit-t-af", "vit-s-af", "vit-b-af", "vit-l-af"])
def test_full_size_presets_map_every_tensor(preset):
    """keys.json: the tensor names and shapes of arcface_torch's vit_t/s/b/l; all but mask_token fill the preset."""
    shapes = json.loads((FIXTURE / "keys.json").read_text())[preset]
    sd = {k: torch.empty(s, device="meta") for k, s in shapes.items()}
    conv = from_arcface_vit(sd)
    assert conv.model["preset"] == preset and set(conv.unused) == {"mask_token"}
    assert conv.read == set(sd) - {"mask_token"} and len(conv.tensors) == len(sd) - 1
    with torch.device("meta"):
        own = MetricModel(preset, 0).state_dict()
    check_fill(own, conv.tensors, preset)  # names and shapes
    assert len(conv.tensors) == len(own) == len(shapes) - 1  # 281/282 for vit_b and vit_l


def _one_error(proc, *needles):
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.mark.integration
def test_bad_inputs_are_one_line_and_write_nothing(cli, tmp_path):
    import argparse
    import collections

    sd = torch.load(FIXTURE / "model.pt", weights_only=True)
    files = {}
    files["code.pt"] = {"state_dict": sd, "extra": collections.ChainMap()}  # a class outside the allowlist
    dino = {"label_enc.weight": torch.zeros(2), "backbone.0.body.patch_embed.proj.weight": torch.zeros(1),
            "input_proj.0.0.weight": torch.zeros(1), "transformer.encoder.layers.0.norm1.weight": torch.zeros(1)}
    files["idea.pth"] = {"model": dino, "args": argparse.Namespace(num_classes=91)}  # allowed, another format
    files["qkv_bias.pt"] = {**sd, "blocks.0.attn.qkv.bias": torch.zeros(72)}  # another variant
    files["short.pt"] = {k: v for k, v in sd.items() if k != "blocks.1.mlp.fc2.bias"}
    for name, obj in files.items():
        torch.save(obj, tmp_path / name)
    cases = [("code.pt", ["refusing to unpickle", "collections.ChainMap"]),
             ("idea.pth", ["IDEA-Research DINO", "--from idea-dino"]),
             ("qkv_bias.pt", ["blocks.0.attn.qkv.bias", "does not know"]),
             ("short.pt", ["leaves 1 of the model's", "backbone.blocks.1.mlp.fc2.bias"])]
    for name, needles in cases:
        out = tmp_path / f"out-{name}"
        _one_error(cli("convert", str(tmp_path / name), str(out), "--from", "arcface-vit"), *needles)
        assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    # a file of another codebase given to --pretrained: the format and the command that reads it
    proc = cli("train", "--model", "debug-af", "--pretrained", str(FIXTURE / "model.pt"), "--output-dir",
                  str(tmp_path / "run"), "--max-steps", "1")
    _one_error(proc, "--pretrained", "arcface_torch ViT", "vtrain convert", "--from arcface-vit")
    # an IDEA DINO file (its `args` Namespace is admitted as data) given to a detection run
    proc = cli("train", "--task", "dino", "--model", "debug", "--pretrained", str(tmp_path / "idea.pth"),
                  "--output-dir", str(tmp_path / "run-dino"), "--max-steps", "1")
    _one_error(proc, "--pretrained", "IDEA-Research DINO", "--from idea-dino")


@pytest.mark.integration
def test_output_rules(cli, tmp_path, converted):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    _one_error(cli("convert", str(FIXTURE / "model.pt"), str(mine), "--from", "arcface-vit", "--overwrite"),
               "not a directory vtrain convert wrote")
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    # an earlier conversion: refused without --overwrite, replaced with it (a file put into it stops that)
    with pytest.raises(VtrainError, match="--overwrite replaces it"):
        convert(FIXTURE / "model.pt", converted, "arcface-vit")
    before = (converted / ".vtrain-run.json").read_text()
    convert(FIXTURE / "model.pt", converted, "arcface-vit", overwrite=True)
    assert (converted / ".vtrain-run.json").read_text() != before  # a new marker: replaced, atomically
    (converted / "checkpoints" / "mine.txt").write_text("x")
    with pytest.raises(VtrainError, match="it holds checkpoints/mine.txt"):
        convert(FIXTURE / "model.pt", converted, "arcface-vit", overwrite=True)
    (converted / "checkpoints" / "mine.txt").unlink()
    with pytest.raises(VtrainError, match="inside the checkpoint"):
        convert(FIXTURE / "model.pt", converted / "checkpoints" / "step_0" / "x", "arcface-vit")


@pytest.mark.slow
def test_eval_export_predict_and_pretrained_accept_the_converted_run(cli, faces, tmp_path, converted):
    proc = ok(cli("eval", "--checkpoint", str(converted), "--data", str(faces), "--json"))
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["genuine_pairs"] > 0 and got["weights"] == "model"
    ok(cli("export", str(converted), str(tmp_path / "m.onnx")))  # checks onnxruntime against PyTorch
    ok(cli("predict", "--checkpoint", str(converted), "--images", str(faces / "val"), "--out",
              str(tmp_path / "emb.safetensors")))
    assert load_file(str(tmp_path / "emb.safetensors"))["embeddings"].shape == (24, 512)  # 6 identities x 4
    weights = converted / "checkpoints" / "step_0" / "model.safetensors"
    run = tmp_path / "run"
    proc = ok(cli("train", "--data", str(faces), "--model", "debug-af", "--output-dir", str(run), "--max-steps",
                     "1", "--pretrained", str(converted), "--lr", "1e-12", "--batch-size", "4", "--num-workers", "0"))
    assert "39/40 tensors of the model" in proc.stdout and "head.weight initialised for 16" in proc.stdout
    start, after = load_file(str(weights)), final_weights(run)
    for k, v in start.items():
        if k.startswith("backbone."):  # the neck's BatchNorm statistics move in a training step; weights do not
            assert torch.allclose(after[k], v, atol=1e-6), k


@pytest.mark.slow
def test_estimate_memory_traces_an_arcface_preset(cli):
    proc = ok(cli("estimate-memory", "--task", "metric", "--model", "vit-t-af", "--batch-size", "8",
                     "--num-classes", "1000", "--no-compare-gc", "--json"))
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    # arcface_torch's vit_t parameters (keys.json, less its BatchNorm buffers and the unused mask_token) + the head
    shapes = json.loads((FIXTURE / "keys.json").read_text())["vit-t-af"]
    arcface = sum(torch.Size(s).numel() for k, s in shapes.items()
                  if k != "mask_token" and not k.endswith(("running_mean", "running_var", "num_batches_tracked")))
    assert report["setup"]["preset"] == "vit-t-af" and report["params_total"] == arcface + 1000 * 512
    assert 0 < report["estimate_gib"]["activations"] < report["estimate_gib"]["total"]
