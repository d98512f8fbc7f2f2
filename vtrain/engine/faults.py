"""Fault injection for the tests, through environment variables: a hard kill, a signal, a non-finite value at a
given step. Each is one `os.environ` read where it is called; without the variable nothing happens."""

from __future__ import annotations

import os
import signal


def crash(var: str, step: int) -> None:
    """`VAR=N`: a hard kill (no cleanup, no exception handlers) at step N, for the resume tests
    (VTRAIN_DEBUG_CRASH_AT_STEP in the loop, VTRAIN_DEBUG_CRASH_IN_SAVE inside a checkpoint's write)."""
    if os.environ.get(var) == str(step):
        os._exit(17)


def send_signal(step: int, rank: int) -> None:
    """For the preemption tests: `VTRAIN_DEBUG_SIGNAL_AT_STEP=N[@RANK]` sends this process a SIGTERM while it
    trains step N (on every rank, or only on RANK), through the real signal handler."""
    spec = os.environ.get("VTRAIN_DEBUG_SIGNAL_AT_STEP", "")
    at, _, who = spec.partition("@")
    if at == str(step) and who in ("", str(rank)):
        os.kill(os.getpid(), signal.SIGTERM)


def nonfinite(what: str, step: int) -> bool:
    """For the non-finite guards: `VTRAIN_DEBUG_NONFINITE=loss@N` makes every loss from step N on NaN; `param@N`
    turns a weight into inf after step N (what an overflowing update does)."""
    kind, _, at = os.environ.get("VTRAIN_DEBUG_NONFINITE", "").partition("@")
    return kind == what and at.isdigit() and step >= int(at)


def file_size_limit(step: int, rank: int) -> None:
    """For the full-disk tests of a multi-process save: `VTRAIN_DEBUG_FILE_LIMIT_IN_SAVE=N[@RANK][:BYTES]` sets
    this process's file size limit (RLIMIT_FSIZE, default 4096 bytes) at the start of the save of step N (on every
    rank, or only on RANK), with SIGXFSZ ignored: every write that would cross it fails with EFBIG, as on a full
    disk, from that point on."""
    spec, _, size = os.environ.get("VTRAIN_DEBUG_FILE_LIMIT_IN_SAVE", "").partition(":")
    at, _, who = spec.partition("@")
    if at == str(step) and who in ("", str(rank)):
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        limit = int(size or 4096)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
