"""State-dict adapters from published DINO codebases to vtrain's DINO, one module per source (the layout of
torchtitan's per-model `state_dict_adapter.py`): `idea` (IDEA-Research/DINO), `detrex` (IDEA-Research/detrex),
`mmdet` (open-mmlab/mmdetection). Each module has `SOURCE` (what it reads), `OPTIONS` (the ModelConfig values of
that codebase, docs/detection.md "Model options") and `from_<source>(sd, whole, categories)` -> models.formats
.Converted, which vtrain/tools/convert.py checks against the model and writes. Shared helpers below.
The command is vtrain/tools/convert.py; the mappings and their sources are in docs/convert.md.

Adapters take views of the source tensors (renames cost nothing); `convert.fill` makes every tensor of the model
once it has checked its shape, so nothing is copied at a size the model does not have. A size an adapter reads
itself (class rows, queries, widths) comes through `formats.need`, which names a missing tensor or one of another
rank in one line."""

from __future__ import annotations

import json
import numbers
import re
from importlib import resources
from dataclasses import dataclass
from typing import Any

import torch

from vtrain.config.model import MAX_QUERIES
from vtrain.errors import shown
from vtrain.models.formats import AdapterError, need
from vtrain.io.records import MAX_CATEGORIES

def coco_categories() -> list[dict[str, Any]]:
    """The 80 COCO 2017 detection categories (id, name) in id order, from coco_categories.json (its source in
    docs/convert.md)."""
    text = resources.files(__package__).joinpath("coco_categories.json").read_text()
    return json.loads(text)["categories"]


def class_rows(t: torch.Tensor, class_ids: list[int], what: str, extra_rows: int = 0) -> torch.Tensor:
    """Rows `class_ids` of a tensor indexed by dataset category id (IDEA DINO's 91 rows: row = COCO id), then
    `extra_rows` rows of zeros (vtrain's denoising padding label)."""
    if t.ndim not in (1, 2) or 0 in t.shape:
        raise AdapterError(f"tensor {what}: class rows of 1 or 2 non-empty dimensions expected, found shape "
                           f"{tuple(t.shape)}")
    if max(class_ids) >= t.shape[0] or min(class_ids) < 0:
        raise AdapterError(f"tensor {what}: {t.shape[0]} class rows (ids 0..{t.shape[0] - 1}), but the categories "
                           f"reach id {max(class_ids)}")
    rows = t[torch.tensor(class_ids)]
    if extra_rows:
        rows = torch.cat([rows, rows.new_zeros(extra_rows, *rows.shape[1:])])
    return rows


def padded(t: torch.Tensor, what: str) -> torch.Tensor:
    """A denoising label embedding (one row per class) with vtrain's padding label appended: a row of zeros."""
    if t.ndim != 2 or 0 in t.shape:
        raise AdapterError(f"tensor {what}: expected 2 non-empty dimensions (classes x width), found shape "
                           f"{tuple(t.shape)}")
    return torch.cat([t, t.new_zeros(1, t.shape[1])])


def untie(sd: dict[str, torch.Tensor], copy: str, original: str) -> None:
    """A tensor stored twice (a shared head saved under both of its names) must be the same tensor twice."""
    if original not in sd:
        raise AdapterError(f"{copy} is stored as a copy of {original}, which the file lacks")
    if not same(sd[copy], sd[original]):
        raise AdapterError(f"{copy} differs from {original}: the file's shared heads are not tied as expected")


def tied(a: torch.Tensor, b: torch.Tensor) -> bool:
    """One tensor saved under two names, as torch.save writes a tied module (same storage, offset, strides)."""
    return a is b or (a.device.type != "meta" and b.device.type != "meta"
                      and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
                      and (a.storage_offset(), a.stride(), a.shape, a.dtype) == (b.storage_offset(), b.stride(),
                                                                               b.shape, b.dtype))


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Tied, or equal in shape, dtype and every value (a tensor on the meta device has no values: only tied)."""
    if tied(a, b):
        return True
    return (a.shape == b.shape and a.dtype == b.dtype and "meta" not in (a.device.type, b.device.type)
            and torch.equal(a, b))


def arg_int(args: Any, name: str, low: int, high: int, what: str) -> int | None:
    """An integer field of a file's saved command line (IDEA DINO's `args`, an argparse.Namespace): None when the file
    has no such field; one line naming it when it is not an integer in low..high (NaN, a string, a list, a bool)."""
    value = vars(args).get(name) if hasattr(args, "__dict__") and isinstance(vars(args), dict) else None
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not low <= int(value) <= high:
        raise AdapterError(f"args.{name} ({what}): expected an integer in {low}..{high}, got {shown(value)}")
    return int(value)


def queries(sd: dict[str, torch.Tensor], key: str) -> int:
    """The number of learned decoder queries: the rows of `key` (IDEA and detrex `tgt_embed`, mmdetection
    `query_embedding`), within what a run accepts (config.model.MAX_QUERIES)."""
    n = need(sd, key, 2, "the decoder's learned queries").shape[0]
    if n > MAX_QUERIES:
        raise AdapterError(f"tensor {key} (the decoder's learned queries): {n} rows; a run takes at most "
                           f"{MAX_QUERIES} queries")
    return n


def given_categories(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Categories given with --categories (records.categories checked them), in id order: vtrain's label order."""
    return sorted(items, key=lambda c: c["id"])


def file_class_names(value: Any, where: str) -> list[str]:
    """Class names a file records (mmdetection's `meta.dataset_meta.classes`): a list of strings."""
    if not isinstance(value, (list, tuple)) or not value:
        raise AdapterError(f"{where}: expected a non-empty list of class names, got {shown(value)}")
    if len(value) > MAX_CATEGORIES:
        raise AdapterError(f"{where}: {len(value)} class names; a detector holds at most {MAX_CATEGORIES} classes")
    bad = next((v for v in value if not isinstance(v, str) or len(v) > 1000), None)
    if bad is not None:
        raise AdapterError(f"{where}: expected class names (strings), found {shown(bad)}")
    return list(value)


def contiguous_categories(rows: int, given: list[dict[str, Any]] | None, names: list[str] | None,
                          where: str) -> list[dict[str, Any]]:
    """The categories of a class head with one row per class in id order (detrex, mmdetection: row i is the i-th
    category by id, as their COCO readers number them): --categories when given; else the names the file records
    (COCO's ids when they are COCO's 80 names in order, else ids 1..N); else COCO's 80 for a head of 80 rows. Any other
    head is refused rather than given names that are not its own."""
    if given is not None:
        if len(given) != rows:
            raise AdapterError(f"--categories lists {len(given)} categories; the file's class head has {rows} rows")
        return given_categories(given)
    coco = coco_categories()
    if names is not None:
        if len(names) != rows:
            raise AdapterError(f"{where} lists {len(names)} classes; the file's class head has {rows} rows")
        if names == [c["name"] for c in coco]:
            return coco
        return [{"id": i + 1, "name": n} for i, n in enumerate(names)]
    if rows != len(coco):
        raise AdapterError(f"the file's class head has {rows} rows, not COCO's {len(coco)}, and the file names no "
                           "classes: give them with --categories FILE (docs/convert.md §6)")
    return coco


@dataclass(frozen=True)
class Layout:
    """What a file's names show of the model: the backbone stages taken (their indices) and the decoder layers."""

    out_indices: tuple[int, ...]
    dec_layers: int


def categories_for(which: str | list[dict[str, Any]] | None, source_rows: int) -> list[dict[str, Any]]:
    """Categories of a class head indexed by category id (IDEA DINO: row = id). `None`/`coco`: the 80 COCO categories
    (class rows selected by id) when the head has COCO's 91 rows; `source`: every row, ids 0..rows-1, the ids COCO
    does not use named N/A; a list (--categories): those categories, their rows selected by id."""
    coco = coco_categories()
    if isinstance(which, list):
        return given_categories(which)
    if which in (None, "coco"):
        if source_rows != 91:
            raise AdapterError(f"the file's class head has {source_rows} rows (category ids 0..{source_rows - 1}), "
                               "not COCO's 91, and the file names no classes: give them with --categories FILE "
                               "(docs/convert.md §6)")
        return coco
    if which != "source":
        raise AdapterError(f"categories: choose coco or source, got {which!r}")
    names = {c["id"]: c["name"] for c in coco}
    return [{"id": i, "name": names.get(i, "N/A")} for i in range(source_rows)]


def dino_preset(embed_dim: int, lay: Layout) -> str | None:
    """The vtrain preset of a Swin-L DINO (embed 192, 6 decoder layers): 5-scale (stages 0-3) or 4-scale (1-3)."""
    if embed_dim != 192 or lay.dec_layers != 6:
        return None
    return {(0, 1, 2, 3): "swin-l", (1, 2, 3): "swin-l-4scale"}.get(lay.out_indices)


def swin_name(key: str, prefix: str, lay: Layout) -> str:
    """vtrain's name for a key of the Swin detection backbone (SwinTransformer/Swin-Transformer-Object-Detection
    layout, as IDEA DINO and detrex save it, below their `prefix`). Its stage i ends with the downsampling that
    timm puts at the start of stage i+1; `norm{i}` is the LayerNorm on output i (vtrain's `backbone.out_norms`)."""
    rest = key[len(prefix):]
    m = re.fullmatch(r"layers\.(\d+)\.downsample\.(.+)", rest)
    if m:
        return f"backbone.body.layers.{int(m.group(1)) + 1}.downsample.{m.group(2)}"
    m = re.fullmatch(r"norm(\d+)\.(.+)", rest)
    if m:
        return out_norm(int(m.group(1)), m.group(2), key, lay)
    return "backbone.body." + rest


def out_norm(level: int, param: str, key: str, lay: Layout) -> str:
    """vtrain's name of the output LayerNorm of backbone level `level` (`lay.out_indices` lists the levels whose
    norm has a weight)."""
    if level not in lay.out_indices:
        raise AdapterError(f"{key}: an output norm of backbone level {level} without its weight")
    return f"backbone.out_norms.{lay.out_indices.index(level)}.{param}"


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
