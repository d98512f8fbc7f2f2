"""Fewer kept activations, unchanged numbers (models/lean.py, docs/recompute.md §3): each change against the code it
replaced, written out here as the reference: the same outputs and gradients bit for bit (the top-k proposal heads
within a stated tolerance), and fewer bytes kept for backward (traced on fake tensors under CUDA's autocast policy,
as `estimate-memory` traces a GPU run)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from timm.models.swin_transformer import SwinTransformerBlock
from torch._subclasses.fake_tensor import FakeTensorMode

import vtrain.models.lean as lean
from test_dino_model import _batch
from vtrain.config import build_config
from vtrain.errors import ConfigError
from vtrain.models.checkpointing import set_recompute
from vtrain.models.dino import DINO
from vtrain.models.dino.msda import MSDeformAttn, auto_impl, ms_deform_attn
from vtrain.models.dino import msda
from vtrain.models.dino.transformer import FFN, Encoder, EncoderBlock, LevelPositions
from vtrain.models.swin_attention import use_shared_bias_attention
from vtrain.tools.memory_setup import Setup
from vtrain.tools.memory_trace import LiveBytes, cuda_autocast_policy, trace_step

AMP = dict(device_type="cpu", dtype=torch.bfloat16)
_ENCLOSING_HOOKS = lean._enclosing_hooks


def _grads(module, out, *inputs):
    """Backward of a fixed function of `out`; the gradients of the inputs and of every parameter."""
    (out.float() * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return [t.grad for t in inputs] + [p.grad for p in module.parameters()]


@contextlib.contextmanager
def _fp32_norms():
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


def _run(module, fn, *inputs):
    for p in module.parameters():
        p.grad = None
    xs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    with _fp32_norms(), torch.autocast(**AMP):
        out = fn(*xs)
    return [out.detach()] + _grads(module, out, *[x for x in xs if x.requires_grad])


def _assert_bitwise(got, want):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert (a is None) == (b is None), i
        assert a is None or torch.equal(a, b), (i, (a - b).abs().max())


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


def _ffn_before(m, x):
    return m.norm(x + m.fc2(F.relu(m.fc1(x))))


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
