"""A timm Swin backbone read out for DINO keeping less for backward, with timm's values (docs/recompute.md §3).

timm's `SwinTransformer.forward_intermediates` hands out an NCHW copy of each taken stage's NHWC output
(`permute(0, 3, 1, 2).contiguous()`); the out norm applied to it kept that copy, and the next stage's
`PatchMerging` kept a second one, its 2x2-regrouped norm input (and in the 16-bit stages of a CUDA autocast run,
the norm's fp32 copy of that instead). Here:

- `swin_features` runs timm's stages itself and applies each out norm to the stage's own NHWC output: the out norm
  keeps that tensor (or, 16-bit, it is what `lean_norm` keeps instead of the fp32 copy);
- `LeanPatchMerging` makes its norm input (and its fp32 copy) again in backward from that same stage output;
- the patch embedding's norm keeps its 16-bit input rather than the fp32 copy (`LeanLayerNorm`).

Per taken stage one copy of its output is kept where there were two (Swin-L at 800x1333, batch 2: 0.19 GiB in
all, plus 0.05 GiB at the patch embedding). The values are the same ops on the same numbers: LayerNorm normalises
each position over channels whatever the input's memory layout, and the regrouping is timm's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from timm.models.swin_transformer import PatchMerging
from torch import nn
from torch.fx.experimental.symbolic_shapes import statically_known_true

from vtrain.models.lean import LeanLayerNorm, lean_norm


def _regroup(x: torch.Tensor) -> torch.Tensor:
    """timm's PatchMerging regrouping: each 2x2 patch's four C-vectors side by side, (B, H/2, W/2, 4C)."""
    b, h, w, c = x.shape
    return x.reshape(b, h // 2, 2, w // 2, 2, c).permute(0, 1, 3, 4, 2, 5).flatten(3)


class LeanPatchMerging(PatchMerging):
    """timm's PatchMerging whose norm input is made again from the stage output in backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, h, w, c = x.shape
        # timm pads always; padding nothing would copy the stage output the recipe keeps. A symbolic size (a
        # dynamic export) is padded by its parity in the graph, which may be 0
        if not (statically_known_true(h % 2 == 0) and statically_known_true(w % 2 == 0)):
            x = F.pad(x, (0, 0, 0, w % 2, 0, h % 2))
        return self.reduction(lean_norm(self.norm, _regroup(x), source=(_regroup, (x,))))


def use_lean_swin(body: nn.Module) -> None:
    """Switch a timm SwinTransformer's patch mergings and patch-embedding norm to the classes above, in place."""
    for m in body.modules():
        if type(m) is PatchMerging:
            m.__class__ = LeanPatchMerging
    norm = getattr(getattr(body, "patch_embed", None), "norm", None)
    if type(norm) is nn.LayerNorm:
        norm.__class__ = LeanLayerNorm


def swin_features(body: nn.Module, x: torch.Tensor, indices: list[int],
                  out_norms: nn.ModuleList) -> list[torch.Tensor]:
    """timm's `forward_intermediates(x, indices, intermediates_only=True)` for a (pruned) SwinTransformer, each
    taken stage output normed by `out_norms` on its NHWC self, returned as NCHW views. An image whose sides are
    not multiples of the patch size is padded with zeros at the bottom and right first, as the detection Swin's
    patch embedding does (docs/detection.md "The detection Swin"; vtrain's batches are multiples of 32 already)."""
    ph, pw = body.patch_embed.patch_size
    if not (statically_known_true(x.shape[-2] % ph == 0) and statically_known_true(x.shape[-1] % pw == 0)):
        x = F.pad(x, (0, -x.shape[-1] % pw, 0, -x.shape[-2] % ph))
    x = body.patch_embed(x)
    feats = []
    for i, stage in enumerate(body.layers):
        x = stage(x)
        if i in indices:
            feats.append(lean_norm(out_norms[len(feats)], x).permute(0, 3, 1, 2))
    return feats
