"""Keep fewer activations without changing a single output: a tensor that backward needs but that is cheap to make
again from tensors kept anyway is not kept, it is made again when backward asks for it (docs/recompute.md §3).

`remat(consumer, (producer, args), ...)` computes `consumer(producer(*args), ...)`; of the tensors autograd saves on
the way, those that share storage with a producer's output are replaced by a recipe, and the first backward that
unpacks one runs `producer(*args)` again (no grad, under the autocast state of the forward) and hands out the same
view of the new result. The producer must be deterministic and draw no random numbers (an activation, a cast, coordinate
arithmetic, a linear layer): the recomputed tensor is then bitwise the one that was dropped, so outputs and
gradients are bitwise unchanged. `lean_norm(norm, x)` does the same for the fp32 copy of a 16-bit input that
CUDA autocast makes for layer/group norms (its fp32 list) and that the norm would keep for backward.

Both work through `torch.autograd.graph.saved_tensors_hooks`, which would take the saved tensors away from an
enclosing activation checkpoint (it installs such hooks too): where any saved-tensor hooks are already active,
they compute plainly and keep what autograd keeps (a checkpointed unit keeps nothing of it anyway). Under
`torch.compile` they compute plainly too: dynamo cannot trace the hook stack or storage identities (each use would
break the graph), and AOTAutograd's partitioner already chooses what backward keeps and what it recomputes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import saved_tensors_hooks

_LOW = (torch.bfloat16, torch.float16)
_DEVICES = ("cpu", "cuda")


def _plain() -> bool:
    """Compute plainly: nothing is saved for backward, saved-tensor hooks are active (activation checkpointing,
    selective or full, or a user's), or dynamo is tracing (its own partitioner decides what backward keeps)."""
    return not torch.is_grad_enabled() or torch.compiler.is_compiling() or _hooks_active()


def _hooks_active() -> bool:
    """Saved-tensor hooks already installed (activation checkpointing, selective or full, or a user's)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is None or top(False) is not None  # unknown torch: assume so, and stay plain


class _Recipe:
    """Makes the dropped tensor again, once, under the forward's autocast state; shared by every saved view."""

    def __init__(self, producer: Callable[..., Tensor], args: tuple[Any, ...]) -> None:
        self.producer, self.args = producer, args
        self.autocast = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _DEVICES]
        self.value: Tensor | None = None

    def make(self) -> Tensor:
        if self.value is None:
            with torch.no_grad(), _autocast_as(self.autocast):
                self.value = self.producer(*self.args)
        return self.value


class _autocast_as:
    def __init__(self, state: list[tuple[str, bool, torch.dtype]]) -> None:
        self.ctxs = [torch.autocast(d, dtype=dt, enabled=on) for d, on, dt in state]

    def __enter__(self) -> None:
        for c in self.ctxs:
            c.__enter__()

    def __exit__(self, *exc: Any) -> None:
        for c in reversed(self.ctxs):
            c.__exit__(*exc)


class _Saved:
    """What autograd holds instead of a saved tensor: the tensor itself, or a recipe and the view to take."""

    __slots__ = ("tensor", "recipe", "view")

    def __init__(self, t: Tensor) -> None:
        self.tensor: Tensor | None = t
        self.recipe: _Recipe | None = None
        self.view: tuple = ()

    def drop_for(self, recipe: _Recipe) -> None:
        t = self.tensor
        self.view = (t.size(), t.stride(), t.storage_offset())
        self.tensor, self.recipe = None, recipe

    def get(self) -> Tensor:
        if self.tensor is not None:
            return self.tensor
        return self.recipe.make().as_strided(*self.view)


def _record(run: Callable[[], Any]) -> tuple[Any, list[_Saved]]:
    saved: list[_Saved] = []

    def pack(t: Tensor) -> _Saved:
        s = _Saved(t)
        saved.append(s)
        return s

    with saved_tensors_hooks(pack, _Saved.get):
        out = run()
    return out, saved


def remat(consumer: Callable[..., Any], *products: tuple[Callable[..., Tensor], tuple[Any, ...]]) -> Any:
    """`consumer(*outs)` with `outs[i] = producer_i(*args_i)` for `products = ((producer_i, args_i), ...)`; backward
    keeps the `args_i` instead of whatever it saves of the outputs (each made again when first needed)."""
    if _plain():
        return consumer(*(fn(*args) for fn, args in products))
    outs: list[Tensor] = []

    def run() -> Any:
        outs.extend(fn(*args) for fn, args in products)
        return consumer(*outs)

    y, saved = _record(run)
    recipes = {id(out.untyped_storage()): _Recipe(fn, args) for out, (fn, args) in zip(outs, products)}
    for s in saved:
        recipe = recipes.get(id(s.tensor.untyped_storage()))
        if recipe is not None:
            s.drop_for(recipe)
    return y


def lean_norm(norm: nn.Module, x: Tensor) -> Tensor:
    """`norm(x)` for a LayerNorm or GroupNorm; if autocast runs it on an fp32 copy of the 16-bit `x` (CUDA's fp32
    list), that copy is made again from `x` in backward instead of being kept (half the bytes)."""
    if x.dtype not in _LOW or _plain():
        return norm(x)
    y, saved = _record(lambda: norm(x))
    own = {id(p) for p in norm.parameters()}
    recipe = _Recipe(Tensor.float, (x,))
    for s in saved:
        t = s.tensor
        # the norm keeps its input, weight, bias and statistics: the input is the tensor of x's shape in fp32
        if t.dtype == torch.float32 and t.shape == x.shape and t.dim() >= 2 and id(t) not in own:
            s.drop_for(recipe)
    return y


def autocast_input(x: Tensor) -> Tensor:
    """`x` as autocast casts a matmul's input (fp32 -> the autocast dtype), or `x` itself when autocast would not
    cast it. Casting once, before several layers take the same input, keeps one 16-bit copy for all of them where
    autocast would make and keep one per layer (the same `to`, so the same values)."""
    dev = x.device.type
    if dev in _DEVICES and torch.is_autocast_enabled(dev) and x.is_floating_point() and x.dtype != torch.float64:
        return x.to(torch.get_autocast_dtype(dev))
    return x


class _Relu(torch.autograd.Function):
    """ReLU whose backward zeroes the incoming gradient in place instead of writing a new tensor: one buffer of
    the input's size less at the backward of a wide FFN (its peak). Safe where the ReLU output has one consumer,
    so the incoming gradient is that consumer's fresh result and nobody else's."""

    @staticmethod
    def forward(x: Tensor) -> Tensor:
        return torch.relu(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor], output: Tensor) -> None:
        ctx.save_for_backward(output)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (out,) = ctx.saved_tensors
        # relu's own backward op, written into the gradient it reads (no mask tensor either)
        return torch.ops.aten.threshold_backward.grad_input(grad, out, 0, grad_input=grad)


def relu_single_use(x: Tensor) -> Tensor:
    """`relu(x)` for an output used once (see _Relu); the same values forward and backward. Plain under
    torch.compile: the traced backward is functional, and the compiler plans its buffers itself."""
    if torch.is_grad_enabled() and x.requires_grad and not torch.compiler.is_compiling():
        return _Relu.apply(x)
    return torch.relu(x)
