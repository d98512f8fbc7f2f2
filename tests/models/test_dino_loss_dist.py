"""The DINO loss normaliser across processes: two ranks splitting a batch must optimise exactly what one process
sees on the whole batch (the gradient engines average over ranks, so mean-of-rank-losses == whole-batch loss)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers.ports import free_port
from vtrain.models.dino.criterion import dino_loss


def _outputs(b_slice: slice, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    b, q, c, layers = 4, 7, 3, 3
    logits = [torch.randn(b, q, c, generator=g)[b_slice].requires_grad_() for _ in range(layers)]
    boxes = [(torch.rand(b, q, 4, generator=g) * 0.5 + 0.25)[b_slice].requires_grad_() for _ in range(layers)]
    out = {"logits": logits, "boxes": boxes,
           "enc_logits": torch.randn(b, q, c, generator=g)[b_slice].requires_grad_(),
           "enc_boxes": (torch.rand(b, q, 4, generator=g) * 0.5 + 0.25)[b_slice].requires_grad_()}
    # images with 1, 3, 0 and 2 targets: the ranks hold different box counts (1+3 vs 0+2)
    counts = torch.tensor([1, 3, 0, 2])
    labels = torch.randint(0, c, (b, 3), generator=g)
    tboxes = torch.rand(b, 3, 4, generator=g) * 0.4 + 0.3
    return out, labels[b_slice], tboxes[b_slice], counts[b_slice]


def _worker(rank: int, port: int, path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        out, labels, boxes, counts = _outputs(slice(2 * rank, 2 * rank + 2))
        loss = dino_loss(out, labels, boxes, counts, None)["loss"]
        loss.backward()
        grad = out["logits"][-1].grad
        torch.save({"loss": loss.detach(), "grad": grad}, f"{path}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.integration
@pytest.mark.slow
def test_two_ranks_optimise_the_whole_batch_loss(tmp_path):
    out, labels, boxes, counts = _outputs(slice(0, 4))
    whole = dino_loss(out, labels, boxes, counts, None)["loss"]
    whole.backward()
    port = free_port()
    mp.spawn(_worker, args=(port, str(tmp_path / "r")), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"r.{r}") for r in range(2)]
    # DDP/FSDP/ZeRO average gradients over ranks: that average is the whole-batch gradient
    torch.testing.assert_close((ranks[0]["loss"] + ranks[1]["loss"]) / 2, whole.detach(), rtol=1e-5, atol=1e-6)
    grad = torch.cat([ranks[0]["grad"], ranks[1]["grad"]]) / 2
    torch.testing.assert_close(grad, out["logits"][-1].grad, rtol=1e-5, atol=1e-7)
    # and the per-rank losses differ (different box counts), so the check is not trivially symmetric
    assert not torch.allclose(ranks[0]["loss"], ranks[1]["loss"])
