"""The client of the fork server (cli_server.py in this folder): `vtrain ARGS` as a fresh forked child of one
process that imported torch and vtrain once, so a suite of short commands does not pay ~10 s of imports each.

`cli.run(args)` gives (rc, stdout, stderr, peak MB) under the data-segment limit DATA_LIMIT_MB; `cli(*args)` a
CompletedProcess, like tests.helpers.cli.vtrain; `cli.start(*args)` a running command to signal and `cli.wait`."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

from tests.helpers.cli import env
from tests.helpers.paths import HELPERS, ROOT

PEAK_LIMIT_MB = 2560  # 2.5 GiB, the forked command's own pages (~0.8 GiB of imports) included
DATA_LIMIT_MB = 3072


class Cli:
    """`vtrain ARGS` as a fresh forked child of one pre-imported server."""

    def __init__(self, logs: Path, script: str = "cli_server.py") -> None:
        """`script`: the server, cli_server.py or one that prepares it first (convert_server.py)."""
        self.logs, self.n = logs, 0
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        self.err = open(logs / "server.err", "w")
        self.server = subprocess.Popen([sys.executable, str(HELPERS / script)], cwd=ROOT,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, stderr=self.err,
                                       env=env(PYTHONPATH=path))

    def _ask(self, request: dict, timeout: float = 600, pid: int | None = None) -> dict:
        self.server.stdin.write(json.dumps(request) + "\n")
        self.server.stdin.flush()
        if not select.select([self.server.stdout], [], [], timeout)[0] and pid is not None:
            os.kill(pid, signal.SIGKILL)  # a hung command fails its case instead of the session
        line = self.server.stdout.readline()
        assert line, f"the CLI server died; see {self.logs / 'server.err'}"
        return json.loads(line)

    def run(self, args: list[str], extra_env: dict[str, str] | None = None) -> tuple[int, str, str, float]:
        """(rc, stdout, stderr, peak MB) of `vtrain ARGS` under the data-segment limit DATA_LIMIT_MB."""
        self.n += 1
        out, err = self.logs / f"{self.n}.out", self.logs / f"{self.n}.err"
        case = {"args": [str(a) for a in args], "env": env(**(extra_env or {})), "cwd": str(ROOT), "stdout": str(out),
                "stderr": str(err), "data_limit_mb": DATA_LIMIT_MB}
        pid = self._ask({"start": case})["pid"]
        reply = self._ask({"wait": pid}, 600, pid)
        return reply["rc"], out.read_text(), err.read_text(), reply["maxrss_kb"] / 1024

    def start(self, *args: str, extra_env: dict[str, str] | None = None) -> dict:
        """A running `vtrain ARGS` (no memory limit): the case with its pid, to signal and then `wait` for."""
        self.n += 1
        case = {"args": [str(a) for a in args], "env": env(**(extra_env or {})), "cwd": str(ROOT),
                "stdout": str(self.logs / f"{self.n}.out"), "stderr": str(self.logs / f"{self.n}.err")}
        return {**case, "pid": self._ask({"start": case})["pid"]}

    def wait(self, job: dict, timeout: float = 600) -> subprocess.CompletedProcess:
        rc = self._ask({"wait": job["pid"]}, timeout, job["pid"])["rc"]
        return subprocess.CompletedProcess(["vtrain", *job["args"]], rc, Path(job["stdout"]).read_text(),
                                           Path(job["stderr"]).read_text())

    def __call__(self, *args: str, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        return self.wait(self.start(*args, extra_env=extra_env))

    def close(self) -> None:
        self.server.stdin.close()
        self.server.wait(timeout=60)
        self.err.close()
