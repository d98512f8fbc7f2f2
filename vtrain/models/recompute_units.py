"""Activation checkpointing applied to a built model, one recompute unit at a time (docs/recompute.md).

A model lists its units with `recompute_units()`: name (`backbone.stage2`, `encoder.3`, the names of
vtrain/recompute.py) -> the blocks that unit checkpoints, each on its own. Checkpointing a block replaces its
`forward` on the instance (not its class, parameters or state-dict keys) with the class forward run under
`torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`; the selective mode passes a `context_fn` from
`create_selective_checkpoint_contexts` whose policy keeps matrix-product outputs (SAVED_OPS) and recomputes the
rest. The block's own `__call__` hooks stay outside the checkpoint, as with torch's `checkpoint_wrapper`; this
is what lets FSDP2 (one `fully_shard` per block, engine/engines/fsdp_units.py: the same blocks) gather parameters before the
recomputation, and DeepSpeed ZeRO-3 gathers them in the hooks of the block's submodules, which the recomputation
calls again. A block therefore must hold no parameters of its own (checked).

Used by tasks (from `--grad-ckpt`), by the memory estimator and, through `recompute_units`/`apply_recompute`,
by a planner that tries sets of units. Model code calls nothing here except its own `recompute_units`.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Iterable, Mapping

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from vtrain import recompute
from vtrain.errors import VtrainError

# Matrix products and the ops built on them: their outputs are kept under the selective mode, everything else
# (elementwise, norms, softmax, casts, layout copies) is recomputed. Names as `OpOverload.name()` gives them;
# `vtrain::ms_deform_attn` is DINO's deformable attention (models/dino/msda.py).
SAVED_OPS = frozenset({
    "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::linear", "aten::convolution",
    "aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_cudnn_attention", "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_efficient_attention_forward", "aten::_flash_attention_forward", "vtrain::ms_deform_attn",
})
_BLOCK_SUFFIXES = ("Block", "Bottleneck", "BasicBlock")  # engine/engines/fsdp_units.py shards the same blocks


def sac_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective checkpointing: keep the outputs of matrix products (SAVED_OPS), recompute the rest. Products run
    without grad (inside a custom autograd Function's forward: the encoder FFN's token chunks, chunked_mlp.py) are
    not kept: autograd saves none of them, and the Function keeps what its backward needs itself."""
    keep = op.name() in SAVED_OPS and torch.is_grad_enabled()
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def _sac_contexts():
    return create_selective_checkpoint_contexts(sac_policy)


# torch 2.14 asks whether the tensors selective checkpointing caches should also go through saved-tensor hooks active
# around them (it warns, and will change its default). models/lean.py's hooks, active inside units, must see only
# what autograd saves, which is the old behaviour: asked for explicitly where torch knows the choice.
_SAC_BYPASSES_HOOKS = ({"respect_saved_tensors_hooks": False}
                       if "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters else {})


def _checkpointed_forward(self: nn.Module, *args, **kwargs):
    fwd = functools.partial(type(self).forward, self)
    if not torch.is_grad_enabled():  # evaluation: nothing is saved, nothing to recompute
        return fwd(*args, **kwargs)
    extra = {"context_fn": _sac_contexts, **_SAC_BYPASSES_HOOKS} if self._vtrain_recompute == "sac" else {}
    return checkpoint(fwd, *args, use_reentrant=False, **extra, **kwargs)


def set_recompute(block: nn.Module, mode: str | None) -> None:
    """Checkpoint `block` (mode "full" or "sac") or stop checkpointing it (None)."""
    if mode is None:
        block.__dict__.pop("forward", None)
        block.__dict__.pop("_vtrain_recompute", None)
        return
    if mode not in recompute.MODES:
        raise ValueError(f"recompute mode must be one of {recompute.MODES}, got {mode!r}")
    if any(True for _ in block.parameters(recurse=False)):
        raise ValueError(f"{type(block).__name__} holds parameters itself: its recomputation would run outside the "
                         "hooks that gather them under ZeRO-3")
    block._vtrain_recompute = mode
    block.forward = types.MethodType(_checkpointed_forward, block)


def recompute_mode(block: nn.Module) -> str | None:
    """The mode `block` is checkpointed with, from the live module (None: not checkpointed)."""
    return block.__dict__.get("_vtrain_recompute") if "forward" in block.__dict__ else None


def outer_blocks(module: nn.Module) -> list[nn.Module]:
    """The outermost residual/transformer blocks inside `module` (itself, if it is one)."""
    found: list[nn.Module] = []
    inside: set[int] = set()
    for m in module.modules():
        if id(m) not in inside and type(m).__name__.endswith(_BLOCK_SUFFIXES):
            found.append(m)
            inside.update(id(s) for s in m.modules())
    return found


def backbone_units(body: nn.Module, prefix: str = "backbone") -> dict[str, tuple[nn.Module, ...]]:
    """Units of a timm backbone, from its `feature_info` (the modules its feature levels come from): a level that is
    one block is a unit `blockN` (ViT), a level holding blocks is a stage `stageN` whose blocks are checkpointed
    one by one (Swin `layers.N`, ResNet `layerN`); N is timm's feature index. Levels without blocks (a stem) and
    levels pruned away are left out."""
    units: dict[str, tuple[nn.Module, ...]] = {}
    for i, info in enumerate(getattr(body, "feature_info", None) or []):
        try:
            level = body.get_submodule(info["module"])
        except (AttributeError, KeyError):
            continue
        blocks = outer_blocks(level)
        if blocks:
            kind = "block" if blocks == [level] else "stage"
            units[f"{prefix}.{kind}{i}"] = tuple(blocks)
    if not units:  # no feature_info: every block its own unit
        units = {f"{prefix}.block{i}": (b,) for i, b in enumerate(outer_blocks(body))}
    return units


def recompute_units(model: nn.Module) -> dict[str, tuple[nn.Module, ...]]:
    """The model's recompute units in forward order: name -> the blocks the unit checkpoints."""
    return model.recompute_units()


def apply_recompute(model: nn.Module, chosen: Mapping[str, str]) -> dict[str, str]:
    """Checkpoint exactly the units in `chosen` (unit name -> "full" | "sac"); every other unit runs plainly.
    Returns the applied map in forward order. Unknown names raise ValueError."""
    units = recompute_units(model)
    unknown = [n for n in chosen if n not in units]
    if unknown:
        raise ValueError(f"no recompute unit {unknown[0]!r}; units: {', '.join(units)}")
    for name, blocks in units.items():
        for b in blocks:
            set_recompute(b, chosen.get(name))
    return {n: chosen[n] for n in units if n in chosen}


def apply_spec(model: nn.Module, value: str | Iterable[str] | None, flag: str = "--grad-ckpt") -> dict[str, str]:
    """Apply a `--grad-ckpt` value to a built model; a unit it names that the model lacks is a VtrainError that
    names the flag and lists the model's units."""
    try:
        chosen = recompute.resolve(recompute.parse(value), list(recompute_units(model)))
    except recompute.SpecError as e:
        raise VtrainError(f"{flag}: {e}") from None
    return apply_recompute(model, chosen)


def active_recompute(model: nn.Module) -> dict[str, str]:
    """Unit name -> mode for every unit whose blocks are all checkpointed now (read from the live modules)."""
    out = {}
    for name, blocks in recompute_units(model).items():
        modes = {recompute_mode(b) for b in blocks}
        if len(modes) == 1 and None not in modes:
            out[name] = modes.pop()
    return out


def recompute_summary(model: nn.Module) -> str:
    """The active checkpointing as the shortest `--grad-ckpt` spec ("none" when nothing is checkpointed)."""
    return str(recompute.from_units(active_recompute(model), list(recompute_units(model))))


# ---- the second knob: a block that remakes one hidden layer in backward (models/lean.py) ------------------------
# A module that can drop its hidden layer and make it again in backward (DINO's encoder FFN: one fc1 matmul more,
# 8 tokens x 256 bytes less per token) says so with a boolean attribute `recompute_hidden`. The model-wide switch is
# ModelConfig.ffn_recompute; the memory planner sets it per unit. Inside a checkpointed unit the remade tensor is
# kept by nobody anyway (lean.py computes plainly there), so the switch only matters for units run plainly.
def hidden_units(model: nn.Module) -> list[str]:
    """Units (forward order) whose blocks hold a module with a `recompute_hidden` switch."""
    return [name for name, blocks in recompute_units(model).items()
            if any(hasattr(m, "recompute_hidden") for b in blocks for m in b.modules())]


def set_hidden_recompute(model: nn.Module, chosen: Iterable[str]) -> list[str]:
    """Turn `recompute_hidden` on in exactly the units `chosen` (names of `hidden_units`), off elsewhere. Returns the
    units switched on, in forward order; a name without such a module raises ValueError."""
    chosen = set(chosen)
    units = recompute_units(model)
    able = hidden_units(model)
    bad = sorted(chosen - set(able))
    if bad:
        raise ValueError(f"unit {bad[0]!r} has no hidden layer to remake; units that do: {', '.join(able) or 'none'}")
    for name in able:
        for b in units[name]:
            for m in b.modules():
                if hasattr(m, "recompute_hidden"):
                    m.recompute_hidden = name in chosen
    return [n for n in able if n in chosen]


def active_hidden_recompute(model: nn.Module) -> list[str]:
    """Units whose every `recompute_hidden` switch is on now (read from the live modules)."""
    units = recompute_units(model)
    return [n for n in hidden_units(model)
            if all(m.recompute_hidden for b in units[n] for m in b.modules() if hasattr(m, "recompute_hidden"))]
