"""vtrain/dist.py: the collective helpers are plain no-ops on one process (with or without a process group of
one), and on two gloo processes every rank gets the same, correct answer."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers.ports import free_port as _port
from vtrain import dist as comm
from vtrain.engine.checkpoint.format import CheckpointError
from vtrain.errors import VtrainError


def _one_process_checks() -> None:
    assert (comm.world_size(), comm.rank(), comm.is_main()) == (1, 0, True)
    assert comm.gather_objects({"a": 1}) == [{"a": 1}]
    t = torch.tensor([1.0, 2.0])
    assert comm.gather_tensors(t)[0] is t and len(comm.gather_tensors(t)) == 1
    assert comm.all_true(True) and not comm.all_true(False)
    assert comm.all_true(torch.tensor(True)) and not comm.all_true(torch.tensor([0.0]))
    assert not comm.all_true(torch.isfinite(torch.tensor(float("nan"))))
    flag = torch.ones(())
    comm.all_true(flag)
    assert flag.shape == () and flag.item() == 1.0  # the caller's tensor is left alone
    assert comm.all_sum(t) is t
    assert comm.all_mean_(t) is t and t.tolist() == [1.0, 2.0]
    assert comm.all_max_(t) is t and t.tolist() == [1.0, 2.0]
    assert comm.mean_over_ranks(2.5, "cpu") == 2.5
    assert comm.broadcast_from_main(lambda: [1, "x"]) == [1, "x"]
    assert comm.agreed(lambda: [2, "y"]) == [2, "y"]

    def bad() -> None:
        raise CheckpointError("the file is damaged")

    # one process: the error itself, type included (not a re-wrapped VtrainError)
    with pytest.raises(CheckpointError, match="the file is damaged"):
        comm.broadcast_from_main(bad)
    with pytest.raises(CheckpointError, match="the file is damaged"):
        comm.agreed(bad)


def test_no_process_group_means_one_process():
    assert not dist.is_initialized()
    _one_process_checks()
    comm.leave()  # nothing to leave


def _group_of_one(rank: int, port: int, path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=1)
    _one_process_checks()
    comm.leave()
    with open(path, "w") as f:
        f.write(json.dumps(dist.is_initialized()))


@pytest.mark.integration
def test_a_process_group_of_one_is_one_process(tmp_path):
    """FSDP2 on one process creates a group of one (engine/accelerator.build_accelerator): still no collective."""
    out = tmp_path / "left"
    mp.spawn(_group_of_one, args=(_port(), str(out)), nprocs=1, join=True)
    assert json.loads(out.read_text()) is False  # leave() destroyed it


def _two_ranks(rank: int, port: int, path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        r: dict = {"world": comm.world_size(), "rank": comm.rank(), "main": comm.is_main()}
        r["objects"] = comm.gather_objects({"rank": rank, "files": [f"f{rank}"]})
        r["tensors"] = [t.tolist() for t in comm.gather_tensors(torch.tensor([rank, 10 + rank]))]
        r["all_true_mixed"] = comm.all_true(rank == 0)
        r["all_true_both"] = comm.all_true(torch.tensor(True))
        r["finite_one_nan"] = comm.all_true(torch.isfinite(torch.tensor(float("nan") if rank else 1.0)))
        local = torch.tensor([float(rank)])
        r["sum"] = comm.all_sum(local).tolist()
        r["sum_left_alone"] = local.tolist()
        r["mean"] = comm.all_mean_(torch.tensor([float(rank), 4.0])).tolist()
        r["max"] = comm.all_max_(torch.tensor([float(rank), -float(rank)])).tolist()
        r["mean_float"] = comm.mean_over_ranks(float(rank) + 1.0, "cpu")
        r["broadcast"] = comm.broadcast_from_main(lambda: f"decided by rank {rank}")

        def bad() -> None:
            raise CheckpointError("the file is damaged")

        try:
            comm.broadcast_from_main(bad)
        except VtrainError as e:
            r["error"] = [type(e).__name__, str(e), getattr(e, "quiet", False)]
        # every rank checks what it reads; rank 1 alone fails: all ranks stop, one of them loudly
        def check(bad: bool) -> int:
            if bad:
                raise CheckpointError(f"bad shard of rank {rank}")
            return rank + 1

        r["agreed"] = comm.agreed(lambda: check(False))
        try:
            comm.agreed(lambda: check(rank == 1))
        except VtrainError as e:
            r["agreed_error"] = [type(e).__name__, str(e), getattr(e, "quiet", False)]
        with open(f"{path}.{rank}", "w") as f:
            json.dump(r, f)
    finally:
        comm.leave()


@pytest.mark.slow
def test_two_processes_agree(tmp_path):
    mp.spawn(_two_ranks, args=(_port(), str(tmp_path / "r")), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"r.{r}").read_text()) for r in range(2))
    assert (r0["world"], r0["rank"], r0["main"]) == (2, 0, True)
    assert (r1["world"], r1["rank"], r1["main"]) == (2, 1, False)
    for key in ("objects", "tensors", "all_true_mixed", "all_true_both", "finite_one_nan", "sum", "mean", "max",
                "mean_float", "broadcast"):
        assert r0[key] == r1[key], key
    assert r0["objects"] == [{"rank": 0, "files": ["f0"]}, {"rank": 1, "files": ["f1"]}]
    assert r0["tensors"] == [[0, 10], [1, 11]]
    assert r0["all_true_mixed"] is False and r0["all_true_both"] is True and r0["finite_one_nan"] is False
    assert r0["sum"] == [1.0] and (r0["sum_left_alone"], r1["sum_left_alone"]) == ([0.0], [1.0])
    assert r0["mean"] == [0.5, 4.0] and r0["mean_float"] == 1.5 and r0["max"] == [1.0, 0.0]
    assert r0["broadcast"] == "decided by rank 0"
    # rank 0 reports the error; the other rank stops with the same message, quietly (the CLI prints it once)
    assert r0["error"] == ["VtrainError", "the file is damaged", False]
    assert r1["error"] == ["AgreedError", "the file is damaged", True]
    # agreed: each rank's own result; an error of rank 1 alone is rank 0's to print, rank 1's to keep quiet
    assert (r0["agreed"], r1["agreed"]) == (1, 2)
    assert r0["agreed_error"] == ["VtrainError", "bad shard of rank 1", False]
    assert r1["agreed_error"] == ["AgreedError", "bad shard of rank 1", True]
