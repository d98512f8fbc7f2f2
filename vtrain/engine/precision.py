"""Precision applied to a built model: autocast contexts, fp32 BatchNorm in full-low-precision modes."""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(device_type: str, precision: str) -> contextlib.AbstractContextManager:
    """bf16/fp16 autocast over fp32 weights; a no-op for `no`."""
    if precision not in DTYPES:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=DTYPES[precision])


@contextlib.contextmanager
def no_weight_cast_cache() -> Iterator[None]:
    """Autocast without its weight-cast cache, for DeepSpeed ZeRO-3's torch_autocast mode.

    `torch.autocast` keeps the 16-bit copy of each weight it casts until the autocast region ends and hands it to
    every later use of that weight, while ZeRO-3 partitions a parameter after each module's forward and gathers
    it again for the next. With a module called twice in one forward (DINO's box heads: inside the decoder for the
    next reference, then for the outputs) and the cache on, backward failed in the parameter's gradient
    accumulation ("The size of tensor a (0) must match the size of tensor b (64)"), on 1 and 2 CPU processes,
    DeepSpeed 0.19.8, `memory_efficient_linear` false (engine/engines/ds_config.py); with the cache off it trains
    (tests/integration/test_dino_train.py, tests/integration/test_precision.py). DeepSpeed opens its autocast with the cache setting in
    force when it is entered (`torch.autocast(cache_enabled=None)` inherits it), so turning the cache off around
    the engine's forward turns it off inside. Each use then casts its own copy; the cache would have kept every
    copy alive to the end of the forward anyway.
    """
    before = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(before)


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
