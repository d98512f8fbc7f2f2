"""One run per output directory: an exclusive lock, the run marker, and the rule for what an existing directory may
hold.

The lock is a file created with O_EXCL (atomic on local and NFS v3+ file systems, unlike flock across nodes)
holding the owner's host, pid and process start time; a daemon thread touches it every `HEARTBEAT_S`. It is
stale when its process is gone (same host: pid absent or another process with that pid) or, from another host,
when it has not been touched for `STALE_AFTER_S`. A stale lock is taken over by renaming it away first, so two
processes that find the same stale lock cannot both win.

Ownership: vtrain replaces and deletes only what it wrote. A run directory is vtrain's when it carries the run
marker (`MARKER`, a small JSON record written when a run first claims the directory, before any other file of the
run). A directory without it (a folder of the user's, or one written by a vtrain before the marker existed) may hold
files at the names a run replaces or deletes (`OWNED_FILES`) only when each is recognisably vtrain's: config.yaml the
complete resolved config vtrain writes, a log whose first line is one of vtrain's records, run_info.json and
best.json with vtrain's keys (`foreign_files`). Any other file there stops the run in one line naming it, whatever
the flags: `--overwrite-output-dir` deletes only vtrain's own records (verified checkpoints of a manifest, the logs,
best.json), never a file vtrain did not write. A `--output-dir` inside a checkpoint (or a run's `checkpoints/` or
`universal/` folder) is refused: the run would rewrite the checkpoint's config.yaml.

A new run refuses a directory that already holds another run's checkpoints or logs, unless it resumes
(`--resume`) or is told to start over (`--overwrite-output-dir`).

Everything a run writes or deletes lies inside its directory, as real files and folders on its own file system
(vtrain/io/guarded.py): a name the run writes (`RUN_NAMES`, and `best.json` or a staging folder in `checkpoints/`)
that is a symbolic link or a mount point stops the run before anything is written, since writing there would write
elsewhere, and so does one that is not a regular file (a FIFO, a device) or folder; a `checkpoints/step_<N>` that
is a link or a mount point is not the run's and is left alone (named in the log). The lock's fields are checked
when read.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path

import psutil

from vtrain.io import guarded
from vtrain.dist import AgreedError, broadcast_from_main, gather_objects, is_main
from vtrain.engine.checkpoint import format as ckpt
from vtrain.engine.run_files import (CONSOLE_LOGS, EVAL_LOG, HEARTBEAT_S, LOCK, LOG_FILES, MARKER, MARKER_FORMAT,
                                     RUN_FILES, STALE_AFTER_S, TRAIN_LOG, check_links, check_owned, check_place,
                                     earlier_run, foreign_files, is_marker, lock_holder, read_lock)
from vtrain.errors import VtrainError
from vtrain.io.files import write_json_atomic, write_text_atomic

# the names of run_files.py that rundir's users read here
__all__ = ["CONSOLE_LOGS", "EVAL_LOG", "LOCK", "MARKER", "MARKER_FORMAT", "RUN_FILES", "STALE_AFTER_S", "TRAIN_LOG",
           "OutputDirLock", "check_links", "check_shared", "claim", "foreign_files", "lock_seen", "read_lock",
           "truncate_logs"]


def _me() -> dict:
    p = psutil.Process()
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": p.create_time(), "token": uuid.uuid4().hex}


class OutputDirLock:
    def __init__(self, output_dir: Path) -> None:
        self.path = Path(output_dir) / LOCK
        self.owner = _me()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> None:
        for _ in range(5):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder, stale = lock_holder(self.path)
                if not stale:
                    raise VtrainError(f"--output-dir {self.path.parent} is in use by another vtrain run ({holder}); "
                                      "wait for it to finish or choose another --output-dir") from None
                self._take_over()
                continue
            except OSError as e:  # a read-only or full directory, a missing permission: one line
                raise guarded.environment_error(e, "create the lock", self.path) or e from None
            try:
                with guarded.disk_op("write the lock", self.path), os.fdopen(fd, "w") as f:
                    json.dump(self.owner, f)
            except VtrainError:
                self.path.unlink(missing_ok=True)  # no half-written lock stays behind
                raise
            self._thread = threading.Thread(target=self._beat, name="vtrain-lock-heartbeat", daemon=True)
            self._thread.start()
            return
        raise VtrainError(f"--output-dir {self.path.parent}: could not take the lock {self.path}")

    def _take_over(self) -> None:
        away = self.path.with_name(f"{LOCK}.stale-{uuid.uuid4().hex}")
        try:
            os.rename(self.path, away)  # only one of several contenders succeeds
        except FileNotFoundError:
            return
        away.unlink(missing_ok=True)

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                pass

    def release(self) -> None:
        self._stop.set()
        held = read_lock(self.path)
        if held is not None and held["token"] == self.owner["token"]:
            try:
                self.path.unlink()
            except OSError:  # a read-only directory now: the lock is stale once this process is gone
                pass


def lock_seen(output_dir: Path, token: str, tries: int = 10, wait_s: float = 0.5) -> str | None:
    """Whether this process sees the lock (by its `token`) that rank 0 just created in output_dir: None if it
    does, else a one-line problem. Several tries: a network file system may show a new file a moment late."""
    for attempt in range(tries):
        held = read_lock(Path(output_dir) / LOCK)
        if held is not None and held["token"] == token:
            return None
        if attempt + 1 < tries:
            time.sleep(wait_s)
    return f"{socket.gethostname()} (pid {os.getpid()}) does not see the lock in {output_dir}"


def check_shared(output_dir: Path, lock: OutputDirLock | None) -> None:
    """Every rank must see the directory rank 0 just locked (`lock`, None on the other ranks): all ranks write their
    shards into one checkpoint folder that rank 0 renames, so on several nodes --output-dir must be on a file system
    they all mount. Checked at start rather than found at the first save, which may be hours in. Collective."""
    problem = lock_seen(output_dir, broadcast_from_main(lambda: lock.owner["token"]))
    bad = [f"rank {r}: {p}" for r, p in enumerate(gather_objects(problem)) if p]
    if bad:
        error = (f"--output-dir {output_dir} is not shared by every process ({'; '.join(bad)}): all ranks write "
                 "each checkpoint into one directory, so put it on a file system every node mounts at the same "
                 "path (docs/multinode.md)")
        raise VtrainError(error) if is_main() else AgreedError(error)


def claim(output_dir: Path, resume: str | None, overwrite: bool) -> tuple[OutputDirLock, list[str]]:
    """Rank 0, before anything is written: lock the directory, apply the rules for what it may hold (see the
    module docstring; the checks are run_files.py's, which `vtrain train` also runs before start-up) and mark it as
    a vtrain run's. Returns the lock and notes for the log."""
    out = Path(output_dir)
    check_place(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise VtrainError(f"--output-dir: cannot create {out} ({e.strerror})") from None
    check_links(out)
    lock = OutputDirLock(out)
    lock.acquire()
    notes: list[str] = ckpt.linked_entries(out)
    try:
        check_owned(out)
        existing = ckpt.complete_checkpoints(out)
        refusal = earlier_run(out, existing)
        if resume is None and refusal is not None:
            if not overwrite:
                raise VtrainError(refusal)
            for p in existing:
                notes += ckpt.remove(p)
            for name in (*LOG_FILES, *CONSOLE_LOGS, f"{ckpt.CHECKPOINTS}/{ckpt.BEST}"):  # best.json: --keep-best
                guarded.unlink(out, out / name)
            if existing:
                notes.append(f"--overwrite-output-dir: deleted {len(existing)} checkpoints of the earlier run in {out}")
        if not is_marker(out / MARKER):
            write_json_atomic(out / MARKER, {"format": MARKER_FORMAT, "version": 1, "created": time.time()})
    except BaseException:
        lock.release()
        raise
    return lock, notes


def truncate_logs(output_dir: Path, step: int) -> None:
    """On resume from `step`: drop log lines of steps after it (they are trained again), so the logs read as one
    uninterrupted run."""
    for name in ("metrics.jsonl", "eval.jsonl"):
        path = Path(output_dir) / name
        if not path.is_file():
            continue
        kept = []
        for line in path.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except (ValueError, RecursionError):
                continue
            # a line vtrain did not write (edited, truncated by a crash) is dropped with the later steps
            if isinstance(record, dict) and type(record.get("step", 0)) is int and record.get("step", 0) <= step:
                kept.append(line)
        write_text_atomic(path, "".join(f"{line}\n" for line in kept))
