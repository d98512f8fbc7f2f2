"""State-dict adapters from published DINO codebases to vtrain's DINO, one module per source (the layout of
torchtitan's per-model `state_dict_adapter.py`): `idea` (IDEA-Research/DINO), `detrex` (IDEA-Research/detrex),
`mmdet` (open-mmlab/mmdetection). Each module has `SOURCE` (what it reads), `OPTIONS` (the ModelConfig values of
that codebase, docs/detection.md "Model options") and `from_<source>(sd, whole, categories)` -> models.formats
.Converted, which vtrain/tools/convert.py checks against the model and writes. Shared helpers below.
The command is vtrain/tools/convert.py; the mappings and their sources are in docs/convert.md."""

from __future__ import annotations

import json
import re
from importlib import resources
from dataclasses import dataclass
from typing import Any

import torch

from vtrain.errors import VtrainError


def coco_categories() -> list[dict[str, Any]]:
    """The 80 COCO 2017 detection categories (id, name) in id order, from coco_categories.json (its source in
    docs/convert.md)."""
    text = resources.files(__package__).joinpath("coco_categories.json").read_text()
    return json.loads(text)["categories"]


def class_rows(t: torch.Tensor, class_ids: list[int], what: str, extra_rows: int = 0) -> torch.Tensor:
    """Rows `class_ids` of a tensor indexed by dataset category id (IDEA DINO's 91 rows: row = COCO id), then
    `extra_rows` rows of zeros (vtrain's denoising padding label)."""
    if max(class_ids) >= t.shape[0]:
        raise VtrainError(f"{what}: {t.shape[0]} class rows, but the categories reach id {max(class_ids)}")
    rows = t[torch.tensor(class_ids)]
    if extra_rows:
        rows = torch.cat([rows, rows.new_zeros(extra_rows, *rows.shape[1:])])
    return rows.clone()


def untie(sd: dict[str, torch.Tensor], copy: str, original: str) -> None:
    """A tensor stored twice (a shared head saved under both of its names) must be the same tensor twice."""
    if original not in sd:
        raise VtrainError(f"{copy} is stored as a copy of {original}, which the file lacks")
    if sd[copy].shape != sd[original].shape or not torch.equal(sd[copy], sd[original]):
        raise VtrainError(f"{copy} differs from {original}: the file's shared heads are not tied as expected")


@dataclass(frozen=True)
class Layout:
    """What a file's names show of the model: the backbone stages taken (their indices) and the decoder layers."""

    out_indices: tuple[int, ...]
    dec_layers: int


def categories_for(which: str, source_rows: int) -> list[dict[str, Any]]:
    """`coco`: the 80 COCO categories (class rows selected by id); `source`: every row of the file's class head, ids
    0..rows-1 (IDEA DINO's index: the COCO id), the unused ids named N/A."""
    coco = coco_categories()
    if which == "coco":
        return coco
    if which != "source":
        raise VtrainError(f"categories: choose coco or source, got {which!r}")
    names = {c["id"]: c["name"] for c in coco}
    return [{"id": i, "name": names.get(i, "N/A")} for i in range(source_rows)]


def dino_preset(embed_dim: int, lay: Layout) -> str | None:
    """The vtrain preset of a Swin-L DINO (embed 192, 6 decoder layers): 5-scale (stages 0-3) or 4-scale (1-3)."""
    if embed_dim != 192 or lay.dec_layers != 6:
        return None
    return {(0, 1, 2, 3): "swin-l", (1, 2, 3): "swin-l-4scale"}.get(lay.out_indices)


def swin_name(rest: str, lay: Layout) -> str:
    """vtrain's name for a key of the Swin detection backbone (SwinTransformer/Swin-Transformer-Object-Detection
    layout, as IDEA DINO and detrex save it, without their prefix). Its stage i ends with the downsampling that
    timm puts at the start of stage i+1; `norm{i}` is the LayerNorm on output i (vtrain's `backbone.out_norms`)."""
    m = re.fullmatch(r"layers\.(\d+)\.downsample\.(.+)", rest)
    if m:
        return f"backbone.body.layers.{int(m.group(1)) + 1}.downsample.{m.group(2)}"
    m = re.fullmatch(r"norm(\d+)\.(.+)", rest)
    if m:
        return f"backbone.out_norms.{lay.out_indices.index(int(m.group(1)))}.{m.group(2)}"
    return "backbone.body." + rest


def renamed(rest: str, table: dict[str, str]) -> str | None:
    """`rest` with the first matching prefix of `table` replaced (None: no prefix matches)."""
    for a, b in table.items():
        if rest.startswith(a):
            return b + rest[len(a):]
    return None


def top_name(key: str, table: dict[str, str]) -> str | None:
    """A top-level key renamed by `table`: an entry ending in "." renames the keys below it, others match whole."""
    for a, b in table.items():
        if key == a or (a.endswith(".") and key.startswith(a)):
            return b + key[len(a):]
    return None


def layer_name(m: re.Match, enc: dict[str, str], dec: dict[str, str]) -> str | None:
    """An encoder/decoder layer key (groups: encoder|decoder, layer index, the rest) in vtrain's names."""
    new = renamed(m.group(3), enc if m.group(1) == "encoder" else dec)
    return None if new is None else f"{m.group(1)}.layers.{m.group(2)}.{new}"
