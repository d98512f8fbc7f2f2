"""Run many `python -m vtrain ARGS` commands without paying the import of torch, timm, Accelerate and DeepSpeed
(~10 s of CPU each) every time: this process imports what the CLI imports, then forks one child per command. A
child starts from that freshly imported state (nothing of vtrain has run yet, no thread exists), runs the CLI's own
`main()` with the command's argv, environment and working directory, its stdout/stderr going to files, and exits as
the interpreter would (atexit handlers, then the exit code). Used by tests that run dozens of short commands.

Protocol, one JSON object per line each way: {"start": {"args", "env", "cwd", "stdout", "stderr"}} -> {"pid"} (the
child runs on; a test may signal it), {"wait": pid} -> {"rc", "maxrss_kb"} (the exit status as subprocess reports
it: -N for a signal; the child's peak resident memory, which includes this server's pages it started with). An
optional "data_limit_mb" in "start" caps the child's data segment (RLIMIT_DATA) at that much above what it
inherited, so a command that would allocate gigabytes fails fast instead of exhausting a shared machine. An optional
"file_size_limit" (bytes) is a full disk as a write sees it (RLIMIT_FSIZE with SIGXFSZ ignored: the write that
crosses it fails with EFBIG), and "read_only" lists folders that the child alone sees read-only (a private mount
namespace with read-only bind mounts: root only), so the command meets EROFS as on a read-only file system. "bind"
lists [source, target] pairs the child alone sees bind-mounted (same private namespace): a folder of a run that is
really another folder, as a bind mount of an archive would make it; the mounts end with the child.
"""

import atexit
import ctypes
import json
import os
import resource
import signal
import subprocess
import sys
import traceback

import vtrain.cli  # noqa: E402  (the modules every command imports lazily, imported once here)
import vtrain.tools.consolidate  # noqa: F401
import vtrain.engine.trainer  # noqa: F401
import vtrain.tools.evaluate  # noqa: F401


def _limit_data(extra_mb: int) -> None:
    with open("/proc/self/status") as f:
        data_kb = next(int(line.split()[1]) for line in f if line.startswith("VmData:"))
    limit = (data_kb + extra_mb * 1024) * 1024
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


def _private_mounts(read_only: list[str], binds: list[list[str]]) -> None:
    if ctypes.CDLL(None, use_errno=True).unshare(0x00020000):  # CLONE_NEWNS: mounts seen by this process alone
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS) failed")
    subprocess.run(["mount", "--make-rprivate", "/"], check=True)  # nothing propagates back to the machine
    for source, target in binds:
        subprocess.run(["mount", "--bind", source, target], check=True)
    for p in read_only:
        subprocess.run(["mount", "--bind", p, p], check=True)
        subprocess.run(["mount", "-o", "remount,bind,ro", p], check=True)


def _child(case: dict) -> int:
    if case.get("data_limit_mb"):
        _limit_data(case["data_limit_mb"])
    if case.get("read_only") or case.get("bind"):
        _private_mounts(case.get("read_only") or [], case.get("bind") or [])
    if case.get("file_size_limit"):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (case["file_size_limit"],) * 2)
    os.chdir(case["cwd"])
    os.environ.clear()
    os.environ.update(case["env"])
    for fd, name in ((1, "stdout"), (2, "stderr")):
        f = os.open(case[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.argv = [vtrain.cli.__file__, *case["args"]]
    try:
        vtrain.cli.main()
        return 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # what the interpreter does with an uncaught exception
        traceback.print_exc()
        return 1


def _start(case: dict) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        code = _child(case)
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve() -> None:
    for line in sys.stdin:
        req = json.loads(line)
        if "start" in req:
            reply = {"pid": _start(req["start"])}
        else:
            _, status, usage = os.wait4(req["wait"], 0)
            reply = {"rc": os.waitstatus_to_exitcode(status), "maxrss_kb": usage.ru_maxrss}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    serve()
