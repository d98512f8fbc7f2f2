"""Whether a process still runs, for tests that watch processes end (a zombie is not running: it holds no memory
and no descriptors, and waits only for its parent to reap it)."""

import psutil


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
