"""Precision applied to a built model: autocast contexts, fp32 BatchNorm in full-low-precision modes."""

from __future__ import annotations

import contextlib
import types

import torch
import torch.nn.functional as F
from torch import nn

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(device_type: str, precision: str) -> contextlib.AbstractContextManager:
    """bf16/fp16 autocast over fp32 weights; a no-op for `no`."""
    if precision not in DTYPES:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=DTYPES[precision])


def _fp32_batchnorm_forward(self: nn.modules.batchnorm._BatchNorm, x: torch.Tensor) -> torch.Tensor:
    # Same running-stat bookkeeping as torch's _BatchNorm.forward, computed in fp32 whatever the weight dtype.
    momentum = 0.0 if self.momentum is None else self.momentum
    if self.training and self.track_running_stats and self.num_batches_tracked is not None:
        self.num_batches_tracked.add_(1)
        if self.momentum is None:
            momentum = 1.0 / float(self.num_batches_tracked)
    use_batch_stats = self.training or (self.running_mean is None and self.running_var is None)
    track = not self.training or self.track_running_stats
    out = F.batch_norm(x.float(), self.running_mean if track else None, self.running_var if track else None,
                       None if self.weight is None else self.weight.float(),
                       None if self.bias is None else self.bias.float(), use_batch_stats, momentum, self.eps)
    return out.to(x.dtype)


def keep_batchnorm_fp32(model: nn.Module) -> int:
    """Make BatchNorm layers compute in fp32 with fp32 running stats even when their weights are cast to
    bf16/fp16 (DeepSpeed's full-bf16/fp16 modes cast parameters, not buffers). An fp16 running_var above
    65504 becomes inf and silently ruins inference (docs/face.md §4). Returns the number of layers changed."""
    n = 0
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.forward = types.MethodType(_fp32_batchnorm_forward, m)
            n += 1
    return n


def has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
