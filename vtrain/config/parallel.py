"""The `parallel` section: precision and the engine (DDP, DeepSpeed from a JSON file, FSDP2)."""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Literal

from vtrain.config.fields import CLI_CHOICE, NO_FLAG, Section

Precision = Literal["auto", "no", "bf16", "fp16"]
PRECISIONS: tuple[str, ...] = typing.get_args(Precision)
ZeroStage = Literal[0, 1, 2, 3]
"""A DeepSpeed ZeRO stage (0: DDP); a run's comes from its --ds-config (ds_json.py), `estimate-memory` takes --zero."""
Offload = Literal["none", "optimizer", "all"]
"""What DeepSpeed moves to the CPU: nothing, the optimizer states, or parameters too (ZeRO-3 only)."""


@dataclass
class ParallelConfig(Section):
    SECTION = "parallel"

    mixed_precision: Precision = field(default="auto", metadata=CLI_CHOICE)
    """auto (bf16 where supported: any CPU, Ampere+ GPUs; else fp16 on CUDA), no, bf16 or fp16. Master weights and
    BatchNorm buffers stay fp32."""
    ds_config: str | None = None
    """DeepSpeed JSON (ZeRO stage 0-3, offload); `auto` values are filled from this config (one owner per knob;
    docs/parallelism.md)."""
    fsdp: bool = False
    """Shard with torch FSDP2 (also chosen by an accelerate config with an FSDP section)."""
    fsdp_offload: bool = field(default=False, metadata=NO_FLAG)
    """FSDP2: keep parameters, gradients and optimizer states on the CPU."""
    fsdp_reshard_after_forward: bool = field(default=True, metadata=NO_FLAG)
    """FSDP2: free the gathered parameters after each block's forward (ZeRO-3 style; false keeps them, ZeRO-2)."""

    def __post_init__(self) -> None:
        self._check_text()
        self._check(self.mixed_precision in PRECISIONS, "mixed_precision", f"choose one of {PRECISIONS}")
        self._check(self.ds_config is None or not self.fsdp, "fsdp",
                    "cannot be combined with --ds-config (choose DeepSpeed or FSDP)")
