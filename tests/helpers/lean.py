"""What the tests of models/lean.py share: CPU bf16 autocast with CUDA's fp32 norms, a run's outputs and gradients,
their bit-for-bit comparison, and the encoder FFN as it was written before."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

import vtrain.models.lean as lean

AMP = dict(device_type="cpu", dtype=torch.bfloat16)
ENCLOSING_HOOKS = lean._enclosing_hooks


def grads(module, out, *inputs):
    """Backward of a fixed function of `out`; the gradients of the inputs and of every parameter."""
    (out.float() * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return [t.grad for t in inputs] + [p.grad for p in module.parameters()]


@contextlib.contextmanager
def fp32_norms():
    """CUDA autocast's fp32 list for the norms (layer_norm, group_norm), on real CPU tensors: CPU autocast would
    run them in bf16 (the estimator's cuda_autocast_policy also swaps SDPA for a kernel CPU tensors lack)."""
    saved = F.layer_norm, F.group_norm

    def up(fn):
        return lambda x, *a, **k: fn(x.float() if x.dtype == torch.bfloat16 else x, *a, **k)

    F.layer_norm, F.group_norm = up(F.layer_norm), up(F.group_norm)
    try:
        yield
    finally:
        F.layer_norm, F.group_norm = saved


def run(module, fn, *inputs):
    for p in module.parameters():
        p.grad = None
    xs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    with fp32_norms(), torch.autocast(**AMP):
        out = fn(*xs)
    return [out.detach()] + grads(module, out, *[x for x in xs if x.requires_grad])


def assert_bitwise(got, want):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert (a is None) == (b is None), i
        assert a is None or torch.equal(a, b), (i, (a - b).abs().max())


def ffn_before(m, x):
    return m.norm(x + m.fc2(F.relu(m.fc1(x))))
