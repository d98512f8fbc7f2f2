"""The peer DINO fixtures (tests/fixtures/README.md) are whole and agree with themselves: what each meta.json lists
is what its outputs file holds, the stored top-k selections and post-processed detections follow from the stored
scores by each peer's rules, and every checkpoint loads with `weights_only=True`."""

import argparse
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

FIX = Path(__file__).parent / "fixtures"
# peer -> (checkpoint file, key of the weights in it, classes, full-size Swin-L 5-scale key count)
PEERS = {"idea": ("checkpoint.pth", "model", 91, 722),
         "detrex": ("model_final.pth", "model", 80, 730),
         "mmdet": ("model.pth", "state_dict", 80, 669)}


def _load(peer):
    return load_file(str(FIX / peer / "outputs.safetensors")), json.loads((FIX / peer / "meta.json").read_text())


def _xyxy(b):
    cx, cy, w, h = b.unbind(-1)
    return torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], -1)


@pytest.mark.parametrize("peer", sorted(PEERS))
def test_meta_lists_the_tensors(peer):
    t, meta = _load(peer)
    assert {k: [str(v.dtype).replace("torch.", ""), list(v.shape)] for k, v in t.items()} == meta["tensors"]
    assert meta["commit"] and meta["repository"].startswith("https://github.com/")
    assert t["input"].shape[-2:] == t["mask"].shape[-2:] == tuple(meta["image_hw"])
    assert t["pred_logits"].shape[-1] == PEERS[peer][2]


@pytest.mark.parametrize("peer", sorted(PEERS))
def test_selections_follow_from_scores(peer):
    t, meta = _load(peer)
    nq = t["pred_logits"].shape[1]
    val, idx = torch.topk(t["enc_token_max_logit"], nq, dim=1)
    assert torch.equal(idx, t["enc_topk_indices"]) and torch.equal(val, t["enc_topk_scores"])
    assert torch.equal(t["enc_topk_logits"].max(-1)[0], t["enc_topk_scores"])
    assert t["spatial_shapes"].prod(1).sum() == t["memory"].shape[1] == t["enc_token_max_logit"].shape[1]
    assert torch.equal(t["dec_logits"][-1], t["pred_logits"]) and torch.equal(t["dec_boxes"][-1], t["pred_boxes"])
    assert meta["near_ties"]["enc_topk_min_gap_logit"] > 1e-4  # no two selected tokens within float noise


def _topk_dets(logits, boxes, k, scale):
    prob = logits.sigmoid().flatten()
    scores, i = prob.topk(k)
    q, label = i // logits.shape[-1], i % logits.shape[-1]
    return scores, label, _xyxy(boxes[q]) * scale


@pytest.mark.parametrize("peer", sorted(PEERS))
def test_detections_follow_from_the_last_layer(peer):
    """Each peer's post-processing: top-100 sigmoid scores over queries x classes, cxcywh -> xyxy, then
    IDEA scales to the original size; detrex scales to the input, then to the original size and clips (dropping
    empty boxes); mmdet scales to the input, clamps, then divides by the resize factor."""
    t, meta = _load(peer)
    oh, ow = t["orig_size"].tolist()
    ih, iw = meta["image_hw"]
    logits, boxes = t["pred_logits"][0], t["pred_boxes"][0]
    if peer == "idea":
        s, lab, b = _topk_dets(logits, boxes, 100, torch.tensor([ow, oh, ow, oh]))
        ids = torch.tensor([i for i in range(1, 91) if i not in (12, 26, 29, 30, 45, 66, 68, 69, 71, 83)])
        s80, lab80, b80 = _topk_dets(logits[:, ids], boxes, 100, torch.tensor([ow, oh, ow, oh]))
        torch.testing.assert_close(t["det80_scores"], s80, rtol=0, atol=1e-6)
        assert torch.equal(t["det80_labels"], ids[lab80])
        torch.testing.assert_close(t["det80_boxes"], b80, rtol=1e-5, atol=1e-4)
    else:
        s, lab, b = _topk_dets(logits, boxes, 100, torch.tensor([iw, ih, iw, ih]))
        if peer == "detrex":
            torch.testing.assert_close(t["det_pre_boxes"], b, rtol=1e-5, atol=1e-4)
            b = b * torch.tensor([ow / iw, oh / ih, ow / iw, oh / ih])
            b = torch.stack([b[:, 0].clamp(0, ow), b[:, 1].clamp(0, oh), b[:, 2].clamp(0, ow),
                             b[:, 3].clamp(0, oh)], -1)
            keep = (b[:, 2] > b[:, 0]) & (b[:, 3] > b[:, 1])
            s, lab, b = s[keep], lab[keep], b[keep]
        else:
            b = torch.stack([b[:, 0].clamp(0, iw), b[:, 1].clamp(0, ih), b[:, 2].clamp(0, iw),
                             b[:, 3].clamp(0, ih)], -1)
            b = b / torch.tensor([iw / ow, ih / oh, iw / ow, ih / oh])
    torch.testing.assert_close(t["det_scores"], s, rtol=0, atol=1e-6)
    assert torch.equal(t["det_labels"], lab)
    torch.testing.assert_close(t["det_boxes"], b, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("peer", sorted(PEERS))
def test_checkpoint_loads_without_pickled_code(peer):
    name, key, classes, full_keys = PEERS[peer]
    with torch.serialization.safe_globals([argparse.Namespace]):  # IDEA pickles its argparse arguments
        ck = torch.load(FIX / peer / name, map_location="cpu", weights_only=True)
    sd = ck[key]
    assert all(isinstance(v, torch.Tensor) for v in sd.values())
    assert sum(v.shape[0] == classes for k, v in sd.items() if k.endswith("bias") and v.dim() == 1) >= 3
    full = json.loads((FIX / f"{peer}_swinl_keys.json").read_text())
    assert full["count"] == len(full["state_dict"]) == full_keys
    # the small model has the full model's names, fewer blocks and layers: every small key exists at full size
    assert set(sd) <= set(full["state_dict"])
