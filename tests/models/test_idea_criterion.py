"""vtrain's DINO denoising and loss against IDEA-Research/DINO's own code (tests/fixtures/idea_criterion/, made by
tests/fixtures/make_idea_criterion_fixture.py from IDEA's `prepare_for_cdn` and `SetCriterion`; README there).

- Denoising: fed IDEA's recorded random draws, vtrain's `build_denoising` makes IDEA's noised labels, noised boxes
  (as logits), group count and attention mask.
- Loss: on IDEA's fixed decoder outputs and targets, each of the 15 weighted terms (2 decoder layers, the encoder
  proposals, 2 denoising layers; class, L1, GIoU) equals IDEA's within 1e-5 relative, as does the weighted total,
  with the same Hungarian matches; the gradients of the total on every output within 1e-5 of their largest entry.
- Negative control: GIoU with vtrain's former eps (1e-7, none in the matcher) moves a term by more than the tolerance
  (the 4 x 4 pixel box of the fixture), so the comparison would see that difference.
"""

import functools
import json

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.paths import FIXTURES
from vtrain.models.dino import criterion, denoising
from vtrain.models.dino.criterion import WEIGHTS, loss_terms
from vtrain.models.dino.denoising import build_denoising
from vtrain.models.dino.matcher import generalized_iou, hungarian_match

DIR = FIXTURES / "idea_criterion"
TOL = 1e-5
KIND = {"ce": "cls", "bbox": "bbox", "giou": "giou"}


@functools.cache
def _fixture():
    return load_file(str(DIR / "criterion.safetensors")), json.loads((DIR / "meta.json").read_text())


def _targets(f):
    """IDEA's per-image targets as vtrain's padded batch: labels (B, M), boxes (B, M, 4), counts (B,)."""
    counts = f["num_targets"]
    b, m = len(counts), int(counts.max())
    labels = torch.zeros(b, m, dtype=torch.long)
    boxes = torch.zeros(b, m, 4)
    start = 0
    for i, n in enumerate(counts.tolist()):
        labels[i, :n] = f["target_labels"][start:start + n]
        boxes[i, :n] = f["target_boxes"][start:start + n]
        start += n
    return labels, boxes, counts


def _draws_in_vtrain_order(f, meta, labels, counts):
    """IDEA's draws rearranged as the four torch.rand calls of build_denoising take them. IDEA lays its noised copies
    out as [half h][every target of the batch] (h = 2 x group + 0 for positives, 1 for negatives), vtrain as
    [image][group][positive|negative][target]; a uniform draw u gives vtrain's value of IDEA's draw (a flip: u itself;
    a new label k: (k + 0.5) / classes; a sign s: (s + 1) / 2; a box magnitude: IDEA's value before its +1)."""
    b, m = labels.shape
    groups, classes = meta["dn_groups"], meta["classes"]
    total = int(counts.sum())
    offsets = [0] + torch.cumsum(counts, 0).tolist()[:-1]
    flip = torch.ones(b, groups, 2, m)
    new = torch.full((b, groups, 2, m), 0.5)
    sign = torch.zeros(b, groups, 2, m, 4)
    mag = torch.zeros(b, groups, 2, m, 4)
    p = f["draw.label_p"]
    chosen = {int(k): int(v) for k, v in zip(torch.nonzero(p < meta["label_noise_ratio"] * 0.5).view(-1),
                                              f["draw.new_label"])}
    for i, n in enumerate(counts.tolist()):
        for g in range(groups):
            for half in range(2):
                for j in range(n):
                    k = (2 * g + half) * total + offsets[i] + j
                    flip[i, g, half, j] = p[k]
                    if k in chosen:
                        new[i, g, half, j] = (chosen[k] + 0.5) / classes
                    sign[i, g, half, j] = (f["draw.box_sign"][k] + 1) / 2
                    mag[i, g, half, j] = f["draw.box_part"][k]
    return [flip, new, sign, mag]


def _idea_denoising(monkeypatch, f, meta):
    labels, boxes, counts = _targets(f)
    queue = _draws_in_vtrain_order(f, meta, labels, counts)

    def rand(*shape, **_kw):
        t = queue.pop(0)
        assert tuple(t.shape) == tuple(shape)
        return t.clone()

    with monkeypatch.context() as m:
        m.setattr(denoising.torch, "rand", rand)
        dn = build_denoising(labels, boxes, counts, meta["classes"], meta["queries"], meta["dn_number"],
                             meta["label_noise_ratio"], meta["box_noise_scale"])
    assert not queue
    return dn, labels, boxes, counts


def test_denoising_from_ideas_draws_is_ideas(monkeypatch):
    f, meta = _fixture()
    dn, *_ = _idea_denoising(monkeypatch, f, meta)
    assert (dn.groups, dn.num_queries) == (meta["dn_groups"], meta["dn_pad_size"])
    ids = dn.label_ids.masked_fill(dn.label_ids == meta["classes"], -1)  # vtrain's padding label: IDEA's zero row
    assert torch.equal(ids, f["cdn.label_ids"])
    torch.testing.assert_close(dn.boxes_unact, f["cdn.boxes_unact"], rtol=0, atol=1e-6)
    assert torch.equal(dn.attn_mask, f["cdn.attn_mask"].bool())


def _vtrain_terms(monkeypatch, f, meta, leaves):
    dn, labels, boxes, counts = _idea_denoising(monkeypatch, f, meta)
    n = dn.num_queries
    logits, coords = leaves["logits"], leaves["boxes"]
    out = {"logits": [x[:, n:] for x in logits], "boxes": [x[:, n:] for x in coords],
           "dn_logits": [x[:, :n] for x in logits], "dn_boxes": [x[:, :n] for x in coords],
           "enc_logits": leaves["interm_logits"], "enc_boxes": leaves["interm_boxes"]}
    return loss_terms(out, labels, boxes, counts, dn), out, labels, boxes, counts


def _idea_name(name: str, layers: int) -> str:
    """vtrain's term name -> IDEA's (loss_ce_0, loss_ce for the last layer, loss_ce_interm, loss_ce_dn_0, ...)."""
    part, kind = name.rsplit("_", 1)
    ce = {v: k for k, v in KIND.items()}[kind]
    if part == "enc":
        return f"loss_{ce}_interm"
    dn, layer = part.startswith("dn"), int(part[2:] if part.startswith("dn") else part[3:])
    return f"loss_{ce}" + ("_dn" if dn else "") + ("" if layer == layers - 1 else f"_{layer}")


def _leaves(f):
    return {k: f[f"out.{k}"].clone().requires_grad_(True) for k in ("logits", "boxes", "interm_logits",
                                                                    "interm_boxes")}


def test_loss_terms_matches_and_gradients_are_ideas(monkeypatch):
    f, meta = _fixture()
    leaves = _leaves(f)
    terms, out, labels, boxes, counts = _vtrain_terms(monkeypatch, f, meta, leaves)
    layers = meta["layers"]
    assert len(terms) == 15
    assert {_idea_name(k, layers) for k in terms} == {k[len("loss."):] for k in f if k.startswith("loss.loss")}
    for name, v in terms.items():
        theirs = f[f"loss.{_idea_name(name, layers)}"]
        assert abs(v.item() - theirs.item()) <= TOL * abs(theirs.item()), (name, v.item(), theirs.item())
        assert WEIGHTS[name.rsplit("_", 1)[1]] == meta["weight_dict"][_idea_name(name, layers)]
    total = sum(WEIGHTS[k.rsplit("_", 1)[1]] * v for k, v in terms.items())
    assert abs(total.item() - f["loss.total"].item()) <= TOL * f["loss.total"].item()
    # the same Hungarian matches in every matching (IDEA's return_indices)
    for name, lg, bx in [("dec0", out["logits"][0], out["boxes"][0]), ("dec1", out["logits"][1], out["boxes"][1]),
                         ("enc", out["enc_logits"], out["enc_boxes"])]:
        for i, (q, t) in enumerate(hungarian_match(lg, bx, labels, boxes, counts)):
            theirs = f[f"match.{name}.{i}"]
            order = torch.argsort(theirs[0])
            assert torch.equal(torch.stack([q, t])[:, torch.argsort(q)], theirs[:, order]), (name, i)
    total.backward()
    for k, leaf in leaves.items():
        theirs = f[f"grad.{k}"]
        assert (leaf.grad - theirs).abs().max() <= TOL * theirs.abs().max(), k


def test_former_giou_eps_would_be_seen(monkeypatch):
    """GIoU without IDEA's eps (vtrain before: 1e-7 in the loss): the denoising GIoU terms, whose positives sit
    near the fixture's 4 x 4 pixel box, move by more than the tolerance."""
    f, meta = _fixture()
    monkeypatch.setattr(criterion, "generalized_iou", functools.partial(generalized_iou, eps=1e-7))
    terms, *_ = _vtrain_terms(monkeypatch, f, meta, _leaves(f))
    theirs = f[f"loss.{_idea_name('dn1_giou', meta['layers'])}"].item()
    assert abs(terms["dn1_giou"].item() - theirs) > 10 * TOL * theirs  # measured: 43 x TOL


def test_giou_eps_effect_documented():
    """docs/detection.md "GIoU eps": a predicted box equal to its target has 1 - GIoU = eps / (area + eps) with
    IDEA's eps (normalised area): 0.063 at 4 x 4 pixels of 800 x 1333, 1.0e-3 at 32 x 32, 1.2e-4 at 96 x 96."""
    for px, expected in ((4, 0.063), (32, 1.0e-3), (96, 1.2e-4)):
        box = torch.tensor([[0.3, 0.3, 0.3 + px / 1333, 0.3 + px / 800]])
        one_minus = 1 - generalized_iou(box, box, pairwise=False).item()
        assert one_minus == pytest.approx(expected, rel=0.05), (px, one_minus)
