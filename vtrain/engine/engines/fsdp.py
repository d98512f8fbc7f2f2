"""FSDP2, applied by vtrain itself (`fully_shard` per block and root: engine/engines/fsdp_units.py), on CPU and GPU alike.

Accelerate skips FSDP on CPU processes, so this engine never goes through `accelerator.prepare`: the model is
sharded in `shard` (before the optimizer exists, which must see the DTensor parameters), the step is the torch
engine's (torch_engine.py) over DTensors, and checkpoints hold model and optimizer as a torch distributed checkpoint (DCP)
in `fsdp/` beside Accelerate's RNG states. Each rank holds a shard of every parameter (`to_local()`).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.distributed.tensor import DTensor, distribute_tensor

from vtrain.engine.checkpoint import format as ckpt
from vtrain.engine.checkpoint import content_state, layout as engine_layout
from vtrain.engine.engines.base import average_buffers, free_port
from vtrain.engine.engines.fsdp_units import apply_fsdp2
from vtrain.engine.engines.torch_engine import TorchEngine
from vtrain.engine.head_shard import ShardedHead
from vtrain.engine.engines.plan import Plan
from vtrain.errors import VtrainError
from vtrain.io.safeio import check_dcp, dcp_refusals


class FSDP2Engine(TorchEngine):
    kind, reads = "fsdp", ("fsdp",)
    layout = engine_layout.FSDP2

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fsdp_units = 0

    @classmethod
    def after_accelerator(cls, plan: Plan) -> None:
        if not dist.is_initialized():
            # fully_shard needs a process group even for one process (Accelerate creates none for a single one)
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=0, world_size=1,
                                    init_method=f"tcp://127.0.0.1:{free_port()}")

    def describe(self) -> str:
        return "FSDP2 (fully_shard per block + root" + (", CPU offload" if self.plan.fsdp_offload else "") + ")"

    @classmethod
    def estimator_fields(cls, plan: Plan) -> dict[str, Any]:
        return {"fsdp": True}

    # ---- build --------------------------------------------------------------------------------------------
    def shard(self, model: nn.Module) -> nn.Module:
        if not self.plan.fsdp_offload:
            model.to(self.device)
        self.fsdp_units = apply_fsdp2(model, self.plan.precision, self.plan.fsdp_offload,
                                      self.plan.fsdp_reshard_after_forward)
        return model

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                head: ShardedHead | None = None) -> tuple[Any, Any]:
        self.model, self.optimizer, self.head = model, optimizer, head
        return self.model, self.optimizer

    @property
    def unwrapped(self) -> nn.Module:
        return self.model

    def sync_context(self, sync: bool) -> contextlib.AbstractContextManager:
        self.model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()

    # ---- state --------------------------------------------------------------------------------------------
    def sync_buffers(self) -> None:
        """Average floating-point buffers over ranks. FSDP2 leaves each rank with statistics of its own data and DCP
        picks the writer rank per tensor for load balance: averaging before every save and evaluation gives one
        consistent model, what is saved is what every rank continues with. Collective."""
        average_buffers(self.model)

    def _gathered_state(self, main: bool) -> dict[str, torch.Tensor]:
        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def save(self, path: Path) -> None:
        super().save(path)
        msd, osd = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path / ckpt.FSDP))

    def load(self, path: Path) -> None:
        """Accelerate's RNG state, then the distributed checkpoint, checked against the state it is loaded into.
        Collective."""
        super().load(path)
        if not (path / ckpt.FSDP).is_dir():
            raise VtrainError(f"--resume: {path} holds no FSDP state (was it saved by another engine?)")
        check_dcp([path / ckpt.FSDP])  # DCP reads its .metadata with plain pickle.load
        msd, osd = get_state_dict(self.model, self.optimizer)
        state = {"model": msd, "optim": osd}
        # the same metadata on every rank: all ranks stop alike (no collective is left waiting)
        content_state.expect_dcp(path / ckpt.FSDP, state, "--resume")
        with dcp_refusals(path / ckpt.FSDP):
            dcp.load(state, checkpoint_id=str(path / ckpt.FSDP))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def optimizer_file(self, path: Path) -> Path:
        return path / ckpt.FSDP

    # ---- the tensors this rank holds: the local shard of each DTensor ------------------------------------------
    def local_tensor(self, p: nn.Parameter) -> torch.Tensor:
        return p.to_local() if isinstance(p, DTensor) else p.data

    def whole_tensor(self, p: nn.Parameter, local: torch.Tensor) -> torch.Tensor | None:
        whole = DTensor.from_local(local.to(self.device), p.device_mesh, p.placements, run_check=False,
                                   shape=p.shape, stride=p.stride()).full_tensor()
        return whole.cpu() if self.accelerator.is_main_process else None

    def local_part(self, p: nn.Parameter, whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        # src_data_rank=None: every rank slices the copy it read, no communication
        return distribute_tensor(whole.to(self.device), p.device_mesh, p.placements, src_data_rank=None).to_local()

    # ---- what is really active -----------------------------------------------------------------------------
    def _own_facts(self) -> dict[str, Any]:
        params = list(self.model.parameters())
        local = sum(p.to_local().numel() for p in params if isinstance(p, DTensor))
        return {"all_params_dtensor": all(isinstance(p, DTensor) for p in params),
                "local_param_fraction": local / sum(p.numel() for p in params), "fsdp_units": self.fsdp_units}

    def _own_problems(self, info: dict[str, Any]) -> list[str]:
        return [] if info["all_params_dtensor"] else ["FSDP2 was requested but parameters are not DTensors"]
