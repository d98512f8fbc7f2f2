"""Imported by the fork server that starts vtrain's DataLoader workers (`PRELOAD` in data/workers.py), and by nothing
else: the server ignores SIGTERM, as it already ignores SIGINT.

A scheduler that preempts a job sends SIGTERM to every process of it. CPython's fork server protects itself from ^C
only (Lib/multiprocessing/forkserver.py, `main`: SIGINT ignored, SIGTERM left at its default), so it died of the
signal, and torch's workers, which take the death of their parent (the server) as the death of their loader's
process (`ManagerWatchdog`), left at their next check: the read after that failed, ending an evaluation inside
training (tests/data/test_workers.py). Ignored here, the server ends as it should, when its last client is gone; a
worker forked from it starts with SIGTERM ignored too (an ignored disposition survives fork).

That is not enough for the worker: torch's worker loop first installs its own SIGTERM handler, which ends the worker
unless the signal came from its parent (torch/utils/data/_utils/worker.py `_worker_loop` calls
`_set_worker_signal_handlers()` before it runs the worker_init_fn), and the fork server's child restores SIGINT's
handler. A stop signal that arrived between that and `WorkerInit` (data/workers.py), as a preemption does when an
evaluation inside training starts its workers, killed the worker and the run read "DataLoader worker exited
unexpectedly". So the server also blocks the stop signals: a forked worker inherits the mask, a signal in that window
stays pending, and `WorkerInit` discards it (setting SIG_IGN discards a pending signal) before it unblocks them.
"""

import signal

from vtrain.data.workers import STOP_SIGNALS

signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
