"""The launch a run asked for against the one it got, checked before anything is imported or built (`vtrain train`).

`accelerate launch --num_processes N` (N > 1) without `--multi_gpu`, `--use_deepspeed`, `--use_fsdp` or a config
file whose `distributed_type` starts several processes runs Accelerate's single-process launcher on a machine
without GPUs: ONE process, which would train alone, unsharded, and report `world 1` (accelerate 1.15,
`commands/launch.py`: `launch_command` falls through to `simple_launcher`, and `_validate_launch_command` turns
`--num_processes > 1` into a multi-GPU launch only when CUDA shows more than one device; docs/cpu_distributed.md §3).
Every launcher of several processes (torchrun, DeepSpeed's, Slurm with the rendezvous variables) sets `WORLD_SIZE`;
the single-process launcher does not. So a process without `WORLD_SIZE` whose parent is `accelerate launch` asking
for more than one process (its command line, else the config file it read) stops with one line naming the fix.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import psutil
import yaml

from vtrain.errors import VtrainError

FIX = ("accelerate launch --config_file accelerate_configs/ddp.yaml --num_processes {n} -m vtrain train ... (or "
       "--multi_gpu instead of the config file; with DeepSpeed add --ds-config FILE)")


def _option(args: list[str], *names: str) -> str | None:
    """The value of the last `--name VALUE` / `--name=VALUE` among `args` (accelerate accepts `-` for `_`)."""
    found = None
    for i, a in enumerate(args):
        for name in names:
            if a == name and i + 1 < len(args):
                found = args[i + 1]
            elif a.startswith(name + "="):
                found = a[len(name) + 1:]
    return found


def launcher_args(cmdline: list[str], script: str | None = None) -> list[str] | None:
    """The options given to `accelerate launch` in a launcher's command line (those before the training script or
    `-m MODULE`), or None when `cmdline` is no `accelerate launch`. `script`: this process's own script path, which
    ends them."""
    start = None
    for i, a in enumerate(cmdline):
        name = Path(a).name
        if name == "accelerate-launch" or a == "accelerate.commands.launch":
            start = i + 1
            break
        if name in ("accelerate", "accelerate.commands.accelerate_cli") and cmdline[i + 1:i + 2] == ["launch"]:
            start = i + 2
            break
    if start is None:
        return None
    own = Path(script).resolve() if script else None
    args = []
    for a in cmdline[start:]:
        if a in ("-m", "--module") or (own is not None and Path(a).resolve() == own):
            break
        args.append(a)
    return args


def _config_processes(args: list[str]) -> int | None:
    """num_processes of the accelerate config file the launcher read: --config_file, else the default one (which
    accelerate reads unless --cpu), when it can be read."""
    path = _option(args, "--config_file", "--config-file")
    if path is None:
        if "--cpu" in args:
            return None
        home = os.environ.get("HF_HOME", os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface"))
        path = os.path.join(os.path.expanduser(home), "accelerate", "default_config.yaml")
    try:
        with open(path) as f:
            value = yaml.safe_load(f).get("num_processes")
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    return value if isinstance(value, int) else None


def requested_processes(args: list[str]) -> int:
    """How many processes `accelerate launch ARGS` asked for: --num_processes, else its config file's, else 1."""
    value = _option(args, "--num_processes", "--num-processes")
    if value is not None:
        try:
            return int(value)
        except ValueError:
            return 1
    return _config_processes(args) or 1


def one_process_launch(environ: dict[str, str] | None = None, parent: list[str] | None = None,
                       script: str | None = None) -> str | None:
    """The error line when this process is the only one that `accelerate launch --num_processes N` (N > 1) started
    (module docstring), else None. `environ`, `parent` (the parent's command line) and `script` default to this
    process's."""
    environ = os.environ if environ is None else environ
    if "WORLD_SIZE" in environ or "LOCAL_RANK" in environ:
        return None
    if parent is None:
        try:
            parent = psutil.Process().parent().cmdline()
        except (psutil.Error, AttributeError):  # no parent to read: nothing to say
            return None
    args = launcher_args(parent, sys.argv[0] if script is None else script)
    if args is None:
        return None
    n = requested_processes(args)
    if n <= 1:
        return None
    return (f"accelerate launch asked for {n} processes but started this one alone: without --multi_gpu or a config "
            f"file of several processes, Accelerate runs a single process on a machine without GPUs (this run "
            f"would train unsharded, world 1); launch it as {FIX.format(n=n)}")


def check_launch() -> None:
    """Stop with one line when this process was launched alone by mistake (`one_process_launch`)."""
    problem = one_process_launch()
    if problem is not None:
        raise VtrainError(problem)
