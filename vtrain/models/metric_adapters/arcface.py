"""arcface_torch ViT -> vtrain's `*-af` presets (`vtrain convert --from arcface-vit`, docs/convert.md §5).

arcface_torch (insightface recognition/arcface_torch/backbones/vit.py) names its transformer as timm does (patch
embedding, position embedding, blocks with norm1/attn.qkv/attn.proj/norm2/mlp.fc1/mlp.fc2, final norm), so those
tensors keep their names under `backbone.`; its feature layer `feature.0-3` (Linear, BatchNorm1d, Linear,
BatchNorm1d) is vtrain's FlattenNeck (models/metric.py). `mask_token` fills the masked tokens of its train-time
token masking, which vtrain does not do: it is left out, and no inference path reads it.

Tensor names outside these patterns (a class token, a qkv bias, BatchNorm token norms of `norm_layer="bn"`) are
other variants: they stay unmatched and `vtrain convert` refuses the file, naming them.
"""

from __future__ import annotations

import re

import torch

from vtrain.models.formats import Converted, need
from vtrain.presets import METRIC_PRESETS

# arcface_torch's transformer tensors, which vtrain's timm backbone names alike
_BACKBONE = re.compile(r"^(pos_embed|patch_embed\.proj\.(weight|bias)|norm\.(weight|bias)|"
                       r"blocks\.\d+\.(norm[12]\.(weight|bias)|attn\.qkv\.weight|attn\.proj\.(weight|bias)|"
                       r"mlp\.fc[12]\.(weight|bias)))$")
_BN = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")
# feature.0 Linear (tokens x width -> width), feature.1 BatchNorm1d, feature.2 Linear (width -> embedding), feature.3
_NECK = {"feature.0.weight": "neck.reduce.weight", "feature.2.weight": "neck.proj.weight",
         **{f"feature.1.{s}": f"neck.reduce_norm.{s}" for s in _BN},
         **{f"feature.3.{s}": f"neck.norm.{s}" for s in _BN}}
UNUSED = {"mask_token": "arcface_torch's train-time token masking (mask_ratio), which vtrain does not do"}


def preset_for(width: int, depth: int) -> str | None:
    """The `*-af` preset of this width and depth, if one has them."""
    for name, make in METRIC_PRESETS.items():
        p = make()
        if p.neck == "flatten" and (p.kwargs["embed_dim"], p.kwargs["depth"]) == (width, depth):
            return name
    return None


def from_arcface_vit(sd: dict[str, torch.Tensor], whole: object = None) -> Converted:
    """Map an arcface_torch ViT state dict (model.pt, or `state_dict_backbone` of checkpoint_gpu_<rank>.pt)."""
    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    for name, t in sd.items():
        new = f"backbone.{name}" if _BACKBONE.match(name) else _NECK.get(name)
        if new is not None:  # views: convert.fill copies each once its shape is checked
            tensors[new], origin[new] = t, name
    pos = need(sd, "pos_embed", 3, "arcface_torch's position embedding, (1, tokens, width)")
    width = pos.shape[-1]
    depth = len({int(m.group(1)) for n in sd if (m := re.match(r"blocks\.(\d+)\.", n))})
    embedding = need(sd, "feature.3.running_mean", 1, "the embedding's BatchNorm statistics").shape[0]
    model = {"embedding_dim": int(embedding), "image_size": 112, "neck_norm": "bn"}
    preset = preset_for(width, depth)
    if preset is not None:
        model["preset"] = preset
    notes = [f"arcface_torch ViT: width {width}, depth {depth}, {pos.shape[1]} tokens, embedding "
             f"{model['embedding_dim']}" + (f" (preset {preset})" if preset else " (no preset has these sizes)")]
    return Converted(tensors, set(origin.values()), {n: why for n, why in UNUSED.items() if n in sd}, model,
                     num_classes=0, notes=notes, origin=origin)
