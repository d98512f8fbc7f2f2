"""A dataset whose every item needs a module-level lock (tests/test_hostile_data.py, docs/input_limits.md §5): a DataLoader
worker forked while another thread holds that lock inherits it held and blocks forever; a worker started from a
fresh interpreter (forkserver, spawn) imports this module anew, with the lock free."""

import threading

import torch
from torch.utils.data import Dataset

LOCK = threading.Lock()


class Squares(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        with LOCK:
            return torch.tensor(i * i)
