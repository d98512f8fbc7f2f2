"""IDEA-Research/detrex DINO (detectron2 `DetectionCheckpointer` files: {'model': state dict, ...}) -> vtrain's DINO.

Key layout of detrex at e244e6c3 (`projects/dino/modeling/dino.py`, `dino_transformer.py`,
`detrex/modeling/neck/channel_mapper.py`, `detrex/modeling/backbone/swin.py`), mapped per tensor (docs/convert.md
"detrex"):
- `backbone.*`: the Swin detection backbone, IDEA's layout without the Joiner's `.0` (adapters.swin_name);
- `neck.convs.{i}.{conv,norm}` (conv with bias) and `neck.extra_convs.{j}.{conv,norm}`;
- transformer layers as detrex's `BaseTransformerLayer` lists them: encoder `attentions.0`, `norms.0` (after
  attention), `ffns.0.layers.{0.0,1}`, `norms.1`; decoder `attentions.0.attn` (self-attention), `norms.0`,
  `attentions.1` (cross-attention), `norms.1`, `ffns.0`, `norms.2`;
- heads `class_embed.{i}` / `bbox_embed.{i}`, one per decoder layer plus the encoder proposals' (the last), saved
  again as `transformer.decoder.class_embed.{i}` / `bbox_embed.{i}` (the same tensors: checked, read once);
- classes: contiguous rows in category-id order (detectron2's thing classes: 80 for COCO), vtrain's order too;
  `label_enc` has those rows and vtrain adds its zero padding row. A detectron2 checkpoint records no class names:
  a head of another size than COCO's 80 needs `--categories`.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from vtrain.models.dino.adapters import (Layout, contiguous_categories, dino_preset, layer_name, padded, queries,
                                         swin_name, top_name, untie)
from vtrain.models.formats import Converted, need

OPTIONS: dict[str, Any] = {"neck_bias": True, "pos_temperature": 10000.0, "pos_offset": -0.5, "pos_normalize": True,
                           "mask_invalid_proposals": False, "refine_eps": 1e-3, "box_eps": 1e-3,
                           "clip_boxes": True}

_ENC = {"attentions.0.": "attn.", "norms.0.": "norm.", "ffns.0.layers.0.0.": "ffn.fc1.", "ffns.0.layers.1.": "ffn.fc2.",
        "norms.1.": "ffn.norm."}
_DEC = {"attentions.0.attn.": "self_attn.", "norms.0.": "norm1.", "attentions.1.": "cross_attn.", "norms.1.": "norm2.",
        "ffns.0.layers.0.0.": "ffn.fc1.", "ffns.0.layers.1.": "ffn.fc2.", "norms.2.": "ffn.norm."}
_TOP = {"transformer.level_embeds": "level_embed", "transformer.tgt_embed.weight": "query_embed.weight",
        "transformer.enc_output.": "memory_proj.", "transformer.enc_output_norm.": "memory_norm.",
        "transformer.decoder.norm.": "decoder.norm.", "transformer.decoder.ref_point_head.": "decoder.ref_point_head."}
_BUFFERS = ("relative_position_index", "attn_mask")


def layout(sd: dict[str, torch.Tensor]) -> Layout:
    outs = sorted(int(m.group(1)) for k in sd if (m := re.fullmatch(r"backbone\.norm(\d+)\.weight", k)))
    heads = sum(1 for k in sd if re.fullmatch(r"class_embed\.\d+\.weight", k))
    return Layout(tuple(outs), heads - 1)


def name(key: str, lay: Layout) -> str | None:
    """vtrain's name for a detrex key (None: unknown; tied copies and buffers: `from_detrex`)."""
    if key.startswith("backbone."):
        return swin_name(key, "backbone.", lay)
    if (top := top_name(key, _TOP)) is not None:
        return top
    m = re.fullmatch(r"transformer\.(encoder|decoder)\.layers\.(\d+)\.(.+)", key)
    if m:
        return layer_name(m, _ENC, _DEC)
    m = re.fullmatch(r"neck\.(convs|extra_convs)\.(\d+)\.(conv|norm)\.(.+)", key)
    if m:
        where = "lateral" if m.group(1) == "convs" else "extra"
        return f"neck.{where}.{m.group(2)}.{0 if m.group(3) == 'conv' else 1}.{m.group(4)}"
    m = re.fullmatch(r"(class_embed|bbox_embed)\.(\d+)\.(.+)", key)
    if m:
        return f"{'cls_heads' if m.group(1) == 'class_embed' else 'reg_heads'}.{m.group(2)}.{m.group(3)}"
    return None


def from_detrex(sd: dict[str, torch.Tensor], whole: Any = None,
                categories: list[dict[str, Any]] | None = None) -> Converted:
    """vtrain's DINO tensors from a detrex DINO state dict (contiguous class rows in id order: COCO's 80, or the
    `categories` of --categories, one per row)."""
    lay = layout(sd)
    rows = need(sd, "class_embed.0.weight", 2, "the class head of decoder layer 0").shape[0]
    cats = contiguous_categories(rows, categories, None, "")
    out: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    read: set[str] = set()
    unused: dict[str, str] = {}
    for key, t in sd.items():
        if key.endswith(_BUFFERS):
            unused[key] = "an index buffer vtrain computes"
            continue
        m = re.fullmatch(r"transformer\.decoder\.(class_embed|bbox_embed)\.(\d+)\.(.+)", key)
        if m:
            untie(sd, key, f"{m.group(1)}.{m.group(2)}.{m.group(3)}")
            unused[key] = f"a tied copy of {m.group(1)}.{m.group(2)}.{m.group(3)}"
            continue
        if key == "label_enc.weight":
            new, value = "label_embed.weight", padded(t, key)
        else:
            new, value = name(key, lay), t  # a view: convert.fill copies it once its shape is checked
            if new is None:
                continue
        out[new], origin[new] = value, key
        read.add(key)
    model = {**OPTIONS, "num_queries": queries(sd, "transformer.tgt_embed.weight")}
    embed = "backbone.patch_embed.proj.weight"
    preset = dino_preset(need(sd, embed, 4, "the Swin patch embedding").shape[0] if embed in sd else 0, lay)
    if preset:
        model["preset"] = preset
    return Converted(out, read, unused, model, rows, cats,
                     [f"detrex DINO: {len(read)} tensors read, {len(unused)} left out (tied head copies, index "
                      f"buffers); classes: {rows}; model options {OPTIONS}"], origin)
