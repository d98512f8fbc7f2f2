"""Fewer kept activations, unchanged numbers (models/lean.py, docs/recompute.md §3): each change against the code it
replaced, written out here as the reference: the same outputs and gradients bit for bit (the top-k proposal heads
within a stated tolerance), and fewer bytes kept for backward (traced on fake tensors under CUDA's autocast policy,
as `estimate-memory` traces a GPU run)."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from timm.models.swin_transformer import PatchMerging, SwinTransformerBlock
from torch._subclasses.fake_tensor import FakeTensorMode

from tests.helpers.batches import dino_batch as _batch
from tests.helpers.lean import (
    AMP, assert_bitwise as _assert_bitwise, ENCLOSING_HOOKS as _ENCLOSING_HOOKS, ffn_before as _ffn_before,
    fp32_norms as _fp32_norms, run as _run)
import vtrain.models.lean as lean
from vtrain.models.dino import DINO
from vtrain.models.dino.detector import Backbone
from vtrain.models.dino.msda import MSDeformAttn, auto_impl, ms_deform_attn
from vtrain.models.dino.transformer import FFN
from vtrain.models.lean import LeanLayerNorm
from vtrain.models.swin_attention import use_shared_bias_attention
from vtrain.memory.setup import Setup
from vtrain.memory.trace import cuda_autocast_policy, trace_step
from vtrain.memory.tracker import LiveBytes
from vtrain.models.swin_lean import LeanPatchMerging
from vtrain.presets import DINO_PRESETS


def _kept_bytes(module, fn, *inputs) -> int:
    """Bytes of the storages `fn` creates that are alive when it returns (what backward keeps, plus the output),
    on fake tensors under CUDA's autocast policy, deformable attention as the fused op."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        xs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
        tracker = LiveBytes([*module.parameters(), *module.buffers(), *xs])
        with tracker, cuda_autocast_policy(), auto_impl("triton"), torch.autocast(**AMP):
            out = fn(*xs)
        return sum(n for key, n in tracker.events if key >= 0) if out is not None else 0


# ---- the replaced code, as it was ---------------------------------------------------------------------------------
def _msda_before(m, query, reference_points, value, shapes, padding_mask):
    b, q, _ = query.shape
    v = m.value_proj(value).masked_fill(padding_mask[..., None], 0.0).view(b, value.shape[1], m.heads, -1)
    offsets = m.sampling_offsets(query).view(b, q, m.heads, m.levels, m.points, 2)
    weights = m.attention_weights(query).view(b, q, m.heads, m.levels * m.points)
    weights = weights.float().softmax(-1).view(b, q, m.heads, m.levels, m.points)
    ref = reference_points.float()
    if ref.shape[-1] == 2:
        norm = torch.tensor([[w, h] for h, w in shapes], dtype=torch.float32)
        loc = ref[:, :, None, :, None, :] + offsets / norm[None, None, None, :, None, :]
    else:
        loc = ref[:, :, None, :, None, :2] + offsets / m.points * ref[:, :, None, :, None, 2:] * 0.5
    return m.output_proj(ms_deform_attn(v, shapes, loc, weights))


# ---- tests --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ref_dim", [2, 4])  # encoder (points) and decoder (boxes)
def test_deformable_attention_casts_the_query_once_and_remakes_locations_and_weights(ref_dim):
    torch.manual_seed(0)
    m = MSDeformAttn(dim=32, levels=2, heads=4, points=2)
    with torch.no_grad():
        m.sampling_offsets.weight.normal_(std=0.3)
        m.attention_weights.weight.normal_(std=0.3)
    shapes = [(6, 5), (3, 3)]
    s = sum(h * w for h, w in shapes)
    query, value = torch.randn(2, 7, 32), torch.randn(2, s, 32)
    ref = torch.rand(2, 7, 2, ref_dim) * 0.6 + 0.2
    mask = torch.zeros(2, s, dtype=torch.bool)
    mask[1, -4:] = True
    args = (query, ref, value)
    _assert_bitwise(_run(m, lambda q, r, v: m(q, r, v, shapes, mask), *args),
                    _run(m, lambda q, r, v: _msda_before(m, q, r, v, shapes, mask), *args))
    # kept: one 16-bit query instead of two; 16-bit offsets and logits instead of fp32 locations and weights
    assert _kept_bytes(m, lambda q, r, v: m(q, r, v, shapes, mask), *args) < \
        _kept_bytes(m, lambda q, r, v: _msda_before(m, q, r, v, shapes, mask), *args)


def test_encoder_ffn_remakes_its_hidden_layer_and_zeroes_relu_gradients_in_place():
    torch.manual_seed(0)
    m = FFN(32, 256, recompute_hidden=True)
    x = torch.randn(2, 50, 32)
    _assert_bitwise(_run(m, m, x), _run(m, lambda t: _ffn_before(m, t), x))
    new, old = _kept_bytes(m, m, x), _kept_bytes(m, lambda t: _ffn_before(m, t), x)
    assert new < old - 2 * 50 * 256 * 2 * 0.9  # the bf16 hidden layer (2 x 50 x 256) is not kept


def test_swin_block_keeps_neither_fp32_norm_copies_nor_the_gelu_output():
    import timm

    torch.manual_seed(0)
    body = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, num_classes=0, embed_dim=32,
                             depths=(2, 2, 1, 1), num_heads=(1, 2, 4, 8), drop_path_rate=0.2, strict_img_size=False)
    use_shared_bias_attention(body)
    block = body.layers[1].blocks[1]  # shifted, drop-path on (its random draw is not part of what is remade)
    block.train()
    x = torch.randn(2, 14, 14, 64).bfloat16().float()  # a 16-bit residual stream, as in stages 1-3

    def new(t):
        torch.manual_seed(3)
        return block(t.bfloat16())

    def old(t):
        torch.manual_seed(3)
        return SwinTransformerBlock.forward(block, t.bfloat16())  # timm's own forward, as before

    _assert_bitwise(_run(block, new, x), _run(block, old, x))
    assert _kept_bytes(block, new, x) < _kept_bytes(block, old, x) - 2 * 196 * (4 * 64 * 2 + 2 * 64 * 2) * 0.9


def test_swin_backbone_keeps_one_copy_of_each_stage_output(monkeypatch):
    """DINO's Swin read out stage by stage (swin_lean.py) against timm's forward_intermediates with the out norms on
    its NCHW copies, timm's PatchMerging and patch-embedding norm (the code replaced): features and gradients
    bitwise (bf16, CUDA's fp32 norms, drop-path on); kept at least one fp32 copy of stage 0's output and the
    patch embedding's fp32 norm input less (measured: the bf16 stages' fp32 merge copies too)."""
    p = dataclasses.replace(DINO_PRESETS["debug"](), out_indices=(0, 1, 2, 3))
    torch.manual_seed(0)
    backbone = Backbone(p, drop_path=0.2).train()
    x = torch.randn(2, 3, 64, 96)

    def features(t):
        torch.manual_seed(3)
        return torch.cat([f.flatten() for f in backbone(t)])

    def timm_path():
        monkeypatch.setattr(backbone, "swin", False)
        monkeypatch.setattr(LeanPatchMerging, "forward", PatchMerging.forward)
        monkeypatch.setattr(LeanLayerNorm, "forward", torch.nn.LayerNorm.forward)

    new, new_kept = _run(backbone, features, x), _kept_bytes(backbone, features, x)
    timm_path()
    _assert_bitwise(new, _run(backbone, features, x))
    stage0 = 2 * 32 * 16 * 24
    assert new_kept < _kept_bytes(backbone, features, x) - 0.9 * (4 * stage0 + 2 * stage0)


@pytest.mark.parametrize("norm", [torch.nn.LayerNorm(16), torch.nn.GroupNorm(4, 16)])
def test_lean_norm_remakes_the_fp32_copy_of_a_16bit_input(norm):
    x = torch.randn(2, 16, 5, 16) if isinstance(norm, torch.nn.LayerNorm) else torch.randn(2, 16, 5, 6)
    x16 = x.bfloat16()

    def new(t):
        return lean.lean_norm(norm, t.bfloat16())

    def old(t):
        return norm(t.bfloat16())

    _assert_bitwise(_run(norm, new, x16.float()), _run(norm, old, x16.float()))
    assert _kept_bytes(norm, new, x16.float()) < _kept_bytes(norm, old, x16.float()) - x.numel() * 2 * 0.9


def test_autocast_input_gives_what_autocast_gives_each_layer():
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 4)
    x = torch.randn(3, 8)
    _assert_bitwise(_run(lin, lambda t: lin(lean.autocast_input(t)), x), _run(lin, lin, x))


def _dino(batch, lean_on, monkeypatch):
    monkeypatch.setattr(lean, "_enclosing_hooks", _ENCLOSING_HOOKS if lean_on else (lambda: True))
    torch.manual_seed(0)
    model = DINO("debug", 3, drop_path=0.2)
    torch.manual_seed(1)
    with _fp32_norms(), torch.autocast(**AMP):
        out = model(**batch)
    out["loss"].backward()
    return [out["loss"].detach()] + [p.grad for p in model.parameters()]


def test_dino_remade_tensors_change_nothing_in_the_whole_model(monkeypatch):
    """Everything `remat`/`lean_norm` drop, made again in backward, against keeping it (bf16, CUDA's fp32 norms,
    drop-path on)."""
    batch = _batch()
    _assert_bitwise(_dino(batch, True, monkeypatch), _dino(batch, False, monkeypatch))
    setup = Setup(task="dino", preset="debug", image_size=(128, 160), batch_size=2, precision="bf16", num_classes=5,
                  num_targets=3)
    monkeypatch.setattr(lean, "_enclosing_hooks", _ENCLOSING_HOOKS)
    lean_peak = trace_step(setup)["Activation"]
    monkeypatch.setattr(lean, "_enclosing_hooks", lambda: True)
    assert lean_peak < 0.9 * trace_step(setup)["Activation"]


def test_proposal_heads_on_the_top_k_rows_give_the_full_computation_s_values():
    """The encoder proposals' heads run with gradients on the k chosen tokens only. Reference: the heads on every
    token, then the gather (the code it replaced). A matmul over k rows instead of all may round differently in the
    last bit (other kernel blocking), so: values and gradients to rtol 1e-5, atol 1e-6 (measured here: one gradient
    element of 4096 off by 1.3e-7)."""
    torch.manual_seed(0)
    model = DINO("debug", 3)
    memory = torch.randn(2, 60, 64, requires_grad=True)
    mask = torch.zeros(2, 60, dtype=torch.bool)
    mask[1, 40:] = True
    shapes = [(6, 6), (4, 4), (2, 2), (2, 2)]
    k = 7

    def new():
        anchors, valid = model._proposals(memory, mask, shapes)
        with torch.no_grad():
            score = model._proposal_logits(memory, valid).float().max(-1)[0].masked_fill(~valid, float("-inf"))
        topk = score.topk(k, dim=1)[1]
        mem = model._proposal_embed(memory.gather(1, topk[..., None].expand(-1, -1, 64)), valid.gather(1, topk))
        return model.cls_heads[-1](mem), model.reg_heads[-1](mem).float() + anchors.gather(
            1, topk[..., None].expand(-1, -1, 4))

    def old():
        anchors, valid = model._proposals(memory, mask, shapes)
        mem = model.memory_norm(model.memory_proj(memory.masked_fill(~valid[..., None], 0.0)))
        logits, coord = model.cls_heads[-1](mem), model.reg_heads[-1](mem).float() + anchors
        score = logits.detach().float().max(-1)[0].masked_fill(~valid, float("-inf"))
        topk = score.topk(k, dim=1)[1]
        return logits.gather(1, topk[..., None].expand(-1, -1, 3)), coord.gather(1, topk[..., None].expand(-1, -1, 4))

    results = []
    for fn in (new, old):
        model.zero_grad()
        memory.grad = None
        logits, coord = fn()
        (logits.sum() + coord.square().sum()).backward()
        results.append([logits.detach(), coord.detach(), memory.grad] + [p.grad for p in model.parameters()])
    for a, b in zip(*results):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
