"""Typed run configuration: one dataclass per section (model, data, optim, parallel, train), pure values checked in
`__post_init__`; errors name the flag to change. Each field is one option of `vtrain train`, declared once: its type
(`Literal[...]` for a choice), default and attribute docstring make the flag, its help and docs/options.md
(fields.py). Paths are checked apart, before they are opened (paths.py)."""

from vtrain.config.data import DEFAULT_MAX_IMAGE_PIXELS, DEMO_DATA, MAX_IMAGE_PIXELS_CEILING, DataConfig
from vtrain.config.fields import Option
from vtrain.config.model import MIN_DETECTION_SIZE, NECK_NORMS, ModelConfig
from vtrain.config.optim import OptimConfig
from vtrain.config.parallel import PRECISIONS, ParallelConfig
from vtrain.config.run import (_SECTION_CLASSES, CONFIG_ONLY, FLAG_SECTIONS, TASK_DEFAULTS, TASKS, RunConfig,
                               build_config, check_neck_batch, check_paths, check_resize, config_from_flags, flag_of,
                               load_run_config, options, resolve)
from vtrain.config.train import TrainConfig
from vtrain.config.values import read_yaml
from vtrain.errors import ConfigError

__all__ = ["CONFIG_ONLY", "DEFAULT_MAX_IMAGE_PIXELS", "DEMO_DATA", "FLAG_SECTIONS", "MAX_IMAGE_PIXELS_CEILING",
           "MIN_DETECTION_SIZE", "NECK_NORMS", "PRECISIONS", "TASKS", "TASK_DEFAULTS", "_SECTION_CLASSES",
           "ConfigError", "DataConfig", "ModelConfig", "OptimConfig", "Option", "ParallelConfig", "RunConfig",
           "TrainConfig", "build_config", "check_neck_batch", "check_paths", "check_resize", "config_from_flags",
           "flag_of", "load_run_config", "options", "read_yaml", "resolve"]
