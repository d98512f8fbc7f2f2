"""Running the real CLI and reading what a run wrote: `vtrain ARGS` in one process, `accelerate launch` of N, and
the run's metrics, run_info, final weights; `reseal` after a deliberate edit; `tree_hash` of a folder."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.paths import HELPERS, ROOT
from tests.helpers.ports import free_port


def env(**extra: str) -> dict[str, str]:
    e = dict(os.environ)
    e.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    e.update(extra)
    return e


def script_env() -> dict[str, str]:
    """`env()` for a `python -c` script that imports vtrain and the helper modules of tests/helpers by name (a
    DataLoader worker unpickles a helper data set by its module)."""
    return env(PYTHONPATH=os.pathsep.join([str(ROOT), str(HELPERS), os.environ.get("PYTHONPATH", "")]))


def vtrain(*args: str, extra_env: dict[str, str] | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run `python -m vtrain ARGS` in one process."""
    return subprocess.run([sys.executable, "-m", "vtrain", *args], cwd=ROOT, capture_output=True, text=True,
                          env=env(**(extra_env or {})), timeout=timeout)


def launch(nproc: int, *args: str, accelerate_config: str | None = None, extra_env: dict[str, str] | None = None,
           timeout: int = 900, module: bool = True) -> subprocess.CompletedProcess:
    """`accelerate launch --num_processes N -m vtrain ARGS` (multi-process via torchrun; gloo on CPU);
    with module=False, ARGS start with a script path instead."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch"]
    if accelerate_config:
        cmd += ["--config_file", str(ROOT / "accelerate_configs" / accelerate_config)]
    cmd += ["--num_processes", str(nproc), "--num_machines", "1", "--main_process_port", str(free_port()),
            *(["-m", "vtrain"] if module else []), *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env(**(extra_env or {})),
                          timeout=timeout)


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-6000:]}\nSTDERR:\n{proc.stderr[-8000:]}"
    return proc


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def run_info(run: Path) -> dict:
    return json.loads((run / "run_info.json").read_text())


def final_weights(run: Path) -> dict:
    from safetensors.torch import load_file

    from vtrain.engine.checkpoint.format import complete_checkpoints

    return load_file(str(complete_checkpoints(run)[-1] / "model.safetensors"))


def reseal(checkpoint: Path) -> None:
    """Recompute a checkpoint's manifest after a test changed its files on purpose (as a user editing it, or
    someone handing over a doctored checkpoint, would), so that what is tested is not the checksum."""
    from vtrain.engine.checkpoint import format as ckpt
    from vtrain.io.files import digest_share

    manifest = json.loads((checkpoint / ckpt.COMPLETE).read_text())
    manifest["files"] = digest_share(checkpoint, ckpt.payload_files(checkpoint))
    (checkpoint / ckpt.COMPLETE).write_text(json.dumps(manifest))


def faces_dataset(tree: Path):
    """An identity tree (`faces`) as a Hugging Face `Dataset` with `image` (the same JPEG bytes) + `label` columns."""
    from datasets import ClassLabel, Dataset, Features, Image

    from vtrain.data.faces import FaceFolder

    folder = FaceFolder(tree, 112, train=False)
    return Dataset.from_dict({"image": [{"bytes": Path(p).read_bytes(), "path": None} for p, _ in folder.samples],
                              "label": [t for _, t in folder.samples]},
                             features=Features({"image": Image(), "label": ClassLabel(names=folder.classes)}))


def tree_hash(root: Path) -> str:
    """Names, symlink targets and contents of everything under `root` (symlinks are not followed). Iterative, so a
    tree of any depth is hashed (os.walk recurses once per level before Python 3.12)."""
    h = hashlib.sha256()
    if not root.exists():
        return "absent"
    todo = [root]
    while todo:
        d = todo.pop()
        names = sorted(os.listdir(d))
        subdirs = []
        for name in names:
            p = d / name
            h.update(str(p.relative_to(root)).encode("utf-8", "surrogateescape") + b"\0")
            if p.is_symlink():
                h.update(b"L" + os.fsencode(os.readlink(p)))
            elif p.is_file():
                h.update(b"F" + p.read_bytes())
            elif p.is_dir():
                subdirs.append(p)
        todo.extend(reversed(subdirs))
    return h.hexdigest()


def cli_in_process(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """`vtrain ARGS` in this process (the real entry point, with its error handling): (exit code, stdout, stderr)."""
    from vtrain.cli import main

    monkeypatch.setattr(sys, "argv", ["vtrain", *args])
    code = 0
    try:
        main()
    except SystemExit as e:
        code = e.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err
