"""DDP through Accelerate (`accelerator.prepare` wraps the model in DistributedDataParallel), and one process.

The step is the torch engine's (torch_engine.py: torch's clip and step, GradScaler for fp16); what DDP adds is the accumulation
window: gradients are all-reduced only on its last micro-batch (`no_sync` before it). One process is DDP of one:
the same checkpoint layout (a run resumes across the two), no wrapper and nothing to synchronise.
"""

from __future__ import annotations

import contextlib
from typing import Any

from vtrain.engine.engines.torch_engine import TorchEngine


DDP_FAMILY = ("single", "ddp")
"""One process is DDP of one: the same checkpoint layout, a run resumes across the two."""


class DDPEngine(TorchEngine):
    kind, reads = "ddp", DDP_FAMILY

    def sync_context(self, sync: bool) -> contextlib.AbstractContextManager:
        """DDP's all-reduce runs in backward: `no_sync` keeps it off until the last micro-batch of the window."""
        return contextlib.nullcontext() if sync else self.model.no_sync()

    def _own_problems(self, info: dict[str, Any]) -> list[str]:
        if info["ddp_wrapped"]:
            return []
        return [f"DDP over {self.plan.world_size} processes was requested but the model is {info['model_class']}"]


class SingleProcessEngine(TorchEngine):
    """One process: Accelerate's `prepare` returns the model as it is."""

    kind, reads = "single", DDP_FAMILY

    def describe(self) -> str:
        return "single process"
