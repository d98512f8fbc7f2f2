"""The training data stream: one DataLoader for the whole run over the sharded, resumable sampler
(data/sampler.py), started at the loop's data position."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from vtrain.data.sampler import ShardedEpochSampler
from vtrain.data.skip import CollateWithBadList
from vtrain.data.workers import worker_options
from vtrain.errors import BadSample


class MicroBatches:
    def __init__(self, dataset: Dataset, sampler: ShardedEpochSampler, batch_size: int, world: int,
                 collate_fn: Callable | None, num_workers: int, device: torch.device, skip_bad: bool,
                 generator: torch.Generator | None = None) -> None:
        self.dataset, self.sampler, self.batch_size, self.world = dataset, sampler, batch_size, world
        # --skip-bad-images: the samples' lists of skipped files are joined into the batch's `bad` list
        self.collate_fn = CollateWithBadList(collate_fn) if skip_bad else collate_fn
        self.num_workers, self.device = num_workers, device
        # the loader's own generator (engine/determinism.py): its iterators draw the workers' seeds from it, not
        # from the global generator whose stream the model's random draws follow
        self.generator = generator
        self._loader: DataLoader | None = None

    def stream(self, consumed_samples: int) -> Iterator[tuple[int, dict[str, Any]]]:
        """Infinite stream of (epoch, micro-batch) starting at the data position: `consumed_samples` counts global
        samples, so a run resumed with another number of processes continues at the same place (exactly so
        when it keeps the global batch, since ranks take interleaved slices of one permutation per epoch). The
        loader is built at the first `next`."""
        per_micro = self.batch_size * self.world
        epoch, offset = divmod(consumed_samples // per_micro, self.sampler.batches_per_epoch)
        workers = self.num_workers
        # one loader for the whole run: persistent workers are not re-spawned every epoch (small datasets), and
        # the sampler runs in this process, so its new position applies to the next iteration;
        # workers start from a fork server, never by forking this process: the lock's heartbeat thread (and
        # tracker threads) already run here (data/workers.py)
        loader = DataLoader(self.dataset, batch_size=self.batch_size, sampler=self.sampler,
                            num_workers=workers, drop_last=True, collate_fn=self.collate_fn,
                            persistent_workers=workers > 0, pin_memory=self.device.type == "cuda",
                            generator=self.generator,
                            **worker_options(workers))
        self._loader = loader
        while True:
            self.sampler.set_position(epoch, offset)
            for batch in loader:
                yield epoch, batch
            epoch, offset = epoch + 1, 0

    def shutdown(self) -> None:
        """Shut the DataLoader workers down through their queues, also after an error (an unreadable image raised
        in a worker). They ignore SIGTERM (data/workers.py), so multiprocessing's exit hook, which
        terminates daemonic children with SIGTERM and then joins them, would otherwise wait forever."""
        # persistent workers' iterator: torch (2.14.1) has no public call that stops them, hence its private one
        it = getattr(self._loader, "_iterator", None)
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()


@contextlib.contextmanager
def skip_hint() -> Iterator[None]:
    """An unreadable training image names the flag that skips it: only around the training data, where the flag
    exists and applies (evaluation, `vtrain eval` and `vtrain predict` never skip an image, so their messages do
    not suggest it)."""
    try:
        yield
    except BadSample as e:
        raise BadSample(f"{e} (--skip-bad-images skips unreadable images)") from None
