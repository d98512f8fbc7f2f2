"""The files and folders a run's config names, checked before a command opens them: one error line each, naming
the flag and its key (`--pretrained (model.pretrained): file not found: ...`).

The sections themselves hold values only (no file is opened while a config is built or reloaded), so a run's
config.yaml reloads as it was written even where its paths are gone. `vtrain train` (and `estimate-memory
--config`) check every path of a new run here (run.check_paths), before anything is built; `vtrain eval` checks the data it is
given (`check_data`)."""

from __future__ import annotations

import glob
import os
from pathlib import Path

from vtrain.config.data import DEMO_DATA, DEMO_TRAIN_IMAGES, DataConfig
from vtrain.config.fields import fail
from vtrain.config.model import ModelConfig
from vtrain.config.parallel import ParallelConfig
from vtrain.config.train import TrainConfig
from vtrain.config.ds_json import DS_CONFIG_UNREADABLE, check_structure, read_json
from vtrain.errors import ConfigError
from vtrain.io.files import cache_root, directory_problem


def check_model(m: ModelConfig) -> None:
    if m.pretrained is not None and not Path(m.pretrained).exists():  # a weights file or a checkpoint directory
        fail(ModelConfig, "pretrained", f"weights file or checkpoint directory not found: {m.pretrained}")


def check_data(d: DataConfig) -> None:
    """The data root (or `demo`, whose files go to the cache: a bad VTRAIN_CACHE is reported now, not after
    start-up), and each explicit file or folder."""
    if d.path.startswith("hf:"):  # a Hugging Face datasets folder or parquet file(s) (data/hf.py)
        if not (Path(d.path[3:]).exists() or glob.glob(d.path[3:])):
            fail(DataConfig, "path", f"no such Hugging Face datasets folder or parquet file: {d.path[3:]}")
    elif d.path != DEMO_DATA:
        p = Path(d.path)
        if not (p.is_dir() or (p.is_file() and p.suffix == ".bin")):
            fail(DataConfig, "path", f"not a directory (or a verification .bin pack): {d.path}")
    else:
        cache_root()
    if d.val_path is not None and not Path(d.val_path).is_dir():
        fail(DataConfig, "val_path", f"not a directory: {d.val_path}")
    if d.pairs_file is not None and not Path(d.pairs_file).is_file():
        fail(DataConfig, "pairs_file", f"file not found: {d.pairs_file}")
    for key in ("train_ann", "val_ann"):
        value = getattr(d, key)
        if value is not None and not Path(value).is_file():
            fail(DataConfig, key, f"file not found: {value}")
    for key in ("train_images", "val_images"):
        value = getattr(d, key)
        if value is not None and not Path(value).is_dir():
            fail(DataConfig, key, f"not a directory: {value}")


def check_parallel(p: ParallelConfig) -> None:
    """The DeepSpeed JSON's own structure too (a pure function of the file, no DeepSpeed import), so a typo there
    is one line before start-up; the values vtrain owns are filled in at launch (engine/engines/plan.py)."""
    if p.ds_config is None:
        return
    if not Path(p.ds_config).is_file():
        fail(ParallelConfig, "ds_config", f"file not found: {p.ds_config}")
    check_structure(read_json(p.ds_config, DS_CONFIG_UNREADABLE), p.ds_config)


def check_train(t: TrainConfig) -> None:
    """The run directory (and tensorboard's folder in it) can be made; what a resume names exists."""
    problem = directory_problem(t.output_dir)
    if problem is not None:
        fail(TrainConfig, "output_dir", problem)
    if t.report_to == "tensorboard":  # found now, not as a traceback from the writer after start-up
        problem = directory_problem(Path(t.output_dir) / "tensorboard")
        if problem is not None:
            fail(TrainConfig, "report_to", f"tensorboard writes into <output-dir>/tensorboard, but {problem}")
    if t.resume is not None and t.resume != "auto" and not Path(t.resume).is_dir():
        fail(TrainConfig, "resume", f"not a checkpoint directory: {t.resume}")
    if t.resume_weights_only is not None and not Path(t.resume_weights_only).is_file():
        fail(TrainConfig, "resume_weights_only", f"file not found: {t.resume_weights_only}")


def check_exists(path: str | Path, flag: str) -> None:
    """A file or folder a command reads (`--checkpoint`, consolidate's CKPT): one line at once when it is not there,
    before the command imports torch."""
    if not os.path.lexists(path):
        raise ConfigError(f"{flag}: no such file or directory: {path}")


def too_large_batch(batch_size: int, world: int, samples: int) -> str:
    """The refusal of a global micro-batch larger than the training set (one epoch would hold no batch)."""
    return f"--batch-size {batch_size} x {world} processes exceeds the {samples} training images"


def check_demo_batch(task: str, d: DataConfig, t: TrainConfig) -> None:
    """Where the training set's size is known without reading it (`--data demo`): a micro-batch over all processes
    larger than it is refused before start-up (the trainer refuses it for any data, after reading it)."""
    if d.path != DEMO_DATA:
        return
    world = os.environ.get("WORLD_SIZE", "1")
    world = int(world) if world.isdigit() else 1
    samples = DEMO_TRAIN_IMAGES[task]
    if t.batch_size * world > samples:
        raise ConfigError(too_large_batch(t.batch_size, world, samples))
