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
(vtrain/guarded.py): a name the run writes (`RUN_NAMES`, and `best.json` or a staging folder in `checkpoints/`)
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
from dataclasses import fields
from pathlib import Path

import psutil
import yaml

from vtrain import guarded
from vtrain.config import RunConfig
from vtrain.dist import AgreedError, broadcast_from_main, gather_objects, is_main
from vtrain.engine import best as best_record
from vtrain.engine import checkpoint as ckpt
from vtrain.errors import VtrainError
from vtrain.files import write_json_atomic, write_text_atomic
from vtrain.records import Record, RecordError, read_json

LOCK = ".vtrain.lock"
MARKER = ".vtrain-run.json"  # {"format": MARKER_FORMAT, "version", "created"}: this directory is a vtrain run's
MARKER_FORMAT = "vtrain-run"
HEARTBEAT_S = 15.0
STALE_AFTER_S = 120.0
LOG_FILES = ("metrics.jsonl", "eval.jsonl", "run_info.json")
# the files a run replaces, rewrites or (--overwrite-output-dir) deletes: each must be vtrain's (`foreign_files`)
OWNED_FILES = (ckpt.CONFIG, *LOG_FILES, f"{ckpt.CHECKPOINTS}/{ckpt.BEST}")
# every name a run writes directly in its directory: none may be a link or a mount point (it would write or delete
# elsewhere); the files must be regular files, the folders real folders
RUN_FILES = (ckpt.CONFIG, *LOG_FILES, LOCK, MARKER)
RUN_FOLDERS = (ckpt.CHECKPOINTS, ckpt.TENSORBOARD, ckpt.UNIVERSAL)
RUN_NAMES = (*RUN_FILES, *RUN_FOLDERS)
# the most vtrain reads of a file to recognise it as its own: a whole JSON or YAML file (its own are a few KiB; a
# run_info.json of 1000 ranks about 1 MiB), the first line of a log (which grows with the run)
SNIFF_BYTES = 16 * 2**20
FIRST_LINE_BYTES = 2**20


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
                holder, stale = self._inspect()
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

    def _inspect(self) -> tuple[str, bool]:
        try:
            age = time.time() - self.path.lstat().st_mtime
        except FileNotFoundError:
            return "gone", True
        held = read_lock(self.path)
        if held is None:
            # a lock being written right now is empty for an instant; an unreadable old one is stale
            return "unreadable lock", age > STALE_AFTER_S
        host, pid, started = held["host"], held["pid"], held["started"]
        who = f"pid {pid} on {host}, heartbeat {age:.0f} s ago"
        if host == socket.gethostname():
            try:
                alive = abs(psutil.Process(pid).create_time() - started) < 1.0
            except psutil.Error:
                alive = False
            return who, not alive
        return who, age > STALE_AFTER_S

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


def read_lock(path: Path) -> dict | None:
    """The lock's fields, checked (host, pid, process start time, token); None for a missing, half-written or
    malformed lock, or one that is not a real file."""
    if Path(path).is_symlink():
        return None
    try:
        r = Record(read_json(path), path)
        return {"host": r.str("host"), "pid": r.int("pid", low=1, high=2**31 - 1),
                "started": r.number("started", low=0), "token": r.str("token")}
    except RecordError:
        return None


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
    module docstring) and mark it as a vtrain run's. Returns the lock and notes for the log."""
    out = Path(output_dir)
    holder = ckpt.inside_checkpoint(out)
    if holder is not None:
        raise VtrainError(f"--output-dir {out} is inside the checkpoint {holder}; a run would rewrite its files (and "
                          "it would no longer verify): choose a folder outside every run's checkpoints/")
    if out.exists() and not out.is_dir():
        raise VtrainError(f"--output-dir: {out} is a file, not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise VtrainError(f"--output-dir: cannot create {out} ({e.strerror})") from None
    check_links(out)
    lock = OutputDirLock(out)
    lock.acquire()
    notes: list[str] = ckpt.linked_entries(out)
    try:
        foreign = foreign_files(out)
        if foreign:
            raise VtrainError(f"--output-dir {out} holds {', '.join(foreign)}, which vtrain did not write (no vtrain "
                              f"run marker {MARKER}, and not what vtrain writes there); a run replaces and deletes "
                              "only its own files, also with --overwrite-output-dir: move them away, or choose "
                              "another --output-dir")
        existing = ckpt.complete_checkpoints(out)
        logs = [n for n in LOG_FILES if (out / n).exists()]
        if resume is None and (existing or logs):
            if not overwrite:
                what = (f"checkpoints of an earlier run ({', '.join(p.name for p in existing[-3:])})" if existing
                        else f"logs of an earlier run ({', '.join(logs)})")
                raise VtrainError(f"--output-dir {out} already holds {what}; continue it with --resume auto, or start "
                                  "over with --overwrite-output-dir (deletes that run's checkpoints and logs)")
            for p in existing:
                notes += ckpt.remove(p)
            for name in (*LOG_FILES, f"{ckpt.CHECKPOINTS}/{ckpt.BEST}"):  # best.json: --keep-best of that run
                guarded.unlink(out, out / name)
            if existing:
                notes.append(f"--overwrite-output-dir: deleted {len(existing)} checkpoints of the earlier run in {out}")
        if not _is_marker(out / MARKER):
            write_json_atomic(out / MARKER, {"format": MARKER_FORMAT, "version": 1, "created": time.time()})
    except BaseException:
        lock.release()
        raise
    return lock, notes


def check_links(out: Path) -> None:
    """Refuse a run directory where a name the run writes is a link or a mount point, or not a regular file (or
    folder) (see the module docstring), before anything is written; links and mount points among the checkpoints
    are left alone (`ckpt.linked_entries`)."""
    mounts = guarded.mount_points()
    crossing = lambda p: p.is_symlink() or (os.path.lexists(p) and guarded.is_mount(p, mounts))  # noqa: E731
    bad = next((out / n for n in RUN_NAMES if crossing(out / n)), None)
    ckpts = ckpt.checkpoint_dir(out)
    if bad is None and ckpts.is_dir():
        names = [ckpts / ckpt.BEST, *(p for p in ckpts.iterdir() if p.name.startswith(ckpt.STAGING))]
        bad = next((p for p in names if crossing(p)), None)
    if bad is not None:
        raise VtrainError(f"--output-dir {out}: {guarded.describe_crossing(bad)}; a run writes and deletes only real "
                          "files and folders inside its directory: remove the link or unmount it, or choose another "
                          "--output-dir")
    for p in (*(out / n for n in RUN_FILES), ckpts / ckpt.BEST):
        kind = guarded.not_regular(p) or ("a folder" if p.is_dir() else None)
        if kind is not None:
            raise VtrainError(f"--output-dir {out}: {p} is {kind}, not a regular file; a run writes its own files "
                              "there: move it away, or choose another --output-dir")
    for p in (out / n for n in RUN_FOLDERS):
        if os.path.lexists(p) and not p.is_dir():
            raise VtrainError(f"--output-dir {out}: {p} is not a folder; a run writes its own files into it: move it "
                              "away, or choose another --output-dir")


# ---- what is vtrain's ---------------------------------------------------------------------------------------------

def foreign_files(out: Path) -> list[str]:
    """The names among `OWNED_FILES` (and the marker's) in `out` that vtrain did not write: none when `out` carries
    vtrain's run marker; without it, every one that is not recognisably vtrain's by its content (a directory of an
    earlier vtrain, which wrote no marker, passes; a user's own file does not)."""
    marker = out / MARKER
    if _is_marker(marker):
        return []
    bad = [MARKER] if os.path.lexists(marker) else []
    return bad + [n for n in OWNED_FILES if os.path.lexists(out / n) and not _RECOGNISE[n](out / n)]


def _is_marker(path: Path) -> bool:
    try:
        return _sniff(path) is not None and Record(read_json(path), path).data.get("format") == MARKER_FORMAT
    except RecordError:
        return False


def _sniff(path: Path, limit: int = SNIFF_BYTES, whole: bool = True) -> bytes | None:
    """A regular file's bytes, at most `limit` of them; None when it is unreadable or, for `whole`, larger."""
    try:
        if not path.is_file() or (whole and path.stat().st_size > limit):
            return None
        with open(path, "rb") as f:
            return f.read(limit)
    except OSError:
        return None


def _first_record(path: Path) -> dict | None:
    """The first line of a log as a JSON object, or None."""
    head = _sniff(path, FIRST_LINE_BYTES, whole=False)
    try:
        record = json.loads(head.split(b"\n", 1)[0]) if head else None
    except (ValueError, RecursionError):
        return None
    return record if isinstance(record, dict) and type(record.get("step")) is int else None


def _is_config(path: Path) -> bool:
    """The complete resolved config vtrain writes: every section of RunConfig, `train.output_dir` set."""
    head = _sniff(path)
    try:
        data = yaml.safe_load(head.decode()) if head else None
    except (yaml.YAMLError, UnicodeDecodeError, RecursionError):
        return False
    sections = {f.name for f in fields(RunConfig) if f.name != "given"}  # (given: internal, never written)
    return (isinstance(data, dict) and set(data) == sections and isinstance(data.get("train"), dict)
            and all(isinstance(data[k], dict) for k in sections - {"task"}) and "output_dir" in data["train"])


def _is_run_info(path: Path) -> bool:
    try:
        data = json.loads(_sniff(path) or b"")
    except (ValueError, RecursionError):
        return False
    return isinstance(data, dict) and {"engine", "world_size", "ranks"} <= set(data)


def _is_best(path: Path) -> bool:
    try:
        return _sniff(path) is not None and best_record.read(path.parent.parent) is not None
    except RecordError:
        return False


_RECOGNISE = {
    ckpt.CONFIG: _is_config,
    "metrics.jsonl": lambda p: (r := _first_record(p)) is not None and {"epoch", "time"} <= set(r),
    "eval.jsonl": lambda p: (r := _first_record(p)) is not None and bool({"balanced_accuracy", "AP"} & set(r)),
    "run_info.json": _is_run_info,
    f"{ckpt.CHECKPOINTS}/{ckpt.BEST}": _is_best,
}


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
