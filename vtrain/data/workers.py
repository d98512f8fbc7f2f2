"""How DataLoader worker processes start: never by forking a process that may run threads.

A forked child inherits every lock in the state it had at the fork, held or not, but only the forking thread: a lock
another thread held at that instant stays held in the child forever. When vtrain starts workers, threads already run:
the output-dir lock's heartbeat (engine/rundir.py), tracker writers (TensorBoard, wandb), and whatever a library
started. Python's own docs warn that forking a multi-threaded process is unsafe, and 3.12 warns about it at run time
(docs/input_limits.md §5). torch's DataLoader forks by default on Linux, so every DataLoader with workers takes its
context from here: `forkserver`, whose server is a fresh single-threaded interpreter that forks the workers. Their
dataset and collate function are pickled to them (data sets here keep no open files or closures for that reason).
The server imports `PRELOAD` once, so each worker starts with torch and vtrain's data modules already imported.
"""

from __future__ import annotations

import multiprocessing
from multiprocessing.context import BaseContext

PRELOAD = ["vtrain.data.faces", "vtrain.data.recordio", "vtrain.data.coco", "vtrain.data.skip"]


def worker_context(num_workers: int) -> BaseContext | None:
    """The `multiprocessing_context` for a DataLoader with `num_workers` workers (None when there are none)."""
    if num_workers <= 0:
        return None
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server first starts; later calls change nothing
    return ctx
