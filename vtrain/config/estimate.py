"""`vtrain estimate-memory`'s options, one field each. The run it sizes is a `vtrain train` run, resolved as train
resolves one (task defaults < this command's defaults or the --config file < the flags: run.py `resolve`), so an
option the two share is train's field itself (`shared`: its flag, type, choices, help and check); the others (the
launch the estimate assumes, what the report shows) are checked once, in `__post_init__`. cli.py makes the command's
options from these fields as it makes train's from the sections."""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from vtrain.config.fields import choices, fail
from vtrain.config.parallel import Offload, ZeroStage
from vtrain.config.run import RunConfig, resolve
from vtrain.config.values import read_yaml


def shared(key: str, help: str | None = None) -> Any:
    """A field that is `vtrain train`'s option `key` (`section.name`, or `task`): the command line takes its flag,
    type, choices and help from that field (or `help`, where this command's default differs), and `resolve`
    checks its value as it checks train's."""
    return field(default=None, metadata={"same": key, **({"help": help} if help else {})})


# the run estimated without a --config file: the published recipes' (docs/dino.md §1.1, docs/face.md §1.2)
DEFAULTS: dict[str, dict[str, dict[str, Any]]] = {
    "dino": {"model": {"preset": "swin-l"}},
    "metric": {"model": {"preset": "vit-b"}, "train": {"batch_size": 128}},
}


@dataclass
class EstimateOptions:
    """The options of `vtrain estimate-memory`, in --help order."""

    model: Any = shared("model.preset", help="Preset (see `vtrain presets`; default: swin-l for dino, vit-b for "
                                             "metric)")
    task: Any = shared("task", help="dino (default) or metric")
    batch_size: Any = shared("train.batch_size")
    grad_accum: Any = shared("train.grad_accum")
    image_size: str | None = None
    """HxW or S, e.g. 800x1333 (DINO) or 112 (metric)"""
    mixed_precision: Any = shared("parallel.mixed_precision")
    grad_ckpt: Any = shared("model.grad_ckpt")
    zero: ZeroStage | None = None
    """DeepSpeed ZeRO stage 0-3 (0: DDP)"""
    fsdp: Any = shared("parallel.fsdp")
    offload: Offload | None = None
    """none, optimizer or all"""
    gpus: int = 1
    """Data-parallel GPUs"""
    num_classes: int | None = None
    """Classes (DINO: 80) or identities (metric)"""
    gpu_memory: float = 24.0
    """GiB per GPU for the largest-batch answer"""
    config: Path | None = None
    """A `vtrain train` YAML: estimate that exact run"""
    ds_config: Any = shared("parallel.ds_config")
    compare_gc: bool = field(default=True, metadata={"flag": "--compare-gc/--no-compare-gc"})
    """Also trace the other checkpointing choices (slower)"""
    memory_budget: Any = shared("model.memory_budget")
    head_parallel: Any = shared("model.head_parallel")
    sample_rate: Any = shared("model.sample_rate")
    neck_norm: Any = shared("model.neck_norm")
    breakdown: bool = field(default=False, metadata={"flag": "--breakdown"})
    """Show the modules holding the most activation bytes at the peak, and the bytes per recompute unit"""
    breakdown_rows: int | None = None
    """Modules --breakdown shows (the rest as one row; default 15)"""
    as_json: bool = field(default=False, metadata={"flag": "--json"})
    """Print the estimate as one JSON object"""

    def __post_init__(self) -> None:
        if not (0 < self.gpu_memory < math.inf):
            fail(EstimateOptions, "gpu_memory", f"must be a positive number of GiB, got {self.gpu_memory}")
        for name in ("gpus", "num_classes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                fail(EstimateOptions, name, f"must be >= 1, got {value}")
        rows = self.breakdown_rows
        if rows is not None and (rows < 1 or not self.breakdown):
            fail(EstimateOptions, "breakdown_rows", f"the rows of the --breakdown table, >= 1 and with --breakdown; "
                 f"got {rows}{'' if self.breakdown else ' without --breakdown'}")
        hints = typing.get_type_hints(EstimateOptions)
        for name in ("zero", "offload"):  # the command line refuses them as a choice; a caller in-process, here
            allowed, value = choices(hints[name]), getattr(self, name)
            if value is not None and value not in allowed:  # type: ignore[operator]
                fail(EstimateOptions, name, f"choose one of {', '.join(map(str, allowed))}")  # type: ignore[arg-type]

    def run_config(self) -> RunConfig:
        """The training run estimated, resolved and checked as `vtrain train` resolves its own (no file it names is
        opened but --config): `--memory-budget` alone plans the checkpointing (`--grad-ckpt auto`)."""
        file_values = read_yaml(self.config) if self.config is not None else {}
        task = self.task if self.task is not None or self.config is not None else "dino"
        if self.config is None:
            file_values = {k: dict(v) for k, v in DEFAULTS[task].items()}
        overrides: dict[str, dict[str, Any]] = {}
        for f in fields(self):
            key, value = f.metadata.get("same"), getattr(self, f.name)
            if key and key != "task" and value is not None:
                section, name = key.split(".")
                overrides.setdefault(section, {})[name] = value
        if self.memory_budget is not None and self.grad_ckpt is None:
            overrides["model"]["grad_ckpt"] = ["auto"]
        return resolve(task, file_values, overrides)
