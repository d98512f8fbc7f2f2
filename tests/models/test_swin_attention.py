"""vtrain's Swin blocks (models/swin_attention.py) compute what timm's blocks compute, are what the presets build,
and hold no N x N tensor per image and window (N = window area)."""

import copy

import pytest
import timm
import torch
from timm.models.swin_transformer import SwinTransformerBlock
from torch.utils._python_dispatch import TorchDispatchMode

from vtrain.memory.trace import cuda_autocast_policy
from vtrain.models.backbones import build_backbone
from vtrain.models.dino import DINO
from vtrain.models.swin_attention import DetectionSwinBlock, SharedBiasSwinBlock, use_shared_bias_attention, window_groups

TINY = dict(embed_dim=32, depths=(2, 2, 2, 2), num_heads=(1, 2, 4, 8), drop_path_rate=0.0)


def _tiny_swin(**kwargs):
    return timm.create_model("swin_tiny_patch4_window7_224", num_classes=0, **TINY, **kwargs)


def _timm_and_vtrain(model: torch.nn.Module, fused: bool) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    with torch.no_grad():  # weights away from init, and a bias table that matters (timm starts it at std 0.02)
        for n, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (1.0 if "relative_position_bias_table" in n else 0.05))
    ours = copy.deepcopy(model)
    assert use_shared_bias_attention(ours) == sum(isinstance(m, SwinTransformerBlock) for m in model.modules())
    for m in model.modules():
        if hasattr(m, "fused_attn"):
            m.fused_attn = fused  # timm's fused (SDPA) branch or its default explicit-softmax branch
    return model, ours


def _run(model, x):
    x = x.clone().requires_grad_()
    y = model.forward_features(x) if hasattr(model, "forward_features") else model(x)
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    return y.detach(), x.grad, {n: p.grad for n, p in model.named_parameters()}


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    return (a - b).abs().max().item() <= tol * max(1.0, a.abs().max().item())


def _check(ref, ours, x, fused):
    y0, gx0, g0 = _run(ref, x)
    y1, gx1, g1 = _run(ours, x)
    if fused:
        # timm's fused branch: the same attention on the same values, so the outputs are bitwise equal; backward
        # runs SDPA per group and sums the bias-table gradient group by group, so gradients agree to rounding
        assert torch.equal(y0, y1) and _close(gx0, gx1, 1e-6)
        assert all(_close(g0[n], g1[n], 1e-6) for n in g0), [n for n in g0 if not _close(g0[n], g1[n], 1e-6)]
    else:
        # timm's default explicit-softmax branch rounds differently from SDPA (timm's own two branches differ by
        # up to ~4e-6 of the largest weight gradient here)
        assert _close(y0, y1, 1e-6) and _close(gx0, gx1, 1e-6)
        assert all(_close(g0[n], g1[n], 1e-5) for n in g0), [n for n in g0 if not _close(g0[n], g1[n], 1e-5)]


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("kwargs,size", [
    ({"img_size": (112, 140)}, (112, 140)),  # fixed size: timm's mask is a buffer
    ({"strict_img_size": False}, (100, 132)),  # DINO's setting: masks per input, padding to the window
    ({"strict_img_size": False}, (60, 92)),  # late stages smaller than one window
])
def test_model_output_and_gradients_equal_timms(kwargs, size, fused):
    ref, ours = _timm_and_vtrain(_tiny_swin(**kwargs), fused)
    _check(ref, ours, torch.randn(2, 3, *size), fused)


@pytest.mark.parametrize("dynamic,size", [(False, (7, 20)), (True, (9, 23)), (True, (16, 30))])
def test_block_shifted_in_one_direction_with_padding(dynamic, size):
    # input_resolution (7, 20) with window 7: window (7, 7), shift (0, 3), a case of timm's mask builder
    block = SwinTransformerBlock(16, input_resolution=(7, 20), num_heads=2, window_size=7, shift_size=3,
                                 dynamic_mask=dynamic)
    assert block.shift_size == (0, 3)
    ref, ours = _timm_and_vtrain(block, fused=True)
    _check(ref, ours, torch.randn(2, *size, 16), fused=True)


def test_checkpointed_blocks_give_the_same_result():
    _, ours = _timm_and_vtrain(_tiny_swin(strict_img_size=False), fused=True)
    ckpt = copy.deepcopy(ours)
    timm.layers.set_reentrant_ckpt(False)
    ckpt.set_grad_checkpointing(True)
    x = torch.randn(2, 3, 100, 132)
    y0, gx0, g0 = _run(ours, x)
    y1, gx1, g1 = _run(ckpt, x)
    assert torch.equal(y0, y1) and torch.equal(gx0, gx1)
    assert all(torch.equal(g0[n], g1[n]) for n in g0)


@pytest.mark.parametrize("batch,grid", [(1, (1, 1)), (2, (1, 3)), (1, (3, 1)), (2, (2, 5)), (1, (4, 4))])
def test_windows_of_a_group_share_timms_mask(batch, grid):
    block = SwinTransformerBlock(8, input_resolution=(14, 14), num_heads=1, window_size=7, shift_size=3,
                                 dynamic_mask=True)
    use_shared_bias_attention(block)
    shifted = torch.zeros(batch, grid[0] * 7, grid[1] * 7, 8)
    full = block.get_attn_mask(shifted).repeat(batch, 1, 1)  # timm's mask of every window of every image
    order, inverse, counts = window_groups(batch, *grid, shifted.device)
    assert torch.equal(order[inverse], torch.arange(batch * grid[0] * grid[1]))
    patterns = block._group_masks(shifted)
    expected = torch.cat([p.expand(n, -1, -1) for p, n in zip(patterns, counts)])
    assert torch.equal(full[order], expected)


def test_presets_build_the_shared_bias_blocks():
    with torch.device("meta"):
        models = {"dino debug": (DINO("debug", 5).backbone.body, DetectionSwinBlock),
                  "metric swin-t": (build_backbone("swin-t", 112), SharedBiasSwinBlock)}
        vit = build_backbone("debug", 112)
    for name, (model, cls) in models.items():
        blocks = [m for m in model.modules() if isinstance(m, SwinTransformerBlock)]
        assert blocks and all(type(m) is cls for m in blocks), name
    assert use_shared_bias_attention(vit) == 0


class _ForwardShapes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.square: list[int] = []  # storage sizes (elements) of the N x N-shaped outputs; views count as
        # their base's storage (the broadcast biases are stride-0 views)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor) and t.shape[-2:] == (49, 49):
                self.square.append(t.untyped_storage().nbytes() // t.element_size())
        return out


@pytest.mark.parametrize("ours", [False, True])
def test_no_attention_matrix_per_image_and_window_in_a_traced_step(ours):
    """The estimator's trace (fake tensors, CUDA autocast policy, CUDA's SDPA kernel choice): timm's blocks
    create (images x windows, heads, 49, 49) tensors in the forward, vtrain's only (heads, 49, 49) biases."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with torch.device("meta"):
        model = timm.create_model("swin_tiny_patch4_window7_224", num_classes=0, embed_dim=32, depths=(2, 2),
                                  num_heads=(1, 2), strict_img_size=False)
    if ours:
        use_shared_bias_attention(model)
    shapes = _ForwardShapes()
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        x = torch.randn(2, 3, 112, 140)
        with cuda_autocast_policy(), torch.autocast("cpu", dtype=torch.bfloat16):
            with shapes:
                y = model.forward_features(x)
            y.float().mean().backward()
    largest = max(shapes.square) // 49**2
    # stage 1 has 2 images x 4 x 5 windows x 1 head; vtrain's largest is the 4 masks or stage 2's 2-head bias
    assert (largest <= 4) if ours else (largest >= 40)
