"""Preemption: the first SIGTERM (what cluster schedulers send before killing a job) or SIGINT asks the loop to
stop after the current optimizer step; the loop then writes a checkpoint on all ranks and exits 128 + signal.
A second signal exits at once (checkpoints are atomic, so nothing saved is damaged by that).

The request is agreed on by all ranks after every step with one all-reduce over a CPU (gloo) group, so a signal
that reaches only some ranks (a scheduler signalling one node, `kill` of one rank) still stops all of them at the
same step, and no GPU stream is synchronised for it.

Python runs a signal handler only when the main thread is back in the interpreter, never while it waits in native
code: a rank waiting in a collective that the other ranks never join (a hang) would not even see the signal. So
each signal is also heard by a thread (`_Watcher`), woken through `signal.set_wakeup_fd` (the interpreter's C-level
handler writes the signal's number to a pipe at once): it prints the first signal's line and ends the process at
the second, wherever the main thread is. The step boundary still learns of the request from the handler.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from vtrain.data.workers import STOP_SIGNALS

# torch is imported where it is used: the CLI installs the handler first thing, and a bad flag must be reported
# without paying the seconds of a torch import. The loader workers ignore STOP_SIGNALS (data/workers.py): the stop
# is this process's to make.


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
        self._announced = False
        self._lock = threading.RLock()  # the handler and the watcher thread both announce; a handler may nest

    def install(self) -> "GracefulInterrupt":
        self._pid = os.getpid()
        for s in STOP_SIGNALS:
            self._previous[s] = signal.signal(s, self._handle)
        _Watcher.attach(self)
        return self

    def _handle(self, signum: int, frame) -> None:
        if os.getpid() != self._pid:
            # a forked child (vtrain forks none, docs/input_limits.md §5, but a library may) inherits this handler; it
            # has no step to finish, and its parent may wait for the SIGTERM it sends to kill it: die as by default
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self.signum:  # second signal: leave now (the watcher thread may have done so already)
            self._leave(signum)
        self.signum = signum
        self.announce(signum)

    def announce(self, signum: int) -> None:
        """The first signal's line, printed once, by the handler or the watcher thread, whichever runs first."""
        with self._lock:  # printed under the lock: `_leave` waits for a line being printed by the other thread
            if self._announced:
                return
            self._announced = True
            print(f"received {signal.Signals(signum).name}: finishing this step and writing a checkpoint "
                  "(send it again to exit at once)", file=sys.stderr, flush=True)

    def _leave(self, signum: int) -> None:
        """Exit at once on a second signal, once the first signal's line is out (the handler and the watcher thread
        both hear both signals: the one that exits must not cut the other's print short)."""
        with self._lock:
            sys.stderr.flush()
            os._exit(128 + signum)

    def heard(self, count: int, signum: int) -> None:
        """From the watcher thread: the `count`-th signal this process received. The second one ends the process
        even while the main thread cannot run the handler."""
        if count == 1:
            self.announce(signum)
            return
        self.announce(signum)
        self._leave(signum)

    def use_group(self, world: int) -> None:
        """Collective: a gloo group for the per-step agreement (the default group may be NCCL)."""
        import torch.distributed as dist

        if world > 1:
            self._group = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")

    def leave_group(self) -> None:
        """Before the process group is destroyed: hold no reference to it (a group that something still holds
        keeps its backend's threads running)."""
        self._group = None

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
        _Watcher.detach(self)


class _Watcher:
    """One per process: a daemon thread reading the signal numbers the interpreter writes to its wakeup pipe, and
    handing SIGTERM/SIGINT to the GracefulInterrupt installed last."""

    pid = 0
    target: GracefulInterrupt | None = None
    count = 0

    @classmethod
    def attach(cls, target: GracefulInterrupt) -> None:
        cls.target, cls.count = target, 0
        if cls.pid == os.getpid():
            return
        read, write = os.pipe()
        os.set_blocking(write, False)  # set_wakeup_fd requires it: the C-level handler must never block
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        cls.pid = os.getpid()
        threading.Thread(target=cls._run, args=(read,), name="vtrain-signal-watch", daemon=True).start()

    @classmethod
    def detach(cls, target: GracefulInterrupt) -> None:
        if cls.target is target:
            cls.target = None

    @classmethod
    def _run(cls, read: int) -> None:
        while True:
            data = os.read(read, 64)
            if not data or cls.pid != os.getpid():
                return
            for signum in data:
                if signum in STOP_SIGNALS and cls.target is not None:
                    cls.count += 1
                    cls.target.heard(cls.count, signum)

    @classmethod
    def _after_fork(cls) -> None:
        """A forked child has no watcher thread, and must not write its signals into the parent's pipe."""
        if cls.pid not in (0, os.getpid()):
            cls.pid, cls.target = 0, None
            try:
                signal.set_wakeup_fd(-1)
            except ValueError:  # not the main thread: leave it
                pass


os.register_at_fork(after_in_child=_Watcher._after_fork)

