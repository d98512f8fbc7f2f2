"""The fused deformable-attention op (Triton, run by the Triton interpreter on CPU) against a float64 run of the
PyTorch path; the custom-op contract (fake kernel, autograd, what backward saves) and activation checkpointing."""

from __future__ import annotations

import importlib
import logging
import re
import sys

import pytest
import torch

from vtrain.models.dino import msda
from vtrain.models.dino.msda import MSDeformAttn, auto_impl, ms_deform_attn


@pytest.fixture
def poisoned(interpret, monkeypatch):
    """Every output a kernel must write starts as NaN, so an element it skips fails the comparison."""
    monkeypatch.setattr(interpret, "empty_output",
                        lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype, device=device))
    return interpret


def _inputs(shapes, b, m, d, q, p, seed, lo=-0.3, hi=1.3):
    """Random value/locations/weights (float64). A third of the locations are snapped to multiples of 1/16:
    for these small maps they land exactly on pixel centres, pixel edges and the borders (0, 1), where the
    bilinear gradient has its kinks; the kernel must take the same side as grid_sample there."""
    g = torch.Generator().manual_seed(seed)
    s = sum(h * w for h, w in shapes)
    value = torch.randn(b, s, m, d, generator=g, dtype=torch.float64)
    loc = torch.rand(b, q, m, len(shapes), p, 2, generator=g, dtype=torch.float64) * (hi - lo) + lo
    snap = torch.rand(loc.shape, generator=g) < 1 / 3
    loc = torch.where(snap, torch.round(loc * 16) / 16, loc)
    attn = torch.rand(b, q, m, len(shapes), p, generator=g, dtype=torch.float64)
    attn = attn / attn.sum((-1, -2), keepdim=True)
    return value, loc, attn


def _run(shapes, value, loc, attn, grad_out, impl):
    leaves = [t.detach().clone().requires_grad_() for t in (value, loc, attn)]
    out = ms_deform_attn(leaves[0], shapes, leaves[1], leaves[2], impl=impl)
    out.backward(grad_out.to(out.dtype))
    return out.detach(), [t.grad for t in leaves]


CASES = {
    # (level shapes, batch, heads, channels, queries, points)
    "odd-sizes-and-1x1": ([(5, 7), (1, 1), (3, 2)], 2, 2, 5, 7, 3),
    "one-level": ([(4, 6)], 1, 3, 8, 5, 2),
    "dino-head-5-levels": ([(6, 10), (3, 5), (2, 3), (1, 2), (1, 1)], 1, 2, 32, 6, 4),
}


def _check_against_float64(case):
    shapes, b, m, d, q, p = CASES[case]
    value, loc, attn = _inputs(shapes, b, m, d, q, p, seed=len(case))
    grad_out = torch.randn(b, q, m * d, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ref_out, ref_grads = _run(shapes, value, loc, attn, grad_out, "pytorch")  # float64 all the way
    out, grads = _run(shapes, value.float(), loc.float(), attn.float(), grad_out, "triton")
    assert out.dtype == torch.float32 and [g.dtype for g in grads] == [torch.float32] * 3
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    for name, got, ref in zip(("value", "locations", "weights"), grads, ref_grads):
        # location gradients scale with the map size (d loc = size * d pixel)
        torch.testing.assert_close(got.double(), ref, atol=1e-4 if name == "locations" else 1e-5, rtol=1e-5,
                                   msg=lambda m, n=name: f"grad {n}: {m}")


@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_gradients_match_float64_reference(case, poisoned):
    _check_against_float64(case)


def test_scalar_atomics_of_gpus_before_sm90_match_too(poisoned, monkeypatch):
    """Before sm_90 the backward adds the value gradient with scalar atomics on quarter tiles (SPLIT_RED,
    docs/msda_roofline.md §3); the interpreter runs that path when the capability says 8.0. D = 5: the quarter
    tiles' channel masks matter."""
    monkeypatch.setattr(poisoned, "_capability", lambda t: (8, 0))
    launches = []
    real = poisoned.backward_launch
    monkeypatch.setattr(poisoned, "backward_launch", lambda *a: launches.append(real(*a)) or launches[-1])
    _check_against_float64("odd-sizes-and-1x1")
    assert launches and all(launch.kwargs["SPLIT_RED"] for launch in launches)


def test_bf16_and_fp16_inputs_at_their_tolerance(poisoned):
    """DINO under autocast: bf16 value and grad_out, fp32 locations and weights. The reference is float64 on the
    same rounded inputs, so the only error left is the fp32 accumulation and one rounding of each output."""
    shapes, b, m, d, q, p = CASES["odd-sizes-and-1x1"]
    value, loc, attn = _inputs(shapes, b, m, d, q, p, seed=7)
    grad_out = torch.randn(b, q, m * d, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    for low, tol in ((torch.bfloat16, 1.6e-2), (torch.float16, 2e-3)):
        v, go = value.to(low), grad_out.to(low)
        ref_out, ref_grads = _run(shapes, v.double(), loc, attn, go.double(), "pytorch")
        out, grads = _run(shapes, v, loc.float(), attn.float(), go, "triton")
        assert out.dtype == low and grads[0].dtype == low and grads[1].dtype == torch.float32
        torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=tol)
        torch.testing.assert_close(grads[0].double(), ref_grads[0], atol=tol, rtol=tol)
        torch.testing.assert_close(grads[1].double(), ref_grads[1], atol=1e-3, rtol=1e-4)
        torch.testing.assert_close(grads[2].double(), ref_grads[2], atol=1e-4, rtol=1e-4)
    # everything in bf16 (locations too): still computed in fp32 from the rounded locations
    out, _ = _run(shapes, value.bfloat16(), loc.bfloat16(), attn.bfloat16(), grad_out, "triton")
    ref = ms_deform_attn(value.bfloat16().double(), shapes, loc.bfloat16().double(), attn.bfloat16().double(),
                         impl="pytorch")
    torch.testing.assert_close(out.double(), ref, atol=1.6e-2, rtol=1.6e-2)


def test_zeroed_padding_and_points_far_outside(poisoned):
    """The caller zeroes padded value rows (masked_fill, docs/msda_kernels.md §4.1): samples that only see padding or
    lie far outside every map give exactly zero, and so do their location and weight gradients; the value
    gradient still reaches the zeroed rows."""
    shapes = [(4, 6), (2, 3)]
    b, m, d, q, p = 1, 2, 4, 6, 2
    value, loc, attn = _inputs(shapes, b, m, d, q, p, seed=3)
    # pad the right half of each level: columns >= w/2 are zero
    for lvl, (h, w) in enumerate(shapes):
        start = sum(hh * ww for hh, ww in shapes[:lvl])
        rows = value[:, start:start + h * w].view(b, h, w, m, d)
        rows[:, :, w // 2:] = 0
    loc[:, :3, ..., 0] = 0.5 + 1.0 / 6 + torch.rand(b, 3, m, 2, p, dtype=torch.float64) / 3  # right half only
    loc[:, 3:5] = torch.tensor([-7.0, 1e6], dtype=torch.float64)  # far outside (and a huge coordinate)
    loc[:, 5] = float("-inf")
    grad_out = torch.randn(b, q, m * d, dtype=torch.float64)
    ref_out, ref_grads = _run(shapes, value, loc[:, :5], attn[:, :5], grad_out[:, :5], "pytorch")
    out, grads = _run(shapes, value.float(), loc.float(), attn.float(), grad_out, "triton")
    assert (out[:, :3] == 0).all() and (out[:, 3:] == 0).all()
    torch.testing.assert_close(out[:, :5].double(), ref_out, atol=1e-6, rtol=0)
    assert (grads[1][:, 3:] == 0).all() and (grads[2][:, 3:] == 0).all()
    torch.testing.assert_close(grads[0].double(), ref_grads[0], atol=1e-5, rtol=1e-5)
    assert grads[0].abs().sum() > 0


def test_impl_choice_and_bad_input(interpret):
    shapes = [(2, 3)]
    value, loc, attn = _inputs(shapes, 1, 1, 2, 3, 1, seed=0)
    assert msda.resolve_impl("auto", value.float(), loc.float(), attn.float()) == "pytorch"  # CPU tensors
    with auto_impl("triton"):
        assert msda.resolve_impl("auto", value.float(), loc.float(), attn.float()) == "triton"
    assert msda.resolve_impl("auto", value.float(), loc.float(), attn.float()) == "pytorch"
    with pytest.raises(ValueError, match="impl must be one of"):
        ms_deform_attn(value, shapes, loc, attn, impl="cuda")
    with pytest.raises(ValueError, match="fp32, bf16 or fp16"):
        ms_deform_attn(value, shapes, loc, attn, impl="triton")  # float64 is the reference's, not the kernel's
    with pytest.raises(ValueError, match="do not match"):
        ms_deform_attn(value, [(3, 3)], loc, attn)
    with pytest.raises(ValueError, match="expected value"):
        ms_deform_attn(value, shapes, loc[..., 0], attn)


def test_custom_op_contract_and_what_backward_saves(interpret):
    """opcheck: schema, the fake kernels against the real ones, the autograd registration, AOT dispatch. Backward
    keeps exactly value, locations and weights, in real runs and under FakeTensorMode (what estimate-memory
    traces)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    shapes, flat = [(3, 4), (1, 1)], [3, 4, 1, 1]
    value, loc, attn = (t.float().requires_grad_() for t in _inputs(shapes, 1, 2, 4, 3, 2, seed=5))
    grad_out = torch.randn(1, 3, 8)
    torch.library.opcheck(torch.ops.vtrain.ms_deform_attn.default, (value, flat, loc, attn))
    torch.library.opcheck(torch.ops.vtrain.ms_deform_attn_backward.default,
                          (grad_out, value.detach(), flat, loc.detach(), attn.detach()),
                          test_utils=("test_schema", "test_faketensor"))

    def saved_by_forward(v, lc, a):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = ms_deform_attn(v, shapes, lc, a, impl="triton")
        return out, saved

    out, saved = saved_by_forward(value, loc, attn)
    assert [t.untyped_storage().data_ptr() for t in saved] == \
        [t.untyped_storage().data_ptr() for t in (value, loc, attn)]
    plain = (value.detach().bfloat16(), loc.detach(), attn.detach())
    with FakeTensorMode() as mode:
        fv, fl, fa = (mode.from_tensor(t).requires_grad_() for t in plain)
        fout, fsaved = saved_by_forward(fv, fl, fa)
        assert fout.shape == out.shape and fout.dtype == torch.bfloat16  # value's dtype
        assert [t.shape for t in fsaved] == [t.shape for t in saved]
        fout.sum().backward()
        assert fv.grad.dtype == torch.bfloat16 and fl.grad.dtype == torch.float32


def test_one_op_under_torch_compile(interpret):
    shapes = [(3, 4), (2, 2)]
    value, loc, attn = (t.float() for t in _inputs(shapes, 1, 2, 4, 3, 2, seed=6))

    def f(v, lc, a):
        return ms_deform_attn(v, shapes, lc, a, impl="triton").square().sum()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)  # fullgraph: no graph break at the op
    leaves = [t.clone().requires_grad_() for t in (value, loc, attn)]
    compiled(*leaves).backward()
    eager = [t.clone().requires_grad_() for t in (value, loc, attn)]
    f(*eager).backward()
    for a, b in zip(leaves, eager):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-6)


def test_encoder_checkpointing_with_the_fused_op_gives_equal_gradients(interpret):
    """Non-reentrant checkpointing recomputes the op's forward inside backward; the result must not change."""
    from vtrain.models.dino.transformer import Encoder

    shapes = [(4, 5), (2, 3)]
    s = sum(h * w for h, w in shapes)
    g = torch.Generator().manual_seed(0)
    src, pos = torch.randn(1, s, 16, generator=g), torch.randn(1, s, 16, generator=g)
    mask = torch.zeros(1, s, dtype=torch.bool)
    mask[0, 15:20] = True  # a padded column on level 0

    def run(ckpt):
        torch.manual_seed(0)
        enc = Encoder(layers=1, dim=16, ffn=32, levels=2, heads=2, points=2)
        with torch.no_grad():
            enc.layers[0].attn.sampling_offsets.weight.normal_(std=0.3)  # leave the init's integer pixel offsets
        enc.grad_ckpt = ckpt
        x = src.clone().requires_grad_()
        with auto_impl("triton"):
            out = enc(x, pos, shapes, torch.ones(1, 2, 2), mask)
            out.square().sum().backward()
        return out.detach(), x.grad, {n: p.grad for n, p in enc.named_parameters()}

    out, xg, grads = run(False)
    out_c, xg_c, grads_c = run(True)
    torch.testing.assert_close(out_c, out)
    torch.testing.assert_close(xg_c, xg, atol=1e-6, rtol=1e-5)
    for n, gr in grads.items():
        torch.testing.assert_close(grads_c[n], gr, atol=1e-6, rtol=1e-5, msg=n)


def test_module_feeds_fp32_locations_and_weights_and_returns_the_compute_dtype(monkeypatch):
    """No fp32 island: under bf16 autocast the value stays bf16, locations and weights are fp32."""
    seen = {}
    real = msda.ms_deform_attn

    def spy(value, shapes, loc, attn, impl="auto"):
        seen.update(value=value.dtype, loc=loc.dtype, attn=attn.dtype)
        return real(value, shapes, loc, attn, impl=impl)

    monkeypatch.setattr(msda, "ms_deform_attn", spy)
    torch.manual_seed(0)
    attn = MSDeformAttn(dim=16, levels=2, heads=2, points=2)
    shapes = [(4, 4), (2, 2)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attn(torch.randn(1, 5, 16), torch.rand(1, 5, 2, 2), torch.randn(1, 20, 16), shapes)
    assert seen == {"value": torch.bfloat16, "loc": torch.float32, "attn": torch.float32}
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


# ---- impl="auto" falls back once, with one warning; impl="triton" raises --------------------------------------
@pytest.fixture
def as_on_gpu(interpret, monkeypatch, caplog):
    """impl='auto' as on a CUDA GPU of compute capability 9.0, before the per-process decision: CPU tensors take
    the GPU branch and the kernels run in the interpreter. Yields the captured log records."""
    monkeypatch.setattr(msda, "_fallback_reason", None)
    monkeypatch.setattr(msda, "_triton_reason", None)
    monkeypatch.setattr(msda, "_on_gpu", lambda t: True)
    monkeypatch.setattr(msda, "_gpu_capability", lambda t: (9, 0))
    caplog.set_level(logging.WARNING, logger=msda.__name__)
    return caplog


def _no_triton(mp: pytest.MonkeyPatch) -> None:
    mp.setitem(sys.modules, "vtrain.models.dino.msda_triton", None)  # the import raises ImportError
    mp.delattr(importlib.import_module("vtrain.models.dino"), "msda_triton")


def _old_gpu(mp: pytest.MonkeyPatch) -> None:
    mp.setattr(msda, "_gpu_capability", lambda t: (7, 5))


def _compile_fails(mp: pytest.MonkeyPatch) -> None:
    def fail(*args):
        raise RuntimeError("injected: out of resources\nmore lines of the compiler's report")

    mp.setattr(importlib.import_module("vtrain.models.dino.msda_triton"), "forward", fail)


def _other_rank_fails(mp: pytest.MonkeyPatch) -> None:
    mp.setattr(msda, "_all_true", lambda flag, device=None: False)  # the MIN all-reduce over ranks says no


FALLBACKS = {
    "triton-missing": (_no_triton, "Triton is not importable (ModuleNotFoundError"),
    "gpu-too-old": (_old_gpu, "compute capability 7.5, the Triton kernels need 8.0 or newer"),
    "compile-or-launch-fails": (_compile_fails, "failed (RuntimeError: injected: out of resources)"),
    "another-rank-fails": (_other_rank_fails, "cannot run on another rank"),
}


@pytest.mark.parametrize("case", list(FALLBACKS))
def test_auto_falls_back_once_with_one_warning_naming_the_reason(case, as_on_gpu):
    breakage, reason = FALLBACKS[case]
    shapes = [(3, 4), (1, 2)]
    value, loc, attn = (t.float() for t in _inputs(shapes, 1, 2, 4, 3, 2, seed=8))
    expected = msda.ms_deform_attn_pytorch(value, shapes, loc, attn)
    with pytest.MonkeyPatch.context() as mp:
        breakage(mp)
        out = ms_deform_attn(value, shapes, loc, attn)  # impl="auto"
    assert torch.equal(out, expected)
    records = [r for r in as_on_gpu.records if r.name == msda.__name__]
    assert len(records) == 1 and "\n" not in records[0].getMessage()
    assert "falls back to the PyTorch path" in records[0].getMessage() and reason in records[0].getMessage()
    # decided for the process: with the cause gone, later calls still take the PyTorch path and say nothing
    assert torch.equal(ms_deform_attn(value, shapes, loc, attn), expected)
    assert msda.resolve_impl("auto", value, loc, attn) == "pytorch"
    assert len([r for r in as_on_gpu.records if r.name == msda.__name__]) == 1


def test_auto_uses_the_kernels_when_they_run_and_decides_once(as_on_gpu, monkeypatch):
    shapes = [(3, 4), (1, 2)]
    value, loc, attn = (t.float() for t in _inputs(shapes, 1, 2, 4, 3, 2, seed=9))
    probes = []
    real_probe = msda._launch_reason
    monkeypatch.setattr(msda, "_launch_reason", lambda *a: probes.append(1) or real_probe(*a))
    out = ms_deform_attn(value, shapes, loc, attn)
    out2 = ms_deform_attn(value, shapes, loc, attn)
    assert probes == [1] and msda._fallback_reason == "" and not as_on_gpu.records
    assert torch.equal(out, out2)
    torch.testing.assert_close(out, msda.ms_deform_attn_pytorch(value, shapes, loc, attn), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["triton-missing", "gpu-too-old"])
def test_impl_triton_raises_instead_of_falling_back(case, as_on_gpu):
    breakage, reason = FALLBACKS[case]
    shapes = [(2, 3)]
    value, loc, attn = (t.float() for t in _inputs(shapes, 1, 1, 2, 3, 1, seed=0))
    with pytest.MonkeyPatch.context() as mp:
        breakage(mp)
        with pytest.raises(RuntimeError, match=r"ms_deform_attn\(impl='triton'\): .*" + re.escape(reason)):
            ms_deform_attn(value, shapes, loc, attn, impl="triton")
    assert msda._fallback_reason is None and not as_on_gpu.records


def test_auto_compiles_without_a_graph_break_once_decided(as_on_gpu, monkeypatch):
    """The per-process decision is a module global after the first call: torch.compile folds it into the graph."""
    monkeypatch.setattr(msda, "_fallback_reason", "")  # decided: the kernels run
    shapes = [(3, 4), (2, 2)]
    value, loc, attn = (t.float() for t in _inputs(shapes, 1, 2, 4, 3, 2, seed=6))

    def f(v, lc, a):
        return ms_deform_attn(v, shapes, lc, a).square().sum()  # impl="auto"

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(value, loc, attn), f(value, loc, attn))
