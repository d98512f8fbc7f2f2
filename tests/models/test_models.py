import math

import pytest
import torch

from vtrain.models.backbones import build_backbone, set_backbone_checkpointing
from vtrain.models.metric import MarginHead, MetricModel
from vtrain.presets import METRIC_PRESETS


@pytest.mark.parametrize("preset", list(METRIC_PRESETS))
def test_every_preset_builds_with_pooled_features(preset):
    with torch.device("meta"):
        bb = build_backbone(preset, 112)
        out = bb(torch.empty(2, 3, 112, 112))
    if METRIC_PRESETS[preset]().neck == "flatten":  # arcface_torch's ViT: every token, flattened by the neck
        assert out.shape == (2, bb.patch_embed.num_patches, bb.num_features)
    else:
        assert out.shape == (2, bb.num_features)
    assert hasattr(bb, "set_grad_checkpointing")


def test_known_parameter_counts():
    with torch.device("meta"):
        counts = {p: sum(x.numel() for x in build_backbone(p, 112).parameters()) for p in ("vit-b", "resnet50")}
    assert counts["resnet50"] == 23_508_032  # torchvision/timm ResNet-50 without fc
    assert 85.5e6 < counts["vit-b"] < 86.0e6  # ViT-B/16 at 112x112 (49 position embeddings)


@pytest.mark.parametrize("neck_norm", ["bn", "ln"])
def test_debug_forward_backward_and_checkpointing_gives_equal_loss(neck_norm):
    torch.manual_seed(0)
    a = MetricModel("debug", num_classes=10, embedding_dim=32, neck_norm=neck_norm)
    b = MetricModel("debug", num_classes=10, embedding_dim=32, neck_norm=neck_norm)
    b.load_state_dict(a.state_dict())
    set_backbone_checkpointing(b.backbone)
    x, y = torch.randn(4, 3, 112, 112), torch.randint(0, 10, (4,))
    la, lb = a(x, y)["loss"], b(x, y)["loss"]
    la.backward()
    lb.backward()
    assert torch.allclose(la, lb, atol=1e-6)
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(pa.grad, pb.grad, atol=1e-5), n


def test_arcface_margin_math():
    head = MarginHead(2, 2, "arcface", margin=0.5, scale=1.0)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    theta = 0.6
    emb = torch.tensor([[math.cos(theta), math.sin(theta)]])
    cos = head.cosine(emb)
    assert cos[0, 0].item() == pytest.approx(math.cos(theta), abs=1e-6)
    loss, _ = head(emb, torch.tensor([0]))
    logits = torch.tensor([[math.cos(theta + 0.5), math.cos(math.pi / 2 - theta)]])
    assert loss.item() == pytest.approx(torch.nn.functional.cross_entropy(logits, torch.tensor([0])).item(), abs=1e-5)


def test_cosface_margin_and_fp32_under_autocast():
    head = MarginHead(8, 5, "cosface", margin=0.4, scale=64.0)
    emb = torch.randn(3, 8).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, cos = head(emb, torch.tensor([0, 1, 2]))
    assert loss.dtype == torch.float32 and cos.dtype == torch.float32
    assert torch.isfinite(loss)
