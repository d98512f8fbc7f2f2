"""DINO building blocks against straightforward references, and per-preset contracts."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.batches import dino_batch as _batch
from vtrain.models.dino import DINO, count_parameters
from vtrain.models.dino.denoising import build_denoising
from vtrain.models.dino.matcher import hungarian_match, match_cost
from vtrain.models.dino.msda import MSDeformAttn, ms_deform_attn
from vtrain.presets import DINO_PRESETS


# ---- deformable attention -------------------------------------------------------------------------------------
def _bilinear_reference(v: torch.Tensor, x: float, y: float) -> torch.Tensor:
    """Sample a (D, h, w) map at normalised (x, y) like grid_sample(align_corners=False, zeros padding), written
    out by hand: pixel centres at (i + 0.5) / size."""
    d, h, w = v.shape
    px, py = x * w - 0.5, y * h - 0.5
    x0, y0 = int(torch.floor(torch.tensor(px))), int(torch.floor(torch.tensor(py)))
    out = torch.zeros(d, dtype=torch.float64)
    for xi, yi in ((x0, y0), (x0 + 1, y0), (x0, y0 + 1), (x0 + 1, y0 + 1)):
        wx = 1 - abs(px - xi)
        wy = 1 - abs(py - yi)
        if 0 <= xi < w and 0 <= yi < h:
            out += wx * wy * v[:, yi, xi].double()
    return out


def test_ms_deform_attn_matches_reference_loop():
    torch.manual_seed(0)
    shapes = [(5, 7), (3, 4), (2, 2)]
    b, heads, dim, q, points = 2, 2, 3, 4, 3
    s = sum(h * w for h, w in shapes)
    value = torch.randn(b, s, heads, dim)
    loc = torch.rand(b, q, heads, len(shapes), points, 2) * 1.2 - 0.1  # some samples fall outside the map
    attn = torch.rand(b, q, heads, len(shapes), points)
    attn = attn / attn.sum((-1, -2), keepdim=True)
    out = ms_deform_attn(value, shapes, loc, attn)
    ref = torch.zeros(b, q, heads, dim, dtype=torch.float64)
    starts = [0] + list(itertools.accumulate(h * w for h, w in shapes))
    for bi, qi, hi in itertools.product(range(b), range(q), range(heads)):
        for li, (h, w) in enumerate(shapes):
            vmap = value[bi, starts[li]:starts[li + 1], hi].T.reshape(dim, h, w)
            for pi in range(points):
                x, y = loc[bi, qi, hi, li, pi].tolist()
                ref[bi, qi, hi] += attn[bi, qi, hi, li, pi].double() * _bilinear_reference(vmap, x, y)
    torch.testing.assert_close(out.double(), ref.reshape(b, q, heads * dim), atol=1e-5, rtol=1e-5)


def test_ms_deform_attn_computes_in_fp32_and_returns_value_dtype_under_autocast():
    """No fp32 island around the op: it takes a bf16 value under autocast, computes in fp32 and rounds once."""
    torch.manual_seed(0)
    attn = MSDeformAttn(dim=16, levels=2, heads=2, points=2)
    shapes = [(4, 4), (2, 2)]
    value = torch.randn(1, 20, 16)
    query = torch.randn(1, 5, 16)
    ref = torch.rand(1, 5, 2, 2)
    v = attn.value_proj(value).view(1, 20, 2, 8).detach()
    loc = torch.rand(1, 5, 2, 2, 2, 2)
    w = torch.softmax(torch.randn(1, 5, 2, 4), -1).view(1, 5, 2, 2, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = ms_deform_attn(v.bfloat16(), shapes, loc, w)
        out = attn(query, ref, value, shapes)
    assert low.dtype == torch.bfloat16
    assert torch.equal(low, ms_deform_attn(v.bfloat16().float(), shapes, loc, w).bfloat16())
    assert out.shape == (1, 5, 16) and out.dtype == torch.bfloat16 and torch.isfinite(out).all()


# ---- denoising ------------------------------------------------------------------------------------------------
def test_denoising_groups_noise_and_attention_mask():
    labels = torch.tensor([[1, 2, 0], [3, 0, 0]])
    boxes = torch.tensor([[[.5, .5, .2, .3], [.3, .3, .1, .1], [0, 0, 0, 0]],
                          [[.4, .6, .3, .2], [0, 0, 0, 0], [0, 0, 0, 0]]])
    num_targets = torch.tensor([2, 1])
    g = torch.Generator().manual_seed(0)
    dn = build_denoising(labels, boxes, num_targets, num_classes=4, num_matching=10, num_dn_queries=20,
                         label_noise=0.0, generator=g)
    assert dn.groups == 10 and dn.max_targets == 2  # dynamic: 20 // max targets
    n = dn.num_queries
    assert n == 10 * 2 * 2 and dn.attn_mask.shape == (n + 10, n + 10)
    m = dn.attn_mask
    assert m[n:, :n].all() and not m[n:, n:].any()  # matching queries never see denoising queries
    assert not m[:n, n:].any()  # denoising queries may look at the matching part
    for a in range(10):
        for c in range(10):
            block = m[a * 4:(a + 1) * 4, c * 4:(c + 1) * 4]
            assert bool(block.all()) == (a != c) and bool(block.any()) == (a != c)
    # labels: positives and negatives copy the target class (no label noise here); padding slots use class 4
    lab = dn.label_ids.view(2, 10, 2, 2)
    assert (lab[0, :, :, 0] == 1).all() and (lab[0, :, :, 1] == 2).all()
    assert (lab[1, :, :, 1] == 4).all()
    # box noise per corner: positives < half the box size; negatives in [1, 2) x half, so further away on
    # average (a negative whose corners cross collapses to a thin box, so no per-corner bound holds for them)
    from torchvision.ops import box_convert

    noised = box_convert(dn.boxes_unact.sigmoid().view(2, 10, 2, 2, 4), "cxcywh", "xyxy")
    gt = box_convert(boxes[0, 0], "cxcywh", "xyxy")
    half = torch.tensor([.1, .15, .1, .15])
    pos_shift = (noised[0, :, 0, 0] - gt).abs()
    neg_shift = (noised[0, :, 1, 0] - gt).abs()
    assert (pos_shift <= half + 1e-3).all()
    assert neg_shift.mean() > 1.5 * pos_shift.mean()
    # positive slots index the positive copies, group-major
    assert dn.positive_slots(0, 2).tolist()[:4] == [0, 1, 4, 5]


def test_denoising_label_noise_rate_and_empty_batch():
    labels = torch.zeros(4, 50, dtype=torch.long)
    boxes = torch.full((4, 50, 4), 0.5)
    dn = build_denoising(labels, boxes, torch.full((4,), 50), num_classes=80, num_matching=5, num_dn_queries=100,
                         label_noise=0.5, generator=torch.Generator().manual_seed(1))
    changed = (dn.label_ids != 0).float().mean().item()
    assert 0.2 < changed < 0.3  # re-drawn with probability 0.25 (a re-draw may hit class 0 again)
    assert build_denoising(labels, boxes, torch.zeros(4, dtype=torch.long), 80, 5) is None


# ---- matcher --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(5))
def test_hungarian_matches_brute_force(seed):
    g = torch.Generator().manual_seed(seed)
    q, t, c = 6, 3, 4
    logits = torch.randn(1, q, c, generator=g)
    boxes = torch.rand(1, q, 4, generator=g) * 0.5 + 0.25
    tl = torch.randint(0, c, (1, t), generator=g)
    tb = torch.rand(1, t, 4, generator=g) * 0.5 + 0.25
    (rows, cols), = hungarian_match(logits, boxes, tl, tb, torch.tensor([t]))
    cost = match_cost(logits[0], boxes[0], tl[0], tb[0])
    best = min(sum(cost[p[j], j].item() for j in range(t)) for p in itertools.permutations(range(q), t))
    got = cost[rows, cols].sum().item()
    assert len(set(rows.tolist())) == t and sorted(cols.tolist()) == list(range(t))
    assert got == pytest.approx(best, abs=1e-5)


# ---- presets and the model contract ---------------------------------------------------------------------------
def test_swin_l_preset_parameter_count_matches_published():
    with torch.device("meta"):
        model = DINO("swin-l", 80)
    n = count_parameters(model)
    # docs/dino.md §2: DINO 5-scale Swin-L 195M backbone / 217-218M total (EasyCV README)
    assert 194.5e6 < n["backbone"] < 195.5e6
    assert 217.0e6 <= n["total"] <= 218.5e6
    assert model.levels == 5 and model.num_queries == 900 and model.dn_queries == 100
    assert len(model.encoder.layers) == 6 and len(model.decoder.layers) == 6


@pytest.mark.parametrize("preset", list(DINO_PRESETS))
def test_every_preset_trains_and_predicts_at_a_small_size(preset):
    torch.manual_seed(0)
    model = DINO(preset, 3, num_queries=50)
    batch = _batch()
    out = model(**batch)
    assert {"loss", "loss_cls", "loss_bbox", "loss_giou", "enc_cls", "dn_cls"} <= set(out)
    assert torch.isfinite(out["loss"])
    if preset == "debug":  # backward through the whole graph for the small one
        out["loss"].backward()
        unused = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
        assert not unused
    model.eval()
    with torch.no_grad():
        pred = model(batch["images"], batch["masks"])
    # two-stage selection takes at most one query per encoder token: demo-resnet reads strides 16-128, on 64x96
    # that is 24 + 6 + 2 + 1 = 33 tokens, fewer than the 50 queries
    k = 33 if preset == "demo-resnet" else 50
    assert pred["pred_logits"].shape == (2, k, 3) and pred["pred_boxes"].shape == (2, k, 4)
    assert ((pred["pred_boxes"] >= 0) & (pred["pred_boxes"] <= 1)).all()


def test_resnet_preset_freezes_batchnorm_and_stage_one():
    with torch.device("meta"):
        model = DINO("resnet50", 3)
    body = model.backbone.body
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in body.modules())
    frozen = {n.split(".")[0] for n, p in body.named_parameters() if not p.requires_grad}
    assert frozen == {"conv1", "layer1"}


def test_gradient_checkpointing_gives_equal_loss_and_gradients():
    batch = _batch()

    def run(parts):
        torch.manual_seed(0)
        model = DINO("debug", 3)
        model.set_grad_checkpointing(parts)
        torch.manual_seed(1)  # same denoising noise in both runs
        out = model(**batch)
        out["loss"].backward()
        return out["loss"].detach(), {n: p.grad for n, p in model.named_parameters()}

    base_loss, base_grads = run([])
    ckpt_loss, ckpt_grads = run(["backbone", "encoder", "decoder"])
    torch.testing.assert_close(ckpt_loss, base_loss, rtol=1e-5, atol=1e-6)
    for n, gr in base_grads.items():
        torch.testing.assert_close(ckpt_grads[n], gr, rtol=1e-4, atol=1e-6, msg=n)


def test_batch_without_targets_trains():
    batch = _batch()
    batch["num_targets"] = torch.tensor([0, 0])
    torch.manual_seed(0)
    model = DINO("debug", 3)
    out = model(**batch)
    out["loss"].backward()
    assert torch.isfinite(out["loss"]) and "dn_cls" not in out
    assert model.label_embed.weight.grad is not None  # touched, so every rank reduces the same parameters


def test_anchors_are_normalised_to_the_unpadded_image():
    """Encoder proposals of a padded image equal those of the same image unpadded (targets are normalised to the
    unpadded size, so anchors and reference points must be too)."""
    shapes_small, shapes_pad = [(8, 12), (4, 6)], [(12, 16), (6, 8)]
    mem_small = torch.zeros(1, sum(h * w for h, w in shapes_small), 4)
    mem_pad = torch.zeros(1, sum(h * w for h, w in shapes_pad), 4)
    mask_small = torch.zeros(1, mem_small.shape[1], dtype=torch.bool)
    masks = []
    for (h, w), (hs, ws) in zip(shapes_pad, shapes_small):
        m = torch.ones(h, w, dtype=torch.bool)
        m[:hs, :ws] = False
        masks.append(m.flatten())
    mask_pad = torch.cat(masks)[None]
    a_small, v_small = DINO._proposals(mem_small, mask_small, shapes_small)
    a_pad, v_pad = DINO._proposals(mem_pad, mask_pad, shapes_pad)
    assert v_pad.sum() == v_small.sum()
    torch.testing.assert_close(a_pad[v_pad], a_small[v_small])


# ---- --pretrained --------------------------------------------------------------------------------------------
def _task(tmp_path, weights):
    from vtrain.config import build_config
    from vtrain.tasks.dino import DinoTask

    return DinoTask(build_config("dino", overrides={"model": {"pretrained": str(weights)}}))


def test_pretrained_original_swin_layout_loads_into_the_backbone(tmp_path):
    """An original (Microsoft) Swin checkpoint: downsample at the end of each stage, classifier `head.*`, stored
    relative_position_index buffers, wrapped in {"model": ...}. timm's filter converts it; we report the rest."""
    import re

    import timm

    from vtrain.presets import DINO_PRESETS

    p = DINO_PRESETS["debug"]()
    torch.manual_seed(5)
    full = timm.create_model(p.timm_name, num_classes=10, **p.kwargs)  # with norm + classifier, as published
    sd = {}
    for k, v in full.state_dict().items():
        k = re.sub(r"layers\.(\d+)\.downsample", lambda m: f"layers.{int(m.group(1)) - 1}.downsample", k)
        sd[k.replace("head.fc.", "head.")] = v
    sd["layers.0.blocks.0.attn.relative_position_index"] = torch.zeros(49, 49, dtype=torch.long)
    path = tmp_path / "swin_original.pth"
    torch.save({"model": sd}, path)
    model = DINO("debug", 4)
    msg = _task(tmp_path, path).load_pretrained(model)
    assert "missing 0" in msg and "head.fc.weight" in msg, msg  # the classifier is reported as unused
    own = model.backbone.body.state_dict()
    for k, v in full.state_dict().items():
        if k in own:
            torch.testing.assert_close(own[k], v, msg=k)


def test_pretrained_full_detector_with_other_classes_keeps_all_but_class_tensors(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(1)
    src = DINO("debug", 7)
    path = tmp_path / "det.safetensors"
    save_file({k: v.contiguous() for k, v in src.state_dict().items()}, str(path))
    torch.manual_seed(2)
    model = DINO("debug", 4)
    msg = _task(tmp_path, path).load_pretrained(model)
    # 3 class heads (2 decoder layers + encoder; weight and bias) and the denoising label embedding
    assert "196/196 tensors" in msg and "re-initialised for 7 → 4 classes" in msg and "no rows kept" in msg, msg
    torch.testing.assert_close(model.encoder.layers[0].attn.value_proj.weight,
                               src.encoder.layers[0].attn.value_proj.weight)
    assert not torch.equal(model.cls_heads[0].weight[:4], src.cls_heads[0].weight[:4])


def test_giou_matches_torchvision_without_eps():
    from torchvision.ops import generalized_box_iou, generalized_box_iou_loss

    from vtrain.models.dino.matcher import generalized_iou

    g = torch.Generator().manual_seed(0)
    xy = torch.rand(20, 2, generator=g)
    a = torch.cat([xy, xy + torch.rand(20, 2, generator=g) * 0.5], 1)
    xy = torch.rand(20, 2, generator=g)
    b = torch.cat([xy, xy + torch.rand(20, 2, generator=g) * 0.5], 1)
    # the formula is torchvision's; vtrain's default eps (IDEA DINO's 1e-6) is the one difference
    torch.testing.assert_close(1 - generalized_iou(a, b, pairwise=False, eps=0.0), generalized_box_iou_loss(a, b))
    torch.testing.assert_close(generalized_iou(a, b, eps=0.0), generalized_box_iou(a, b))
