"""Where Swin's training memory goes, by the aten op that made each storage (fake tensors: no real memory, no GPU).

One bf16 forward + backward traced with vtrain's estimator (`vtrain.memory.trace`: `LiveBytes` and the CUDA
autocast policy), here with each storage tagged with the op that created it. Printed per case: the activation
peak (the estimator's figure), the storages live at that peak and at the end of the forward (what backward
keeps) grouped by op and dtype, and the part that is N x N per window (N = window area: attention matrices,
masks, biases).

Cases: (a) the Swin-L/12 backbone alone at 768x1152, batch 2 (docs/memory_ckpt.md §1.5: 9.48 GiB of activations),
`forward_features`; (b) DINO `swin-l` at 800x1333, batch 2, through the estimator's own `trace_step`.
`--timm` traces timm's blocks as they are (the "before"); the default traces vtrain's models, whose Swin blocks
use `vtrain.models.swin_attention` (the "after").

SDPA calls with a trainable bias are traced through CUDA's memory-efficient kernel, as the estimator's CUDA policy
does (`memory._cuda_sdpa`): on CPU they would fall back to the math kernel and materialise the attention matrix.

    OMP_NUM_THREADS=1 python benchmarks/swin_mask_memory.py --case backbone --timm
    OMP_NUM_THREADS=1 python benchmarks/swin_mask_memory.py --case backbone
    OMP_NUM_THREADS=1 python benchmarks/swin_mask_memory.py --case dino --grad-ckpt none
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import timm
import torch
from torch.utils._pytree import tree_leaves

from vtrain.memory import trace as memory
from vtrain.memory.setup import Setup
from vtrain.models import swin_attention

GiB = 2**30


class OpLiveBytes(memory.LiveBytes):
    """LiveBytes that also remembers, for each storage, the op, shape and dtype it was created with."""

    last: OpLiveBytes | None = None

    def __init__(self, existing: list[torch.Tensor], *args) -> None:
        super().__init__(existing, *args)
        self.origin: dict[int, tuple[str, tuple[int, ...], torch.dtype]] = {}
        self.forward_end: int | None = None  # len(events) when the forward returned
        OpLiveBytes.last = self

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        first_new = self.next_key
        out = super().__torch_dispatch__(func, types, args, kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                key = self.key_of(t)
                if key is not None and key >= first_new and key not in self.origin:
                    self.origin[key] = (func.__name__, tuple(t.shape), t.dtype)
        return out

    def live_at(self, stop: int, exclude: set[int]) -> set[int]:
        live: set[int] = set()
        for key, n in self.events[:stop]:
            if key < 0 or key in exclude:
                continue
            if n > 0:
                live.add(key)
            else:
                live.discard(key)
        return live

    def peak_index(self, exclude: set[int]) -> int:
        live = peak = 0
        at = 0
        for i, (key, n) in enumerate(self.events):
            if key not in exclude and key >= 0:
                live += n
                if live > peak:
                    peak, at = live, i + 1
        return at


def trace_backbone(size: tuple[int, int], batch: int, patched: bool, dynamic: bool) -> tuple[OpLiveBytes, set[int]]:
    """Case (a): timm Swin-L/12 `forward_features` + mean loss, bf16 autocast, CUDA fp32 list, fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    kwargs = {"strict_img_size": False} if dynamic else {"img_size": size}
    with torch.device("meta"):
        model = timm.create_model("swin_large_patch4_window12_384", num_classes=0, **kwargs)
    if patched:
        swin_attention.use_shared_bias_attention(model)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        model.train()
        x = torch.randn(batch, 3, *size)
        tracker = OpLiveBytes([*model.parameters(), *model.buffers(), x])
        with tracker, memory.cuda_autocast_policy():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = model.forward_features(x)
            tracker.forward_end = len(tracker.events)
            y.float().mean().backward()
        grads = {tracker.key_of(p.grad) for p in model.parameters() if p.grad is not None} - {None}
    return tracker, grads


def trace_dino(grad_ckpt: tuple[str, ...], patched: bool) -> tuple[OpLiveBytes, set[int]]:
    """Case (b): the estimator's own trace_step for DINO swin-l at 800x1333, batch 2, bf16."""
    built = []
    build = memory.build_model

    def build_and_mark(setup):
        model = build(setup)
        built.append(model)
        # the end of the forward, for the "saved for backward" breakdown
        model.register_forward_hook(lambda *_: setattr(OpLiveBytes.last, "forward_end", len(OpLiveBytes.last.events)))
        return model

    from vtrain.models.dino import detector

    saved = (memory.LiveBytes, memory.build_model, detector.use_shared_bias_attention)
    memory.LiveBytes, memory.build_model = OpLiveBytes, build_and_mark
    if not patched:
        detector.use_shared_bias_attention = lambda model: 0
    try:
        setup = Setup(task="dino", preset="swin-l", batch_size=2, image_size=(800, 1333), precision="bf16",
                      grad_ckpt=grad_ckpt)
        memory.trace_step(setup)
    finally:
        memory.LiveBytes, memory.build_model, detector.use_shared_bias_attention = saved
    tracker = OpLiveBytes.last
    grads = {tracker.key_of(p.grad) for p in built[-1].parameters() if p.grad is not None} - {None}
    return tracker, grads


def breakdown(tracker: OpLiveBytes, keys: set[int], window_areas: set[int], top: int) -> list[str]:
    sizes = {k: n for k, n in tracker.events if n > 0}
    by_op: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    square = 0
    for key in keys:
        n = sizes[key]
        op, shape, dtype = tracker.origin.get(key, ("?", (), None))
        entry = by_op[(op, str(dtype).replace("torch.", ""))]
        entry[0] += n
        entry[1] += 1
        if len(shape) >= 2 and shape[-1] == shape[-2] and shape[-1] in window_areas:
            square += n
    total = sum(v[0] for v in by_op.values())
    lines = [f"    total {total / GiB:.3f} GiB; N x N per window (attention matrices/masks/biases): "
             f"{square / GiB:.3f} GiB"]
    for (op, dtype), (n, count) in sorted(by_op.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"    {n / GiB:8.3f} GiB  {count:5d} x  {op} [{dtype}]")
    return lines


def report(name: str, tracker: OpLiveBytes, grads: set[int], seconds: float, top: int) -> None:
    stop = tracker.peak_index(grads)
    print(f"== {name}: activation peak {tracker.peak(grads) / GiB:.3f} GiB, peak with gradients "
          f"{tracker.peak(set()) / GiB:.3f} GiB ({seconds:.0f} s)")
    areas = {49, 144}
    print("  live at the activation peak, by creating op:")
    print("\n".join(breakdown(tracker, tracker.live_at(stop, grads), areas, top)))
    if tracker.forward_end is not None:
        print("  live at the end of the forward (kept for backward + outputs), by creating op:")
        print("\n".join(breakdown(tracker, tracker.live_at(tracker.forward_end, grads), areas, top)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", choices=["backbone", "dino"], default="backbone")
    ap.add_argument("--timm", action="store_true", help="timm's blocks unchanged (before the fix)")
    ap.add_argument("--dynamic", action="store_true", help="(a) built with strict_img_size=False, as DINO")
    ap.add_argument("--grad-ckpt", default="none", help="(b) none, backbone, backbone,encoder")
    ap.add_argument("--top", type=int, default=8)
    args = ap.parse_args()
    patched = not args.timm
    t0 = time.perf_counter()
    if args.case == "backbone":
        tracker, grads = trace_backbone((768, 1152), 2, patched, args.dynamic)
        name = f"Swin-L/12 backbone 768x1152 b2 bf16{' dynamic' if args.dynamic else ''}"
    else:
        gc = tuple(p for p in args.grad_ckpt.split(",") if p and p != "none")
        tracker, grads = trace_dino(gc, patched)
        name = f"DINO swin-l 800x1333 b2 bf16, grad-ckpt {args.grad_ckpt}"
    name += f", {'timm blocks' if args.timm else 'vtrain blocks'}"
    report(name, tracker, grads, time.perf_counter() - t0, args.top)


if __name__ == "__main__":
    main()
