"""DINO's deformable transformer: sine positions, encoder, two-stage query selection, refining decoder.

Sizes and constants follow the recipe in docs/dino.md §1 (6+6 layers, 256-d, 8 heads, 4 points,
FFN 2048, dropout 0, sine positions with temperature 20, 900 queries). Blocks are named `...Block` so the
engine's per-block FSDP2 sharding finds them; each layer is one recompute unit (`encoder.N`, `decoder.N`,
models/recompute_units.py), checkpointed on the block itself.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from vtrain.models.recompute_units import recompute_mode, set_recompute
from vtrain.models.dino.msda import MSDeformAttn
from vtrain.models.chunked_mlp import residual_mlp
from vtrain.models.lean import autocast_input, relu_single_use, remat_in_checkpoint


def inverse_sigmoid(x: torch.Tensor, eps: float = 1e-3) -> torch.Tensor:
    x = x.clamp(0, 1)
    return torch.log(x.clamp(min=eps) / (1 - x).clamp(min=eps))


def sine_position_2d(mask: torch.Tensor, num_feats: int, temperature: float = 20.0,
                     offset: float = 0.0, normalize: bool = True) -> torch.Tensor:
    """(B, H, W) padding mask -> (B, 2*num_feats, H, W) sine/cosine positions over the valid region, normalised to
    it and scaled by 2*pi unless `normalize` is False (MMD base config: normalize=True, offset 0.0, temperature 20;
    detrex: offset -0.5, temperature 10000; docs/dino.md §1.1, docs/detection.md "Model options")."""
    not_mask = (~mask).float()
    y = not_mask.cumsum(1)
    x = not_mask.cumsum(2)
    if normalize:
        eps, scale = 1e-6, 2 * math.pi
        # the last row and column as (B, 1, W) and (B, H, 1): an index, not a slice `-1:`, whose size torch.export
        # cannot tell is 1 for a symbolic H (a dynamic export)
        y = (y + offset) / (y[:, -1].unsqueeze(1) + eps) * scale
        x = (x + offset) / (x[:, :, -1].unsqueeze(2) + eps) * scale
    dim_t = torch.arange(num_feats, dtype=torch.float32, device=mask.device)
    dim_t = temperature ** (2 * (dim_t // 2) / num_feats)
    px = x[..., None] / dim_t
    py = y[..., None] / dim_t
    px = torch.stack([px[..., 0::2].sin(), px[..., 1::2].cos()], -1).flatten(3)
    py = torch.stack([py[..., 0::2].sin(), py[..., 1::2].cos()], -1).flatten(3)
    return torch.cat([py, px], -1).permute(0, 3, 1, 2)


def sine_position_boxes(boxes: torch.Tensor, num_feats: int) -> torch.Tensor:
    """(B, Q, 4) cxcywh in [0, 1] -> (B, Q, 4*num_feats), ordered y, x, w, h (DINO's query positions)."""
    scale = 2 * math.pi
    dim_t = torch.arange(num_feats, dtype=torch.float32, device=boxes.device)
    dim_t = 10000 ** (2 * (dim_t // 2) / num_feats)
    parts = []
    for i in (1, 0, 2, 3):
        p = boxes[..., i, None].float() * scale / dim_t
        parts.append(torch.stack([p[..., 0::2].sin(), p[..., 1::2].cos()], -1).flatten(2))
    return torch.cat(parts, -1)


class LevelPositions:
    """The encoder's position embedding, (B, S, D): each level's sine positions over its valid region plus that
    level's learned embedding, made by each layer that uses it instead of once. Made once, the fp32 tensor would be
    held by every checkpointed encoder layer until its backward, and its gradient, summed over the six layers before
    reaching the level embedding, would be one more such tensor during the encoder's backward. Each layer's gradient
    now reaches the embedding on its own: the same terms, summed over layers and tokens in another order (fp32
    reordering only, docs/recompute.md §3)."""

    def __init__(self, masks: list[torch.Tensor], level_embed: torch.Tensor, dtype: torch.dtype,
                 sine: tuple[float, float, bool] = (20.0, 0.0, True)) -> None:
        self.masks, self.level_embed, self.dtype = masks, level_embed, dtype
        self.sine = sine  # (temperature, offset, normalize) of sine_position_2d
        self.made: torch.Tensor | None = None

    def __call__(self) -> torch.Tensor:
        if self.made is not None:
            return self.made
        feats = self.level_embed.shape[1] // 2
        pos = torch.cat([sine_position_2d(m, feats, *self.sine).to(self.dtype).flatten(2).transpose(1, 2)
                         + self.level_embed[lvl].to(self.dtype) for lvl, m in enumerate(self.masks)], 1)
        if not torch.is_grad_enabled():
            # inference (eval, predict, export) keeps nothing for backward: made once for every layer (and traced
            # once into an exported graph), the same values
            self.made = pos
        return pos


class MLP(nn.Module):
    def __init__(self, in_dim: int, hidden: int, out_dim: int, layers: int) -> None:
        super().__init__()
        dims = [in_dim] + [hidden] * (layers - 1) + [out_dim]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.relu(x)
        return x


class FFN(nn.Module):
    """Post-norm FFN. With `recompute_hidden` (the encoder's: 2048 wide over every token of every level) it keeps
    only its 16-bit input for backward and makes the ReLU output again there, `chunk` tokens at a time
    (models/chunked_mlp.py; chunk 0: all tokens at once, the same values as the plain FFN)."""

    def __init__(self, dim: int, hidden: int, recompute_hidden: bool = False, chunk: int = 0) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.norm = nn.LayerNorm(dim)
        self.recompute_hidden, self.chunk = recompute_hidden, chunk

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.residual(x))

    def residual(self, x: torch.Tensor) -> torch.Tensor:
        """x + fc2(relu(fc1(x))): the FFN before its norm."""
        if self.recompute_hidden:
            return residual_mlp(x, self.fc1, self.fc2, self.chunk)
        return x + self.fc2(relu_single_use(self.fc1(x)))


class EncoderBlock(nn.Module):
    """Deformable self-attention over all levels + FFN, post-norm."""

    def __init__(self, dim: int, ffn: int, levels: int, heads: int, points: int) -> None:
        super().__init__()
        self.attn = MSDeformAttn(dim, levels, heads, points)
        self.norm = nn.LayerNorm(dim)
        self.ffn = FFN(dim, ffn, recompute_hidden=True)

    def forward(self, src: torch.Tensor, pos: LevelPositions, reference_points: torch.Tensor,
                spatial_shapes: list[tuple[int, int]], padding_mask: torch.Tensor) -> torch.Tensor:
        attn = self.attn(src, reference_points, src, spatial_shapes, padding_mask, query_pos=pos)
        # inside a checkpointed layer the norm's fp32 input is made again from the layer's input and the 16-bit
        # attention output (lean.py)
        x = remat_in_checkpoint(self.norm, (torch.add, (src, attn)))
        del attn
        # the FFN's two steps here rather than through its module call, whose arguments would hold x (fp32, the
        # size of the layer's output) while its norm makes the output: x goes as soon as the residual sum exists
        s = self.ffn.residual(x)
        del x
        return self.ffn.norm(s)


class DecoderBlock(nn.Module):
    """Self-attention among queries (masked for denoising groups), deformable cross-attention, FFN."""

    def __init__(self, dim: int, ffn: int, levels: int, heads: int, points: int) -> None:
        super().__init__()
        self.self_attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm1 = nn.LayerNorm(dim)
        self.cross_attn = MSDeformAttn(dim, levels, heads, points)
        self.norm2 = nn.LayerNorm(dim)
        self.ffn = FFN(dim, ffn)

    def forward(self, tgt: torch.Tensor, query_pos: torch.Tensor, reference_points: torch.Tensor,
                memory: torch.Tensor, spatial_shapes: list[tuple[int, int]], memory_mask: torch.Tensor,
                attn_mask: torch.Tensor | None) -> torch.Tensor:
        q = tgt + query_pos
        tgt = self.norm1(tgt + self.self_attn(q, q, tgt, attn_mask=attn_mask, need_weights=False)[0])
        tgt = self.norm2(tgt + self.cross_attn(tgt + query_pos, reference_points, memory, spatial_shapes,
                                               memory_mask))
        return self.ffn(tgt)


class _Layers(nn.Module):
    """A stack of blocks whose `grad_ckpt` switches full checkpointing of every layer (the units `encoder.N` /
    `decoder.N` one by one: models/recompute_units.py)."""

    layers: nn.ModuleList

    @property
    def grad_ckpt(self) -> bool:
        return all(recompute_mode(layer) == "full" for layer in self.layers)

    @grad_ckpt.setter
    def grad_ckpt(self, enabled: bool) -> None:
        for layer in self.layers:
            set_recompute(layer, "full" if enabled else None)


class Encoder(_Layers):
    def __init__(self, layers: int, dim: int, ffn: int, levels: int, heads: int, points: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EncoderBlock(dim, ffn, levels, heads, points) for _ in range(layers))

    @staticmethod
    def reference_points(spatial_shapes: list[tuple[int, int]], valid_ratios: torch.Tensor) -> torch.Tensor:
        """Pixel centres of every level, normalised to the valid region, then mapped into each level:
        (B, S, L, 2)."""
        refs = []
        like = {"dtype": torch.float32, "device": valid_ratios.device}
        for lvl, (h, w) in enumerate(spatial_shapes):
            # i + 0.5 (what linspace(0.5, h - 0.5, h) gives, exactly): arange keeps a symbolic h of a dynamic
            # export in the graph, where linspace would bake the traced size in
            ys, xs = torch.meshgrid(torch.arange(h, **like) + 0.5, torch.arange(w, **like) + 0.5, indexing="ij")
            ys = ys.reshape(1, -1) / (valid_ratios[:, None, lvl, 1] * h)
            xs = xs.reshape(1, -1) / (valid_ratios[:, None, lvl, 0] * w)
            refs.append(torch.stack([xs, ys], -1))
        ref = torch.cat(refs, 1)
        return ref[:, :, None] * valid_ratios[:, None]

    def forward(self, src, pos, spatial_shapes, valid_ratios, padding_mask):
        ref = self.reference_points(spatial_shapes, valid_ratios)
        for layer in self.layers:
            src = layer(src, pos, ref, spatial_shapes, padding_mask)
        return src


class Decoder(_Layers):
    """Iterative box refinement with look-forward-twice: the box predicted by layer i is
    sigmoid(delta_i + logit(ref_{i-1})) with ref_{i-1} *not* detached (its gradient reaches layer i-1), while
    the reference the next layer samples from is detached (DINO paper arXiv:2203.03605 §3.5; MMD DinoTransformerDecoder)."""

    def __init__(self, layers: int, dim: int, ffn: int, levels: int, heads: int, points: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DecoderBlock(dim, ffn, levels, heads, points) for _ in range(layers))
        self.ref_point_head = MLP(2 * dim, dim, dim, 2)
        self.norm = nn.LayerNorm(dim)
        self.dim = dim
        self.refine_eps = 1e-3  # inverse_sigmoid's eps in the refinement (DinoOptions.refine_eps)

    def forward(self, query, reference, memory, spatial_shapes, valid_ratios, memory_mask, attn_mask,
                reg_branches: Sequence[nn.Module]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """query (B, Q, D); reference (B, Q, 4) sigmoid boxes. Returns per layer the normed hidden states and
        the reference boxes each layer's prediction starts from (undetached)."""
        hidden, refs = [], [reference]
        ratios = torch.cat([valid_ratios, valid_ratios], -1)[:, None]  # (B, 1, L, 4)
        memory = autocast_input(memory)  # one 16-bit copy for every layer's value projection (lean.py)
        for i, layer in enumerate(self.layers):
            ref_input = reference.detach()[:, :, None] * ratios
            query_pos = self.ref_point_head(sine_position_boxes(ref_input[:, :, 0], self.dim // 2).to(query.dtype))
            query = layer(query, query_pos, ref_input, memory, spatial_shapes, memory_mask, attn_mask)
            delta = reg_branches[i](query).float()
            new_ref = (delta + inverse_sigmoid(reference.detach().float(), self.refine_eps)).sigmoid()
            hidden.append(self.norm(query))
            refs.append(new_ref)
            reference = new_ref.detach()
        return hidden, refs[:-1]
