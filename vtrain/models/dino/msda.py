"""Multi-scale deformable attention (Deformable-DETR): the sampling kernel behind one function, and the module.

`ms_deform_attn` is the single replaceable kernel: a fused CUDA/Triton implementation with the same signature
can take its place. This one is pure PyTorch (one bilinear `grid_sample` per level, zeros padding,
align_corners=False, as the reference fallbacks in dino.md §3) and always computes in fp32 with autocast off:
no public kernel supports bf16, and fp16 overflow in this path is the classic DINO failure (dino.md §3-4).
Levels are accumulated one at a time instead of stacked, so only one level's sampled values are alive at once.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def ms_deform_attn(value: torch.Tensor, spatial_shapes: list[tuple[int, int]], sampling_locations: torch.Tensor,
                   attention_weights: torch.Tensor) -> torch.Tensor:
    """Deformable attention over a flattened multi-level feature map.

    value: (B, S, H, D) with S = sum(h*w) over levels, in level order;
    spatial_shapes: [(h, w)] per level;
    sampling_locations: (B, Q, H, L, P, 2) as (x, y) in [0, 1] of each level's (padded) map;
    attention_weights: (B, Q, H, L, P), softmax-normalised over L*P.
    Returns (B, Q, H*D) in fp32.
    """
    b, _, heads, dim = value.shape
    _, q, _, levels, points, _ = sampling_locations.shape
    with torch.autocast(device_type=value.device.type, enabled=False):
        value = value.float()
        grids = 2.0 * sampling_locations.float() - 1.0  # grid_sample works in [-1, 1]
        weights = attention_weights.float()
        out = value.new_zeros(b * heads, dim, q)
        start = 0
        for lvl, (h, w) in enumerate(spatial_shapes):
            # (B, h*w, H, D) -> (B*H, D, h, w)
            v = value[:, start:start + h * w].permute(0, 2, 3, 1).reshape(b * heads, dim, h, w)
            start += h * w
            g = grids[:, :, :, lvl].transpose(1, 2).reshape(b * heads, q, points, 2)
            sampled = F.grid_sample(v, g, mode="bilinear", padding_mode="zeros", align_corners=False)  # (BH, D, Q, P)
            wl = weights[:, :, :, lvl].transpose(1, 2).reshape(b * heads, 1, q, points)
            out = out + (sampled * wl).sum(-1)
        return out.view(b, heads * dim, q).transpose(1, 2).contiguous()


class MSDeformAttn(nn.Module):
    """Sampling offsets and weights predicted from the query; values projected from the flattened memory.

    reference_points: (B, Q, L, 2) normalised centres (encoder), or (B, Q, L, 4) boxes (decoder), where the
    offsets are scaled by half the box size per point (Deformable-DETR / DINO decoder)."""

    def __init__(self, dim: int = 256, levels: int = 4, heads: int = 8, points: int = 4) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} not divisible by heads {heads}")
        self.dim, self.levels, self.heads, self.points = dim, levels, heads, points
        self.sampling_offsets = nn.Linear(dim, heads * levels * points * 2)
        self.attention_weights = nn.Linear(dim, heads * levels * points)
        self.value_proj = nn.Linear(dim, dim)
        self.output_proj = nn.Linear(dim, dim)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Deformable-DETR init: offsets start on a ring of directions, k-th point k steps out; uniform weights.
        nn.init.constant_(self.sampling_offsets.weight, 0.0)
        theta = torch.arange(self.heads, dtype=torch.float32) * (2.0 * math.pi / self.heads)
        grid = torch.stack([theta.cos(), theta.sin()], -1)
        grid = (grid / grid.abs().max(-1, keepdim=True)[0]).view(self.heads, 1, 1, 2)
        grid = grid.repeat(1, self.levels, self.points, 1)
        grid = grid * torch.arange(1, self.points + 1, dtype=torch.float32).view(1, 1, -1, 1)
        with torch.no_grad():
            self.sampling_offsets.bias.copy_(grid.reshape(-1))
        nn.init.constant_(self.attention_weights.weight, 0.0)
        nn.init.constant_(self.attention_weights.bias, 0.0)
        nn.init.xavier_uniform_(self.value_proj.weight)
        nn.init.constant_(self.value_proj.bias, 0.0)
        nn.init.xavier_uniform_(self.output_proj.weight)
        nn.init.constant_(self.output_proj.bias, 0.0)

    def forward(self, query: torch.Tensor, reference_points: torch.Tensor, value: torch.Tensor,
                spatial_shapes: list[tuple[int, int]], padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        b, q, _ = query.shape
        s = value.shape[1]
        v = self.value_proj(value)
        if padding_mask is not None:
            v = v.masked_fill(padding_mask[..., None], 0.0)
        v = v.view(b, s, self.heads, self.dim // self.heads)
        offsets = self.sampling_offsets(query).view(b, q, self.heads, self.levels, self.points, 2)
        weights = self.attention_weights(query).view(b, q, self.heads, self.levels * self.points)
        weights = weights.float().softmax(-1).view(b, q, self.heads, self.levels, self.points)
        ref = reference_points.float()
        offsets = offsets.float()
        if ref.shape[-1] == 2:
            # offsets are in pixels of each level: normalise by (w, h)
            norm = torch.tensor([[w, h] for h, w in spatial_shapes], dtype=torch.float32, device=query.device)
            loc = ref[:, :, None, :, None, :] + offsets / norm[None, None, None, :, None, :]
        elif ref.shape[-1] == 4:
            loc = ref[:, :, None, :, None, :2] + offsets / self.points * ref[:, :, None, :, None, 2:] * 0.5
        else:
            raise ValueError(f"reference_points must end in 2 or 4 values, got {tuple(ref.shape)}")
        out = ms_deform_attn(v, spatial_shapes, loc, weights)
        # back to the projection's dtype (bf16 under FSDP2 mixed precision or DeepSpeed bf16; autocast casts itself)
        return self.output_proj(out.to(self.output_proj.weight.dtype))
