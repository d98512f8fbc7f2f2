"""The sharded face head run through the PartialFC_V2 fixture (tests/fixtures/face_head/partial_fc_w*.safetensors,
made by tests/fixtures/make_face_head_fixtures.py from arcface_torch's own code), for the 1-process test
(tests/models/test_face_head_fixtures.py) and each rank of the 2-process one (tests/models/test_partial_fc.py)."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from tests.helpers.paths import FIXTURES
from vtrain.config import ModelConfig, OptimConfig, RunConfig
from vtrain.engine.head_shard import ShardedHead

FX = FIXTURES / "face_head"
REL = 1e-6  # the relative error allowed, of a whole tensor (`rel`)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b| over the whole tensor (L2)."""
    return float((a.double() - b.double()).norm() / b.double().norm())


def head_cfg(fx_meta: dict, update: str) -> RunConfig:
    """The run config of the fixture's head: ArcFace, s 64, m 0.5, AdamW of its LR and weight decay, no clipping
    (arcface_torch does not clip its class centres)."""
    return RunConfig(task="metric",
                     model=ModelConfig(embedding_dim=fx_meta["dim"], head="arcface", margin=0.5, scale=64.0,
                                       head_parallel="sharded", sample_rate=fx_meta["sample_rate"],
                                       head_update=update),
                     optim=OptimConfig(lr=fx_meta["lr"], weight_decay=fx_meta["weight_decay"], clip_grad=0.0))


PFC = json.loads((FX / "meta.json").read_text())["partial_fc"]  # the settings the fixture was made with


def _load_state(head: ShardedHead, fx: dict, rank: int, step: int) -> None:
    """The fixture's class centres and AdamW state after `step` (-1: the start) into `head`."""
    with torch.no_grad():
        if step < 0:
            head.fc.weight.copy_(fx[f"rank{rank}.weight_init"])
            return
        head.fc.weight.copy_(fx[f"rank{rank}.step{step}.weight"])
        head.exp_avg.copy_(fx[f"rank{rank}.step{step}.exp_avg"])
        head.exp_avg_sq.copy_(fx[f"rank{rank}.step{step}.exp_avg_sq"])
    head.row_steps.fill_(int(fx[f"rank{rank}.step{step}.adamw_step"]))
    head.uniform_step = int(fx[f"rank{rank}.step{step}.adamw_step"])


def check_partial_fc_rank(rank: int, world: int, update: str = "dense", forced: bool = True) -> dict[str, float]:
    """Run vtrain's sharded head (`update`) as rank `rank` of `world` (a process group of `world` must exist when
    world > 1) through the fixture's steps and return the largest relative error of each quantity against
    PartialFC_V2 + AdamW. `forced`: every step starts from the fixture's state after the step before, so each step
    is compared on its own (with s = 64 a rounding difference in a centre moves the logits 64 times as much, so
    free-running gradients drift apart by more than the arithmetic); else the run goes on from its own state.
    The rows sampled must be the fixture's in every step."""
    fx = load_file(str(FX / f"partial_fc_w{world}.safetensors"))
    head = ShardedHead(head_cfg(PFC, update), PFC["classes"], rank, world, torch.device("cpu"))
    _load_state(head, fx, rank, -1)
    per = fx["labels"].shape[1] // world
    worst: dict[str, float] = {}
    for step in range(PFC["steps"]):
        if forced:
            _load_state(head, fx, rank, step - 1)
        emb = fx["embeddings"][step, rank * per:(rank + 1) * per].clone().requires_grad_(True)
        torch.manual_seed(PFC["seed"] + step)
        out = head.loss({"embedding": emb}, fx["labels"][step, rank * per:(rank + 1) * per])
        assert torch.equal(head.fc.last_index, fx[f"rank{rank}.step{step}.index"]), step  # the same rows
        out["loss"].backward()
        rows, grad = head.grad()
        dense = grad if rows is None else torch.zeros_like(head.fc.weight).index_copy_(0, rows, grad)
        got = {"loss": rel(out["loss"].detach(), fx[f"rank{rank}.step{step}.loss"]),
               "emb_grad": rel(emb.grad, fx[f"rank{rank}.step{step}.emb_grad"]),
               "weight_grad": rel(dense, fx[f"rank{rank}.step{step}.weight_grad"])}
        head.step(PFC["lr_factors"][step], None, 0.0)
        got.update(weight=rel(head.fc.weight.detach(), fx[f"rank{rank}.step{step}.weight"]),
                   exp_avg=rel(head.exp_avg, fx[f"rank{rank}.step{step}.exp_avg"]),
                   exp_avg_sq=rel(head.exp_avg_sq, fx[f"rank{rank}.step{step}.exp_avg_sq"]))
        worst = {k: max(worst.get(k, 0.0), v) for k, v in got.items()}
    if update == "dense":
        assert torch.equal(head.row_steps, torch.full_like(head.row_steps, PFC["steps"]))
    return worst


