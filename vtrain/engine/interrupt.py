"""Preemption: the first SIGTERM (what cluster schedulers send before killing a job) or SIGINT asks the loop to
stop after the current optimizer step; the loop then writes a checkpoint on all ranks and exits 128 + signal.
A second signal exits at once (checkpoints are atomic, so nothing saved is damaged by that).

The request is agreed on by all ranks after every step with one all-reduce over a CPU (gloo) group, so a signal
that reaches only some ranks (a scheduler signalling one node, `kill` of one rank) still stops all of them at the
same step, and no GPU stream is synchronised for it.
"""

from __future__ import annotations

import os
import signal
import sys

# torch is imported where it is used: the CLI installs the handler first thing, and a bad flag must be reported
# without paying the seconds of a torch import

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class TrainingInterrupted(Exception):
    """Raised by the loop after the interrupt checkpoint is written; the CLI prints it and exits `code`."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class GracefulInterrupt:
    def __init__(self) -> None:
        self.signum = 0
        self._group = None
        self._previous: dict[int, object] = {}
        self._pid = os.getpid()

    def install(self) -> "GracefulInterrupt":
        self._pid = os.getpid()
        for s in SIGNALS:
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum: int, frame) -> None:
        if os.getpid() != self._pid:
            # a forked child (vtrain forks none since issue 18 §5, but a library may) inherits this handler; it
            # has no step to finish, and its parent may wait for the SIGTERM it sends to kill it: die as by default
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self.signum:  # second signal: leave now
            os._exit(128 + signum)
        self.signum = signum
        print(f"received {signal.Signals(signum).name}: finishing this step and writing a checkpoint "
              "(send it again to exit at once)", file=sys.stderr, flush=True)

    def use_group(self, world: int) -> None:
        """Collective: a gloo group for the per-step agreement (the default group may be NCCL)."""
        import torch.distributed as dist

        if world > 1:
            self._group = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")

    def requested(self) -> int:
        """The signal any rank received (0: none). Collective when distributed."""
        if self._group is None:
            return self.signum
        import torch
        import torch.distributed as dist

        flag = torch.tensor([self.signum], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return int(flag.item())

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()


def ignore_in_worker(_: int = 0) -> None:
    """DataLoader worker_init_fn: a Ctrl-C in a terminal signals the whole process group; the main process
    handles it, the workers must not die of it."""
    for s in SIGNALS:
        signal.signal(s, signal.SIG_IGN)
