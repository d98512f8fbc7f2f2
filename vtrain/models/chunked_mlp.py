"""A residual two-layer ReLU MLP, `x + fc2(relu(fc1(x)))`, run over the rows of `x` a chunk at a time, forward and
backward, that keeps only its (16-bit) input for backward (docs/recompute.md §3).

DINO's encoder FFN is 2048 wide over every token of every level: at 800x1333, batch 2, its hidden layer is 0.68 GiB
in bf16, and backward needs it and its gradient at once. Made again in backward a chunk of rows at a time, neither
is ever larger than a chunk: the hidden layer costs one more fc1 matmul (as `ffn_recompute` always did) and at
most 2 x chunk x hidden elements at a time, inside a checkpointed layer as well as outside (a custom autograd
Function keeps its input through whatever saved-tensor hooks are active).

Numbers. Each output row and each input-gradient row is computed by the same ops from the same row, so they do
not depend on the chunking (bitwise on CPU, tests/models/test_lean.py; a GPU library may pick another kernel for another
row count). The weight and bias gradients are sums over all rows: with one chunk they are computed by exactly the
ops autograd uses for `F.linear` (bitwise today's); with several chunks each chunk's product is accumulated in
fp32 (exact products of 16-bit inputs, fp32 sums, as a 16-bit GEMM accumulates internally) and rounded once to
the weight's dtype, so they differ from one long GEMM only by the order of the fp32 additions: within one
rounding step of the parameter dtype, stated and measured in tests/models/test_lean.py.

The Function reads fc1's and fc2's weights itself, outside their own forward. FSDP2 shards whole blocks, so they are
gathered with the block; DeepSpeed ZeRO-3 gathers a partitioned parameter that a forward reads and registers it with
the module running (its `ZeROOrderedDict`, deepspeed/runtime/zero/parameter_offload.py), which gathers it again for
backward (tests/integration/test_recompute_dist.py runs ZeRO-3 with every parameter partitioned).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake

from vtrain.models.lean import autocast_input, remaking


_MIXED_MM: list[bool] = []  # whether this torch has `mm(..., out_dtype=)`, learnt on first use


def _mm_fp32(a: Tensor, b: Tensor) -> Tensor:
    """`a @ b` with fp32 output: exact products of 16-bit inputs summed in fp32. CUDA (and the estimator's fake
    tensors, which trace a GPU run) has a mixed-dtype mm in recent torch (2.14: `aten::mm.dtype`, CUDA-only); the
    CPU, and a torch without it, widen the inputs first, which gives the same products (and a transient fp32 copy
    of the chunk)."""
    if a.dtype == torch.float32:
        return a.mm(b)
    if (a.device.type == "cuda" or is_fake(a)) and _MIXED_MM != [False]:
        try:
            out = torch.mm(a, b, out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError):
            _MIXED_MM[:] = [False]
        else:
            _MIXED_MM[:] = [True]
            return out
    return a.float().mm(b.float())


class _ResidualMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, res: Tensor, x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor, chunk: int) -> Tensor:
        rows, res_rows = x.reshape(-1, x.shape[-1]), res.reshape(-1, res.shape[-1])
        # the sum's dtype as `res + y` promotes it (fp32 residual stream + 16-bit MLP output: fp32)
        out = res_rows.new_empty(res_rows.shape, dtype=torch.result_type(res, b2))
        for s in range(0, max(rows.shape[0], 1), chunk):
            # F.linear's ops on a row block; relu in place (the same values as relu)
            h = torch.addmm(b1, rows[s:s + chunk], w1.t()).relu_()
            torch.add(res_rows[s:s + chunk], torch.addmm(b2, h, w2.t()), out=out[s:s + chunk])
            del h  # before the next chunk's is made
        ctx.save_for_backward(x, w1, b1, w2)
        ctx.chunk, ctx.b2_dtype = chunk, b2.dtype
        return out.view(res.shape)

    @staticmethod
    def backward(ctx: Any, grad: Tensor):
        x, w1, b1, w2 = ctx.saved_tensors
        rows, g = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        n, chunk = rows.shape[0], ctx.chunk
        gx = torch.empty_like(rows) if ctx.needs_input_grad[1] else None
        # one chunk: the ops autograd runs for F.linear, in the 16-bit dtype; several: fp32 sums, rounded once
        one = n <= chunk
        mm = torch.mm if one else _mm_fp32
        wide = {} if one else {"dtype": torch.float32}
        sums = None  # d(w1), d(b1), d(w2), d(b2)
        for s in range(0, max(n, 1), chunk):
            # the sum's gradient as the MLP output's dtype takes it (what autograd's add does), a chunk at a time
            xc, gc = rows[s:s + chunk], g[s:s + chunk].to(ctx.b2_dtype)
            with remaking():  # the forward's fc1 again: recomputation, for the planner's count
                h = torch.addmm(b1, xc, w1.t()).relu_()
            part = [None, None, mm(gc.t(), h), gc.sum(0, **wide)]
            gh = gc.mm(w2)
            # relu's backward op, written into the gradient it reads: zero where the output is zero
            gh = torch.ops.aten.threshold_backward.grad_input(gh, h, 0, grad_input=gh)
            del h
            part[:2] = mm(gh.t(), xc), gh.sum(0, **wide)
            if gx is not None:
                torch.mm(gh, w1, out=gx[s:s + chunk])
            del gh
            sums = part if sums is None else [a.add_(b) for a, b in zip(sums, part)]
        gw1, gb1, gw2, gb2 = (a.to(dt) for a, dt in zip(sums, (w1.dtype, b1.dtype, w2.dtype, ctx.b2_dtype)))
        # the residual's gradient is the sum's (add's backward)
        return grad, (gx.view_as(x) if gx is not None else None), gw1, gb1, gw2, gb2, None


def residual_mlp(x: Tensor, fc1: nn.Linear, fc2: nn.Linear, chunk: int) -> Tensor:
    """`x + fc2(relu(fc1(x)))` over `chunk` rows of `x` at a time (chunk <= 0: all rows at once), keeping only `x`
    as autocast casts it for the matmuls (a 16-bit copy under autocast) for backward; the MLP's output never exists
    whole either. Under autocast the weights are cast as autocast casts them.

    Plain under torch.compile (as lean.py): dynamo cannot trace the Function's chunk loop over a symbolic row count,
    `torch.result_type` or `new_empty` (graph breaks), and AOTAutograd's partitioner decides what backward keeps."""
    if torch.compiler.is_compiling():
        return x + fc2(torch.relu(fc1(x)))
    rows = x.numel() // x.shape[-1]
    chunk = rows if chunk <= 0 else min(chunk, max(rows, 1))
    c = autocast_input
    return _ResidualMLP.apply(x, c(x), c(fc1.weight), c(fc1.bias), c(fc2.weight), c(fc2.bias), chunk)
