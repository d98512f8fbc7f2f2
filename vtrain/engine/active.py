"""What a run really has active, read from the live objects, and the check that it is what was asked for.

Accelerate misreports or skips some engines on CPU processes (docs/cpu_distributed.md): a DeepSpeed run on gloo
without an explicit backend reports one process, every rank "main"; FSDP through Accelerate is skipped on CPU. So
the facts a run records in run_info.json (and tests assert) come from the model and the process group themselves.
This module holds the facts every engine shares (rank, host, world as Accelerate and torch.distributed see it, the
regions `--compile` really made) and the world-size check; each engine class adds its own (engine/engines/: the
DeepSpeed engine's ZeRO stage and offload, DTensor parameters and the fraction held locally, a DDP wrapper).
"""

from __future__ import annotations

import os
import socket
from typing import Any

from accelerate import Accelerator
from torch import nn

from vtrain.dist import world_size
from vtrain.engine.compile import compiled_regions
from vtrain.engine.engines.plan import Plan
from vtrain.errors import VtrainError


def common_facts(plan: Plan, accelerator: Accelerator, model: Any, module: nn.Module) -> dict[str, Any]:
    """Facts every engine reports, for this rank: `model` as prepared, `module` the model's own module in it."""
    params = list(model.parameters())
    return {
        "rank": accelerator.process_index,
        # where this rank runs: on several nodes each node numbers its processes from local rank 0 (the GPU
        # index), and GROUP_RANK is the node rank torch elastic (`accelerate launch --machine_rank`) assigned
        "host": socket.gethostname(),
        "local_rank": accelerator.local_process_index,
        "node_rank": int(os.environ.get("GROUP_RANK", "0")),
        "accelerate_num_processes": accelerator.num_processes,
        "accelerate_is_main": accelerator.is_main_process,
        "dist_world_size": world_size(),
        "model_class": type(model).__name__,
        "precision": plan.precision,
        # --compile: the blocks whose forward really is a compiled region, read from the live modules
        "compiled_regions": compiled_regions(module),
        "param_dtype": str(params[0].dtype),
    }


def world_problems(plan: Plan, info: dict[str, Any]) -> list[str]:
    """The world size launched against the one Accelerate and torch.distributed see."""
    if info["accelerate_num_processes"] != plan.world_size or info["dist_world_size"] != plan.world_size:
        return [f"world size: launched {plan.world_size} processes but Accelerate sees "
                f"{info['accelerate_num_processes']} and torch.distributed {info['dist_world_size']}"]
    return []


def refuse(problems: list[str]) -> None:
    """Stop with one line if what runs is not what was asked for."""
    if problems:
        raise VtrainError("active engine differs from the request: " + "; ".join(problems))
