"""How DataLoader worker processes start: never by forking a process that may run threads.

A forked child inherits every lock in the state it had at the fork, held or not, but only the forking thread: a lock
another thread held at that instant stays held in the child forever. When vtrain starts workers, threads already run:
the output-dir lock's heartbeat (engine/rundir.py), tracker writers (TensorBoard, wandb), and whatever a library
started. Python's own docs warn that forking a multi-threaded process is unsafe, and 3.12 warns about it at run time
(docs/input_limits.md §5). torch's DataLoader forks by default on Linux, so every DataLoader with workers takes its
context from here: `forkserver`, whose server is a fresh single-threaded interpreter that forks the workers. Their
dataset and collate function are pickled to them (data sets here keep no open files or closures for that reason).
The server imports `PRELOAD` once, so each worker starts with torch and vtrain's data modules already imported.

A worker also ends when the process that made its loader is gone (`WorkerInit`). torch's workers watch their parent
process (torch/utils/data/_utils/worker.py, `ManagerWatchdog`: `os.getppid()`), which under a fork server is the
server, not the loader's process; and the server waits for every holder of its liveness pipe to close it, which the
workers are among (CPython Lib/multiprocessing/forkserver.py passes that descriptor to each child it forks). So a
process that ends without shutting its loader down (an `os._exit` after a crash, a second signal, SIGKILL from the
OOM killer or a scheduler) left the server and its workers running for good, holding their memory and any pipe
they inherited (a `| tail` of the process's output had not ended 600 s later). Each worker now watches its loader's process through a
pidfd (Linux >= 5.3; elsewhere it polls once a second) and exits when that process has; the server then sees its
pipe closed and exits too.

And a worker ignores the stop signals (`STOP_SIGNALS`): a Ctrl-C in a terminal signals the whole process group, and a
scheduler that preempts a job signals every process of it, workers included. What a stop means is for the process
that made the loader to decide (`vtrain train` finishes the step and writes a checkpoint, engine/interrupt.py); a
worker that died of the signal instead would make that process's next read from the loader fail (an evaluation
inside training ended the run that way; so did a signal that arrived while a worker started, before its
worker_init_fn ran, until the fork server blocked them: data/worker_server.py). A worker ends when its loader tells
it to, or when that process is gone.
Since multiprocessing ends the daemonic children still running at exit with SIGTERM and then waits for them
(Lib/multiprocessing/util.py `_exit_function`), a worker of a loader that was never shut down (an error left its
iterator alive) would make that wait endless: vtrain ends those first, with SIGKILL (`end_workers`, at exit).
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import select
import signal
import threading
import time
from multiprocessing.context import BaseContext
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
"""What a scheduler (SIGTERM) and a terminal (SIGINT) send to ask a run to stop."""

PRELOAD = [
    "vtrain.data.worker_server", "vtrain.data.faces", "vtrain.data.recordio", "vtrain.data.coco", "vtrain.data.skip"]


def worker_context(num_workers: int) -> BaseContext | None:
    """The `multiprocessing_context` for a DataLoader with `num_workers` workers (None when there are none)."""
    if num_workers <= 0:
        return None
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server first starts; later calls change nothing
    return ctx


def worker_options(num_workers: int) -> dict[str, Any]:
    """The DataLoader arguments every vtrain loader takes for its workers: their start method (`worker_context`) and
    `WorkerInit` (a worker ignores the stop signals and ends when its loader's process is gone)."""
    global _ENDS_AT_EXIT
    if num_workers <= 0:
        return {"multiprocessing_context": None, "worker_init_fn": None}
    context = worker_context(num_workers)
    if not _ENDS_AT_EXIT:  # after multiprocessing registered its own exit handler, so that this one runs first
        atexit.register(end_workers)
        _ENDS_AT_EXIT = True
    return {"multiprocessing_context": context, "worker_init_fn": WorkerInit()}


_ENDS_AT_EXIT = False


def end_workers() -> None:
    """At exit: kill the daemonic child processes still running (DataLoader workers whose loader was not shut down)
    and reap them. They ignore SIGTERM, which is all multiprocessing's own exit handler would send before joining
    them."""
    for process in multiprocessing.active_children():
        if process.daemon:
            process.kill()
            process.join()


class WorkerInit:
    """A DataLoader worker_init_fn, made in the process that makes the loader: ignore the stop signals, and watch
    that process."""

    def __init__(self) -> None:
        self.owner = os.getpid()

    def __call__(self, worker_id: int) -> None:
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)  # discards one that arrived since the fork (data/worker_server.py)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        watch_owner(self.owner)


def watch_owner(pid: int, poll_s: float = 1.0) -> threading.Thread:
    """End this process (`os._exit(0)`) once process `pid` has exited: a daemon thread waits on a pidfd of `pid`
    (readable when it exits; no pid reuse can fool it), or, without pidfd support, checks it every `poll_s`."""
    try:
        fd: int | None = os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfd_open (not Linux, kernel < 5.3), or `pid` already gone
        fd = None

    def wait() -> None:
        if fd is not None:
            select.select([fd], [], [])
        else:
            while _alive(pid):
                time.sleep(poll_s)
        os._exit(0)

    thread = threading.Thread(target=wait, name="vtrain-loader-owner", daemon=True)
    thread.start()
    return thread


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user (a reused pid): treat as alive, as the pidfd would not
        return True
    return True
