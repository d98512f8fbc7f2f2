"""The detection Swin (models/swin_attention.py DetectionSwinBlock, docs/detection.md "The detection Swin") against a
reference written here from the published algorithm (Swin Transformer, Liu et al. 2021, and the detection code of
SwinTransformer/Swin-Transformer-Object-Detection that IDEA DINO, detectron2/detrex and mmdetection carry): every odd
block of every stage shifts by half a window, the map is padded to whole windows before the cyclic shift, and the
shift mask (-100 between regions) is built on the padded map. timm's order (shift, then pad) and timm's turning the
shift off where one window covers the map are the negative cases."""

import copy

import pytest
import timm
import torch
import torch.nn.functional as F
from timm.models.swin_transformer import SwinTransformerBlock

from vtrain.models.dino import DINO
from vtrain.models.swin_attention import DetectionSwinBlock, SharedBiasSwinBlock, use_shared_bias_attention

TINY = dict(embed_dim=32, depths=(2, 2, 2, 2), num_heads=(1, 2, 4, 8), drop_path_rate=0.0, strict_img_size=False)


# ---- the reference, from the published algorithm (no timm code on its path, only the block's weights) ----------
def _rel_index(ws: int) -> torch.Tensor:
    coords = torch.stack(torch.meshgrid(torch.arange(ws), torch.arange(ws), indexing="ij")).flatten(1)
    rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (ws - 1)
    return rel[..., 0] * (2 * ws - 1) + rel[..., 1]


def _partition(x: torch.Tensor, ws: int) -> torch.Tensor:
    b, h, w, c = x.shape
    return x.view(b, h // ws, ws, w // ws, ws, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, ws * ws, c)


def _reverse(x: torch.Tensor, ws: int, b: int, h: int, w: int) -> torch.Tensor:
    return x.view(b, h // ws, w // ws, ws, ws, -1).permute(0, 1, 3, 2, 4, 5).reshape(b, h, w, -1)


def _shift_mask(hp: int, wp: int, ws: int, s: int) -> torch.Tensor:
    img = torch.zeros(1, hp, wp, 1)
    cnt = 0
    for hs in (slice(0, -ws), slice(-ws, -s), slice(-s, None)):
        for wsl in (slice(0, -ws), slice(-ws, -s), slice(-s, None)):
            img[:, hs, wsl, :] = cnt
            cnt += 1
    win = _partition(img, ws).squeeze(-1)
    diff = win[:, None, :] - win[:, :, None]
    return diff.masked_fill(diff != 0, -100.0).masked_fill(diff == 0, 0.0)


def _ref_block(blk: SwinTransformerBlock, x: torch.Tensor, shift: bool, ws: int) -> torch.Tensor:
    b, h, w, c = x.shape
    a = blk.attn
    heads, s = a.num_heads, ws // 2 if shift else 0
    y = F.pad(blk.norm1(x), (0, 0, 0, (ws - w % ws) % ws, 0, (ws - h % ws) % ws))  # pad first ...
    hp, wp = y.shape[1:3]
    if s:
        y = torch.roll(y, (-s, -s), (1, 2))  # ... then shift
    win = _partition(y, ws)
    n = ws * ws
    qkv = a.qkv(win).reshape(win.shape[0], n, 3, heads, -1).permute(2, 0, 3, 1, 4)
    q, k, v = qkv[0] * (c // heads) ** -0.5, qkv[1], qkv[2]
    att = q @ k.transpose(-2, -1)
    att = att + a.relative_position_bias_table[_rel_index(ws).reshape(-1)].view(n, n, -1).permute(2, 0, 1)[None]
    if s:
        mask = _shift_mask(hp, wp, ws, s)
        att = (att.view(b, -1, heads, n, n) + mask[None, :, None]).view(-1, heads, n, n)
    out = a.proj((att.softmax(-1) @ v).transpose(1, 2).reshape(win.shape[0], n, c))
    y = _reverse(out, ws, b, hp, wp)
    if s:
        y = torch.roll(y, (s, s), (1, 2))
    x = x + y[:, :h, :w]
    return x + blk.mlp(blk.norm2(x))


def _ref_merge(m, x: torch.Tensor) -> torch.Tensor:
    x = F.pad(x, (0, 0, 0, x.shape[2] % 2, 0, x.shape[1] % 2))
    x = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], -1)
    return m.reduction(m.norm(x))


def reference_stages(body, images: torch.Tensor, ws: int) -> list[torch.Tensor]:
    """Each stage's output (B, H, W, C) of the detection Swin with `body`'s weights."""
    x, outs = body.patch_embed(images), []
    for stage in body.layers:
        if not isinstance(stage.downsample, torch.nn.Identity):
            x = _ref_merge(stage.downsample, x)
        for i, blk in enumerate(stage.blocks):
            x = _ref_block(blk, x, shift=i % 2 == 1, ws=ws)
        outs.append(x)
    return outs


# ---- tests -------------------------------------------------------------------------------------------------
def _perturbed(**kwargs):
    torch.manual_seed(0)
    model = timm.create_model("swin_tiny_patch4_window7_224", num_classes=0, **TINY, **kwargs).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (1.0 if "relative_position_bias_table" in n else 0.1))
    return model


def _stages(body, images):
    outs, x = [], body.patch_embed(images)
    for stage in body.layers:
        x = stage(x)
        outs.append(x)
    return outs


def _max_diff(a, b):
    """Largest difference over the levels, relative to each level's largest value (at least 1). The tolerance of
    1e-5 below is fp32 rounding: SDPA here against the reference's explicit softmax, over 8 blocks whose perturbed
    weights grow the residual stream to ~10."""
    return max(((x - y).abs().max() / x.abs().max().clamp(min=1)).item() for x, y in zip(a, b))


def _abs_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


SIZES = [(100, 132), (60, 92), (112, 112)]  # padding at every stage; late stages under one window; no padding


@pytest.mark.parametrize("size", SIZES)
def test_detection_blocks_equal_the_published_algorithm(size):
    ours = _perturbed(always_partition=True)
    assert use_shared_bias_attention(ours, detection=True) == 8
    images = torch.randn(2, 3, *size)
    with torch.no_grad():
        ref = reference_stages(ours, images, 7)
        got = _stages(ours, images)
    assert _max_diff(ref, got) <= 1e-5, _max_diff(ref, got)


def test_timm_order_and_timm_shift_choice_differ_from_the_published_algorithm():
    """Negative cases, with the same weights: timm's blocks (shift then pad; no shift in the last stage, where
    the 224-size model's 7x7 map fits one window) and each of the two changes alone."""
    images = torch.randn(2, 3, 100, 132)
    timm_model = _perturbed()  # timm's default: always_partition=False
    with torch.no_grad():
        ref = reference_stages(timm_model, images, 7)
        assert timm_model.layers[3].blocks[1].shift_size == (0, 0)  # the mechanism: timm drops the shift
        assert _abs_diff(ref, _stages(timm_model, images)) > 1.0
        # pad-first alone is not enough: the last stage must shift too
        pad_only = copy.deepcopy(timm_model)
        use_shared_bias_attention(pad_only, detection=True)
        assert _abs_diff(ref, _stages(pad_only, images)) > 1.0
        # shifting everywhere in timm's order (roll, then pad) differs where a side is not a multiple of the window
        shift_only = _perturbed(always_partition=True)
        use_shared_bias_attention(shift_only)
        assert _abs_diff(ref, _stages(shift_only, images)) > 1.0
        # at a size with no padding anywhere the order does not matter: the difference is the pad order's alone
        whole = torch.randn(2, 3, 112, 112)  # 28, 14, 7, 4 (the last stage pads 4 -> 7)
        ref_w = reference_stages(shift_only, whole, 7)
        assert _max_diff(ref_w[:3], _stages(shift_only, whole)[:3]) <= 1e-5


def test_dino_backbone_is_the_detection_swin():
    torch.manual_seed(0)
    model = DINO("debug", 3).eval()
    body = model.backbone.body
    blocks = [m for m in body.modules() if isinstance(m, SwinTransformerBlock)]
    assert blocks and all(type(m) is DetectionSwinBlock for m in blocks)
    assert all(m.always_partition for m in blocks)
    with torch.no_grad():
        for p in model.backbone.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        images = torch.randn(1, 3, 96, 160)
        ref = reference_stages(body, images, 7)
        feats = model.backbone(images)
    want = [n(ref[i].float()).permute(0, 3, 1, 2) for n, i in zip(model.backbone.out_norms, model.backbone.indices)]
    assert _max_diff(want, feats) <= 1e-5


def test_metric_backbones_keep_timms_classification_swin():
    from vtrain.models.backbones import build_backbone

    with torch.device("meta"):
        body = build_backbone("swin-t", 112)
    assert all(type(m) is SharedBiasSwinBlock for m in body.modules() if isinstance(m, SwinTransformerBlock))


def test_same_tensors_as_before_so_old_checkpoints_load():
    """The detection Swin changes how blocks run, not what they hold: the backbone's state dict has the names and
    shapes of timm's default Swin (what vtrain built before), for the debug and swin-l presets."""
    from vtrain.presets import DINO_PRESETS

    for name in ("debug", "swin-l"):
        p = DINO_PRESETS[name]()
        with torch.device("meta"):
            before = timm.create_model(p.timm_name, pretrained=False, num_classes=0, **p.kwargs)
            now = DINO(name, 3).backbone.body
        before.prune_intermediate_layers(list(p.out_indices), prune_norm=True, prune_head=True)
        shapes = {k: tuple(v.shape) for k, v in before.state_dict().items()}
        assert shapes == {k: tuple(v.shape) for k, v in now.state_dict().items()}, name


def test_checkpointed_detection_blocks_give_the_same_result():
    from vtrain.models.recompute_units import set_recompute

    ours = _perturbed(always_partition=True)
    use_shared_bias_attention(ours, detection=True)
    ckpt = copy.deepcopy(ours)
    for m in ckpt.modules():
        if isinstance(m, DetectionSwinBlock):
            set_recompute(m, "full")
    x = torch.randn(2, 3, 100, 132)
    grads = []
    for model in (ours, ckpt):
        xi = x.clone().requires_grad_()
        y = _stages(model, xi)[-1]
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        grads.append((y.detach(), xi.grad, {n: p.grad for n, p in model.named_parameters()}))
    (y0, gx0, g0), (y1, gx1, g1) = grads
    assert torch.equal(y0, y1) and torch.equal(gx0, gx1)
    used = [n for n in g0 if g0[n] is not None]  # the final norm is not on the stages' path
    assert len(used) > 100 and all(torch.equal(g0[n], g1[n]) for n in used)
