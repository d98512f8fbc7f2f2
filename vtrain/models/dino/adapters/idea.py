"""IDEA-Research/DINO (`main.py` checkpoints: {'model': state dict, 'args': argparse.Namespace, ...}) -> vtrain's DINO.

Key layout of IDEA DINO at faa8520f (`models/dino/dino.py`, `deformable_transformer.py`, `swin_transformer.py`,
`config/DINO/DINO_5scale.py`), mapped per tensor (docs/convert.md "IDEA DINO"):
- `backbone.0.*`: the Swin detection backbone; its stage i ends with the downsampling that timm puts at the start
  of stage i+1, and `norm{i}` is the LayerNorm on output i (vtrain's `backbone.out_norms`);
  `relative_position_index` is a buffer vtrain computes.
- `input_proj.{i}.{0,1}`: conv (with bias) + GroupNorm per level; the first levels take backbone outputs, the
  rest are the stride-2 extra levels.
- decoder layers apply `norm2` after self-attention and `norm1` after cross-attention.
- heads: `class_embed.{i}` / `bbox_embed.{i}` per decoder layer, tied in the file with
  `transformer.decoder.class_embed.{i}` / `bbox_embed.{i}` (checked equal, read once); `transformer.enc_out_*` are
  the encoder-proposal heads (vtrain's last head). The published configs share one class head and one box head
  across the decoder layers (`dec_pred_class_embed_share`, `dec_pred_bbox_embed_share`), which the file stores
  under every layer's name: equal in every layer (or the file's `args` say so) is a shared head, read once as head
  0 and recorded as `shared_class_head` / `shared_box_head`, so a fine-tuning run trains IDEA's parameterisation.
- classes: 91 rows indexed by COCO category id (`num_classes=91`), `label_enc` 92 rows (dn_labelbook_size + 1):
  the rows of the dataset's category ids are taken, in label order.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from vtrain.config.model import MAX_DN_QUERIES
from vtrain.models.dino.adapters import (Layout, arg_int, categories_for, class_rows, dino_preset, layer_name,
                                         queries, swin_name, same, top_name, untie)
from vtrain.models.formats import Converted, need

OPTIONS: dict[str, Any] = {"neck_bias": True, "pos_temperature": 20.0, "pos_offset": 0.0, "pos_normalize": True,
                           "mask_invalid_proposals": False, "refine_eps": 1e-3, "box_eps": 1e-3,
                           "clip_boxes": False}

_ENC = {"self_attn.": "attn.", "norm1.": "norm.", "linear1.": "ffn.fc1.", "linear2.": "ffn.fc2.", "norm2.": "ffn.norm."}
_DEC = {"self_attn.": "self_attn.", "cross_attn.": "cross_attn.", "norm2.": "norm1.", "norm1.": "norm2.",
        "linear1.": "ffn.fc1.", "linear2.": "ffn.fc2.", "norm3.": "ffn.norm."}
_TOP = {"transformer.level_embed": "level_embed", "transformer.tgt_embed.weight": "query_embed.weight",
        "transformer.enc_output.": "memory_proj.", "transformer.enc_output_norm.": "memory_norm.",
        "transformer.decoder.norm.": "decoder.norm.", "transformer.decoder.ref_point_head.": "decoder.ref_point_head."}
_BUFFERS = ("relative_position_index", "attn_mask")


def layout(sd: dict[str, torch.Tensor]) -> Layout:
    """The structure the file's names show: backbone outputs (`backbone.0.norm{i}`), decoder layers."""
    outs = sorted(int(m.group(1)) for k in sd if (m := re.fullmatch(r"backbone\.0\.norm(\d+)\.weight", k)))
    layers = sum(1 for k in sd if re.fullmatch(r"class_embed\.\d+\.weight", k))
    return Layout(tuple(outs), layers)


def name(key: str, lay: Layout) -> str | None:
    """vtrain's name for an IDEA key copied as it is (class rows and tied copies: `from_idea`); None: unknown."""
    if key.startswith("backbone.0."):
        return swin_name(key, "backbone.0.", lay)
    if (top := top_name(key, _TOP)) is not None:
        return top
    m = re.fullmatch(r"transformer\.(encoder|decoder)\.layers\.(\d+)\.(.+)", key)
    if m:
        return layer_name(m, _ENC, _DEC)
    m = re.fullmatch(r"input_proj\.(\d+)\.([01])\.(.+)", key)
    if m:
        i, nb = int(m.group(1)), len(lay.out_indices)
        where = f"lateral.{i}" if i < nb else f"extra.{i - nb}"
        return f"neck.{where}.{m.group(2)}.{m.group(3)}"
    m = re.fullmatch(r"bbox_embed\.(\d+)\.(.+)", key)
    if m:
        return f"reg_heads.{m.group(1)}.{m.group(2)}"
    if key.startswith("transformer.enc_out_bbox_embed."):
        return f"reg_heads.{lay.dec_layers}." + key[len("transformer.enc_out_bbox_embed."):]
    return None


def shared_heads(sd: dict[str, torch.Tensor], lay: Layout, args: Any = None) -> dict[str, bool]:
    """Whether the file's class and box heads are one module shared by the decoder layers: its `args` when they
    say (IDEA's `dec_pred_class_embed_share` / `dec_pred_bbox_embed_share`), else every layer's copy equal to layer
    0's (a shared head is saved under every layer's name)."""
    out = {}
    for head, flag in (("class_embed", "dec_pred_class_embed_share"), ("bbox_embed", "dec_pred_bbox_embed_share")):
        said = getattr(args, flag, None)
        if isinstance(said, bool):
            out[head] = said
            continue
        first = {k: t for k, t in sd.items() if k.startswith(f"{head}.0.")}
        out[head] = lay.dec_layers > 1 and bool(first) and all(
            (other := sd.get(f"{head}.{i}." + k[len(f"{head}.0."):])) is not None and same(other, t)
            for i in range(1, lay.dec_layers) for k, t in first.items())
    return out


def from_idea(sd: dict[str, torch.Tensor], whole: Any = None,
              categories: str | list[dict[str, Any]] | None = None) -> Converted:
    """vtrain's DINO tensors from an IDEA DINO state dict. `categories`: None (the 80 COCO categories, class rows
    selected by id, for a head of COCO's 91 rows), `source` (every row, ids 0..rows-1 as IDEA indexes them) or the
    categories of --categories (their rows selected by id)."""
    lay = layout(sd)
    head = need(sd, "class_embed.0.weight", 2, "the class head of decoder layer 0")
    cats = categories_for(categories, head.shape[0])
    args = whole.get("args") if isinstance(whole, dict) else None
    shared = shared_heads(sd, lay, args)
    ids = [c["id"] for c in cats]
    out: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    read: set[str] = set()
    unused: dict[str, str] = {}
    for key, t in sd.items():
        if key.endswith(_BUFFERS):
            unused[key] = "an index buffer vtrain computes"
            continue
        m = re.fullmatch(r"transformer\.decoder\.(class_embed|bbox_embed)\.(\d+)\.(.+)", key)
        if m:  # the decoder's reference to the detector's per-layer heads (shared): the same tensors again
            untie(sd, key, f"{m.group(1)}.{m.group(2)}.{m.group(3)}")
            unused[key] = "a tied copy of " + f"{m.group(1)}.{m.group(2)}.{m.group(3)}"
            continue
        m = re.fullmatch(r"(class_embed|bbox_embed)\.(\d+)\.(.+)", key)
        if m and shared[m.group(1)] and m.group(2) != "0":  # one head for every layer: read once, as head 0
            untie(sd, key, f"{m.group(1)}.0.{m.group(3)}")
            unused[key] = f"a copy of the shared head {m.group(1)}.0.{m.group(3)}"
            continue
        if key.startswith("transformer.enc_out_bbox_embed.") and shared["bbox_embed"]:
            new = "reg_heads.1." + key[len("transformer.enc_out_bbox_embed."):]
            out[new], origin[new] = t, key  # a view: convert.fill copies it once its shape is checked
            read.add(key)
            continue
        m = re.fullmatch(r"(class_embed\.(\d+)|transformer\.enc_out_class_embed)\.(weight|bias)", key)
        if m:
            layer = m.group(2) if m.group(2) is not None else (1 if shared["class_embed"] else lay.dec_layers)
            new, value = f"cls_heads.{layer}.{m.group(3)}", class_rows(t, ids, key)
        elif key == "label_enc.weight":
            new, value = "label_embed.weight", class_rows(t, ids, key, extra_rows=1)
        else:
            new, value = name(key, lay), t  # a view: convert.fill copies it once its shape is checked
            if new is None:
                continue  # convert refuses the file, naming it
        out[new], origin[new] = value, key
        read.add(key)
    model = {**OPTIONS, "num_queries": queries(sd, "transformer.tgt_embed.weight"),
             "shared_class_head": shared["class_embed"], "shared_box_head": shared["bbox_embed"]}
    dn = arg_int(args, "dn_number", 0, MAX_DN_QUERIES, "IDEA's denoising queries")
    if dn is not None:
        model["dn_queries"] = dn
    embed = "backbone.0.patch_embed.proj.weight"
    preset = dino_preset(need(sd, embed, 4, "the Swin patch embedding").shape[0] if embed in sd else 0, lay)
    if preset:
        model["preset"] = preset
    which = "given" if isinstance(categories, list) else categories or "coco"
    return Converted(out, read, unused, model, len(cats), cats,
                     [f"IDEA DINO: {len(read)} tensors read, {len(unused)} left out (tied head copies, index "
                      f"buffers); classes: {len(cats)} ({which}); heads shared by the decoder layers: "
                      f"class {shared['class_embed']}, box {shared['bbox_embed']}; model options {OPTIONS}"], origin)
