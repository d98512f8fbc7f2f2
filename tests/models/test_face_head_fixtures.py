"""The face heads against fixtures made by arcface_torch's own code (tests/fixtures/face_head/, made by
tests/fixtures/make_face_head_fixtures.py; docs/face_head.md): ArcFace's two gradients and CosFace (loss and
gradients), and `--head-update dense` against PartialFC_V2 + torch's AdamW over 5 steps on one process (the two
processes are checked in test_partial_fc.py's 2-process test, through `check_partial_fc_rank` below).

Equality is measured as the relative error of a whole tensor, |a - b| / |b| (L2), at most 1e-6."""

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.face_head import FX, REL, check_partial_fc_rank, rel
from vtrain.models.metric import MarginHead
from vtrain.models.partial_fc import PartialFC

CAP = -torch.log(torch.tensor(1e-30)).item()  # arcface_torch's per-sample loss cap, 69.08
MODES = [("arcface", "straight", "arcface_7fadd420"), ("arcface", "chain", "arcface_2e2e8c97"),
         ("cosface", "straight", "cosface_7fadd420")]


def _margin_run(head_cls: str, kind: str, grad: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    fx = load_file(str(FX / "margin.safetensors"))
    emb, weight, labels = fx["margin.emb"].clone().requires_grad_(True), fx["margin.weight"], fx["margin.labels"]
    margin = 0.5 if kind == "arcface" else 0.4
    if head_cls == "MarginHead":
        head = MarginHead(weight.shape[1], weight.shape[0], kind, margin, 64.0, grad)
        loss = head(emb, labels)[0]
    else:
        head = PartialFC(weight.shape[1], weight.shape[0], kind, margin, 64.0, arcface_grad=grad)
        loss = head(emb, labels)["loss"]
    with torch.no_grad():
        head.weight.copy_(weight)
    emb.grad = None
    loss = (head(emb, labels)[0] if head_cls == "MarginHead" else head(emb, labels)["loss"])
    loss.backward()
    return loss.detach(), emb.grad, head.weight.grad


@pytest.mark.parametrize("head_cls", ["MarginHead", "PartialFC"])
@pytest.mark.parametrize("kind,grad,case", MODES)
def test_margin_heads_equal_arcface_torch(head_cls, kind, grad, case):
    """Loss (exact: arcface_torch's capped one is checked below) and both gradients, replicated head and sharded."""
    fx = load_file(str(FX / "margin.safetensors"))
    loss, emb_grad, weight_grad = _margin_run(head_cls, kind, grad)
    assert rel(loss, fx[f"{case}.loss_exact"]) <= REL
    assert rel(emb_grad, fx[f"{case}.emb_grad"]) <= REL
    assert rel(weight_grad, fx[f"{case}.weight_grad"]) <= REL


def test_the_fixture_tells_the_arcface_gradients_and_the_cap_apart():
    """The fixture can fail the test above: the two ArcFace gradients differ by far more than the tolerance (the
    values are equal wherever theta + m <= pi), and arcface_torch's logged loss is capped, vtrain's exact."""
    fx = load_file(str(FX / "margin.safetensors"))
    straight, chain = _margin_run("MarginHead", "arcface", "straight"), _margin_run("MarginHead", "arcface", "chain")
    assert rel(straight[1], fx["arcface_2e2e8c97.emb_grad"]) > 1e-2
    assert rel(chain[1], fx["arcface_7fadd420.emb_grad"]) > 1e-2
    assert rel(straight[2], fx["arcface_2e2e8c97.weight_grad"]) > 1e-2
    for case in ("arcface_7fadd420", "arcface_2e2e8c97", "cosface_7fadd420"):
        capped, exact = float(fx[f"{case}.loss"]), float(fx[f"{case}.loss_exact"])
        assert capped < exact - 1.0 and capped <= CAP


def test_dense_head_update_equals_partial_fc_v2_and_adamw():
    """5 steps at sample rate 0.5 (one with more positives than sampled rows, one with exactly as many): the same
    rows sampled for the same seed; loss, gradients of embeddings and centres, centres and AdamW moments after
    every step equal to arcface_torch's within 1e-6, each step from the fixture's state; and the centres of the run
    going on from its own state too (measured: at most 1.4e-7 per step, 4.5e-7 going on)."""
    forced = check_partial_fc_rank(0, 1, "dense")
    assert max(forced.values()) <= REL, forced
    free = check_partial_fc_rank(0, 1, "dense", forced=False)
    assert max(free[k] for k in ("weight", "exp_avg", "exp_avg_sq")) <= REL, free


def test_sampled_head_update_is_not_partial_fc_v2():
    """The negative control: the sampled update (rows not sampled keep weight and moments, no decay) gives centres
    and moments the fixture tells apart; the loss and gradients of each step (from the fixture's state) agree."""
    worst = check_partial_fc_rank(0, 1, "sampled")
    assert max(worst[k] for k in ("loss", "emb_grad", "weight_grad")) <= REL, worst
    assert worst["weight"] > 1e-4 and worst["exp_avg"] > 1e-2, worst
