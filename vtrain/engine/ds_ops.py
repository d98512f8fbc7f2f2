"""DeepSpeed's C++ ops that a run compiles the first time on a machine, announced: no silent minutes.

A DeepSpeed run on CPU processes builds, on first use:

- the shared-memory collectives (`deepspeed_shm_comm`, DeepSpeed's `ShareMemCommBuilder`): the CPU accelerator
  builds it when DeepSpeed's process group starts (deepspeed/comm/torch.py, `build_shm_op` in
  `TorchBackend.__init__`), so every CPU run under DeepSpeed needs it, whatever the ZeRO stage;
- CPU Adam (`cpu_adam`, `CPUAdamBuilder`): built when `DeepSpeedCPUAdam` is made, which ZeRO-Offload of the
  optimizer states needs (engines/deepspeed.py `make_optimizer`), on CPUs and GPUs alike.

Both go through DeepSpeed's `OpBuilder.jit_load` (deepspeed/ops/op_builder/builder.py), which calls
`torch.utils.cpp_extension.load`: ninja compiles the sources into the extensions folder (`$TORCH_EXTENSIONS_DIR/<op>`,
else `~/.cache/torch_extensions/py<ver>_<accelerator>/<op>`), guarded by a file lock (the other ranks wait for the
first), and every later run loads `<op>.so` from there in seconds. vtrain wraps `jit_load` (`announce_builds`) so
that an op not yet in that folder is announced on rank 0 with one line before (what, why, where, how long it can
take) and one after (how long it took). Cold build times measured on this project's 2-core build machine:
docs/parallelism.md ("DeepSpeed's compiled ops").
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from vtrain.console import console, hms

WHY = {
    "deepspeed_shm_comm": "DeepSpeed's shared-memory collectives for CPU processes, built when its process group "
                          "starts",
    "cpu_adam": "DeepSpeed's CPU Adam, the optimizer step of ZeRO-Offload (optimizer states on the CPU)",
}
"""What each op a vtrain run builds is for (another op is announced by its name)."""
TYPICAL = "a few minutes on an idle machine, up to 20 on a busy 2-core one"
"""How long one cold build can take (docs/parallelism.md, measured: both ops together 190 s of CPU time; 11 and 20
minutes of wall time on a 2-core machine under a load of 15)."""


def extensions_dir(name: str) -> Path:
    """Where torch.utils.cpp_extension builds (and later finds) op `name`: $TORCH_EXTENSIONS_DIR/<name>, else
    ~/.cache/torch_extensions/py<major><minor>_<cu<version>|rocm<version>|cpu>/<name> (torch's
    `_get_build_directory`, torch 2.14)."""
    # imported here, when DeepSpeed loads an op (it imports the module then too): importing it warns "No CUDA
    # runtime is found" on a machine with a CUDA toolkit and no GPU, which a run without DeepSpeed must not show
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is not None:
        return Path(root) / name
    if torch.version.hip is not None:
        accel = f"rocm{torch.version.hip.replace('.', '')}"
    elif torch.version.cuda is not None:
        accel = f"cu{torch.version.cuda.replace('.', '')}"
    else:
        accel = "cpu"
    py = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{py}_{accel}" / name


def is_built(name: str, sources: list[str]) -> bool:
    """Whether op `name` was built from these `sources` (absolute paths) already, so that loading it takes seconds:
    its library is in the extensions folder, no older than the ninja file, which names them. Another installation of
    DeepSpeed (another virtual environment) has other source paths, and ninja then compiles again (measured); a build
    under way has written its ninja file but not yet its library."""
    folder = extensions_dir(name)
    try:
        ninja = (folder / "build.ninja").read_text(errors="replace")
        fresh = (folder / f"{name}.so").stat().st_mtime >= (folder / "build.ninja").stat().st_mtime
    except OSError:
        return False
    return fresh and all(src in ninja for src in sources)


def _announced(jit_load: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(jit_load)
    def load(self: Any, *args: Any, **kwargs: Any) -> Any:
        name = getattr(self, "name", "?")
        # the sources as jit_load hands them to torch.utils.cpp_extension.load
        sources = [os.path.abspath(self.deepspeed_src_path(path)) for path in self.sources()]
        if os.environ.get("RANK", "0") != "0" or is_built(name, sources):
            return jit_load(self, *args, **kwargs)
        where = extensions_dir(name)
        console.print(f"building {WHY.get(name, f'DeepSpeed op {name}')} ({name}): compiled once on this machine "
                      f"into {where}, then reused; this can take {TYPICAL}", soft_wrap=True)
        t0 = time.perf_counter()
        module = jit_load(self, *args, **kwargs)
        console.print(f"built {name} in {hms(time.perf_counter() - t0)}", soft_wrap=True)
        return module

    load.vtrain_announces = True  # type: ignore[attr-defined]
    return load


def announce_builds() -> None:
    """Wrap DeepSpeed's `OpBuilder.jit_load` (once) so that a build is announced (module docstring)."""
    from deepspeed.ops.op_builder.builder import OpBuilder

    if not getattr(OpBuilder.jit_load, "vtrain_announces", False):
        OpBuilder.jit_load = _announced(OpBuilder.jit_load)


def quiet_other_ranks() -> None:
    """On ranks other than 0: no warnings of the library loggers that say the same on every rank (torch's "No CUDA
    runtime is found" when an op is loaded, DeepSpeed's start-up notes): rank 0 shows them once."""
    if os.environ.get("RANK", "0") != "0":
        for name in ("torch.utils.cpp_extension", "DeepSpeed", "deepspeed"):
            logging.getLogger(name).setLevel(logging.ERROR)
