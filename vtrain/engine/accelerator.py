"""The Accelerator a run is built on: rendezvous, process group backend and DeepSpeed plugin for a Plan.

vtrain applies precision and FSDP2 itself (engine/parallel.py), so Accelerate gets `mixed_precision="no"` and never
wraps the model in FSDP; what it does own is the launch environment, DDP and the DeepSpeed engine.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

from vtrain.engine.plan import Plan


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    """`log_with`: an Accelerate tracker (tensorboard, wandb) writing under `project_dir`."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # say it, instead of DeepSpeed warning that it guessed
    if plan.kind == "deepspeed" and "RANK" not in os.environ:
        # A plain `vtrain train --ds-config ...` (or `accelerate launch` with one process) sets no rendezvous;
        # DeepSpeed would then try MPI discovery and fail on "No module named 'mpi4py'".
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    # We own FSDP (see fsdp.py): keep Accelerate from wrapping the model itself on GPUs.
    for var in ("ACCELERATE_USE_FSDP",):
        os.environ.pop(var, None)
    handlers = []
    cpu_only = not torch.cuda.is_available()
    if cpu_only and (plan.world_size > 1 or plan.kind == "deepspeed"):
        # Without an explicit gloo backend Accelerate reports 1 process and every rank "main" on CPU under
        # DeepSpeed (data not sharded, every rank saving): docs/cpu_distributed.md.
        handlers.append(InitProcessGroupKwargs(backend="gloo", timeout=timedelta(minutes=30)))
    ds_plugin = None
    if plan.kind == "deepspeed":
        os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)  # the plugin below is the only DeepSpeed source
        # `accelerate launch --config_file` with a deepspeed_config section lists the YAML's keys here, and the
        # plugin then refuses any JSON file ("the following accelerate config variables will be ignored",
        # measured with accelerate 1.15 and accelerate_configs/deepspeed.yaml). The plan has already read
        # what it needs from that YAML, and vtrain fills the JSON from its own flags: one owner per knob.
        os.environ.pop("ACCELERATE_CONFIG_DS_FIELDS", None)
        ds_plugin = DeepSpeedPlugin(hf_ds_config=plan.ds_config)
    # On CPU processes DDP needs cpu=True: with the gloo kwargs alone Accelerate stays at distributed type NO
    # and `prepare` returns the bare model (measured: accelerate 1.15). cpu=True would drop DeepSpeed, so
    # DeepSpeed keeps the kwargs route above.
    cpu_flag = cpu_only and plan.kind != "deepspeed" and plan.world_size > 1
    # Precision is applied by vtrain (autocast here, torch_autocast inside DeepSpeed), so Accelerate gets "no".
    accelerator = Accelerator(mixed_precision="no", deepspeed_plugin=ds_plugin, kwargs_handlers=handlers,
                              cpu=cpu_flag, gradient_accumulation_steps=grad_accum, log_with=log_with,
                              project_dir=project_dir)
    if plan.kind == "fsdp" and not dist.is_initialized():
        # fully_shard needs a process group even for one process (Accelerate creates none for a single one)
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=0, world_size=1,
                                init_method=f"tcp://127.0.0.1:{_free_port()}")
    quiet_libraries()
    return accelerator
