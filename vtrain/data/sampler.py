"""A resumable, sharded, epoch-seeded sampler: the data position is part of the train state.

Every rank draws the same permutation for an epoch (seeded by seed + epoch), truncated to a multiple of
world_size * batch_size, and takes every world_size-th index starting at its rank, so ranks see disjoint
samples and a global batch does not depend on how it is split into micro-batches. With `group_ids` (e.g.
landscape/portrait, the detection recipe's aspect-ratio batching) each global micro-batch is drawn from one group
where the permutation allows it; leftovers of the groups fill mixed batches, so the batch count per epoch stays
num_samples // (world_size * batch_size) and resuming stays exact. The sampler yields
(epoch, index) pairs so that per-sample augmentation can be seeded by both, making resumed runs bit-identical.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


class ShardedEpochSampler(Sampler[tuple[int, int]]):
    def __init__(self, num_samples: int, batch_size: int, rank: int = 0, world_size: int = 1, seed: int = 0,
                 shuffle: bool = True, group_ids: list[int] | None = None) -> None:
        self.num_samples, self.batch_size = num_samples, batch_size
        self.group_ids = group_ids
        self.rank, self.world_size, self.seed, self.shuffle = rank, world_size, seed, shuffle
        self.epoch, self.start_batch = 0, 0

    @property
    def batches_per_epoch(self) -> int:
        return self.num_samples // (self.world_size * self.batch_size)

    def set_position(self, epoch: int, start_batch: int = 0) -> None:
        """Continue at micro-batch `start_batch` of `epoch` (both 0-based)."""
        self.epoch, self.start_batch = epoch, start_batch

    def epoch_indices(self, epoch: int) -> list[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + epoch)
            perm = torch.randperm(self.num_samples, generator=g)
        else:
            perm = torch.arange(self.num_samples)
        usable = self.batches_per_epoch * self.world_size * self.batch_size
        order = perm.tolist()
        if self.group_ids is not None:
            order = self._grouped(order, torch.Generator().manual_seed(self.seed + epoch + 7919))
        return order[:usable][self.rank :: self.world_size]

    def _grouped(self, perm: list[int], g: torch.Generator) -> list[int]:
        """Reorder a permutation into global batches of one group each (leftovers form mixed batches at the
        end of the list), then shuffle the order of the batches."""
        size = self.world_size * self.batch_size
        buckets: dict[int, list[int]] = {}
        batches: list[list[int]] = []
        for i in perm:
            b = buckets.setdefault(self.group_ids[i], [])
            b.append(i)
            if len(b) == size:
                batches.append(b.copy())
                b.clear()
        rest = [i for b in buckets.values() for i in b]
        batches += [rest[j:j + size] for j in range(0, len(rest) - size + 1, size)]
        shuffled = [batches[j] for j in torch.randperm(len(batches), generator=g).tolist()]
        return [i for b in shuffled for i in b]

    def __iter__(self) -> Iterator[tuple[int, int]]:
        idx = self.epoch_indices(self.epoch)[self.start_batch * self.batch_size :]
        return iter([(self.epoch, i) for i in idx])

    def __len__(self) -> int:
        return (self.batches_per_epoch - self.start_batch) * self.batch_size


def eval_shard(n: int, rank: int, world: int) -> tuple[list[int], int]:
    """This rank's slice of n evaluation items, all slices of equal length (sharded engines need every rank in
    every forward): padded with the last item. Returns the indices and how many of them are real."""
    per_rank = -(-n // world)
    start = rank * per_rank
    return [min(i, n - 1) for i in range(start, start + per_rank)], max(0, min(per_rank, n - start))
