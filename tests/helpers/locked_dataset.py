"""A dataset whose every item needs a module-level lock (tests/integration/test_hostile_data.py, docs/input_limits.md
§5): a DataLoader worker forked while another thread holds that lock inherits it held and blocks forever; a worker
started from a fresh interpreter (forkserver, spawn) imports this module anew, with the lock free."""

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


class SignalledInit:
    """A DataLoader worker_init_fn (tests/data/test_workers.py): the worker sends itself SIGTERM where a preemption's
    signal can land while a worker starts, after torch's worker loop installed its SIGTERM handler and before
    vtrain's `WorkerInit` ignores the stop signals; then it runs `init` (a `WorkerInit`, or nothing) and fails if a
    stop signal is still blocked after it."""

    def __init__(self, init=None) -> None:
        self.init = init

    def __call__(self, worker_id: int) -> None:
        import os
        import signal

        os.kill(os.getpid(), signal.SIGTERM)
        if self.init is not None:
            self.init(worker_id)
            blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
            if blocked & {signal.SIGTERM, signal.SIGINT}:
                raise RuntimeError(f"stop signals still blocked after WorkerInit: {sorted(blocked)}")
