"""What vtrain may delete or replace, the one checked way it writes a file, and one line for every environment error
while it writes.

Confinement. Inside a run directory, vtrain deletes and replaces only real files and folders of that directory's
own file system: every part of the path below the run directory is checked to be neither a symbolic link nor a
mount point (a bind mount of an archive or of another run, another file system) before anything is deleted, so a
checkpoint folder, a `checkpoints/` folder or a file inside a checkpoint that leads elsewhere is left alone and named,
never followed (`crossing_in`). A folder deleted whole is first searched for mount points inside it. The checks are
made right before each delete; they do not defend against a process that swaps a folder for a link or mounts
something in between (vtrain's lock keeps other vtrain runs out, not other users).

Outputs a user names (`consolidate OUT`, `predict --out`, `export OUT`, `eval --save-predictions`, `convert OUT`): an
existing target is refused without `--overwrite`, a target inside a checkpoint is refused always (the caller says
what a checkpoint is: this module is below the format), and so is one that exists and is not a regular file (a FIFO,
a device, a socket, or a symbolic link to one: replacing `/dev/null` would replace the system's node, and a link to a
FIFO was set up to be written through), and one that is an input of the same command (`Read`, `check_not_input`):
the same file by resolved path or by (device, inode), so also through a link, a bind mount or a hard link, or a file
inside a folder the command reads, or an input inside a folder it replaces whole. The file is written beside its
target under a fresh name and renamed over it: a link at the target (dangling, or to a regular file or folder) is
replaced, never written through.

Writing. Every file vtrain writes itself goes through `replace_file`; bytes vtrain holds go through `write_bytes`,
which checks that the file on disk holds every byte before the rename. Libraries that write a file themselves are
used only where they report a failed or short write (torch.save, safetensors, Python's own file objects); an
encoder that does not (torchvision's `write_jpeg` ignores what `fwrite` returns) is replaced by encoding to bytes.

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
import stat
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
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
    """A path vtrain will not delete, replace or write through: a symbolic link, a mount point, a checkpoint's own
    file, or something that is not a regular file."""


# ---- confinement --------------------------------------------------------------------------------------------------

def mount_points() -> frozenset[str]:
    """Every mount point this process sees (`/proc/self/mountinfo`, Linux), as real paths; empty where that file
    does not exist. A bind mount on the same file system has the device id of its parent, so `os.path.ismount`
    misses it; the kernel's own list names it."""
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return frozenset()
    # field 5 is the mount point, with space, tab, newline and backslash written as octal escapes (proc(5))
    unescape = lambda m: bytes([int(m.group(1), 8)])  # noqa: E731
    return frozenset(os.fsdecode(re.sub(rb"\\([0-7]{3})", unescape, fields[4])) for line in lines
                     if len(fields := line.split(b" ")) > 4)


def is_mount(path: str | Path, mounts: frozenset[str] | None = None) -> bool:
    """Whether `path` (no symbolic link itself) is a mount point: another device than its parent, or listed by the
    kernel (`mounts`, read when not given)."""
    if os.path.ismount(path):
        return True
    return os.path.realpath(path) in (mount_points() if mounts is None else mounts)


def crossing_in(root: str | Path, path: str | Path) -> Path | None:
    """The first part of `path` below `root` (`path` itself included, `root` not: the user named it) that leads out
    of the run's own tree: a symbolic link or a mount point; None when every part is real. A `path` that is not
    below `root` is refused."""
    root, path = Path(root), Path(path)
    try:
        rel = path.relative_to(root)
    except ValueError:
        raise Refused(f"{path} is outside {root}; not touching it") from None
    if ".." in rel.parts:
        raise Refused(f"{path} leaves {root}; not touching it")
    p, mounts = root, None
    for part in rel.parts:
        p = p / part
        if p.is_symlink():
            return p
        if not os.path.lexists(p):  # nothing below a missing part exists either
            return None
        mounts = mount_points() if mounts is None else mounts
        if is_mount(p, mounts):
            return p
    return None


def describe_crossing(path: Path) -> str:
    """`path` (a `crossing_in` result) in words: a link and its target, or a mount point."""
    if not path.is_symlink():
        return f"{path} is a mount point (another file system, or a bind mount of another folder)"
    try:
        return f"{path} is a symbolic link (to {os.readlink(path)})"
    except OSError:
        return f"{path} is a symbolic link"


def mounts_below(top: str | Path) -> list[Path]:
    """The mount points inside the folder `top` (files and folders; links are not followed)."""
    mounts, found = mount_points(), []
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            if not p.is_symlink() and is_mount(p, mounts):
                found.append(p)
        dirnames[:] = [d for d in dirnames if Path(dirpath, d) not in found]  # never descend into one
    return found


def unlink(root: str | Path, path: str | Path) -> str | None:
    """Delete the file `path` below `root` if it and every folder above it (up to `root`) is real and on the run's
    own file system. Returns a note naming what was left alone (a link, a mount point), or None. A missing file is
    no error."""
    crossing = crossing_in(root, path)
    if crossing is not None:
        return f"{describe_crossing(crossing)}: left alone"
    with disk_op("delete", path):
        Path(path).unlink(missing_ok=True)
    return None


def rmtree(root: str | Path, path: str | Path) -> None:
    """Delete the folder `path` below `root` and what it holds (links inside are removed, never followed); refused
    when `path` or a folder above it is a link or a mount point, or a mount point lies inside it (shutil.rmtree would
    delete what is mounted there). A missing folder is no error."""
    crossing = crossing_in(root, path)
    if crossing is None and Path(path).is_dir():
        crossing = next(iter(mounts_below(path)), None)
    if crossing is not None:
        raise Refused(f"{describe_crossing(crossing)}; vtrain deletes only real folders inside its run directory: "
                      "remove the link or unmount it yourself")
    if os.path.lexists(path):
        with disk_op("delete", path):
            shutil.rmtree(path)


def remove_empty_dirs(root: str | Path, top: str | Path) -> None:
    """Remove the real, empty folders under `top` (and `top`), deepest first; links and mount points are never
    entered."""
    if crossing_in(root, top) is not None or not Path(top).is_dir():
        return
    mounts = set(mounts_below(top))
    found = []
    for dirpath, dirnames, _ in os.walk(top):  # os.walk does not descend into links
        dirnames[:] = [d for d in dirnames if Path(dirpath, d) not in mounts]
        found.append(dirpath)
    for dirpath in reversed(found):
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


def not_regular(path: str | Path) -> str | None:
    """What `path` is when it exists and vtrain must not replace it: a FIFO, a device, a socket, or a symbolic link
    to one of these (in words); None for a regular file, a folder, a link to either, a dangling link or nothing."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return None
    link = stat.S_ISLNK(mode)
    if link:
        try:
            mode = os.stat(path).st_mode
        except OSError:  # dangling: replacing the link touches nothing behind it
            return None
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a character device" if stat.S_ISCHR(mode) else
            "a block device" if stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
    return f"a symbolic link to {kind} ({os.readlink(path)})" if link else kind


@dataclass(frozen=True)
class Read:
    """An input of a command, for `check_not_input`: a file, or a folder of which it reads every file
    (`suffixes` None) or the files ending in one of `suffixes` (lower case: an image folder)."""

    flag: str
    path: Path
    folder: bool = False
    suffixes: tuple[str, ...] | None = None


def _identity(path: str | Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino


def _folders_above(path: str | Path) -> Iterator[tuple[int, int]]:
    """(device, inode) of every folder `path` lies in, links resolved, up to /."""
    p = Path(os.path.realpath(path)).parent
    for q in (p, *p.parents):
        ident = _identity(q)
        if ident is not None:
            yield ident


def check_not_input(targets: list[Path], reads: list[Read], flag: str, replaced: list[Path] = ()) -> None:
    """The rule that `--overwrite` never reaches an input of the same command: a target (a file the command writes)
    that exists is refused when it is a file the command reads, by resolved path or by (device, inode) (so through
    a link, a bind mount or a hard link), or a file a read folder holds; a folder the command replaces whole
    (`replaced`) is refused when an input lies in it. One error line naming both; with or without --overwrite."""
    files = {ident: r for r in reads if not r.folder and (ident := _identity(r.path)) is not None}
    files.update({os.path.realpath(r.path): r for r in reads if not r.folder})  # type: ignore[dict-item]
    folders = [(ident, r) for r in reads if r.folder and (ident := _identity(r.path)) is not None]

    def refuse(t: Path, r: Read, how: str) -> None:
        raise Refused(f"{flag}: {t} {how} {r.flag} {r.path}, an input of this command; vtrain never writes over "
                      "what it reads, even with --overwrite: choose another path")

    for t in targets:
        ident = _identity(t) if os.path.lexists(t) else None
        if ident is None:  # nothing there (or a dangling link): no input can be lost
            continue
        r = files.get(ident) or files.get(os.path.realpath(t))
        if r is not None:
            refuse(t, r, "is the same file as")
        above = set(_folders_above(t)) if folders else set()
        for folder, r in folders:
            if folder in above and (r.suffixes is None or os.path.realpath(t).lower().endswith(r.suffixes)):
                refuse(t, r, "lies in the folder")
    for out in replaced:
        ident = _identity(out)
        for r in reads:
            if ident is not None and (_identity(r.path) == ident or ident in set(_folders_above(r.path))):
                refuse(out, r, "is replaced whole, and holds")


def claim_output(targets: list[Path], overwrite: bool, flag: str,
                 inside_checkpoint: Callable[[Path], Path | None], reads: list[Read] = ()) -> None:
    """The one rule for files a command writes where the user said (`targets`: every file it will write). Never
    into a checkpoint, even with --overwrite (links resolved: a link to a checkpoint's file is that file); never over
    a FIFO, a device or a socket (or a link to one), even with --overwrite; never over one of the command's inputs
    (`reads`, `check_not_input`), even with --overwrite; an existing target only with --overwrite; a path
    safetensors could not read back, never."""
    check_not_input(targets, list(reads), flag)
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
        kind = not_regular(t)
        if kind is not None:
            raise VtrainError(f"{flag}: {t} is {kind}, not a regular file; vtrain replaces only regular files, "
                              "even with --overwrite: choose another path")
    existing = [t for t in targets if os.path.lexists(t)]
    if existing and not overwrite:
        raise VtrainError(f"{flag}: {existing[0]} exists; --overwrite replaces it")


def replace_file(path: str | Path, write: Callable[[Path], T], what: str = "write") -> T:
    """Write `path` through `write(tmp)` on a fresh hidden name beside it (created exclusively, so nothing left
    there is written through), then rename it over `path` (a link at `path` is replaced, its target untouched).
    Never over a FIFO, a device or a socket (`not_regular`). On any error the temp file is removed and `path` is as
    it was; an environment error is one line."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    kind = not_regular(path)
    if kind is not None:
        raise Refused(f"cannot {what} {path}: it is {kind}, not a regular file; vtrain replaces only regular files")
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


def write_bytes(path: str | Path, data: bytes | bytearray | memoryview, what: str = "write") -> None:
    """`data` into `path` (`replace_file`), every byte accounted for: the file on disk must hold exactly
    len(data) bytes before it is renamed into place, else the write is an error naming the path and what is
    missing (a writer that ignores a short write, as C's fwrite callers may, could leave a truncated file)."""
    want = memoryview(data).nbytes

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            f.write(data)  # Python's file object raises on a failed or short write (EFBIG, ENOSPC, EIO)
            f.flush()
            size = os.fstat(f.fileno()).st_size
        if size != want:
            raise OSError(errno.EIO, f"the file holds {size} of {want} bytes after writing")

    replace_file(path, write, what)


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
