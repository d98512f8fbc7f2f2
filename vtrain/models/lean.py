"""Keep fewer activations without changing a single output: a tensor that backward needs but that is cheap to make
again from tensors kept anyway is not kept, it is made again when backward asks for it (docs/recompute.md §3).

`remat(consumer, (producer, args), ...)` computes `consumer(producer(*args), ...)`; of the tensors autograd saves on
the way, those that share storage with a producer's output are replaced by a recipe, and the first backward that
unpacks one runs `producer(*args)` again (no grad, under the autocast state of the forward) and hands out the same
view of the new result. The producer must be deterministic and draw no random numbers (an activation, a cast, coordinate
arithmetic, a linear layer): the recomputed tensor is then bitwise the one that was dropped, so outputs and
gradients are bitwise unchanged. `lean_norm(norm, x)` does the same for the fp32 copy of a 16-bit input that
CUDA autocast makes for layer/group norms (its fp32 list) and that the norm would keep for backward.

Both work through `torch.autograd.graph.saved_tensors_hooks`. Inside an activation checkpoint (torch's
non-reentrant `checkpoint`, full or selective), whose own hooks keep nothing in the forward and the tensors of its
recomputation until backward unpacks them, they hand every saved tensor on to the checkpoint's hooks, and a
dropped one as a one-element placeholder of the same shape, dtype and device that carries its recipe: the
recomputation then keeps the recipe's inputs instead of the dropped tensor, and backward makes it from them (the
checkpoint checks only shape, dtype and device of what it recomputes). Under other saved-tensor hooks (a user's,
CPU offload) they compute plainly and keep what autograd keeps.
Under `torch.compile` they compute plainly too (`torch.compiler.is_compiling()`): dynamo cannot trace the hook
stack or storage identities (each use would break the graph), and AOTAutograd's partitioner already chooses what
backward keeps and what it recomputes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import saved_tensors_hooks

_LOW = (torch.bfloat16, torch.float16)
_DEVICES = ("cpu", "cuda")


def _outer() -> tuple | None | bool:
    """Where the rules below may drop a tensor: `_enclosing_hooks()`, or True (compute plainly) when nothing is
    saved for backward or dynamo is tracing (its own partitioner decides what backward keeps)."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return True
    return _enclosing_hooks()


def _enclosing_hooks() -> tuple | None | bool:
    """The saved-tensor hooks active now: None (none), the (pack, unpack) pair of torch's checkpoint (its forward
    or its recomputation), or True (other hooks, or a torch without this query: stay plain)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return True
    hooks = top(False)
    if hooks is None:
        return None
    return hooks if _is_checkpoint_hook(hooks[0]) else True


def in_checkpoint() -> bool:
    """Whether torch's checkpoint hooks are the innermost saved-tensor hooks now: in backward, that is a
    checkpointed unit running forward again (also inside a custom Function's forward, where grad mode is off)."""
    return isinstance(_enclosing_hooks(), tuple)


# torch.utils.checkpoint's own pack hooks: its forward's and its recomputation's (the names of torch 2.1-2.14; 2.14
# also marks them `_checkpoint_internal`)
_CHECKPOINT_PACKS = ("_checkpoint_hook.__init__.<locals>.pack_hook", "_recomputation_hook.__init__.<locals>.pack_hook")


def _is_checkpoint_hook(pack: Any) -> bool:
    if getattr(pack, "_checkpoint_internal", False):
        return True
    return getattr(pack, "__module__", "") == "torch.utils.checkpoint" and \
        getattr(pack, "__qualname__", "") in _CHECKPOINT_PACKS


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
            # the inputs can go now: a second saved view (softmax keeps the weights the op also keeps) may hold
            # this recipe until a later backward, and needs only the value
            self.producer = self.args = None
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
    """What autograd holds instead of a saved tensor: the tensor itself, or a recipe and the view to take; inside
    a checkpoint, what the checkpoint's pack returned (for a dropped tensor: for its placeholder) and the view."""

    __slots__ = ("tensor", "recipe", "view", "inner", "unpack")

    def __init__(self, t: Tensor) -> None:
        self.tensor: Tensor | None = t
        self.recipe: _Recipe | None = None
        self.view: tuple = ()
        self.inner, self.unpack = None, None

    def settle(self, recipe: _Recipe | None, outer: tuple | None) -> None:
        """Drop the tensor for `recipe` (if any); inside a checkpoint, hand it (or its placeholder) on."""
        t = self.tensor
        if recipe is not None:
            self.view = (t.size(), t.stride(), t.storage_offset())
            self.tensor, self.recipe = None, recipe
        if outer is not None:
            self.inner = outer[0](t if recipe is None else _placeholder(t, recipe))
            self.tensor, self.recipe, self.unpack = None, None, outer[1]

    def get(self) -> Tensor:
        if self.unpack is not None:
            t = self.unpack(self.inner)
            recipe = getattr(t, "_vtrain_recipe", None)  # the placeholder the recomputation handed on
            return t if recipe is None else recipe.make().as_strided(*self.view)
        if self.tensor is not None:
            return self.tensor
        return self.recipe.make().as_strided(*self.view)


def _placeholder(t: Tensor, recipe: _Recipe) -> Tensor:
    ph = torch.empty((), dtype=t.dtype, device=t.device).expand(t.shape)
    ph._vtrain_recipe = recipe
    return ph


class _Recorder:
    """Saved-tensor hooks that keep each saved tensor or drop it for the recipe `choose(tensor)` returns; inside a
    checkpoint they hand every saved tensor (or placeholder) on to the checkpoint's hooks, in the order autograd
    saved them. That happens at once where `choose` can tell, so parameters reach the checkpoint while the engine
    has them gathered (ZeRO-3 releases them after each module's forward); tensors saved while the producers of
    `remat` still run wait for `settle()`, called once their outputs are known."""

    def __init__(self, choose: Callable[[Tensor], Any], outer: tuple | None) -> None:
        self.choose, self.outer = choose, outer
        self.waiting: list[_Saved] = []

    def pack(self, t: Tensor) -> _Saved:
        s = _Saved(t)
        if isinstance(t, nn.Parameter):
            s.settle(None, self.outer)  # never a producer's output
            return s
        if self.waiting or (recipe := self.choose(t)) is _LATER:
            self.waiting.append(s)
        else:
            s.settle(recipe, self.outer)
        return s

    def settle(self) -> None:
        for s in self.waiting:
            s.settle(self.choose(s.tensor), self.outer)
        self.waiting.clear()

    def run(self, fn: Callable[[], Any]) -> Any:
        try:
            with saved_tensors_hooks(self.pack, _Saved.get):
                out = fn()
            self.settle()
        finally:
            # the graph keeps the pack hook, and so this object, as long as it lives: let go of the recipes
            self.choose, self.outer = None, None
        return out


_LATER = object()  # `choose`: not known yet


def remat(consumer: Callable[..., Any], *products: tuple[Callable[..., Tensor], tuple[Any, ...]]) -> Any:
    """`consumer(*outs)` with `outs[i] = producer_i(*args_i)` for `products = ((producer_i, args_i), ...)`; backward
    keeps the `args_i` instead of whatever it saves of the outputs (each made again when first needed)."""
    outer = _outer()
    if outer is True:
        return consumer(*(fn(*args) for fn, args in products))
    recipes: dict[int, _Recipe] = {}

    def choose(t: Tensor) -> Any:
        return recipes.get(id(t.untyped_storage())) if recipes else _LATER

    def run() -> Any:
        outs = [fn(*args) for fn, args in products]
        # what the producers saved can be told apart now (a producer may save its own output: softmax)
        recipes.update({id(o.untyped_storage()): _Recipe(fn, a) for o, (fn, a) in zip(outs, products)})
        recorder.settle()
        return consumer(*outs)

    recorder = _Recorder(choose, outer)
    return recorder.run(run)


def remat_in_checkpoint(consumer: Callable[..., Any], *products: tuple[Callable[..., Tensor], tuple[Any, ...]]) -> Any:
    """`remat` inside an activation checkpoint, plain outside it. For producers whose output is smaller than their
    inputs (a 16-bit cast of an fp32 tensor, the fp32 sum of a kept tensor and a 16-bit one): keeping the inputs
    pays only where they are kept anyway, as a checkpointed layer's recomputation keeps the layer's inputs."""
    if isinstance(_outer(), tuple):
        return remat(consumer, *products)
    return consumer(*(fn(*args) for fn, args in products))


def lean_norm(norm: nn.Module, x: Tensor, source: tuple[Callable[..., Tensor], tuple[Any, ...]] | None = None,
              call: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """`norm(x)` for a LayerNorm or GroupNorm; if autocast runs it on an fp32 copy of the 16-bit `x` (CUDA's fp32
    list), that copy is made again from `x` in backward instead of being kept (half the bytes). `source=(fn, args)`:
    `x` is `fn(*args)`, a layout copy of tensors kept anyway; backward then keeps `args` instead of `x` or its fp32
    copy. `call`: the norm's own forward, for a norm module that calls this from its forward."""
    run = call or norm
    low = x.dtype in _LOW
    outer = _outer() if low or source is not None else True
    if outer is True:
        return run(x)
    own = {id(p) for p in norm.parameters()}
    storage = id(x.untyped_storage())
    if source is None:
        itself, copy = None, _Recipe(Tensor.float, (x,))
    else:
        fn, args = source
        itself, copy = _Recipe(fn, args), _Recipe(lambda *a: fn(*a).float(), args)

    def choose(t: Tensor) -> _Recipe | None:
        # the norm keeps its input (x itself, or its fp32 copy: the tensor of x's shape in fp32), weight, bias and
        # statistics
        if id(t) in own:
            return None
        if id(t.untyped_storage()) == storage:
            return itself
        is_copy = low and t.dtype == torch.float32 and t.shape == x.shape and t.dim() >= 2
        return copy if is_copy else None

    return _Recorder(choose, outer).run(lambda: run(x))


class LeanLayerNorm(nn.LayerNorm):
    """A LayerNorm that keeps a 16-bit input rather than autocast's fp32 copy of it (lean_norm). Made by switching
    the class of an existing LayerNorm inside a model that is not ours (the same parameters and state-dict keys)."""

    def forward(self, x: Tensor) -> Tensor:
        return lean_norm(self, x, call=super().forward)


_REMAKING = [0]  # depth of `remaking()` blocks running now


@contextlib.contextmanager
def remaking() -> Iterator[None]:
    """Marks work a backward does again that its forward already did (a hidden layer remade from its kept input
    inside a custom autograd Function, where no module forward runs), so the memory planner's tracer
    (vtrain/memory/tracker.py) counts its FLOPs as recomputation, the cost it weighs against the bytes saved."""
    _REMAKING[0] += 1
    try:
        yield
    finally:
        _REMAKING[0] -= 1


def is_remaking() -> bool:
    return _REMAKING[0] > 0


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
