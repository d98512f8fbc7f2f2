"""--layer-decay: backbone LRs follow lr * backbone_lr_mult * R^(L - timm layer id), the head keeps lr, weight
decay rules are unchanged, the schedule keeps the ratios, and bad values or backbones are one-line errors."""

import pytest
import torch
from torch import nn

from tests.helpers.cli import metrics, ok, vtrain
from vtrain.config import ConfigError, OptimConfig, build_config
from vtrain.engine.optim import build_scheduler, layer_decay_note, param_groups
from vtrain.errors import VtrainError
from vtrain.models.dino import DINO
from vtrain.models.metric import MetricModel

LR, MULT, R = 1e-3, 0.1, 0.5


def _lr_and_decay(model: nn.Module, cfg: OptimConfig) -> dict[str, tuple[float, float]]:
    groups = param_groups(model, cfg)
    named = {id(p): n for n, p in model.named_parameters()}
    out = {named[id(p)]: (g["lr"], g["weight_decay"]) for g in groups for p in g["params"]}
    assert len(out) == sum(p.requires_grad for p in model.parameters())  # every parameter in exactly one group
    return out


def _check(model: nn.Module, expected_layer: dict[str, int], num_layers: int, head: list[str]) -> None:
    cfg = OptimConfig(lr=LR, weight_decay=0.1, backbone_lr_mult=MULT, layer_decay=R)
    got = _lr_and_decay(model, cfg)
    for name, layer in expected_layer.items():
        assert got[name][0] == pytest.approx(LR * MULT * R ** (num_layers - layer)), name
    for name in head:
        assert got[name][0] == pytest.approx(LR), name
    # weight decay exactly as without layer decay
    plain = _lr_and_decay(model, OptimConfig(lr=LR, weight_decay=0.1, backbone_lr_mult=MULT))
    assert {n: wd for n, (_, wd) in got.items()} == {n: wd for n, (_, wd) in plain.items()}


def test_metric_vit_first_and_last_block_stem_and_head():
    model = MetricModel("debug", num_classes=4, embedding_dim=16)  # ViT depth 2: stem 0, blocks 1-2, L = 3
    _check(model, {"backbone.patch_embed.proj.weight": 0, "backbone.pos_embed": 0, "backbone.cls_token": 0,
                   "backbone.blocks.0.attn.qkv.weight": 1, "backbone.blocks.1.mlp.fc2.weight": 2,
                   "backbone.norm.weight": 2},  # timm puts the final norm with the last block
           num_layers=3, head=["head.weight", "neck.proj.weight"])
    decay = dict((n, wd) for n, (_, wd) in _lr_and_decay(model, OptimConfig(weight_decay=0.1, layer_decay=R)).items())
    assert decay["backbone.pos_embed"] == 0.0 and decay["backbone.blocks.0.attn.qkv.bias"] == 0.0
    assert decay["backbone.blocks.0.attn.qkv.weight"] == 0.1


def test_dino_swin_first_and_last_block_stem_and_transformer():
    # DINO debug: Swin depths (1, 1, 1, 1): stem 0, stage i (its downsampling with its block) i + 1, L = 5
    model = DINO("debug", 5)
    names = dict(model.named_parameters())
    assert "backbone.body.layers.3.downsample.reduction.weight" in names
    _check(model, {"backbone.body.patch_embed.proj.weight": 0,
                   "backbone.body.layers.0.blocks.0.attn.qkv.weight": 1,
                   "backbone.body.layers.0.blocks.0.attn.relative_position_bias_table": 1,
                   "backbone.body.layers.3.downsample.reduction.weight": 4,
                   "backbone.body.layers.3.blocks.0.mlp.fc2.weight": 4,
                   "backbone.out_norms.0.weight": 5},  # vtrain's own norms outside the timm model: layer L
           num_layers=5, head=["neck.lateral.0.0.weight", "encoder.layers.0.attn.value_proj.weight", "cls_heads.0.weight"])


def test_dino_resnet_stem_and_blocks():
    # DINO debug-resnet: timm resnet10t, one block per stage: deep stem 0, layer i block 0 is layer id i, L = 5
    _check(DINO("debug-resnet", 5), {"backbone.body.conv1.0.weight": 0, "backbone.body.bn1.weight": 0,
                                     "backbone.body.layer1.0.conv1.weight": 1,
                                     "backbone.body.layer2.0.downsample.1.weight": 2,
                                     "backbone.body.layer4.0.bn2.bias": 4},
           num_layers=5, head=["neck.lateral.0.0.weight", "cls_heads.0.weight"])


def test_schedule_keeps_the_ratios_and_the_note_states_them():
    model = MetricModel("debug", num_classes=4, embedding_dim=16)
    cfg = OptimConfig(lr=LR, backbone_lr_mult=MULT, layer_decay=R, warmup_steps=2, schedule="cosine")
    groups = param_groups(model, cfg)
    peak = [g["lr"] for g in groups]
    opt = torch.optim.AdamW(groups, lr=cfg.lr)
    sched = build_scheduler(opt, cfg, total_steps=10)
    for _ in range(4):
        opt.step()
        sched.step()
        lrs = sched.get_last_lr()
        assert lrs == pytest.approx([p * lrs[0] / peak[0] for p in peak])
    note = layer_decay_note(model, cfg)
    assert "layer decay 0.5" in note and f"stem {LR * MULT * R**3:.3g}" in note and f"head {LR:.3g}" in note
    # no --layer-decay: the groups are the four they always were
    assert [g["group"] for g in param_groups(model, OptimConfig())] == ["head", "head/no_decay", "backbone",
                                                                         "backbone/no_decay"]


def test_backbone_without_group_matcher_is_a_clear_error():
    model = nn.Module()
    model.backbone = nn.Linear(4, 4)
    model.head = nn.Linear(4, 2)
    with pytest.raises(VtrainError, match="--layer-decay: the backbone \\(Linear\\) has no timm group_matcher"):
        param_groups(model, OptimConfig(layer_decay=0.75))


@pytest.mark.parametrize("value", [0.0, -0.5, 1.5, float("nan"), float("inf"), "0.5x"])
def test_layer_decay_validated(value):
    # a flag's value is named by the flag; a YAML value by its key when its type is wrong (validated as written,
    # even where a flag overrides it) and by the flag when only its range is; directly by the dataclass
    with pytest.raises(ConfigError, match=r"^--layer-decay \(optim\.layer_decay\): "):
        build_config("metric", None, {"optim": {"layer_decay": value}})
    with pytest.raises(ConfigError, match=r"^(--config optim\.layer_decay|--layer-decay \(optim\.layer_decay\)): "):
        build_config("metric", {"optim": {"layer_decay": value}})
    with pytest.raises(ConfigError, match=r"^--config optim\.layer_decay: "):
        build_config("metric", {"optim": {"layer_decay": "0.5x"}}, {"optim": {"layer_decay": 0.5}})
    if not isinstance(value, str):
        with pytest.raises(ConfigError, match="--layer-decay"):
            OptimConfig(layer_decay=value)
    assert build_config("metric", {"optim": {"layer_decay": "1"}}).optim.layer_decay == 1.0


@pytest.mark.integration
def test_cli_flag_reaches_the_trainer_and_rejects_bad_values(faces, tmp_path):
    proc = vtrain("train", "--output-dir", str(tmp_path / "r"), "--layer-decay", "1.5")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert [line for line in proc.stderr.splitlines() if line.startswith("error:")] == [
        "error: --layer-decay (optim.layer_decay): must be in (0, 1], got 1.5"]
    run = tmp_path / "run"
    args = ["--data", str(faces), "--output-dir", str(run), "--batch-size", "4", "--num-workers", "0",
            "--embedding-dim", "16", "--lr", "1e-3", "--backbone-lr-mult", "0.1", "--log-every", "1",
            "--eval-every", "0"]
    proc = ok(vtrain("train", *args, "--max-steps", "2", "--layer-decay", "0.5"))
    # debug ViT: stem + 2 blocks, L = 3
    assert "layer decay 0.5: backbone LR 0.0001 x 0.5^(3 - layer id)" in proc.stdout, proc.stdout
    assert "stem 1.25e-05, last block 5e-05; head 0.001" in proc.stdout
    assert [r["step"] for r in metrics(run)] == [1, 2]
    # resuming without it: other parameter groups, one error line instead of the optimizer's traceback
    proc = vtrain("train", *args, "--max-steps", "3", "--resume", "auto")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "optimizer parameter groups, this run builds 4 (was --layer-decay changed?)" in proc.stderr
