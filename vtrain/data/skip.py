"""`--skip-bad-images`: a sample whose file cannot be read is replaced, and reported, instead of stopping the run.

Without the flag a dataset raises `BadSample` naming the file, which reaches the user as one line even from a
DataLoader worker (see errors.py). With it, the wrapper below replaces the sample by the next readable index
(deterministically, so a resumed run sees the same batches) and records the skipped file in the batch; the loop
counts them and names them in the log at the end of each epoch. Batches keep their size, so every rank still
runs the same number of steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data import Dataset, default_collate

from vtrain.errors import BadSample, VtrainError

MAX_CONSECUTIVE_BAD = 32


class SkipBadSamples(Dataset):
    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name: str) -> Any:  # group_ids, num_classes, ... of the wrapped dataset
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __getitem__(self, key: tuple[int, int]) -> dict[str, Any]:
        epoch, idx = key if isinstance(key, tuple) else (0, key)
        bad: list[str] = []
        for k in range(MAX_CONSECUTIVE_BAD):
            try:
                sample = self.dataset[(epoch, (idx + k) % len(self.dataset))]
            except BadSample as e:
                bad.append(str(e))
                continue
            sample["bad"] = bad
            return sample
        raise VtrainError(f"{MAX_CONSECUTIVE_BAD} consecutive unreadable files from index {idx}, e.g. {bad[0]}; "
                          "is the data set damaged?")


class CollateWithBadList:
    """Collate wrapper: pops each sample's `bad` list and joins them into the batch's `bad` list. A class, not a
    closure: DataLoader workers start without fork (data/workers.py) and receive it pickled."""

    def __init__(self, collate: Callable | None) -> None:
        self.inner = collate or default_collate

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        bad = [b for s in samples for b in s.pop("bad", [])]
        batch = self.inner(samples)
        batch["bad"] = bad
        return batch
