"""A resumable, sharded, epoch-seeded sampler: the data position is part of the train state.

Every rank draws the same permutation for an epoch (seeded by seed + epoch), truncated to a multiple of
world_size * batch_size, and takes every world_size-th index starting at its rank, so ranks see disjoint
samples and a global batch does not depend on how it is split into micro-batches. The sampler yields
(epoch, index) pairs so that per-sample augmentation can be seeded by both, making resumed runs bit-identical.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


class ShardedEpochSampler(Sampler[tuple[int, int]]):
    def __init__(self, num_samples: int, batch_size: int, rank: int = 0, world_size: int = 1, seed: int = 0,
                 shuffle: bool = True) -> None:
        self.num_samples, self.batch_size = num_samples, batch_size
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
        return perm[:usable][self.rank :: self.world_size].tolist()

    def __iter__(self) -> Iterator[tuple[int, int]]:
        idx = self.epoch_indices(self.epoch)[self.start_batch * self.batch_size :]
        return iter([(self.epoch, i) for i in idx])

    def __len__(self) -> int:
        return (self.batches_per_epoch - self.start_batch) * self.batch_size
