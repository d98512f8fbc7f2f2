"""Fewer kept activations in chunks and inside checkpointed units (docs/recompute.md §3, changes 10-16): the encoder
FFN over token chunks, deformable attention over head chunks, `remat`/`lean_norm` inside activation checkpoints and
what a checkpointed encoder layer keeps. Each against the code it replaced: bitwise where the same ops run on the
same numbers, within a stated tolerance where sums run in another order; and the bytes saved, traced on fake
tensors under CUDA's autocast policy as `estimate-memory` traces a GPU run."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tests.helpers.batches import dino_batch as _batch
from tests.helpers.lean import (
    AMP, assert_bitwise as _assert_bitwise, ENCLOSING_HOOKS as _ENCLOSING_HOOKS, ffn_before as _ffn_before,
    fp32_norms as _fp32_norms, grads as _grads, run as _run)
import vtrain.models.lean as lean
from vtrain.config import build_config
from vtrain.errors import ConfigError
from vtrain.models.recompute_units import set_recompute
from vtrain.models.dino import DINO, msda
from vtrain.models.dino.msda import MSDeformAttn, auto_impl
from vtrain.models.dino.transformer import FFN, Encoder, EncoderBlock, LevelPositions
from vtrain.memory.trace import cuda_autocast_policy
from vtrain.memory.tracker import LiveBytes


def _within_one_rounding(got, want, dtype):
    """Each element equal up to one rounding step of `dtype` at its size (bf16: fp32 sums that differ in their last
    bits can round to neighbouring bf16 values), plus the reordering error of an fp32 sum, which does not shrink with
    the result where terms cancel: 1e-6 of the tensor's largest element (8 fp32 steps)."""
    floor = 1e-6 * float(want.abs().max())
    if dtype == torch.bfloat16:
        step = torch.finfo(torch.bfloat16).eps * torch.maximum(got.abs(), want.abs())
        assert ((got - want).abs() <= step + floor).all(), (got - want).abs().max()
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=floor)


@pytest.mark.parametrize("amp", [True, False], ids=["bf16", "fp32"])
@pytest.mark.parametrize("chunk", [64, 7])
def test_encoder_ffn_in_token_chunks_changes_only_the_weight_gradient_sums(amp, chunk):
    """Rows are computed alone, so outputs and input gradients are bitwise those of the whole FFN; the weight and
    bias gradients are fp32 sums over chunks, rounded once: equal up to one rounding of their dtype (measured on
    this input: bf16 at most 1 element of fc2.weight one bf16 step off, fp32 relative 1e-3 on elements that nearly
    cancel, absolute 2e-7)."""
    torch.manual_seed(0)
    m = FFN(32, 256, recompute_hidden=True, chunk=chunk)
    x = torch.randn(2, 350, 32)

    def run(fn):
        for p in m.parameters():
            p.grad = None
        xs = x.clone().requires_grad_()
        with torch.autocast(**AMP, enabled=amp):
            out = fn(xs)
        return [out.detach()] + _grads(m, out, xs)

    got, want = run(m), run(lambda t: _ffn_before(m, t))
    _assert_bitwise(got[:2], want[:2])
    for a, b in zip(got[2:], want[2:]):
        _within_one_rounding(a, b, torch.bfloat16 if amp else torch.float32)
    # the hidden layer and its gradient exist a chunk at a time: the step's peak is lower by about both
    peaks = []
    for c in (chunk, 0):
        m.chunk = c
        with FakeTensorMode(allow_non_fake_inputs=True):
            xs = x.clone().requires_grad_()
            tracker = LiveBytes([*m.parameters(), xs])
            with tracker, torch.autocast(**AMP, enabled=amp):
                m(xs).float().sum().backward()
            peaks.append(tracker.peak(set()))
    hidden = 2 * 350 * 256 * (2 if amp else 4)
    assert peaks[0] < peaks[1] - 1.5 * hidden * (1 - 2 * chunk / 700)


def test_dino_with_chunked_encoder_ffns_differs_only_in_their_weight_gradients():
    """The whole debug DINO (bf16, CUDA's fp32 norms), FFNs over 48 of its 256 encoder tokens at a time against all
    at once: the loss and every gradient bitwise, except the encoder FFNs' weights and biases (one bf16 rounding)."""
    batch = _batch()
    runs = []
    for chunk in (48, 0):
        torch.manual_seed(0)
        model = DINO("debug", 3, ffn_chunk=chunk)
        with _fp32_norms(), torch.autocast(**AMP):
            out = model(**batch)
        out["loss"].backward()
        runs.append((out["loss"].detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss, got), (loss0, want) = runs
    assert torch.equal(loss, loss0)
    ffn = [n for n in want if n.startswith("encoder.") and ".ffn.fc" in n]
    assert len(ffn) == 4 * len(model.encoder.layers)
    _assert_bitwise([got[n] for n in want if n not in ffn], [want[n] for n in want if n not in ffn])
    for n in ffn:
        _within_one_rounding(got[n], want[n], torch.bfloat16)
    with pytest.raises(ConfigError, match="model.ffn_chunk"):
        build_config("dino", overrides={"model": {"ffn_chunk": -1}})


def test_deformable_attention_samples_a_chunk_of_heads_at_a_time(monkeypatch):
    """8 heads, sampled 4 at a time (msda.HEAD_CHUNK) against all 8 in one call: heads sample their own channels,
    so outputs and gradients are bitwise the same; the fp32 locations, weights and their gradients of the op's
    backward exist for half the heads at a time (2 x (2 + 1) x 4 bytes per query, head, level and point less
    at its peak, less the full-size gradients the first chunk leaves behind)."""
    torch.manual_seed(0)
    m = MSDeformAttn(dim=64, levels=2, heads=8, points=2)
    with torch.no_grad():
        m.sampling_offsets.weight.normal_(std=0.3)
        m.attention_weights.weight.normal_(std=0.3)
    shapes = [(20, 15), (10, 8)]
    s = sum(h * w for h, w in shapes)
    query, value, ref = torch.randn(2, s, 64), torch.randn(2, s, 64), torch.rand(2, s, 2, 2) * 0.6 + 0.2
    mask = torch.zeros(2, s, dtype=torch.bool)
    mask[1, -30:] = True

    def attn(q, r, v):
        return m(q, r, v, shapes, mask)

    def peak() -> int:
        with FakeTensorMode(allow_non_fake_inputs=True):
            q, v = query.clone().requires_grad_(), value.clone().requires_grad_()
            tracker = LiveBytes([*m.parameters(), q, v, ref, mask])
            with tracker, cuda_autocast_policy(), auto_impl("triton"), torch.autocast(**AMP):
                attn(q, ref, v).float().sum().backward()
            return tracker.peak(set())

    def run():  # reference points without gradient, as DINO's (with one, the op takes all heads at once)
        return _run(m, lambda q, v: attn(q, ref, v), query, value)

    chunked, chunked_peak = run(), peak()
    monkeypatch.setattr(msda, "HEAD_CHUNK", 8)
    _assert_bitwise(chunked, run())
    assert chunked_peak < peak() - 0.25 * 2 * s * 8 * 2 * 2 * (2 + 1) * 4


@pytest.mark.parametrize("mode", ["full", "sac"])
def test_remade_tensors_are_not_kept_by_a_checkpointed_layer_either(mode, monkeypatch):
    """Inside an activation checkpoint the recomputation keeps the 16-bit offsets and logits, not the fp32 locations
    and weights made from them (before: remat computed plainly inside checkpoints and the recomputation kept
    both): the peak of a checkpointed encoder layer's backward is lower by their difference, and outputs and
    gradients are bitwise those of the layer without checkpointing."""
    torch.manual_seed(0)
    block = EncoderBlock(32, 64, levels=2, heads=4, points=2)
    with torch.no_grad():
        block.attn.sampling_offsets.weight.normal_(std=0.3)
    shapes = [(30, 20), (15, 10)]
    s = sum(h * w for h, w in shapes)
    src, pos, ref = torch.randn(2, s, 32), torch.randn(2, s, 32), torch.rand(2, s, 2, 2) * 0.6 + 0.2
    mask = torch.zeros(2, s, dtype=torch.bool)

    def layer(t):
        return block(t, pos, ref, shapes, mask)

    plain = _run(block, layer, src)
    set_recompute(block, mode)
    _assert_bitwise(_run(block, layer, src), plain)

    def peak() -> int:
        with FakeTensorMode(allow_non_fake_inputs=True):
            x = src.clone().requires_grad_()
            tracker = LiveBytes([*block.parameters(), x, pos, ref, mask])
            with tracker, cuda_autocast_policy(), auto_impl("triton"), torch.autocast(**AMP):
                layer(x).float().sum().backward()
            return tracker.peak(set())

    lean_inside = peak()
    monkeypatch.setattr(lean, "_enclosing_hooks", lambda: None if _ENCLOSING_HOOKS() is None else True)
    # fp32 (B, S, heads, levels, points, 2) locations and (..., points) weights vs their 16-bit sources
    dropped = 2 * s * 4 * 2 * 2 * (2 * 2 + 2)
    assert lean_inside < peak() - 0.9 * dropped


def _encoder_layer_before(layer, src, pos, reference_points, spatial_shapes, padding_mask):
    """EncoderBlock.forward as it was: positions made once by the caller, the FFN through its module call, the
    16-bit query and value copies and the norm's fp32 input kept by every recomputation."""
    x = layer.norm(src + layer.attn(src + pos, reference_points, src, spatial_shapes, padding_mask))
    return layer.ffn(x)


@pytest.mark.parametrize("mode", ["full", "sac", None])
def test_checkpointed_encoder_layers_keep_their_inputs_instead_of_copies_and_positions(mode, monkeypatch):
    """Per-layer positions (LevelPositions), the query/value copies and the norm's input made again from the
    layer's input inside checkpoints, the FFN's input let go before its norm. Against the code they replaced: the
    output and every gradient bitwise but the level embedding's, whose gradient now sums the layers' terms before
    the tokens' (fp32 reordering: rtol 1e-5); the step's peak lower by more than two (B, S, D) fp32 tensors
    when the layers are checkpointed (measured 2.5), and not higher without."""
    torch.manual_seed(0)
    enc = Encoder(2, 32, 64, levels=2, heads=4, points=2)
    for layer in enc.layers:
        set_recompute(layer, mode)
    shapes = [(30, 20), (15, 10)]
    s = sum(h * w for h, w in shapes)
    src, level_embed = torch.randn(2, s, 32), torch.randn(2, 32)
    masks = [torch.zeros(2, h, w, dtype=torch.bool) for h, w in shapes]
    masks[0][1, :, 15:] = True
    mask, ratios = torch.cat([m.flatten(1) for m in masks], 1), torch.ones(2, 2, 2)

    def run(before, fake=False):
        if before:
            monkeypatch.setattr(EncoderBlock, "forward", _encoder_layer_before)
            monkeypatch.setattr(msda, "remat_in_checkpoint", lambda c, *ps: c(*(f(*a) for f, a in ps)))
        with FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext():
            for p in enc.parameters():
                p.grad = None
            x, lvl = src.clone().requires_grad_(), level_embed.clone().requires_grad_()
            tracker = LiveBytes([*enc.parameters(), x, lvl, mask, ratios, *masks])
            with tracker, cuda_autocast_policy(), auto_impl("triton" if fake else "pytorch"), torch.autocast(**AMP):
                pos = LevelPositions(masks, lvl, torch.float32)
                out = enc(x, pos() if before else pos, shapes, ratios, mask)
                del pos
                _grads(enc, out)
        monkeypatch.undo()
        return tracker.peak(set()) if fake else [out.detach(), x.grad] + [p.grad for p in enc.parameters()], lvl.grad

    (got, lvl_got), (want, lvl_want) = run(False), run(True)
    _assert_bitwise(got, want)
    torch.testing.assert_close(lvl_got, lvl_want, rtol=1e-5, atol=1e-6)
    (new, _), (old, _) = run(False, fake=True), run(True, fake=True)
    unit = 2 * s * 32 * 4
    assert new < old - 2 * unit if mode else new <= old
