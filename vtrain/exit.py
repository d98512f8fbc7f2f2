"""How a command ends: a command that ran a process group leaves it on an error and ends without interpreter
teardown once everything is flushed (cli.py; docs/safety.md). Nothing here imports torch: a plain flag error must not
pay for it."""

from __future__ import annotations

import atexit
import ctypes
import os
import sys
import threading
from typing import NoReturn


def leave_gloo_group() -> None:
    """After an error: leave a gloo process group now, while every object it serves is alive (an NCCL one is left
    alone: destroying it while another rank may still wait in a collective can hang). Only when torch is loaded
    already: a plain flag error must not pay for importing it."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
        sys.modules["vtrain.dist"].leave()


def groups_left() -> int:
    """How many process groups this process has left (vtrain.dist.leave), plus one if a group is still open."""
    vdist, tdist = sys.modules.get("vtrain.dist"), sys.modules.get("torch.distributed")
    still_open = tdist is not None and tdist.is_available() and tdist.is_initialized()
    return (vdist.groups_left() if vdist is not None else 0) + int(still_open)


def end(code: int, groups_before: int) -> NoReturn:
    """End the command with `code`. A command that ran a process group ends without interpreter teardown, once
    everything is flushed: the native threads of its backends (gloo's, DeepSpeed's) outlive
    destroy_process_group while any object still holds them, and one that takes the GIL during teardown is ended
    by Python 3.11 with pthread_exit, whose unwinding aborts the process ("terminate called without an active
    exception", SIGABRT) after a run that succeeded (docs/safety.md, "What the file rules rely on"). What a normal
    exit would still do runs first: the non-daemon threads are joined, the atexit handlers run (the output
    directory's lock, logging), Python's and C's stdio buffers are flushed."""
    if groups_left() == groups_before:
        sys.exit(code)
    main_thread = threading.main_thread()
    for t in threading.enumerate():
        if t is not main_thread and not t.daemon:
            t.join()
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed or broken pipe: nothing more can reach it
                pass
        ctypes.CDLL(None).fflush(None)  # what native code printed through C's stdio
        os._exit(code)
