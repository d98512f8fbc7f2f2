"""Fine-tuning a detector on other classes: which of DINO's tensors depend on the class list, and how a full
checkpoint's class rows are carried over to a model built for another one (docs/detection.md, "Fine-tuning on
your own classes").

Three kinds of tensor hold one row per class: every class head (`cls_heads.<i>.weight` (C, d) and `.bias` (C,),
one per decoder layer plus the encoder-proposal head) and the denoising label embedding `label_embed.weight`
(C + 1, d), whose last row is the padding slot (`padding_idx`, zero, never trained). Everything else is the same
for any class list. A row is carried over when the checkpoint's class of that row has the same name as the new
class (compared case- and surrounding-space-insensitively); every other row keeps the value the new model was
built with: its own recipe initialisation (`DINO._init_weights`: the class bias at prior probability 0.01, Linear
weights as torch initialises them, the label embedding N(0, 1), the padding row zero).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

_CLASS_KEY = re.compile(r"^(cls_heads\.(\d+)\.(weight|bias)|label_embed\.weight)$")


def class_keys(names: Sequence[str]) -> list[str]:
    """The names among `names` (a DINO state dict's keys) whose first dimension runs over the classes."""
    return [k for k in names if _CLASS_KEY.match(k)]


def class_count(sd: Mapping[str, torch.Tensor]) -> int | None:
    """The class count a DINO state dict was built for (rows of its first class head); None without one."""
    w = sd.get("cls_heads.0.weight")
    return int(w.shape[0]) if w is not None and w.dim() == 2 else None


def _key(c: Mapping[str, Any]) -> str:
    # a category without a name is named by its id, as the COCO reader and categories.json do
    return str(c.get("name", c.get("id"))).strip().casefold()


@dataclass
class RowPlan:
    """How a checkpoint's class rows map onto the new model's."""

    old: int
    new: int
    pairs: list[tuple[int, int]]
    """(new row, checkpoint row) of every class carried over."""
    by_name: bool
    """The pairs were found by name (both class lists known); else they are the identity of equal counts."""

    @property
    def as_is(self) -> bool:
        """Same classes in the same order: every class tensor loads unchanged."""
        return self.old == self.new and self.pairs == [(i, i) for i in range(self.new)]


def plan_rows(old: int, new: int, old_categories: Sequence[Mapping[str, Any]] | None,
              new_categories: Sequence[Mapping[str, Any]] | None) -> RowPlan:
    """Rows to carry over from a checkpoint of `old` classes to a model of `new`. With both class lists (COCO
    `categories` entries in label order) rows are matched by name; without the checkpoint's, equal counts are taken
    to be the same classes (a bare weights file records no names) and other counts keep no row."""
    if old_categories is None or new_categories is None:
        return RowPlan(old, new, [(i, i) for i in range(new)] if old == new else [], False)
    first: dict[str, int] = {}
    for i, c in enumerate(old_categories):
        first.setdefault(_key(c), i)
    pairs = [(i, first[_key(c)]) for i, c in enumerate(new_categories) if _key(c) in first]
    return RowPlan(old, new, pairs, True)


def carry_rows(sd: Mapping[str, torch.Tensor], own: Mapping[str, torch.Tensor], plan: RowPlan) -> dict[str, torch.Tensor]:
    """The class tensors of the new model: its own values (the recipe's initialisation) with the planned rows
    copied from the checkpoint `sd`. The label embedding's padding row (the last) stays the new model's."""
    out = {}
    rows_new = torch.tensor([n for n, _ in plan.pairs], dtype=torch.long)
    rows_old = torch.tensor([o for _, o in plan.pairs], dtype=torch.long)
    for k in class_keys(list(own)):
        t = own[k].detach().clone()
        if plan.pairs and k in sd:  # (a partial load, --allow-partial-pretrained, may lack some)
            t[rows_new] = sd[k][rows_old].to(t.dtype)
        out[k] = t
    return out


def misfit_class_tensors(sd: Mapping[str, torch.Tensor], own: Mapping[str, torch.Tensor], old: int,
                         new: int) -> list[str]:
    """Class tensors of `sd` whose shape is not the model's once the class rows are set aside (another width, or
    rows that do not follow the class count): these are architecture differences, not other classes."""
    bad = []
    for k in class_keys(list(own)):
        if k not in sd:
            continue
        extra = 1 if k == "label_embed.weight" else 0  # the padding row
        have, want = tuple(sd[k].shape), tuple(own[k].shape)
        if have[:1] != (old + extra,) or want[:1] != (new + extra,) or have[1:] != want[1:]:
            bad.append(k)
    return bad


def describe_keys(keys: Sequence[str]) -> str:
    """`cls_heads.0-6.weight/bias, label_embed.weight`: the class tensors, short."""
    heads = sorted({int(m.group(2)) for k in keys if (m := _CLASS_KEY.match(k)) and m.group(2) is not None})
    parts = []
    if heads:
        span = str(heads[0]) if len(heads) == 1 else f"{heads[0]}-{heads[-1]}"
        parts.append(f"cls_heads.{span}.weight/bias")
    if "label_embed.weight" in keys:
        parts.append("label_embed.weight")
    return ", ".join(parts)


def describe_plan(plan: RowPlan, new_categories: Sequence[Mapping[str, Any]] | None, keys: Sequence[str],
                  shown: int = 5) -> str:
    """The class part of the --pretrained log line: which tensors, old -> new class count, rows kept."""
    if plan.as_is:
        how = "same names" if plan.by_name else "same count; the checkpoint records no class names"
        return f"class tensors loaded as is ({plan.new} classes, {how})"
    # (no square brackets: the log line is printed through rich, which reads them as markup)
    text = f"class tensors ({describe_keys(keys)}) re-initialised for {plan.old} → {plan.new} classes"
    kept = len(plan.pairs)
    if not plan.by_name:
        return text + " (the checkpoint records no class names: no rows kept)"
    if not kept:
        return text + " (no class names in common: no rows kept)"
    names = [str(new_categories[n].get("name", new_categories[n].get("id"))) for n, _ in plan.pairs[:shown]]
    more = ", ..." if kept > shown else ""
    return text + f", rows of {kept} classes kept by name ({', '.join(names)}{more}), {plan.new - kept} new"
