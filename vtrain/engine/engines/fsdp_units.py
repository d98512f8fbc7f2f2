"""FSDP2 (`torch.distributed.fsdp.fully_shard`) applied by vtrain itself, on CPU and GPU alike.

Accelerate never applies FSDP on CPU processes (its distributed type stays NO and each rank silently trains an
unsharded copy; docs/cpu_distributed.md), so vtrain shards the built model directly: one
`fully_shard` per residual/transformer block, then the root. Blocks without BatchNorm gather their parameters
in bf16 (MixedPrecisionPolicy, fp32 gradient reduction); the root and BatchNorm-holding blocks keep fp32
parameters because BatchNorm with bf16 weights and fp32 running stats fails (docs/memory_ckpt.md §4).
"""

from __future__ import annotations

import re

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from vtrain.engine.precision import DTYPES, has_batchnorm

_BLOCK_RE = re.compile(r"(Block|Bottleneck|BasicBlock)$")


def shard_units(model: nn.Module) -> list[nn.Module]:
    """Outermost residual/transformer blocks (timm's Block, SwinTransformerBlock, Bottleneck, BasicBlock...)."""
    units: list[nn.Module] = []
    inside: set[int] = set()
    for m in model.modules():
        if id(m) in inside:
            continue
        if _BLOCK_RE.search(type(m).__name__):
            units.append(m)
            inside.update(id(s) for s in m.modules())
    return units


def apply_fsdp2(model: nn.Module, precision: str, offload: bool, reshard_after_forward: bool) -> int:
    """Shard `model` in place; returns the number of per-block units. Must run before the optimizer is built."""
    low = DTYPES.get(precision)
    offload_policy = CPUOffloadPolicy() if offload else OffloadPolicy()
    fp32_policy = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32)
    units = shard_units(model)
    for unit in units:
        policy = fp32_policy
        if low is not None and not has_batchnorm(unit):
            policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
        fully_shard(unit, mp_policy=policy, offload_policy=offload_policy,
                    reshard_after_forward=reshard_after_forward)
    # root: neck/head/embeddings; keep its parameters' gather last so it overlaps nothing it needs
    fully_shard(model, mp_policy=fp32_policy, offload_policy=offload_policy,
                reshard_after_forward=reshard_after_forward)
    return len(units)
