"""Shared fixtures: a private data cache, small synthetic identity trees, helpers that run the real CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session", autouse=True)
def _cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    os.environ["VTRAIN_CACHE"] = str(tmp_path_factory.mktemp("vtrain_cache"))
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def faces(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """train/: 16 identities x 6 images, val/: 6 held-out identities x 4 images (real JPEG files)."""
    from vtrain.data.demo_faces import write_identity_tree

    root = tmp_path_factory.mktemp("faces")
    write_identity_tree(root / "train", 0, 16, 6, seed=3)
    write_identity_tree(root / "val", 100, 6, 4, seed=3)
    return root


def env(**extra: str) -> dict[str, str]:
    e = dict(os.environ)
    e.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    e.update(extra)
    return e


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
    cmd += ["--num_processes", str(nproc), "--num_machines", "1", "--main_process_port", str(_port()),
            *(["-m", "vtrain"] if module else []), *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env(**(extra_env or {})),
                          timeout=timeout)


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-6000:]}\nSTDERR:\n{proc.stderr[-8000:]}"
    return proc


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def run_info(run: Path) -> dict:
    return json.loads((run / "run_info.json").read_text())


def final_weights(run: Path) -> dict:
    from safetensors.torch import load_file

    from vtrain.engine.checkpoint import complete_checkpoints

    return load_file(str(complete_checkpoints(run)[-1] / "model.safetensors"))


def reseal(checkpoint: Path) -> None:
    """Recompute a checkpoint's manifest after a test changed its files on purpose (as a user editing it, or
    someone handing over a doctored checkpoint, would), so that what is tested is not the checksum."""
    from vtrain.engine import checkpoint as ckpt

    manifest = json.loads((checkpoint / ckpt.COMPLETE).read_text())
    manifest["files"] = ckpt.digest_share(checkpoint, ckpt.payload_files(checkpoint))
    (checkpoint / ckpt.COMPLETE).write_text(json.dumps(manifest))


def faces_dataset(tree: Path):
    """An identity tree (`faces`) as a Hugging Face `Dataset` with `image` (the same JPEG bytes) + `label` columns."""
    from datasets import ClassLabel, Dataset, Features, Image

    from vtrain.data.faces import FaceFolder

    folder = FaceFolder(tree, 112, train=False)
    return Dataset.from_dict({"image": [{"bytes": Path(p).read_bytes(), "path": None} for p, _ in folder.samples],
                              "label": [t for _, t in folder.samples]},
                             features=Features({"image": Image(), "label": ClassLabel(names=folder.classes)}))
