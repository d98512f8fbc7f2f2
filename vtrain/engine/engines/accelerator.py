"""The Accelerator a run is built on: rendezvous, process group backend and DeepSpeed plugin for a Plan.

vtrain applies precision and FSDP2 itself (engine/engines/), so Accelerate gets `mixed_precision="no"` and never
wraps the model in FSDP; what it does own is the launch environment, DDP and the DeepSpeed engine. What differs by
engine is asked of the plan's engine class (engine/engines/build.py), never tested here.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs

from vtrain.engine.engines.build import engine_class
from vtrain.engine.engines.plan import Plan


def quiet_libraries() -> None:
    """Keep the run log readable: DeepSpeed's INFO chatter and deprecation warnings from inside libraries."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    # DeepSpeed steps the client optimizer through its own wrapper, which LambdaLR cannot see: the order is right.
    warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
    for name in ("DeepSpeed", "deepspeed"):
        logging.getLogger(name).setLevel(logging.WARNING)


def build_accelerator(plan: Plan, grad_accum: int, log_with: str | None = None,
                      project_dir: str | None = None) -> Accelerator:
    """`log_with`: an Accelerate tracker (tensorboard, wandb) writing under `project_dir`. What differs by engine
    (the rendezvous, the process group, the DeepSpeed plugin) comes from the plan's engine class."""
    engine = engine_class(plan)
    engine.check_installed()  # start-up: an untested version of a library whose internals the engine patches
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # say it, instead of DeepSpeed warning that it guessed
    engine.launch_environment(plan)
    # We own FSDP (see fsdp.py): keep Accelerate from wrapping the model itself on GPUs.
    for var in ("ACCELERATE_USE_FSDP",):
        os.environ.pop(var, None)
    options = engine.accelerator_options(plan, not torch.cuda.is_available())
    handlers = []
    if options["gloo"]:
        # Without an explicit gloo backend Accelerate reports 1 process and every rank "main" on CPU under
        # DeepSpeed (data not sharded, every rank saving): docs/cpu_distributed.md.
        handlers.append(InitProcessGroupKwargs(backend="gloo", timeout=timedelta(minutes=30)))
    # Precision is applied by vtrain (autocast here, torch_autocast inside DeepSpeed), so Accelerate gets "no".
    accelerator = Accelerator(mixed_precision="no", deepspeed_plugin=options["deepspeed_plugin"],
                              kwargs_handlers=handlers, cpu=options["cpu"], gradient_accumulation_steps=grad_accum,
                              log_with=log_with, project_dir=project_dir)
    engine.after_accelerator(plan)
    quiet_libraries()
    return accelerator
