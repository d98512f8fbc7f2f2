"""Fault injection for the tests, through environment variables: a hard kill, a signal, a non-finite value at a
given step, a full disk during a save. The variables are read once, when a run starts (`injected()`, from the
Trainer's and the checkpointer's constructors), never in the loop; without them every check is a comparison with
nothing and nothing happens.

- `VTRAIN_DEBUG_CRASH_AT_STEP=N` (in the loop) and `VTRAIN_DEBUG_CRASH_IN_SAVE=N` (inside a checkpoint's write): a
  hard kill (no cleanup, no exception handlers) at step N, for the resume tests.
- `VTRAIN_DEBUG_SIGNAL_AT_STEP=N[@RANK]`: a SIGTERM to this process while it trains step N (on every rank, or only
  on RANK), through the real signal handler, for the preemption tests.
- `VTRAIN_DEBUG_NONFINITE=loss@N`: every loss from step N on is NaN; `param@N`: a weight turns inf after step N (what
  an overflowing update does), for the non-finite guards.
- `VTRAIN_DEBUG_FILE_LIMIT_IN_SAVE=N[@RANK][:BYTES]`: this process's file size limit (RLIMIT_FSIZE, default 4096
  bytes) is set at the start of the save of step N (on every rank, or only on RANK), with SIGXFSZ ignored: every
  write that would cross it fails with EFBIG, as on a full disk, from that point on.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping

CRASHES = ("VTRAIN_DEBUG_CRASH_AT_STEP", "VTRAIN_DEBUG_CRASH_IN_SAVE")


class Faults:
    """The injections of this process, parsed from `env` once."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self._crash_at = {var: env.get(var) for var in CRASHES}
        self._signal_at, _, self._signal_rank = env.get("VTRAIN_DEBUG_SIGNAL_AT_STEP", "").partition("@")
        kind, _, at = env.get("VTRAIN_DEBUG_NONFINITE", "").partition("@")
        self._nonfinite = (kind, int(at)) if at.isdigit() else None
        spec, _, self._limit_bytes = env.get("VTRAIN_DEBUG_FILE_LIMIT_IN_SAVE", "").partition(":")
        self._limit_at, _, self._limit_rank = spec.partition("@")

    def crash(self, var: str, step: int) -> None:
        """A hard kill at the step `var` names (one of CRASHES)."""
        if self._crash_at[var] == str(step):
            os._exit(17)

    def send_signal(self, step: int, rank: int) -> None:
        if self._signal_at == str(step) and self._signal_rank in ("", str(rank)):
            os.kill(os.getpid(), signal.SIGTERM)

    def nonfinite(self, what: str, step: int) -> bool:
        """Whether `what` (loss | param) is to be made non-finite at `step`."""
        return self._nonfinite is not None and self._nonfinite[0] == what and step >= self._nonfinite[1]

    def file_size_limit(self, step: int, rank: int) -> None:
        if self._limit_at == str(step) and self._limit_rank in ("", str(rank)):
            import resource

            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            limit = int(self._limit_bytes or 4096)
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


_injected: Faults | None = None


def injected() -> Faults:
    """This process's injections, read from the environment at the first call (a run's start-up) only."""
    global _injected
    if _injected is None:
        _injected = Faults(os.environ)
    return _injected
