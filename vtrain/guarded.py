"""What vtrain may delete or replace, and one line for every environment error while it writes (issue 18 §1, §4).

Confinement. Inside a run directory, vtrain deletes and replaces only real files and folders: every part of the
path below the run directory is checked to be no symbolic link before anything is deleted, so a checkpoint folder,
a `checkpoints/` folder or a file inside a checkpoint that points elsewhere (another run, an archive) is left alone
and named, never followed. The check is made right before each delete; it does not defend against a process that
swaps a folder for a link in between (vtrain's lock keeps other vtrain runs out, not other users).

Outputs a user names (`consolidate OUT`, `predict --out`, `export OUT`, `eval --save-predictions`): an existing
target is refused without `--overwrite`, a target inside a checkpoint is refused always (the caller says what a
checkpoint is: this module is below the format), and the file is written beside its target under a fresh name and
renamed over it. A link at the target is therefore replaced, never written through.

Environment errors. A write can fail because the disk is full, a quota or file size limit is reached, the file
system is read-only, or a permission is missing; the libraries report that in their own ways: `OSError` (Python),
`RuntimeError` without an errno from torch.save's zip writer ("unexpected pos", "file write failed"),
`SafetensorError` with "(os error N)", a torch distributed checkpoint's `CheckpointException` holding each rank's
error. `environment_reason` reads all of them; `Writes` and `disk_op` turn one into a single line naming the path
and the operation.
"""

from __future__ import annotations

import errno
import os
import re
import resource
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from vtrain.errors import VtrainError

T = TypeVar("T")

# errors that say something about the disk or its permissions, never about vtrain's own logic
ENVIRONMENT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM,
                                errno.EEXIST, errno.ENOTDIR, errno.EISDIR, errno.EIO, errno.ENAMETOOLONG,
                                errno.ELOOP, errno.EMLINK, errno.ENOTEMPTY, errno.ENOENT, errno.EXDEV})
# torch.save's zip writer (caffe2's inline_container) raises a bare RuntimeError when a write comes up short
_TORCH_WRITER = re.compile(r"PytorchStreamWriter|inline_container|file write failed|unexpected pos")
_OS_ERROR_IN_TEXT = re.compile(r"os error (\d+)|\[Errno (\d+)\]")


class Refused(VtrainError):
    """A path vtrain will not delete or write through: a symbolic link, or a checkpoint's own file."""


# ---- confinement --------------------------------------------------------------------------------------------------

def link_in(root: str | Path, path: str | Path) -> Path | None:
    """The first part of `path` below `root` (`path` itself included, `root` not: the user named it) that is a
    symbolic link; None when every part is real. A `path` that is not below `root` is refused."""
    root, path = Path(root), Path(path)
    try:
        rel = path.relative_to(root)
    except ValueError:
        raise Refused(f"{path} is outside {root}; not touching it") from None
    if ".." in rel.parts:
        raise Refused(f"{path} leaves {root}; not touching it")
    p = root
    for part in rel.parts:
        p = p / part
        if p.is_symlink():
            return p
    return None


def describe_link(link: Path) -> str:
    try:
        return f"{link} is a symbolic link (to {os.readlink(link)})"
    except OSError:
        return f"{link} is a symbolic link"


def unlink(root: str | Path, path: str | Path) -> str | None:
    """Delete the file `path` below `root` if it and every folder above it (up to `root`) is real. Returns a note
    naming what was left alone (a link), or None. A missing file is no error."""
    link = link_in(root, path)
    if link is not None:
        return f"{describe_link(link)}: left alone"
    with disk_op("delete", path):
        Path(path).unlink(missing_ok=True)
    return None


def rmtree(root: str | Path, path: str | Path) -> None:
    """Delete the folder `path` below `root` and what it holds (links inside are removed, never followed); refused
    when `path` or a folder above it is a link. A missing folder is no error."""
    link = link_in(root, path)
    if link is not None:
        raise Refused(f"{describe_link(link)}; vtrain deletes only real folders inside its run directory: remove "
                      "the link yourself")
    if os.path.lexists(path):
        with disk_op("delete", path):
            shutil.rmtree(path)


def remove_empty_dirs(root: str | Path, top: str | Path) -> None:
    """Remove the real, empty folders under `top` (and `top`), deepest first; links are never followed."""
    if link_in(root, top) is not None or not Path(top).is_dir():
        return
    for dirpath, _, _ in os.walk(top, topdown=False):  # os.walk does not descend into links
        try:
            os.rmdir(dirpath)
        except OSError:  # not empty: something stays there
            pass


# ---- outputs a user names -----------------------------------------------------------------------------------------

def utf8_problem(path: str | Path) -> str | None:
    """A path safetensors cannot open (it takes only UTF-8 paths): the weights of everything written there could
    not be read back."""
    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError:
        return (f"{str(path)!a} is not valid UTF-8: safetensors opens only UTF-8 paths, so the weights "
                "written there could not be read back")
    return None


def claim_output(targets: list[Path], overwrite: bool, flag: str,
                 inside_checkpoint: Callable[[Path], Path | None]) -> None:
    """The one rule for files a command writes where the user said (`targets`: every file it will write). Never
    into a checkpoint, even with --overwrite (links resolved: a link to a checkpoint's file is that file); an
    existing target only with --overwrite; a path safetensors could not read back, never."""
    for t in targets:
        problem = utf8_problem(t)
        if problem is not None:
            raise VtrainError(f"{flag}: {problem}")
        holder = inside_checkpoint(t)
        if holder is not None:
            raise VtrainError(f"{flag}: {t} is inside the checkpoint {holder}; vtrain never writes into a "
                              "checkpoint (it would no longer verify): choose another path")
        if t.is_dir() and not t.is_symlink():
            raise VtrainError(f"{flag}: {t} is a folder; give a file name")
    existing = [t for t in targets if os.path.lexists(t)]
    if existing and not overwrite:
        raise VtrainError(f"{flag}: {existing[0]} exists; --overwrite replaces it")


def replace_file(path: str | Path, write: Callable[[Path], T], what: str = "write") -> T:
    """Write `path` through `write(tmp)` on a fresh hidden name beside it (created exclusively, so nothing left
    there is written through), then rename it over `path` (a link at `path` is replaced, its target untouched).
    On any error the temp file is removed and `path` is as it was; an environment error is one line."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with disk_op(what, path):
            path.parent.mkdir(parents=True, exist_ok=True)
            os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            result = write(tmp)
            os.replace(tmp, path)
        return result
    finally:
        if os.path.lexists(tmp):
            tmp.unlink()


# ---- environment errors -------------------------------------------------------------------------------------------

def environment_reason(e: BaseException, path: str | Path | None = None) -> str | None:
    """Why a write failed, when the environment made it fail (see the module docstring); None for anything else
    (a bug must stay a traceback). `path`: where it was writing, looked at when the library gave no errno."""
    seen: set[int] = set()
    todo: list[BaseException] = [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno in ENVIRONMENT_ERRNOS:
            return x.strerror or os.strerror(x.errno)
        m = _OS_ERROR_IN_TEXT.search(str(x))
        if m and type(x).__name__ == "SafetensorError":
            code = int(m.group(1) or m.group(2))
            if code in ENVIRONMENT_ERRNOS:
                return os.strerror(code)
        if isinstance(x, RuntimeError) and _TORCH_WRITER.search(str(x)):
            return _short_write_reason(path)
        failures = getattr(x, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict):
            todo += [f for f in failures.values() if isinstance(f, BaseException)]
        todo += [x.__cause__, x.__context__]
    return None


def _short_write_reason(path: str | Path | None) -> str:
    """torch.save says only that a write came up short: look at the disk and the file size limit for why."""
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY:
        return f"{os.strerror(errno.EFBIG)} (the file size limit, ulimit -f, is {limit} bytes)"
    p = Path(path) if path is not None else None
    while p is not None and not p.exists() and p != p.parent:
        p = p.parent
    if p is not None:
        try:
            st = os.statvfs(p)
            if st.f_bavail * st.f_frsize < 2**20:
                return os.strerror(errno.ENOSPC)
        except OSError:
            pass
    return "the write came up short (torch.save gives no reason: is the disk full?)"


def environment_error(e: BaseException, what: str, path: str | Path) -> VtrainError | None:
    """`e` as one line naming the operation and the path, when the environment caused it; else None."""
    reason = environment_reason(e, path)
    return None if reason is None else VtrainError(f"cannot {what} {path}: {reason}")


@contextmanager
def disk_op(what: str, path: str | Path) -> Iterator[None]:
    """Around a write (or delete) of `path`: an environment error becomes one line, `cannot <what> <path>:
    <reason>`; anything else propagates unchanged."""
    try:
        yield
    except VtrainError:
        raise
    except Exception as e:
        error = environment_error(e, what, path)
        if error is None:
            raise
        raise error from None


class Writes:
    """A sequence of writes that must not stop half-way through the collectives between them: each call runs
    `fn` unless an earlier one failed, and keeps the first environment failure as one line (`problem`) instead of
    raising it, so a rank whose disk is full still joins every collective and all ranks can agree on the outcome
    afterwards. A VtrainError (already one line) is kept the same way; anything else propagates."""

    def __init__(self) -> None:
        self.problem: str | None = None

    def __call__(self, what: str, path: str | Path, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self.problem is not None:
            return None
        try:
            return fn(*args, **kwargs)
        except VtrainError as e:  # already one line (e.g. a link refused): agreed like the rest
            self.problem = str(e)
            return None
        except Exception as e:
            error = environment_error(e, what, path)
            if error is None:
                raise
            self.problem = str(error)
            return None
