"""What a run directory may hold, and the checks a new run's `--output-dir` gets: the names a run writes, how vtrain
recognises its own files, links and special files where a run writes, the lock's holder, an earlier run's
checkpoints and logs (the rules: engine/rundir.py's docstring).

Nothing here imports torch: `vtrain train` runs `check_new_run` before its heavy imports, so a re-used or unusable
`--output-dir` is one line within a second; `rundir.claim` applies the same checks again under the lock.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path

import psutil
import yaml

from vtrain.io import guarded
from vtrain.config import RunConfig
from vtrain.engine.checkpoint import best as best_record
from vtrain.engine.checkpoint import format as ckpt
from vtrain.errors import VtrainError
from vtrain.io.records import Record, RecordError, read_json

LOCK = ".vtrain.lock"
MARKER = ".vtrain-run.json"  # {"format": MARKER_FORMAT, "version", "created"}: this directory is a vtrain run's
MARKER_FORMAT = "vtrain-run"
HEARTBEAT_S = 15.0
STALE_AFTER_S = 120.0
LOG_FILES = ("metrics.jsonl", "eval.jsonl", "run_info.json")
# the console's logs (vtrain/console.py): `train` appends to train.log (rank 0), `vtrain eval --save-predictions FILE`
# to the eval.log beside FILE; each start begins with a header line. A new run may find them (an earlier start that
# stopped before its first step wrote one): they are appended to, never a reason to refuse the directory;
# --overwrite-output-dir deletes them with the other logs.
TRAIN_LOG, EVAL_LOG = "train.log", "eval.log"
CONSOLE_LOGS = (TRAIN_LOG, EVAL_LOG)
# the files a run replaces, rewrites or (--overwrite-output-dir) deletes: each must be vtrain's (`foreign_files`)
OWNED_FILES = (ckpt.CONFIG, *LOG_FILES, *CONSOLE_LOGS, f"{ckpt.CHECKPOINTS}/{ckpt.BEST}")
# every name a run writes directly in its directory: none may be a link or a mount point (it would write or delete
# elsewhere); the files must be regular files, the folders real folders
RUN_FILES = (ckpt.CONFIG, *LOG_FILES, *CONSOLE_LOGS, LOCK, MARKER)
RUN_FOLDERS = (ckpt.CHECKPOINTS, ckpt.TENSORBOARD, ckpt.UNIVERSAL)
RUN_NAMES = (*RUN_FILES, *RUN_FOLDERS)
# the most vtrain reads of a file to recognise it as its own: a whole JSON or YAML file (its own are a few KiB; a
# run_info.json of 1000 ranks about 1 MiB), the first line of a log (which grows with the run)
SNIFF_BYTES = 16 * 2**20
FIRST_LINE_BYTES = 2**20


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


def lock_holder(path: Path) -> tuple[str, bool]:
    """Who holds the lock at `path` (in words) and whether it is stale: its process is gone (same host), or it has not
    been touched for STALE_AFTER_S (another host)."""
    try:
        age = time.time() - path.lstat().st_mtime
    except FileNotFoundError:
        return "gone", True
    held = read_lock(path)
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


def check_place(out: Path) -> None:
    """`out` is no checkpoint's folder (nor inside one) and no file."""
    holder = ckpt.inside_checkpoint(out)
    if holder is not None:
        raise VtrainError(f"--output-dir {out} is inside the checkpoint {holder}; a run would rewrite its files (and "
                          "it would no longer verify): choose a folder outside every run's checkpoints/")
    if out.exists() and not out.is_dir():
        raise VtrainError(f"--output-dir: {out} is a file, not a directory")


def check_owned(out: Path) -> None:
    """Every file at a name the run replaces or deletes is vtrain's (`foreign_files`)."""
    foreign = foreign_files(out)
    if foreign:
        raise VtrainError(f"--output-dir {out} holds {', '.join(foreign)}, which vtrain did not write (no vtrain "
                          f"run marker {MARKER}, and not what vtrain writes there); a run replaces and deletes "
                          "only its own files, also with --overwrite-output-dir: move them away, or choose "
                          "another --output-dir")


def earlier_run(out: Path, existing: list[Path]) -> str | None:
    """The refusal of a new run (no --resume, no --overwrite-output-dir) in a directory holding an earlier run's
    `existing` checkpoints or logs; None when it holds neither (console logs alone do not count)."""
    logs = [n for n in LOG_FILES if (out / n).exists()]
    if not (existing or logs):
        return None
    what = (f"checkpoints of an earlier run ({', '.join(p.name for p in existing[-3:])})" if existing
            else f"logs of an earlier run ({', '.join(logs)})")
    return (f"--output-dir {out} already holds {what}; continue it with --resume auto, or start over with "
            "--overwrite-output-dir (deletes that run's checkpoints and logs)")


def in_use(out: Path) -> str | None:
    """The refusal when a live vtrain run holds `out`'s lock."""
    if not os.path.lexists(out / LOCK):
        return None
    holder, stale = lock_holder(out / LOCK)
    return None if stale else (f"--output-dir {out} is in use by another vtrain run ({holder}); wait for it to "
                               "finish or choose another --output-dir")


def check_new_run(output_dir: str | Path, resume: str | None, overwrite: bool) -> None:
    """What `rundir.claim` will refuse, checked before anything is imported or built (no lock is taken, nothing is
    written): one error line within a second instead of after start-up."""
    out = Path(output_dir)
    check_place(out)
    if not out.is_dir():
        return
    check_links(out)
    problem = in_use(out)
    if problem is not None:
        raise VtrainError(problem)
    check_owned(out)
    problem = earlier_run(out, ckpt.complete_checkpoints(out)) if resume is None and not overwrite else None
    if problem is not None:
        raise VtrainError(problem)


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
    if is_marker(marker):
        return []
    bad = [MARKER] if os.path.lexists(marker) else []
    return bad + [n for n in OWNED_FILES if os.path.lexists(out / n) and not _RECOGNISE[n](out / n)]


def is_marker(path: Path) -> bool:
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


def _is_console_log(command: str) -> Callable[[Path], bool]:
    """Whether a file is a console log of `command` (its first line is vtrain's header, console.header)."""
    def recognise(path: Path) -> bool:
        head = _sniff(path, FIRST_LINE_BYTES, whole=False)
        return head is not None and head.startswith(f"vtrain {command} log: ".encode())
    return recognise


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
    TRAIN_LOG: _is_console_log("train"),
    EVAL_LOG: _is_console_log("eval"),
}


def eval_log(predictions: str | Path) -> tuple[Path | None, str]:
    """Where `vtrain eval --save-predictions FILE` keeps its console: eval.log beside FILE (its output place; an
    evaluation writes nothing else, and never into the run it reads). None and why not (for a note) when that
    folder lies in a checkpoint or eval.log there is a link, a special file or not vtrain's, or cannot be written."""
    folder = Path(predictions).parent
    log = folder / EVAL_LOG
    if ckpt.inside_checkpoint(log) is not None:
        return None, f"{folder} is inside a checkpoint"
    if os.path.lexists(log) and (log.is_symlink() or guarded.not_regular(log) or not _RECOGNISE[EVAL_LOG](log)):
        return None, f"{log} is not vtrain's eval log"
    if not os.access(log if log.exists() else folder, os.W_OK):
        return None, f"{log if log.exists() else folder} is not writable"
    return log, ""