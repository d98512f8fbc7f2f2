"""What the suites on the files around a run share: their prior face run and its training flags, whether we run as
root (and may use private mounts), the fork-server client with the server's file options, and what a command
left."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from tests.helpers.cli import env
from tests.helpers.fork_server import Cli
from tests.helpers.paths import ROOT
from vtrain.engine.checkpoint import format as ckpt

TRAIN = ["--batch-size", "4", "--num-workers", "0", "--embedding-dim", "16", "--mixed-precision", "no",
         "--neck-norm", "ln"]
ROOT_USER = os.geteuid() == 0


class FilesCli(Cli):
    def run_with(self, args: list[str], options: dict) -> tuple[int, str, str]:
        """`vtrain ARGS` with the server's `options` (file_size_limit, read_only); returns (rc, stdout, stderr)."""
        self.n += 1
        out, err = self.logs / f"{self.n}.out", self.logs / f"{self.n}.err"
        case = {"args": [str(a) for a in args], "env": env(), "cwd": str(ROOT), "stdout": str(out),
                "stderr": str(err), **options}
        pid = self._ask({"start": case})["pid"]
        rc = self._ask({"wait": pid}, 600, pid)["rc"]
        return rc, out.read_text(errors="replace"), err.read_text(errors="replace")


def face_run(root: Path, cli: FilesCli) -> tuple[Path, Path]:
    """The prior run these suites copy: faces/ (train/: 2 identities x 2 images; val/: 2 held-out identities x 2
    images) and run/, trained 2 steps with checkpoints step_1 and step_2. Returns (faces, run)."""
    from vtrain.data.demo_faces import write_identity_tree

    write_identity_tree(root / "faces" / "train", 0, 2, 2, seed=3)
    write_identity_tree(root / "faces" / "val", 100, 2, 2, seed=4)
    rc, out, err = cli.run_with(["train", "--data", str(root / "faces"), "--output-dir", str(root / "run"), *TRAIN,
                                 "--max-steps", "2", "--save-every", "1", "--keep-last", "3"], {})
    assert rc == 0, out[-3000:] + err[-3000:]
    return root / "faces", root / "run"


def private_mounts_work() -> bool:
    return ROOT_USER and shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "-m", "true"], capture_output=True).returncode == 0


def verifying(run: Path) -> dict[str, str]:
    """Name -> the manifest's hash of its train state, for every real checkpoint of `run` that verifies."""
    return {p.name: ckpt.read_manifest(p).files["train_state.json"]["sha256"]
            for p in ckpt.complete_checkpoints(run) if ckpt.verify(p) is None}


def leftovers(*roots: Path) -> list[str]:
    """Staging folders and temp files vtrain writes on the way, left anywhere under `roots`."""
    found = []
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            found += [os.path.join(dirpath, n) for n in dirnames + filenames
                      if (n.startswith(ckpt.STAGING) or (n.startswith(".") and n.endswith(".tmp")))
                      and not os.path.islink(os.path.join(dirpath, n))]  # a link a case planted stays, by design
    return found
