"""Swin window attention with one shared bias per mask pattern: timm's Swin blocks, minus the
(batch x windows x heads x N x N) tensors they build at detection sizes (benchmarks/RESULTS.md, Swin attention masks).

timm's `SwinTransformerBlock` (1.0.31) spends memory on N x N tensors per window and head (N = window area):
- its default attention path (fused SDPA is "experimental" for Swin and off unless TIMM_FUSED_ATTN=2) computes
  the attention matrix explicitly: bf16 logits + the fp32 relative-position bias give fp32 logits, softmax saves its
  fp32 output and the matmul with V a bf16 copy of it, in every block (the 4.1 of 9.48 GiB of docs/memory_ckpt.md §2.4);
- its fused path adds the shift mask, expanded over batch and heads, to the bias: a (B*nW, heads, N, N) tensor
  that SDPA keeps for backward, in every shifted block.

The shift mask of a window depends only on whether the window lies in the last window row and/or column: timm
labels the rolled, padded feature map in 3 x 3 regions whose boundaries fall inside the last window row and column.
So the windows form at most four groups (interior, last column, last row, corner) with one mask each. The block
below lays the windows out group by group and calls SDPA once per group with a (1, heads, N, N) bias, the
relative-position bias plus that group's mask, which SDPA broadcasts over the group's windows and images. The masks
come from timm's own `get_attn_mask` on a 2 x 2-window map (whose four windows are the four groups), and the bias
and the SDPA call are those of timm's fused path, so the block computes what timm's fused path computes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from timm.models.swin_transformer import SwinTransformerBlock, WindowAttention, window_partition, window_reverse
from torch import nn
from torch.fx.experimental.symbolic_shapes import statically_known_true

from vtrain.models.lean import lean_norm, remat


def window_groups(batch: int, grid_h: int, grid_w: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Window order that puts the windows of each mask group together, its inverse, and the group sizes.

    timm numbers windows image by image, row by row (`window_partition`). `order` lists those indices as the
    interior windows, then the last column, the last row and the corner (each for all images); `counts` holds the
    size of each group (some may be 0). Built on the device from shapes only: no host sync, and it runs under
    fake tensors."""
    idx = torch.arange(grid_h * grid_w, device=device).view(grid_h, grid_w)
    parts = [idx[:-1, :-1], idx[:-1, -1:], idx[-1:, :-1], idx[-1:, -1:]]
    image_start = torch.arange(batch, device=device)[:, None] * (grid_h * grid_w)
    order = torch.cat([(image_start + p.reshape(1, -1)).reshape(-1) for p in parts])
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=device))
    return order, inverse, [batch * p.numel() for p in parts]


def grouped_window_attention(attn: WindowAttention, x: torch.Tensor, masks: torch.Tensor | None = None,
                             groups: tuple[torch.Tensor, torch.Tensor, list[int]] | None = None) -> torch.Tensor:
    """timm's WindowAttention (its fused branch) with the windows of `x` (timm's order) regrouped by `groups`
    (`window_groups`): the windows of group g share the additive mask `masks[g]` (N, N) and one SDPA call.
    No groups: one call, relative-position bias only (unshifted blocks).

    The windows are regrouped after the qkv projection and put back before the output projection, so both
    projections see timm's row order: their weight gradients sum in the same order as timm's."""
    b_, n, _ = x.shape
    qkv = attn.qkv(x)
    counts = [b_]
    if groups is not None:
        order, _, counts = groups
        # index_select both ways: its backward (index_add) writes each row once, as a permutation needs
        qkv = qkv.index_select(0, order)
    q, k, v = qkv.reshape(b_, n, 3, attn.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
    rel_bias = attn._get_rel_pos_bias()  # (1, heads, N, N)
    dropout = attn.attn_drop.p if attn.training else 0.0
    outs, start = [], 0
    for g, count in enumerate(counts):
        if statically_known_true(count == 0):  # a symbolic count (a dynamic export) may be 0: an empty call
            continue
        bias = rel_bias if masks is None else rel_bias + masks[g]
        end = start + count
        outs.append(F.scaled_dot_product_attention(q[start:end], k[start:end], v[start:end], attn_mask=bias,
                                                   dropout_p=dropout))
        start = end
    out = torch.cat(outs) if len(outs) > 1 else outs[0]
    out = out.transpose(1, 2).reshape(b_, n, -1)
    if groups is not None:
        out = out.index_select(0, groups[1])
    return attn.proj_drop(attn.proj(out))


class SharedBiasSwinBlock(SwinTransformerBlock):
    """A timm SwinTransformerBlock whose attention passes one broadcast bias per mask group to fused SDPA (see the
    module docstring). Same parameters, buffers and state-dict keys; made by `use_shared_bias_attention`.

    Its forward is timm's, minus two copies backward need not keep (lean.py, same values): the fp32 copy of the
    16-bit residual stream that CUDA autocast makes for each LayerNorm, and the GELU output that fc2 keeps, made
    again from the fc1 output that GELU keeps anyway."""

    pad_first = False  # timm's order: shift, then pad (DetectionSwinBlock pads first)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, h, w, c = x.shape
        x = x + self.drop_path1(self._attn(lean_norm(self.norm1, x)))
        x = x.reshape(b, -1, c)
        x = x + self.drop_path2(self._mlp(lean_norm(self.norm2, x)))
        return x.reshape(b, h, w, c)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        # timm's Mlp.forward: fc1, act, drop1, norm, fc2, drop2
        m = self.mlp
        y = remat(lambda a: m.fc2(m.norm(m.drop1(a))), (m.act, (m.fc1(x),)))
        return m.drop2(y)

    def _group_masks(self, shifted_x: torch.Tensor) -> torch.Tensor:
        """The four mask patterns (interior, last column, last row, corner), (4, N, N), from timm's own builder on
        a 2 x 2-window map; in the dtype timm's mask would have (the input's, or the fixed-size model's buffer)."""
        wh, ww = self.window_size
        dtype = shifted_x.dtype if self.dynamic_mask or self.attn_mask is None else self.attn_mask.dtype
        return self.get_attn_mask(shifted_x.new_empty((1, 2 * wh, 2 * ww, 1), dtype=dtype))

    def _attn(self, x: torch.Tensor) -> torch.Tensor:
        # timm's _attn (cyclic shift, pad, partition, merge, reverse shift) with the windows regrouped by mask;
        # DetectionSwinBlock pads before the shift instead (`pad_first`)
        b, h, w, c = x.shape
        has_shift = any(self.shift_size)
        pad_h = (self.window_size[0] - h % self.window_size[0]) % self.window_size[0]
        pad_w = (self.window_size[1] - w % self.window_size[1]) % self.window_size[1]
        if self.pad_first:
            x = F.pad(x, (0, 0, 0, pad_w, 0, pad_h))
        shifted_x = torch.roll(x, shifts=(-self.shift_size[0], -self.shift_size[1]), dims=(1, 2)) if has_shift else x
        if not self.pad_first:
            shifted_x = F.pad(shifted_x, (0, 0, 0, pad_w, 0, pad_h))
        _, hp, wp, _ = shifted_x.shape

        windows = window_partition(shifted_x, self.window_size).view(-1, self.window_area, c)
        if has_shift:
            groups = window_groups(b, hp // self.window_size[0], wp // self.window_size[1], x.device)
            out = grouped_window_attention(self.attn, windows, self._group_masks(shifted_x), groups)
        else:
            out = grouped_window_attention(self.attn, windows)

        out = out.view(-1, self.window_size[0], self.window_size[1], c)
        shifted_x = window_reverse(out, self.window_size, hp, wp)
        if self.pad_first:
            if has_shift:
                shifted_x = torch.roll(shifted_x, shifts=self.shift_size, dims=(1, 2))
            return shifted_x[:, :h, :w, :].contiguous()
        shifted_x = shifted_x[:, :h, :w, :].contiguous()
        if has_shift:
            return torch.roll(shifted_x, shifts=self.shift_size, dims=(1, 2))
        return shifted_x


class DetectionSwinBlock(SharedBiasSwinBlock):
    """The Swin block of the detection codebases (docs/detection.md "The detection Swin"): the feature map is padded
    to whole windows *before* the cyclic shift, and the padding is cut off after the reverse shift, as the Swin
    detection code that IDEA DINO, detectron2/detrex and mmdetection carry does (timm shifts first, then pads:
    the two differ wherever a side is not a multiple of the window). Whether a block shifts is the model's setting:
    the detection backbone builds timm's Swin with `always_partition=True`, so every odd block of every stage
    shifts by half a window, also where one window covers the whole map (timm's default turns the shift off there).
    Same parameters, buffers and state-dict keys as timm's block; the shift masks are the same function of the
    padded map, so the four mask groups and the shared-bias attention are those of SharedBiasSwinBlock."""

    pad_first = True


def use_shared_bias_attention(model: nn.Module, detection: bool = False) -> int:
    """Switch every timm SwinTransformerBlock in `model` to SharedBiasSwinBlock in place (a class swap: weights,
    checkpointing and FSDP units are untouched), or to DetectionSwinBlock (`detection`: pad before the shift).
    Returns how many blocks were switched (0 for other backbones)."""
    cls = DetectionSwinBlock if detection else SharedBiasSwinBlock
    n = 0
    for m in model.modules():
        if type(m) is SwinTransformerBlock:
            m.__class__ = cls
            n += 1
    return n
