"""The sharded epoch sampler on arrays: every sample once per epoch across the ranks, global batches of one group
where the groups allow it, the same order on a restart and from a mid-epoch position, the order of the list-based
sampler it replaced (kept below as the reference), and a few bytes per own sample at WebFace42M's size."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import torch

from vtrain.data.sampler import ShardedEpochSampler


def reference_order(n: int, batch: int, rank: int, world: int, seed: int, epoch: int,
                    groups: list[int] | None) -> list[int]:
    """The sampler as it was written with Python lists (vtrain <= 0.2): the order the array version must keep."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    size = world * batch
    usable = n // size * size
    if groups is not None:
        buckets: dict[int, list[int]] = {}
        batches: list[list[int]] = []
        for i in perm:
            b = buckets.setdefault(groups[i], [])
            b.append(i)
            if len(b) == size:
                batches.append(b.copy())
                b.clear()
        rest = [i for b in buckets.values() for i in b]
        batches += [rest[j:j + size] for j in range(0, len(rest) - size + 1, size)]
        g = torch.Generator().manual_seed(seed + epoch + 7919)
        perm = [i for j in torch.randperm(len(batches), generator=g).tolist() for i in batches[j]]
    return perm[:usable][rank::world]


def _groups(kind: str, n: int, seed: int) -> list[int] | None:
    rng = np.random.default_rng(seed)
    if kind == "none":
        return None
    if kind == "one":
        return [5] * n
    if kind == "two":
        return rng.integers(0, 2, n).tolist()
    return rng.choice([9, 2, 4], n, p=[0.7, 0.25, 0.05]).tolist()  # "three, skewed": a rare group


CASES = [(n, batch, world, seed, groups) for n, batch, world, seed, groups in [
    (103, 4, 3, 7, "none"), (64, 8, 2, 3, "none"), (1, 1, 1, 0, "none"), (50, 5, 1, 1, "two"),
    (97, 3, 2, 11, "two"), (200, 4, 4, 0, "three"), (61, 2, 3, 5, "three"), (40, 4, 2, 2, "one"),
]]


@pytest.mark.parametrize("n,batch,world,seed,kind", CASES)
def test_every_sample_once_per_epoch_disjoint_ranks_pure_groups(n, batch, world, seed, kind):
    groups = _groups(kind, n, seed)
    ids = None if groups is None else np.array(groups)  # callers may pass an array
    for epoch in (0, 1):
        per_rank = [ShardedEpochSampler(n, batch, r, world, seed=seed, group_ids=ids) for r in range(world)]
        got = [s.epoch_indices(epoch) for s in per_rank]
        steps = n // (world * batch)
        assert all(len(g) == steps * batch and g.dtype == np.int32 for g in got)
        flat = np.concatenate(got)
        assert len(np.unique(flat)) == len(flat) == steps * world * batch and 0 <= flat.min() and flat.max() < n
        if groups is None:
            continue
        # global batch b = every rank's b-th micro-batch: of one group, except at most one per group's leftovers
        counts = np.bincount(np.unique(groups, return_inverse=True)[1])
        pure = sum(len({groups[i] for r in range(world) for i in got[r][b * batch:(b + 1) * batch]}) == 1
                   for b in range(steps))
        assert pure >= (counts // (world * batch)).sum() and steps - pure <= len(counts) - 1


@pytest.mark.parametrize("n,batch,world,seed,kind", CASES)
def test_the_order_of_the_list_sampler_it_replaced(n, batch, world, seed, kind):
    groups = _groups(kind, n, seed)
    for rank in range(world):
        s = ShardedEpochSampler(n, batch, rank, world, seed=seed, group_ids=groups)
        for epoch in (0, 2):
            assert s.epoch_indices(epoch).tolist() == reference_order(n, batch, rank, world, seed, epoch, groups)


@pytest.mark.parametrize("n,batch,world,seed,kind", CASES)
def test_restart_and_mid_epoch_resume_continue_exactly(n, batch, world, seed, kind):
    groups = _groups(kind, n, seed)
    rank = world - 1
    full = list(ShardedEpochSampler(n, batch, rank, world, seed=seed, group_ids=groups))
    assert full == list(ShardedEpochSampler(n, batch, rank, world, seed=seed, group_ids=groups))  # a restart
    steps = n // (world * batch)
    for start in sorted({0, steps // 2, steps - 1}):
        resumed = ShardedEpochSampler(n, batch, rank, world, seed=seed, group_ids=groups)  # a fresh process
        resumed.set_position(0, start)
        assert list(resumed) == full[start * batch:] and len(resumed) == len(full) - start * batch
    later = ShardedEpochSampler(n, batch, rank, world, seed=seed, group_ids=groups)
    later.set_position(3, 0)
    pairs = list(later)
    assert {e for e, _ in pairs} == {3} and sorted(i for _, i in pairs) == sorted(later.epoch_indices(3).tolist())
    if n > 20:
        assert [i for _, i in pairs] != [i for _, i in full]  # reshuffled per epoch


def test_the_position_is_read_when_an_epoch_starts():
    s = ShardedEpochSampler(40, 4, seed=1)
    s.set_position(0, 2)
    it = iter(s)
    s.set_position(1, 0)  # the loader asks for the next epoch's iterator only after this one ends
    assert next(it) == (0, int(s.epoch_indices(0)[8]))


def test_webface42m_size_keeps_four_bytes_per_own_sample():
    """44.5M samples, 8 ranks: a rank keeps its 5.6M indices as int32 and nothing else that grows with the set
    (the whole permutation is made once and dropped); pairs are made one at a time."""
    n, world = 44_500_000, 8
    tracemalloc.start()
    try:
        s = ShardedEpochSampler(n, 128, rank=3, world_size=world, seed=0)
        mine = s.epoch_indices(0)
        it = iter(s)
        first = [next(it) for _ in range(5)]
        kept, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    own = n // (world * 128) * 128
    assert len(mine) == own and mine.nbytes == 4 * own and first[0] == (0, int(mine[0]))
    assert kept <= 4 * own + (1 << 20), kept  # the own share and at most 1 MiB besides


def test_ranks_see_disjoint_samples_covering_the_usable_epoch():
    s = [ShardedEpochSampler(103, 4, rank=r, world_size=3, seed=7) for r in range(3)]
    idx = [[i for _, i in x] for x in s]
    assert all(len(i) == 32 for i in idx)  # 103 // 12 = 8 batches of 4 per rank
    assert not set(idx[0]) & set(idx[1]) and not set(idx[1]) & set(idx[2])
    assert len(set().union(*idx)) == 96


def test_position_resume_and_epoch_reshuffle():
    s = ShardedEpochSampler(50, 5, seed=1)
    full = list(s)
    s.set_position(0, 3)
    assert list(s) == full[15:]
    s.set_position(1, 0)
    assert [i for _, i in s] != [i for _, i in full] and all(e == 1 for e, _ in s)


def test_accumulation_split_sees_the_same_samples_per_step():
    # batch 4 x accum 2 and batch 8 x accum 1 put the same samples in each optimizer step on each rank
    a = ShardedEpochSampler(64, 4, rank=1, world_size=2, seed=3)
    b = ShardedEpochSampler(64, 8, rank=1, world_size=2, seed=3)
    assert [i for _, i in a][:16] == [i for _, i in b][:16]
