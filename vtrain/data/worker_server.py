"""Imported by the fork server that starts vtrain's DataLoader workers (`PRELOAD` in data/workers.py), and by nothing
else: the server ignores SIGTERM, as it already ignores SIGINT.

A scheduler that preempts a job sends SIGTERM to every process of it. CPython's fork server protects itself from ^C
only (Lib/multiprocessing/forkserver.py, `main`: SIGINT ignored, SIGTERM left at its default), so it died of the
signal, and torch's workers, which take the death of their parent (the server) as the death of their loader's
process (`ManagerWatchdog`), left at their next check: the read after that failed, ending an evaluation inside
training (tests/data/test_workers.py). Ignored here, the server ends as it should, when its last client is gone; a
worker forked from it starts with SIGTERM ignored too (an ignored disposition survives fork), before its
worker_init_fn runs.
"""

import signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)
