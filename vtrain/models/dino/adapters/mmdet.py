"""open-mmlab/mmdetection DINO (mmengine checkpoints: {'meta': ..., 'state_dict': ...}) -> vtrain's DINO.

Key layout of mmdetection 3.3.0 (`mmdet/models/detectors/dino.py`, `deformable_detr.py`,
`models/layers/transformer/dino_layers.py`, `deformable_detr_layers.py`, `models/backbones/swin.py`,
`models/necks/channel_mapper.py`, `models/dense_heads/dino_head.py`), mapped per tensor (docs/convert.md "mmdet"):
- `backbone.*`: mmdet's Swin: `patch_embed.projection`, `stages.{i}.blocks.{j}.attn.w_msa.*`,
  `ffn.layers.{0.0,1}` (fc1, fc2), `stages.{i}.downsample` (timm's `layers.{i+1}.downsample`), `norm{i}`. Its
  PatchMerging gathers each 2x2 patch with `nn.Unfold`, channel-major with the offsets (0,0), (0,1), (1,0), (1,1);
  the Swin/timm order is offset-major, (0,0), (1,0), (0,1), (1,1): the downsample `reduction.weight` columns and
  `norm` entries are put back in that order (the inverse of mmdet's own `correct_unfold_reduction_order` /
  `correct_unfold_norm_order` in `swin2mmdet`).
- `neck.convs.{i}.{conv,gn}` (no conv bias) and `neck.extra_convs.{j}.{conv,gn}`;
- encoder layers `self_attn`, `norms.0`, `ffn.layers.{0.0,1}`, `norms.1`; decoder layers `self_attn.attn`,
  `norms.0`, `cross_attn`, `norms.1`, `ffn`, `norms.2`;
- `bbox_head.cls_branches.{i}` / `reg_branches.{i}.{0,2,4}`: one per decoder layer plus the encoder proposals'
  (the last); `query_embedding`, `memory_trans_fc`, `memory_trans_norm`, `dn_query_generator.label_embedding`;
- classes: contiguous rows in category-id order (`CocoDataset.METAINFO`: COCO's 80), vtrain's order too; their
  names are the checkpoint's `meta.dataset_meta.classes` (mmengine's runner saves the dataset's metainfo there),
  the row count is the class head's.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from vtrain.models.dino.adapters import (Layout, contiguous_categories, dino_preset, file_class_names, layer_name,
                                         out_norm, padded, queries, renamed, top_name)
from vtrain.models.formats import AdapterError, Converted, need

OPTIONS: dict[str, Any] = {"neck_bias": False, "pos_temperature": 20.0, "pos_offset": 0.0, "pos_normalize": True,
                           "mask_invalid_proposals": False, "refine_eps": 1e-3, "box_eps": 1e-5,
                           "clip_boxes": True}

_SWIN = {"patch_embed.projection.": "patch_embed.proj.", "attn.w_msa.": "attn.", "ffn.layers.0.0.": "mlp.fc1.",
         "ffn.layers.1.": "mlp.fc2."}
_ENC = {"self_attn.": "attn.", "norms.0.": "norm.", "ffn.layers.0.0.": "ffn.fc1.", "ffn.layers.1.": "ffn.fc2.",
        "norms.1.": "ffn.norm."}
_DEC = {"self_attn.attn.": "self_attn.", "norms.0.": "norm1.", "cross_attn.": "cross_attn.", "norms.1.": "norm2.",
        "ffn.layers.0.0.": "ffn.fc1.", "ffn.layers.1.": "ffn.fc2.", "norms.2.": "ffn.norm."}
_TOP = {"level_embed": "level_embed", "query_embedding.weight": "query_embed.weight",
        "memory_trans_fc.": "memory_proj.", "memory_trans_norm.": "memory_norm.", "decoder.norm.": "decoder.norm.",
        "decoder.ref_point_head.": "decoder.ref_point_head."}
_BUFFERS = ("relative_position_index", "attn_mask")


def layout(sd: dict[str, torch.Tensor]) -> Layout:
    outs = sorted(int(m.group(1)) for k in sd if (m := re.fullmatch(r"backbone\.norm(\d+)\.weight", k)))
    heads = sum(1 for k in sd if re.fullmatch(r"bbox_head\.cls_branches\.\d+\.weight", k))
    return Layout(tuple(outs), heads - 1)


def unfold_to_swin(t: torch.Tensor, key: str = "") -> torch.Tensor:
    """A PatchMerging tensor over the 4C merged channels (reduction weight: last dim; norm: the only dim) from
    mmdet's unfold order (channel-major, offsets (0,0), (0,1), (1,0), (1,1)) to Swin's (offset-major, offsets
    (0,0), (1,0), (0,1), (1,1))."""
    if t.ndim not in (1, 2) or t.shape[-1] % 4 or 0 in t.shape:
        raise AdapterError(f"tensor {key}: a patch-merging tensor over 4 x C merged channels (1 or 2 dimensions, the "
                           f"last a non-zero multiple of 4) expected, found shape {tuple(t.shape)}")
    lead, c4 = t.shape[:-1], t.shape[-1]
    x = t.reshape(*lead, c4 // 4, 4).transpose(-1, -2)  # (..., offset in unfold order, C)
    return x[..., [0, 2, 1, 3], :].reshape(*lead, c4)


def name(key: str, lay: Layout) -> str | None:
    """vtrain's name for an mmdet key (None: unknown)."""
    m = re.fullmatch(r"backbone\.stages\.(\d+)\.downsample\.(.+)", key)
    if m:
        return f"backbone.body.layers.{int(m.group(1)) + 1}.downsample.{m.group(2)}"
    m = re.fullmatch(r"backbone\.norm(\d+)\.(.+)", key)
    if m:
        return out_norm(int(m.group(1)), m.group(2), key, lay)
    m = re.fullmatch(r"backbone\.stages\.(\d+)\.blocks\.(\d+)\.(.+)", key)
    if m:
        rest = renamed(m.group(3), _SWIN) or m.group(3)
        return f"backbone.body.layers.{m.group(1)}.blocks.{m.group(2)}.{rest}"
    if key.startswith("backbone.patch_embed."):
        return "backbone.body." + (renamed(key[len("backbone."):], _SWIN) or key[len("backbone."):])
    if (top := top_name(key, _TOP)) is not None:
        return top
    m = re.fullmatch(r"(encoder|decoder)\.layers\.(\d+)\.(.+)", key)
    if m:
        return layer_name(m, _ENC, _DEC)
    m = re.fullmatch(r"neck\.(convs|extra_convs)\.(\d+)\.(conv|gn)\.(.+)", key)
    if m:
        where = "lateral" if m.group(1) == "convs" else "extra"
        return f"neck.{where}.{m.group(2)}.{0 if m.group(3) == 'conv' else 1}.{m.group(4)}"
    m = re.fullmatch(r"bbox_head\.cls_branches\.(\d+)\.(.+)", key)
    if m:
        return f"cls_heads.{m.group(1)}.{m.group(2)}"
    m = re.fullmatch(r"bbox_head\.reg_branches\.(\d+)\.([024])\.(.+)", key)
    if m:
        return f"reg_heads.{m.group(1)}.layers.{int(m.group(2)) // 2}.{m.group(3)}"
    return None


def dataset_classes(whole: Any) -> list[str] | None:
    """The class names mmengine's runner saved with the weights (`meta.dataset_meta.classes`), or None."""
    meta = whole.get("meta") if isinstance(whole, dict) else None
    dataset = meta.get("dataset_meta") if isinstance(meta, dict) else None
    if not isinstance(dataset, dict) or dataset.get("classes") is None:
        return None
    return file_class_names(dataset["classes"], "meta.dataset_meta.classes")


def from_mmdet(sd: dict[str, torch.Tensor], whole: Any = None, categories: list[dict[str, Any]] | None = None,
               unfold_order: bool = True) -> Converted:
    """vtrain's DINO tensors from an mmdet DINO state dict (contiguous class rows in id order, named by the file's
    `meta.dataset_meta.classes` or by the `categories` of --categories). `unfold_order=False` copies the
    downsampling tensors as they are (only to show that their order matters: tests)."""
    lay = layout(sd)
    rows = need(sd, "bbox_head.cls_branches.0.weight", 2, "the class head of decoder layer 0").shape[0]
    cats = contiguous_categories(rows, categories, dataset_classes(whole), "meta.dataset_meta.classes")
    out: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    read: set[str] = set()
    unused: dict[str, str] = {}
    for key, t in sd.items():
        if key.endswith(_BUFFERS):
            unused[key] = "an index buffer vtrain computes"
            continue
        if key == "dn_query_generator.label_embedding.weight":
            new, value = "label_embed.weight", padded(t, key)
        else:
            new = name(key, lay)
            if new is None:
                continue  # convert refuses the file, naming it
            merging = re.fullmatch(r"backbone\.stages\.\d+\.downsample\.(reduction\.weight|norm\.weight|norm\.bias)",
                                   key)
            value = unfold_to_swin(t, key) if merging and unfold_order else t  # else a view: fill copies it
        out[new], origin[new] = value, key
        read.add(key)
    model = {**OPTIONS, "num_queries": queries(sd, "query_embedding.weight")}
    embed = "backbone.patch_embed.projection.weight"
    preset = dino_preset(need(sd, embed, 4, "the Swin patch embedding").shape[0] if embed in sd else 0, lay)
    if preset:
        model["preset"] = preset
    return Converted(out, read, unused, model, rows, cats,
                     [f"mmdetection DINO: {len(read)} tensors read, {len(unused)} index buffers left out; "
                      f"PatchMerging channels put back in Swin order; classes: {rows}"
                      f"{' named by the file' if categories is None and dataset_classes(whole) else ''}; "
                      f"model options {OPTIONS}"], origin)
