"""A resumable, sharded, epoch-seeded sampler: the data position is part of the train state.

Every rank draws the same permutation for an epoch (seeded by seed + epoch), truncated to a multiple of
world_size * batch_size, and takes every world_size-th index starting at its rank, so ranks see disjoint
samples and a global batch does not depend on how it is split into micro-batches. With `group_ids` (e.g.
landscape/portrait, the detection recipe's aspect-ratio batching) each global micro-batch is drawn from one group
where the permutation allows it; leftovers of the groups fill mixed batches, so the batch count per epoch stays
num_samples // (world_size * batch_size) and resuming stays exact. The sampler yields
(epoch, index) pairs so that per-sample augmentation can be seeded by both, making resumed runs bit-identical.

Memory: a rank keeps only its own share of the epoch's order, as int32 (int64 from 2^31 samples): 4 bytes per own
sample, and the group of each sample as the smallest integer type. The permutation of the whole epoch is made as
int32 too and dropped once the share is cut from it, and (epoch, index) pairs are made one at a time as the loader
asks for them. Everything is numpy / torch arrays: no Python list grows with the data set.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import Sampler


class ShardedEpochSampler(Sampler[tuple[int, int]]):
    def __init__(self, num_samples: int, batch_size: int, rank: int = 0, world_size: int = 1, seed: int = 0,
                 shuffle: bool = True, group_ids: Sequence[int] | np.ndarray | None = None) -> None:
        self.num_samples, self.batch_size = num_samples, batch_size
        self.rank, self.world_size, self.seed, self.shuffle = rank, world_size, seed, shuffle
        self.epoch, self.start_batch = 0, 0
        self._dtype = torch.int32 if num_samples < 2**31 else torch.int64
        # groups as dense codes 0..G-1 numbered by value (the order of first appearance in each epoch's
        # permutation, not the codes, decides where leftovers go)
        self._groups: np.ndarray | None = None
        if group_ids is not None:
            _, codes = np.unique(np.asarray(group_ids), return_inverse=True)
            self._groups = codes.reshape(-1).astype(np.min_scalar_type(max(int(codes.max(initial=0)), 1)))
        self._cached: tuple[int, np.ndarray] | None = None

    @property
    def batches_per_epoch(self) -> int:
        return self.num_samples // (self.world_size * self.batch_size)

    def set_position(self, epoch: int, start_batch: int = 0) -> None:
        """Continue at micro-batch `start_batch` of `epoch` (both 0-based)."""
        self.epoch, self.start_batch = epoch, start_batch

    def epoch_indices(self, epoch: int) -> np.ndarray:
        """This rank's sample indices for `epoch`, in order (int32 below 2^31 samples)."""
        if self._cached is not None and self._cached[0] == epoch:
            return self._cached[1]
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + epoch)
            perm = torch.randperm(self.num_samples, generator=g, dtype=self._dtype).numpy()
        else:
            perm = np.arange(self.num_samples, dtype=self._dtype)
        usable = self.batches_per_epoch * self.world_size * self.batch_size
        if self._groups is not None:
            perm = self._grouped(perm, torch.Generator().manual_seed(self.seed + epoch + 7919))
        mine = perm[:usable][self.rank :: self.world_size].copy()  # the whole permutation is dropped here
        self._cached = (epoch, mine)
        return mine

    def _grouped(self, perm: np.ndarray, g: torch.Generator) -> np.ndarray:
        """Reorder a permutation into global batches of one group each, then shuffle the order of the batches.

        Walking the permutation, a group's batch is complete at the position of its size-th, 2*size-th, ...
        member: complete batches keep that order (the order they fill up in) and their members' permutation
        order; what is left of each group (fewer than `size`), groups in the order they first appear, forms
        mixed batches after them (a last incomplete one is dropped)."""
        size = self.world_size * self.batch_size
        n = len(perm)
        group = self._groups[perm].astype(np.int64)
        by_group = np.argsort(group, kind="stable")  # positions in perm, grouped, each group in perm order
        counts = np.bincount(group, minlength=int(self._groups.max(initial=0)) + 1)
        starts = np.cumsum(counts) - counts
        rank = np.empty(n, np.int64)  # each position's rank among its group's members
        rank[by_group] = np.arange(n) - np.repeat(starts, counts)
        full = counts // size * size
        done = np.flatnonzero((rank < full[group]) & (rank % size == size - 1))  # where a batch fills up
        first = starts[group[done]] + rank[done] - (size - 1)  # its first member in `by_group`
        batches = by_group[first[:, None] + np.arange(size)]
        present = np.flatnonzero(counts)
        appear = present[np.argsort(by_group[starts[present]], kind="stable")]  # groups by first appearance
        rest = np.concatenate([by_group[starts[c] + full[c]:starts[c] + counts[c]] for c in appear] or
                              [np.zeros(0, np.int64)])
        rest = rest[: len(rest) // size * size].reshape(-1, size)
        batches = np.concatenate([batches, rest])
        order = torch.randperm(len(batches), generator=g).numpy()
        return perm[batches[order].reshape(-1)]

    def __iter__(self) -> Iterator[tuple[int, int]]:
        # the position is read now, when the loader starts an epoch, not at its first `next`
        return _pairs(self.epoch, self.epoch_indices(self.epoch), self.start_batch * self.batch_size)

    def __len__(self) -> int:
        return (self.batches_per_epoch - self.start_batch) * self.batch_size


def _pairs(epoch: int, indices: np.ndarray, start: int, chunk: int = 1 << 14) -> Iterator[tuple[int, int]]:
    """(epoch, index) for indices[start:], converted to Python ints a chunk at a time."""
    for a in range(start, len(indices), chunk):
        for i in indices[a:a + chunk].tolist():
            yield epoch, i


def eval_shard(n: int, rank: int, world: int) -> tuple[list[int], int]:
    """This rank's slice of n evaluation items, all slices of equal length (sharded engines need every rank in
    every forward): padded with the last item. Returns the indices and how many of them are real."""
    per_rank = -(-n // world)
    start = rank * per_rank
    return [min(i, n - 1) for i in range(start, start + per_rank)], max(0, min(per_rank, n - start))
