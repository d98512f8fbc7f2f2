"""Regional `torch.compile` (`--compile`): every residual/transformer block compiled on its own (docs/compile.md).

The regions are the blocks FSDP2 shards one by one (`fsdp.shard_units`): each backbone block (timm ViT `Block`,
`SwinTransformerBlock`, ResNet `Bottleneck`/`BasicBlock`), each DINO encoder and decoder layer. Everything between
them (stems, patch merging, the neck, query selection, heads, the losses, DINO's Hungarian matcher, the margin head)
runs eagerly: that glue is where shapes are data-dependent or the host is involved, and it costs little next to
the blocks. A change of image size then recompiles a few small graphs, never one graph of the whole model.

How a block is compiled (the order is torchtitan's `apply_compile`, pytorch/torchtitan
torchtitan/models/llama3/infra/parallelize.py: activation checkpointing, then compile, then `fully_shard`):
- the compiled function replaces the block's `forward` on the instance and calls the forward the block had before,
  so activation checkpointing applied inside the block (an instance `forward`) is traced into the graph, while
  checkpointing applied by a parent around the block call stays outside it;
- the module's `__call__` and its hooks stay eager: FSDP2's pre-/post-forward hooks (parameter all-gather and
  reshard) run around the compiled graph, never inside it, which is torchtitan's "compile the block inside the
  FSDP unit";
- parameters, buffers and submodules are untouched: state-dict keys stay those of the eager model (no `_orig_mod.`
  prefix in checkpoints, EMA files or consolidated weights), and `eval`, `predict` and `export` build plain models.

Shapes: a task whose inputs change size every step (DINO: multi-scale resize, batches padded to their largest
image, the number of denoising queries) compiles with sizes symbolic from the start (`dynamic=True`); a task of
fixed crops (metric) keeps torch's default, static graphs until a size changes (evaluation's batch), then that size
symbolic. Recompiles: blocks that can share a graph (same class, same parameter shapes, same settings) form a
group with one `torch.compile` call of its own (`isolate_recompiles=True`) and its own recompile budget
(`RECOMPILE_LIMIT` graphs). A group that reaches it runs eagerly from then on for inputs no cached graph accepts
(dynamo's warning names the function and the guard that failed last): the run stays correct, only slower.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn
from torch.fx.experimental import _config as fx_config

from vtrain.config import TrainConfig
from vtrain.engine.engines.fsdp_units import shard_units
from vtrain.errors import VtrainError


# Graphs one group may need even with symbolic sizes: training and evaluation (grad mode, eval flag) x the shape
# classes a Swin block specialises on (each side a multiple of the window or padded; one window per row or column
# at the coarsest stage of a small image). Duck sizing is off in the regions of a task whose sizes vary
# (`_distinct_symbols`): two sizes equal by chance at the first compile specialise nothing. torch's default of
# 8 for all of that could push a Swin group into eager mid-run; twice that still stops a block that recompiles
# every step after 16 compiles.
RECOMPILE_LIMIT = 16


def _run_region(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    # The block's forward from before compile: its class's, or the checkpointed forward activation checkpointing
    # put on the instance. Looked up on `self` (no closure over the block) so every block of a group shares the
    # one compiled function, and a deep copy of the model calls its own blocks.
    return self._vtrain_eager_forward(*args, **kwargs)


def _distinct_symbols(compiled: Any) -> Any:
    """`compiled` called with dynamo's duck sizing off. Duck sizing gives two input sizes that are equal at the
    first compile one symbol, and the graph then holds only while they stay equal: DINO's encoder layers take each
    level's padding mask, and an image whose coarsest level came out square (3 x 3) compiled a graph that the next
    image size could not use. The setting is read when a compile starts (its ShapeEnv), so it is set around the
    call, and only for the regions."""

    def call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        with fx_config.patch(use_duck_shape=False):
            return compiled(self, *args, **kwargs)

    return call


def _group_key(block: nn.Module) -> tuple:
    """What dynamo guards on and so specialises a graph to: the block's class, the forward it runs, its parameter
    and buffer shapes and dtypes, and the plain settings of the block and its submodules (e.g. Swin's shift)."""
    fwd = getattr(block.forward, "__func__", block.forward)
    tensors = tuple((n, tuple(t.shape), t.dtype) for n, t in [*block.named_parameters(), *block.named_buffers()])
    settings = tuple((name, k, v) for name, m in block.named_modules() for k, v in sorted(vars(m).items())
                     if not k.startswith("_") and isinstance(v, (bool, int, float, str, tuple)))
    return type(block), fwd, tensors, settings


def check_backend(backend: str, device: torch.device) -> None:
    """Fail before training when the backend cannot run here: inductor generates C++ on CPU (a C++ compiler is
    needed) and Triton on GPU. Its own error would come in the first step, deep inside a traceback."""
    if backend != "inductor":
        return
    if device.type == "cpu":
        from torch._inductor.cpp_builder import get_cpp_compiler

        try:
            get_cpp_compiler()
        except Exception as e:  # inductor's own search: no g++/clang++ (or $CXX) found
            raise VtrainError(f"--compile: inductor needs a C++ compiler on CPU ({' '.join(str(e).split())[:200]}); "
                              "install g++ or train without --compile") from None
    elif device.type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            raise VtrainError("--compile: inductor needs Triton on the GPU and it is not usable here; install the "
                              "triton package that matches torch or train without --compile")


def apply_compile(model: nn.Module, backend: str = "inductor", sizes_vary: bool = False,
                  fullgraph: bool = False) -> list[str]:
    """Compile each block of `model` in place (lazily: dynamo traces at a block's first call). Returns the names
    of the compiled blocks. Call after activation checkpointing and before FSDP2 (`apply_fsdp2`).

    `sizes_vary`: the inputs change size from step to step (DINO). Their sizes are then symbolic from the first
    compile (`dynamic=True`): a static graph would serve one step and be compiled again dynamic at the next.
    Otherwise torch's default (`dynamic=None`): static graphs, and a size that does change (the evaluation batch)
    is made symbolic at its first change.

    `fullgraph=True` turns a graph break inside a block into an error (tests). Training leaves it off: DeepSpeed
    ZeRO-3 gathers parameters in submodule hooks that dynamo must not trace, which breaks a block's graph."""
    blocks = shard_units(model)
    if not blocks:
        raise VtrainError(f"--compile: {type(model).__name__} has no residual/transformer blocks to compile")
    groups: dict[tuple, list[nn.Module]] = {}
    for b in blocks:
        groups.setdefault(_group_key(b), []).append(b)
    for i, members in enumerate(groups.values()):
        fn = torch.compile(_run_region, backend=backend, dynamic=True if sizes_vary else None, fullgraph=fullgraph,
                           isolate_recompiles=True, recompile_limit=RECOMPILE_LIMIT,
                           name=f"vtrain_region_{i}_{type(members[0]).__name__}")
        if sizes_vary:
            fn = _distinct_symbols(fn)
        for b in members:
            b._vtrain_eager_forward = b.forward
            b._vtrain_compile_group = i
            b.forward = types.MethodType(fn, b)
    return compiled_regions(model)


def _is_region(m: nn.Module) -> bool:
    return "_vtrain_compile_group" in vars(m) and getattr(vars(m).get("forward"), "__self__", None) is m


def compiled_regions(model: nn.Module) -> list[str]:
    """Names of the blocks whose forward is a compiled region now, read from the live modules (run_info.json)."""
    return [name for name, m in model.named_modules() if _is_region(m)]


def compiled_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks whose forward is a compiled region now."""
    return [m for m in model.modules() if _is_region(m)]


def compile_groups(model: nn.Module) -> int:
    """How many separately compiled groups the regions form (each with its own recompile budget)."""
    return len({vars(m)["_vtrain_compile_group"] for m in model.modules() if "_vtrain_compile_group" in vars(m)})


def compile_regions(model: nn.Module, t: TrainConfig, device: torch.device, sizes_vary: bool) -> list[str]:
    """`--compile` on a built model: the build-order step (the trainer's one call). `sizes_vary`: the task's
    inputs change size from step to step (DINO). Returns the log line, if any."""
    if not t.compile:
        return []
    check_backend(t.compile_backend, device)
    apply_compile(model, t.compile_backend, sizes_vary)
    return [describe(model, t.compile_backend, sizes_vary)]


def describe(model: nn.Module, backend: str, sizes_vary: bool) -> str:
    """The one log line: how many regions are compiled, what runs eagerly, how shapes are treated."""
    regions = compiled_regions(model)
    shapes = ("input sizes symbolic from the first compile" if sizes_vary else
              "static shapes until a size changes, then that size symbolic")
    return (f"--compile: {len(regions)} regions compiled separately with torch.compile(backend={backend}) in "
            f"{compile_groups(model)} groups ({regions[0]} ... {regions[-1]}), {shapes}; everything between them "
            "runs eagerly")
