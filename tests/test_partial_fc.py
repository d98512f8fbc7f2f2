"""The sharded margin-softmax head (models/partial_fc.py) against the unsharded MarginHead, and its row-sparse
optimizer (engine/head_shard.py). Op-level: 2 gloo processes vs 1 process; no training loop."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vtrain.models.metric import MarginHead
from vtrain.models.partial_fc import PartialFC, shard_range

C, D, B = 7, 6, 3  # 7 classes over 2 ranks: shards of 4 and 3 (uneven on purpose)


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(2 * B, D, generator=g)
    labels = torch.tensor([0, 3, 3, 6, 4, 1])
    weight = torch.randn(C, D, generator=g)
    return emb, labels, weight


def _reference(kind):
    emb, labels, weight = _batch()
    head = MarginHead(D, C, kind, 0.5 if kind == "arcface" else 0.4, 16.0)
    head.weight.data.copy_(weight)
    emb.requires_grad_(True)
    loss, _ = head(emb, labels)
    loss.backward()
    return loss.detach(), emb.grad, head.weight.grad


def _sharded(rank, world, kind, sample_rate=1.0):
    emb, labels, weight = _batch()
    head = PartialFC(D, C, kind, 0.5 if kind == "arcface" else 0.4, 16.0, sample_rate, rank, world)
    start, n = shard_range(C, rank, world)
    head.weight.data.copy_(weight[start:start + n])
    mine = emb[rank * B:(rank + 1) * B].clone().requires_grad_(True) if world > 1 else emb.clone().requires_grad_(True)
    lab = labels[rank * B:(rank + 1) * B] if world > 1 else labels
    out = head(mine, lab)
    out["loss"].backward()
    # the embedding gradient carries the factor W that undoes the engines' gradient averaging
    return out["loss"].detach(), mine.grad / world, head.weight.grad, head.touched.clone()


def _worker(rank, world, port, kind, sample_rate, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        q.put((rank, _sharded(rank, world, kind, sample_rate)))
    finally:
        dist.destroy_process_group()


def _two_ranks(kind, sample_rate=1.0):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, kind, sample_rate, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    return got


@pytest.mark.parametrize("kind", ["arcface", "cosface"])
def test_one_shard_equals_margin_head(kind):
    loss, emb_grad, w_grad = _reference(kind)
    l1, g1, w1, touched = _sharded(0, 1, kind)
    assert torch.allclose(l1, loss, atol=1e-6) and torch.allclose(g1, emb_grad, atol=1e-6)
    assert torch.allclose(w1, w_grad, atol=1e-6) and touched.all()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["arcface", "cosface"])
def test_two_shards_equal_margin_head(kind):
    loss, emb_grad, w_grad = _reference(kind)
    got = _two_ranks(kind)
    for rank, (l, g, w, _) in got.items():
        start, n = shard_range(C, rank, 2)
        assert torch.allclose(l, loss, atol=1e-5), (rank, l, loss)  # the same global loss on every rank
        assert torch.allclose(g, emb_grad[rank * B:(rank + 1) * B], atol=1e-5)
        assert torch.allclose(w, w_grad[start:start + n], atol=1e-5)
