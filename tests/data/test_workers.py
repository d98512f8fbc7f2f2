"""DataLoader workers end with the process that made their loader (data/workers.py): a process that ends without
shutting its loader down (`os._exit` after a crash, a second signal, SIGKILL) leaves no worker and no fork server
behind, holding memory and the pipes they inherited; and without the watch they did stay (the negative control)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.helpers.cli import env, script_env
from tests.helpers.paths import ROOT
from tests.helpers.processes import running

# A loader with 2 persistent workers over a helper dataset (workers unpickle it by module), one batch read, then
# the process ends at once, as vtrain's crash path does: it prints the workers' and the fork server's pids first.
ENDS_WITHOUT_SHUTDOWN = """
    import multiprocessing.forkserver, os, sys
    import torch
    import locked_dataset
    from vtrain.data.workers import worker_context, worker_options

    options = worker_options(2) if sys.argv[1] == "watched" else {"multiprocessing_context": worker_context(2)}
    loader = torch.utils.data.DataLoader(locked_dataset.Squares(64), batch_size=2, num_workers=2,
                                         persistent_workers=True, **options)
    it = iter(loader)
    next(it)
    pids = [w.pid for w in it._workers] + [multiprocessing.forkserver._forkserver._forkserver_pid]
    print("pids", *pids, flush=True)
    os._exit(3)
"""


def _ended_without_shutdown(tmp_path, kind: str) -> tuple[list[int], int]:
    """Run the script (`watched` or `unwatched`) in its own session; its output goes to a file, since a pipe stays
    open as long as any process that inherited it. Returns (worker and server pids, the session's process group)."""
    out, err = tmp_path / f"{kind}.out", tmp_path / f"{kind}.err"
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(ENDS_WITHOUT_SHUTDOWN), kind], cwd=ROOT,
                                env=script_env(), stdout=o, stderr=e, start_new_session=True)
        assert proc.wait(timeout=120) == 3, err.read_text()[-3000:]
    line = next(line for line in out.read_text().splitlines() if line.startswith("pids "))
    return [int(p) for p in line.split()[1:]], proc.pid


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_workers_and_the_fork_server_end_with_the_loaders_process(tmp_path):
    pids, group = _ended_without_shutdown(tmp_path, "watched")
    try:
        deadline = time.monotonic() + 60  # a bound on a hang, not a speed requirement (pidfd wakes at once)
        while any(map(running, pids)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in pids if running(p)], "workers or the fork server outlived the loader's process"
    finally:
        _kill_group(group)


def test_without_the_watch_they_outlive_it(tmp_path):
    """The negative control: torch's own watchdog looks at the worker's parent, the fork server, which waits for
    the workers: both stay. Checked past torch's 5 s status interval (MP_STATUS_CHECK_INTERVAL), then killed."""
    pids, group = _ended_without_shutdown(tmp_path, "unwatched")
    try:
        time.sleep(7)
        assert all(map(running, pids))
    finally:
        _kill_group(group)


@pytest.mark.parametrize("how", ["pidfd", "poll"])
def test_watch_owner_ends_this_process_when_the_owner_exits(how):
    """`watch_owner` on both paths: a pidfd, and (where os.pidfd_open is missing) a check every poll_s."""
    script = textwrap.dedent(f"""
        import os, subprocess, time
        from vtrain.data import workers
        if {how!r} == "poll":
            del os.pidfd_open
        owner = subprocess.Popen(["sleep", "0.5"])
        workers.watch_owner(owner.pid, poll_s=0.05)
        owner.wait()  # reaped: the parent of a real loader process (a shell, a launcher) reaps it
        time.sleep(60)
        print("still running")
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env(PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "still running" not in proc.stdout, proc.stderr[-3000:]


# A loader read while the process group gets SIGTERM, as a scheduler preempting a job sends it to every process of
# the job: the loader's process handles it (as `vtrain train` does), the workers must not die of it.
GROUP_SIGNAL = """
    import multiprocessing, os, signal, sys
    import torch
    import locked_dataset
    from vtrain.data.workers import worker_options

    heard = []
    signal.signal(signal.SIGTERM, lambda s, f: heard.append(s))
    if sys.argv[1] == "vtrain":
        options = worker_options(2)
    else:  # a fork server without vtrain's preload, workers without WorkerInit
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload([])
        options = {"multiprocessing_context": context}
    loader = torch.utils.data.DataLoader(locked_dataset.Squares(200), batch_size=2, num_workers=2, **options)
    n = 0
    try:
        for batch in loader:
            n += 1
            if n == 5:
                os.killpg(os.getpgid(0), signal.SIGTERM)
        print("read", n, "batches; heard", heard)
    except Exception as e:
        print("failed after", n, "batches:", type(e).__name__)
"""


@pytest.mark.parametrize("options", ["vtrain", "plain"])
def test_a_stop_signal_to_the_group_leaves_the_decision_to_the_loaders_process(options):
    """With `worker_options` every batch is read and the signal reached the handler; with a plain forkserver
    context (the negative control: no vtrain preload in the server, no WorkerInit) the workers die of it and the
    read fails."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(GROUP_SIGNAL), options], cwd=ROOT,
                          env=script_env(), capture_output=True, text=True, timeout=120,
                          start_new_session=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if options == "vtrain":
        assert "read 100 batches; heard [15]" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    else:
        assert proc.stdout.startswith("failed after"), proc.stdout + proc.stderr[-3000:]  # at 5, or a prefetched 6


# A stop signal that lands while a worker starts: torch's worker loop has installed its own SIGTERM handler (which
# ends the worker) and vtrain's WorkerInit has not run yet. Each worker sends it to itself there (SignalledInit).
SIGNAL_WHILE_STARTING = """
    import multiprocessing, sys
    import torch
    import locked_dataset
    from vtrain.data.workers import WorkerInit, worker_options

    if sys.argv[1] == "vtrain":
        options = worker_options(2)
        options["worker_init_fn"] = locked_dataset.SignalledInit(options["worker_init_fn"])
    else:  # a fork server without vtrain's preload: the stop signals are not blocked while a worker starts
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload([])
        options = {"multiprocessing_context": context, "worker_init_fn": locked_dataset.SignalledInit(WorkerInit())}
    loader = torch.utils.data.DataLoader(locked_dataset.Squares(40), batch_size=2, num_workers=2, **options)
    n = 0
    try:
        for epoch in range(2):  # the second epoch starts new workers from the same server
            n += sum(1 for _ in loader)
        print("read", n, "batches")
    except Exception as e:
        print("failed after", n, "batches:", type(e).__name__, e)
"""


@pytest.mark.parametrize("server", ["vtrain", "plain"])
def test_a_stop_signal_while_a_worker_starts_is_discarded(server):
    """With vtrain's fork server the stop signals stay blocked from the fork until WorkerInit ignores them, so the
    signal is discarded and every batch of both epochs is read (and WorkerInit leaves them unblocked); with a plain
    fork server (the negative control) torch's handler ends the worker and the read fails. This window made
    tests/integration/test_safety.py's SIGTERM-with-workers test fail at random."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(SIGNAL_WHILE_STARTING), server], cwd=ROOT,
                          env=script_env(), capture_output=True, text=True, timeout=120, start_new_session=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if server == "vtrain":
        assert "read 40 batches" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    else:
        assert proc.stdout.startswith("failed after 0 batches"), proc.stdout + proc.stderr[-3000:]


# The process ends (normally: atexit runs) while a loader's workers are still running, its iterator never shut down,
# as when an error leaves it alive in a traceback.
EXIT_WITH_LIVE_WORKERS = """
    import atexit, sys
    import torch
    import locked_dataset
    from vtrain.data import workers

    loader = torch.utils.data.DataLoader(locked_dataset.Squares(64), batch_size=2, num_workers=2,
                                         persistent_workers=True, **workers.worker_options(2))
    it = iter(loader)
    next(it)
    if sys.argv[1] == "without-end-workers":
        atexit.unregister(workers.end_workers)
    print("exiting", flush=True)
    sys.exit(0)
"""


@pytest.mark.parametrize("kind", ["vtrain", "without-end-workers"])
def test_a_process_that_exits_with_live_workers_ends(tmp_path, kind):
    """`end_workers` kills them at exit; without it (the negative control) multiprocessing's exit handler sends them
    SIGTERM, which they ignore, and waits for them: still waiting after 20 s (then the group is killed)."""
    with open(tmp_path / "out", "w") as o, open(tmp_path / "err", "w") as e:
        proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(EXIT_WITH_LIVE_WORKERS), kind], cwd=ROOT,
                                env=script_env(), stdout=o, stderr=e, start_new_session=True)
        try:
            if kind != "vtrain":  # the 20 s of the control count from its exit, not from a start slowed by load
                deadline = time.monotonic() + 120
                while "exiting" not in (tmp_path / "out").read_text() and proc.poll() is None \
                        and time.monotonic() < deadline:
                    time.sleep(0.2)
            rc = proc.wait(timeout=120 if kind == "vtrain" else 20)  # bounds on a hang, not speed requirements
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            _kill_group(proc.pid)
            proc.wait()
    assert "exiting" in (tmp_path / "out").read_text(), (tmp_path / "err").read_text()[-3000:]
    assert rc == (0 if kind == "vtrain" else None), (tmp_path / "err").read_text()[-3000:]
