"""What a run really has active, read from the live objects, and the check that it is what was asked for.

Accelerate misreports or skips some engines on CPU processes (docs/cpu_distributed.md): a DeepSpeed run on gloo
without an explicit backend reports one process, every rank "main"; FSDP through Accelerate is skipped on CPU. So
the facts a run records in run_info.json (and tests assert) come from the model and the process group themselves:
the engine class, the ZeRO stage and offload the DeepSpeed engine reports, DTensor parameters and the fraction of
them held locally, a DDP wrapper, the regions `--compile` really made.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import torch
from accelerate import Accelerator
from torch import nn

from vtrain.dist import world_size
from vtrain.engine.compile import compiled_regions
from vtrain.engine.plan import Plan
from vtrain.errors import VtrainError


def active_facts(plan: Plan, accelerator: Accelerator, model: Any, unwrapped: nn.Module,
                 fsdp_units: int) -> dict[str, Any]:
    """Facts read from the live objects (not from flags), for this rank: `model` as prepared (a DeepSpeedEngine,
    DDP, or the FSDP2-sharded module), `unwrapped` the module inside it."""
    info: dict[str, Any] = {
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
        "compiled_regions": compiled_regions(model.module if plan.kind == "deepspeed"
                                             else unwrapped),
    }
    params = list(model.parameters())
    if plan.kind == "deepspeed":
        import deepspeed

        info["deepspeed_engine"] = isinstance(model, deepspeed.DeepSpeedEngine)
        info["zero_stage"] = model.zero_optimization_stage()
        info["offload_optimizer"] = bool(model.zero_offload_optimizer()) if plan.zero_stage else False
        info["offload_params"] = bool(model.zero_offload_param()) if plan.zero_stage == 3 else False
        info["torch_autocast"] = bool(model.torch_autocast_enabled())
        info["param_dtype"] = str(params[0].dtype)
        if plan.zero_stage == 3:
            local = sum(p.ds_tensor.numel() for p in params)
            total = sum(p.ds_numel for p in params)
            info["local_param_fraction"] = local / total
    elif plan.kind == "fsdp":
        from torch.distributed.tensor import DTensor

        info["all_params_dtensor"] = all(isinstance(p, DTensor) for p in params)
        local = sum(p.to_local().numel() for p in params if isinstance(p, DTensor))
        total = sum(p.numel() for p in params)
        info["local_param_fraction"] = local / total
        info["fsdp_units"] = fsdp_units
        info["param_dtype"] = str(params[0].dtype)
    else:
        info["ddp_wrapped"] = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        info["param_dtype"] = str(params[0].dtype)
    return info

def verify_active(plan: Plan, info: dict[str, Any]) -> None:
    """Stop with a clear error if what runs is not what was asked for."""
    p, problems = plan, []
    if info["accelerate_num_processes"] != p.world_size or info["dist_world_size"] != p.world_size:
        problems.append(f"world size: launched {p.world_size} processes but Accelerate sees "
                        f"{info['accelerate_num_processes']} and torch.distributed {info['dist_world_size']}")
    if p.kind == "deepspeed":
        if not info["deepspeed_engine"]:
            problems.append("DeepSpeed was requested but the model is not a DeepSpeedEngine")
        elif info["zero_stage"] != p.zero_stage:
            problems.append(f"ZeRO stage {info['zero_stage']} active, {p.zero_stage} requested")
        elif info["offload_optimizer"] != p.offload_optimizer or info["offload_params"] != p.offload_params:
            problems.append("DeepSpeed offload settings differ from the config")
    elif p.kind == "fsdp":
        if not info["all_params_dtensor"]:
            problems.append("FSDP2 was requested but parameters are not DTensors")
    elif p.kind == "ddp" and not info["ddp_wrapped"]:
        problems.append(f"DDP over {p.world_size} processes was requested but the model is "
                        f"{info['model_class']}")
    if problems:
        raise VtrainError("active engine differs from the request: " + "; ".join(problems))
