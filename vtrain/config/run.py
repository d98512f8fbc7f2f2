"""The whole run's config: the sections, the rules that span them, and how values from a file and flags merge.

Precedence (lowest first): dataclass defaults < task defaults < ``--config FILE.yaml`` < CLI flags. The resolved
config is written to ``<output-dir>/config.yaml``; `load_run_config` reads it back as it was written (no file it
names is opened: paths.py checks those for a new run, and each command where it opens them).
"""

from __future__ import annotations

import typing
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

import yaml

from vtrain import recompute
from vtrain.config.data import DataConfig
from vtrain.config.fields import CLI_CHOICE, NO_FLAG, Option, fail, flag, options_of, where
from vtrain.config.model import MIN_DETECTION_SIZE, ModelConfig
from vtrain.config.optim import OptimConfig
from vtrain.config.parallel import ParallelConfig
from vtrain.config import paths
from vtrain.config.train import TrainConfig
from vtrain.config.values import coerce, read_yaml
from vtrain.errors import ConfigError, shown
from vtrain.io.files import write_text_atomic
from vtrain.presets import presets_for

Task = Literal["metric", "dino"]
TASKS: tuple[str, ...] = typing.get_args(Task)


def check_neck_batch(neck_norm: str, batch_size: int) -> None:
    """The face model's micro-batch against its embedding neck, for `train` and `estimate-memory` alike: BatchNorm in
    training needs two samples per channel (each rank normalises its own micro-batch)."""
    if not (neck_norm != "bn" or batch_size >= 2):
        fail(TrainConfig, "batch_size", "must be >= 2 with the BatchNorm embedding neck (--neck-norm bn); use "
             "--neck-norm ln for 1")


def check_resize(image_size: int, max_size: int | None, size_from: str = "--image-size",
                 flag: str | None = None) -> None:
    """DINO's resize (training, evaluation and `vtrain predict`): the longest-side cap `max_size` (None: the recipe's
    image_size x 1333 / 800) must lie above the short side `image_size`, which torchvision's Resize requires (it
    refuses a cap at or below the size it scales the short side to). The one rule for `vtrain train` (flags and
    YAML), a run's config.yaml reloaded by eval and predict, and their own --image-size / --max-size. `size_from`:
    how the message names where the short side comes from; `flag`: how it names the cap (default: the config
    field, `--max-size (data.max_size)`; eval and predict name their own flag)."""
    if max_size is not None and max_size <= image_size:
        msg = f"must be above the short side {image_size} ({size_from}), got {max_size}"
        if flag is not None:
            raise ConfigError(f"{flag}: {msg}")
        fail(DataConfig, "max_size", msg)


@dataclass
class RunConfig:
    task: Task = field(default="metric", metadata=CLI_CHOICE)
    """metric (face recognition: an embedding model with an ArcFace/CosFace head) or dino (detection,
    docs/detection.md)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    given: frozenset[str] = field(default=frozenset(), compare=False, repr=False, metadata=NO_FLAG)
    """Internal, not an option: the `section.key`s the run set itself (its --config file and flags), whatever their
    values; a key not in it holds a default. `--pretrained` takes a checkpoint's model options only for keys the
    run did not set (engine/pretrained.py): a value equal to vtrain's default is set all the same."""

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            fail(RunConfig, "task", f"choose one of {TASKS}")
        names = presets_for(self.task)
        if self.model.preset not in names:
            fail(ModelConfig, "preset", f"unknown {self.task} preset {self.model.preset!r}; choose one of: "
                 f"{', '.join(names)}")
        for m in self.optim.milestones:
            if not (self.train.max_steps is None or m <= self.train.max_steps):
                fail(OptimConfig, "milestones", f"milestone {m} is beyond --max-steps {self.train.max_steps}")
        self.model._check(not (self.model.pretrained and self.train.resume_weights_only), "pretrained",
                          "cannot be combined with --resume-weights-only (which replaces every weight)")
        if self.task == "metric":
            check_neck_batch(self.model.neck_norm, self.train.batch_size)
        try:
            recompute.check_parts(recompute.parse(self.model.grad_ckpt), self.task)
        except recompute.SpecError as e:
            fail(ModelConfig, "grad_ckpt", str(e))
        self.model._check(self.task == "metric" or self.model.head_parallel == "none", "head_parallel",
                          "sharded is for --task metric (the margin-softmax head)")
        defaults = {"model": ModelConfig(), "data": DataConfig()}
        for section, f in self._other_task_fields():  # an option that would be ignored is a mistake: said now
            if getattr(section, f.name) != getattr(defaults[section.SECTION], f.name):
                fail(type(section), f.name, f"applies to --task {f.metadata['task']} only (this run is --task "
                     f"{self.task})")
        if self.task == "dino":
            self.model._check(self.model.image_size >= MIN_DETECTION_SIZE, "image_size",
                              f"must be >= {MIN_DETECTION_SIZE} for detection (the coarsest DINO feature stride "
                              "is 64)")
            check_resize(self.model.image_size, self.data.max_size)

    def _other_task_fields(self) -> list[tuple[Any, Any]]:
        """(section, field) of every option that applies only to the other task (fields.METRIC_ONLY, DINO_ONLY)."""
        return [(section, f) for section in (self.model, self.data) for f in fields(section)
                if f.metadata.get("task") not in (None, self.task)]

    def to_dict(self) -> dict[str, Any]:
        """The config as config.yaml holds it: the options of this task (another task's are left out; they reload
        at their defaults, which is all this task can hold: `__post_init__`)."""
        d = asdict(self)
        del d["given"]
        d["optim"]["betas"] = list(d["optim"]["betas"])
        for section, f in self._other_task_fields():
            del d[section.SECTION][f.name]
        return d

    def save(self, path: str | Path) -> None:
        write_text_atomic(path, yaml.safe_dump(self.to_dict(), sort_keys=False))


_SECTION_CLASSES = {"model": ModelConfig, "data": DataConfig, "optim": OptimConfig,
                    "parallel": ParallelConfig, "train": TrainConfig}


def options() -> list[Option]:
    """Every option of a run, in order: `task`, then each section's fields (those without a flag included)."""
    task = [o for o in options_of(RunConfig, None) if o.name == "task"]
    return task + [o for name, cls in _SECTION_CLASSES.items() for o in options_of(cls, name)]


def flag_of(name: str) -> str:
    """The `vtrain train` flag of a section field: its name with dashes, or its rename (`path` is --data)."""
    return next(flag(f) for cls in _SECTION_CLASSES.values() for f in fields(cls) if f.name == name and flag(f))


# fields set only in a --config file (no flag): their errors name the key alone, never a flag that does not exist
CONFIG_ONLY = frozenset(f.name for cls in _SECTION_CLASSES.values() for f in fields(cls) if flag(f) is None)
# the fields with a `vtrain train` flag of their own (flag_of names it), per section: all but CONFIG_ONLY
FLAG_SECTIONS: dict[str, tuple[str, ...]] = {section: tuple(f.name for f in fields(cls) if flag(f) is not None)
                                              for section, cls in _SECTION_CLASSES.items()}

# Defaults that differ per task, applied below the YAML file and the flags.
TASK_DEFAULTS: dict[str, dict[str, dict[str, Any]]] = {
    # insightface ViT recipe uses AdamW lr 1e-3, wd 0.1 (docs/face.md §1.2); our small-batch default keeps lr 1e-3.
    "metric": {"optim": {"lr": 1e-3, "weight_decay": 0.1}},
    # DINO recipe (docs/dino.md §1.1): AdamW 1e-4, wd 1e-4 on every parameter, backbone x0.1, clip 0.1, step decay
    # x0.1, no warm-up; test resize 800 (long side 1333); micro-batch 2 per GPU.
    "dino": {"model": {"image_size": 800},
             "optim": {"lr": 1e-4, "weight_decay": 1e-4, "weight_decay_skip": "none", "backbone_lr_mult": 0.1,
                       "clip_grad": 0.1, "schedule": "step", "gamma": 0.1, "warmup_steps": 0},
             "train": {"batch_size": 2}},
}


def resolve(task: str | None, file_values: dict[str, Any] | None = None,
            overrides: dict[str, dict[str, Any]] | None = None, file_name: str = "--config") -> RunConfig:
    """Merge task defaults < file values < CLI overrides into a RunConfig whose values are checked; no file it
    names is opened. `file_name` is how errors name the file (`--config`, or `checkpoint config PATH`)."""
    file_values = dict(file_values or {})
    task = file_values.pop("task", None) if task is None else task
    task = task or "metric"
    merged: dict[str, dict[str, Any]] = {name: {} for name in _SECTION_CLASSES}
    given: set[str] = set()
    for source in (TASK_DEFAULTS.get(task, {}), file_values, overrides or {}):
        for section, values in source.items():
            if section == "task":
                continue
            if section not in _SECTION_CLASSES:
                raise ConfigError(f"{file_name}: unknown section {shown(section)}; sections are "
                                  f"{', '.join(_SECTION_CLASSES)}")
            if not isinstance(values, dict):
                raise ConfigError(f"{file_name}: section {shown(section)} must be a mapping")
            known = {f.name for f in fields(_SECTION_CLASSES[section])}
            hints = typing.get_type_hints(_SECTION_CLASSES[section])
            for k, v in values.items():
                if k not in known:
                    raise ConfigError(f"{file_name}: unknown key {section}.{str(k)[:80]}; known: "
                                      f"{', '.join(sorted(known))}")
                if v is not None and source is file_values:  # the file as written, even where a flag overrides it
                    coerce(v, hints[k], f"{file_name}{' ' if file_name.startswith('--') else ': '}{section}.{k}")
                if v is not None:
                    merged[section][k] = v
                    if source is not TASK_DEFAULTS.get(task):
                        given.add(f"{section}.{k}")
    if not isinstance(task, str):
        raise ConfigError(f"{file_name}: task must be a string, got {shown(task)}")
    sections = {}
    for name, cls in _SECTION_CLASSES.items():
        hints = typing.get_type_hints(cls)
        values = {k: coerce(v, hints[k], where(cls, k)) for k, v in merged[name].items()}
        sections[name] = cls(**values)
    return RunConfig(task=task, **sections, given=frozenset(given))


def check_paths(cfg: RunConfig) -> None:
    """Every file and folder a new run names (paths.py), section by section."""
    paths.check_model(cfg.model)
    paths.check_data(cfg.data)
    paths.check_parallel(cfg.parallel)
    paths.check_train(cfg.train)


def build_config(task: str | None, file_values: dict[str, Any] | None = None,
                 overrides: dict[str, dict[str, Any]] | None = None) -> RunConfig:
    """A new run's config (`resolve`), and every file and folder it names checked before anything is built
    (paths.py: one error line each)."""
    cfg = resolve(task, file_values, overrides)
    check_paths(cfg)
    return cfg


def config_from_flags(flags: dict[str, Any]) -> RunConfig:
    """`vtrain train`'s config from its flags as the command line passes them (`--config` FILE, `--task`, one entry
    per field with a flag: None when unset, a choice as its value or an Enum member): task defaults < the file <
    the flags (`resolve`), every path it names checked (`build_config`), nothing built. The recipe files in configs/
    are tested through this, and the fuzz lane calls it with generated values."""
    flags = dict(flags)
    config = flags.pop("config", None)
    file_values = read_yaml(config) if config is not None else {}
    task = flags.pop("task", None)
    overrides = {section: {n: getattr(flags[n], "value", flags[n]) for n in names if flags.get(n) is not None}
                 for section, names in FLAG_SECTIONS.items()}
    return build_config(getattr(task, "value", task), file_values, overrides)


def load_run_config(path: str | Path) -> RunConfig:
    """The config saved with a run (``config.yaml``), as it was written: its values checked, no path it names. An
    empty optional value ('' for --pretrained, which a vtrain before the empty-value rule accepted and ignored) is
    read as unset, what it meant then; a rule its values break is one error naming the file."""
    data = read_yaml(path, "checkpoint config")
    task = data.pop("task", "metric")
    for section, cls in _SECTION_CLASSES.items():
        values = data.get(section)
        if isinstance(values, dict):
            hints = typing.get_type_hints(cls)
            data[section] = {k: None if v == "" and type(None) in typing.get_args(hints.get(k)) else v
                             for k, v in values.items()}
    name = f"checkpoint config {path}"
    try:
        return resolve(task, data, file_name=name)
    except ConfigError as e:
        if str(e).startswith(name):
            raise
        raise ConfigError(f"{name}: {e}") from None
