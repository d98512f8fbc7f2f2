"""The `--grad-ckpt` language: which recompute units to checkpoint, and how (docs/recompute.md).

One module owns the grammar, the part names and the parsing; it imports nothing of vtrain or torch, so the config
validates a value with it, the models resolve it against their units (models/recompute_units.py), the tasks and the
memory estimator read the part names from it, and the CLI prints `HELP`.

    SPEC := "" | none | auto | ITEM ("," ITEM)*
    ITEM := ["sac:"] PART [":" SEL ("," SEL)*]     a bare SEL after a comma continues the ITEM before it
                                                   (a bare N takes the kind before it: stage0,2 = stage0,stage2)
    PART := backbone | encoder | decoder           (metric: backbone)
    SEL  := N | N-M                                encoder/decoder layers
          | stageN | stageN-M                      backbone stages (Swin layers.N, ResNet layerN: timm feature index)
          | blockN | blockN-M                      backbone blocks (ViT)

A unit is named `<part>.<selector>`: `backbone.stage2`, `backbone.block7`, `encoder.3`, `decoder.5`; a PART alone
means all of its units, so every value of the old comma list of parts (`backbone`, `backbone,encoder`, ...) keeps
its meaning. `sac:` selects torch's selective activation checkpointing for those units instead of full
recomputation. `auto` is reserved for the memory planner (`--memory-budget`). Nothing here knows a model: whether
`encoder:7` exists is decided when the spec is resolved against a built model's units.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

PARTS: dict[str, tuple[str, ...]] = {"dino": ("backbone", "encoder", "decoder"), "metric": ("backbone",)}
"""Recompute parts per task, in forward order."""
MODES = ("full", "sac")
"""full: keep a unit's inputs and recompute all of it in backward; sac: keep its matrix-product outputs too."""
AUTO = "auto"
HELP = ("Activation checkpointing (non-reentrant), comma list of PART or PART:SEL with PART "
        "backbone|encoder|decoder; SEL N, N-M (encoder/decoder layers), stageN[-M] (Swin/ResNet stages), "
        "blockN[-M] (ViT blocks); prefix sac: for selective checkpointing (keeps matmul outputs). "
        "E.g. backbone:stage0-1,encoder:0-3,sac:decoder. Default none")
FORMS = "PART, PART:N-M, PART:stageN-M, PART:blockN-M, sac:PART[:SEL] (e.g. backbone:stage0,encoder:0-2,sac:decoder)"

_SEL = re.compile(r"^(stage|block)?(\d+)(?:-(?:\1)?(\d+))?$")  # stage0-2 or stage0-stage2
MAX_DIGITS = 18
"""A unit number longer than this names no model's unit (and stays an ordinary int64)."""


def _short(text: str, limit: int = 60) -> str:
    """`text` cut for a message: a value may be as long as the command line or the config file."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class SpecError(ValueError):
    """A malformed spec; the message says what is wrong (the caller names the flag)."""


@dataclass(frozen=True)
class Selector:
    """Units `lo..hi` (inclusive) of one kind: "" (a layer index), "stage" or "block"."""

    kind: str
    lo: int
    hi: int

    def __str__(self) -> str:
        return f"{self.kind}{self.lo}" if self.lo == self.hi else f"{self.kind}{self.lo}-{self.hi}"


@dataclass(frozen=True)
class Item:
    """One part (all of its units when `selectors` is empty) in one mode."""

    part: str
    mode: str = "full"
    selectors: tuple[Selector, ...] = ()

    def __str__(self) -> str:
        head = ("sac:" if self.mode == "sac" else "") + self.part
        return head + (":" + ",".join(map(str, self.selectors)) if self.selectors else "")


@dataclass(frozen=True)
class RecomputeSpec:
    """A parsed `--grad-ckpt` value: items in the order given, or `auto` (the planner chooses)."""

    items: tuple[Item, ...] = ()
    auto: bool = False

    @property
    def parts(self) -> list[str]:
        return list(dict.fromkeys(i.part for i in self.items))

    def canonical(self) -> list[str]:
        """The items as strings (the config's `grad_ckpt` list); `",".join` of it parses back to this spec."""
        return [AUTO] if self.auto else [str(i) for i in self.items]

    def __str__(self) -> str:
        return ",".join(self.canonical()) or "none"

    def __bool__(self) -> bool:
        return self.auto or bool(self.items)


def parse(value: str | Iterable[str] | None) -> RecomputeSpec:
    """Parse a `--grad-ckpt` value (a string, or the config's list of items, which is joined with commas)."""
    if value is None:
        return RecomputeSpec()
    text = value if isinstance(value, str) else ",".join(str(v) for v in value)
    tokens = [t.strip() for t in text.split(",")]
    if all(t == "" for t in tokens) or tokens == ["none"]:
        return RecomputeSpec()
    if AUTO in tokens:
        if tokens != [AUTO]:
            raise SpecError("auto stands alone (the planner chooses every unit)")
        return RecomputeSpec(auto=True)
    # (part, mode, selectors) lists: a long run of bare selectors appends in place (no tuple copied per token)
    items: list[tuple[str, str, list[Selector]]] = []
    for tok in tokens:
        if not tok:
            raise SpecError(f"empty item in {_short(text)!r}")
        if _SEL.match(tok):  # a bare selector continues the item before it: encoder:2,5
            if not items:
                raise SpecError(f"{_short(tok)!r} names no part (write e.g. encoder:{_short(tok)})")
            part, _, sels = items[-1]
            if sels and tok[0].isdigit():  # backbone:stage0,2 -> stage0, stage2
                tok = sels[-1].kind + tok
            sels.append(_selector(tok, part))
            continue
        item = _item(tok)
        items.append((item.part, item.mode, list(item.selectors)))
    return RecomputeSpec(tuple(Item(p, m, tuple(sels)) for p, m, sels in items))


def _item(tok: str) -> Item:
    mode = "full"
    if tok.startswith("sac:"):
        mode, tok = "sac", tok[4:]
    part, sep, sel = tok.partition(":")
    if "." in part and not sep:  # a unit's own name, encoder.3 or backbone.stage2
        part, sel, sep = *part.split(".", 1), ":"
    if not re.fullmatch(r"[a-z]+", part):
        raise SpecError(f"{_short(tok)!r} is not PART or PART:SEL")
    if sep and not sel:
        raise SpecError(f"{part}: nothing after ':'")
    return Item(part, mode, (_selector(sel, part),) if sep else ())


def _selector(tok: str, part: str) -> Selector:
    m = _SEL.match(tok)
    if not m:
        raise SpecError(f"{part}:{_short(tok)}: a selector is N, N-M, stageN[-M] or blockN[-M]")
    if max(len(m.group(2)), len(m.group(3) or "")) > MAX_DIGITS:  # int() raises past 4300 digits (a traceback)
        raise SpecError(f"{part}:{_short(tok)}: a unit number has at most {MAX_DIGITS} digits")
    kind, lo = m.group(1) or "", int(m.group(2))
    hi = int(m.group(3)) if m.group(3) is not None else lo
    if hi < lo:
        raise SpecError(f"{part}:{_short(tok)}: empty range")
    if (kind == "") != (part != "backbone"):
        want = "stageN or blockN" if part == "backbone" else "layer numbers N or N-M"
        raise SpecError(f"{part}:{_short(tok)}: {part} units are {want}")
    return Selector(kind, lo, hi)


def check_parts(spec: RecomputeSpec, task: str) -> None:
    """Every item names a part of `task` (SpecError otherwise)."""
    allowed = PARTS[task]
    for item in spec.items:
        if item.part not in allowed:
            raise SpecError(f"unknown part {item.part!r} for --task {task}; parts: {', '.join(allowed)}")


def resolve(spec: RecomputeSpec, units: Sequence[str]) -> dict[str, str]:
    """Unit name -> mode for a model whose units are `units` (in forward order). A unit named twice keeps one mode
    (naming it as both full and sac is an error); a selector naming no unit is an error that lists the units.
    A range is checked as an interval against the model's units, never expanded: work and memory follow the
    model's unit count, whatever numbers the spec holds."""
    if spec.auto:
        raise SpecError("auto is resolved by the memory planner, not against a model")
    chosen: dict[str, str] = {}
    for item in spec.items:
        own = [u for u in units if u.startswith(item.part + ".")]
        names = own if not item.selectors else [n for s in item.selectors for n in _select(item, s, own)]
        for n in names:
            if chosen.get(n, item.mode) != item.mode:
                raise SpecError(f"{n} is named as both full and sac")
            chosen[n] = item.mode
    return {u: chosen[u] for u in units if u in chosen}


def _select(item: Item, sel: Selector, own: Sequence[str]) -> list[str]:
    """The units of `own` (one part's units) that `sel` names; SpecError naming the first one the model lacks."""
    index = {}
    for u in own:
        m = _SEL.match(u.split(".", 1)[1])
        if m and (m.group(1) or "") == sel.kind and m.group(3) is None and sel.lo <= int(m.group(2)) <= sel.hi:
            index[int(m.group(2))] = u
    if len(index) == sel.hi - sel.lo + 1:
        return [index[i] for i in sorted(index)]
    missing = next(i for i in range(sel.lo, sel.hi + 1) if i not in index)  # at most len(own) + 1 steps
    raise SpecError(f"{_short(str(item))}: no unit {item.part}.{sel.kind}{missing}; this model has {len(own)} "
                    f"{item.part} unit{'s' if len(own) != 1 else ''}: {compact(own) or 'none'}")


def from_units(chosen: Mapping[str, str], units: Sequence[str] | None = None) -> RecomputeSpec:
    """The shortest spec that resolves to `chosen` (unit name -> mode), for logs and run_info: whole parts where
    every unit of `units` is chosen in one mode, ranges elsewhere. Without `units`, no part is written whole."""
    items: list[Item] = []
    for mode in MODES:
        names = [u for u, m in chosen.items() if m == mode]
        for part in dict.fromkeys(n.split(".", 1)[0] for n in names):
            mine = [n.split(".", 1)[1] for n in names if n.startswith(part + ".")]
            everything = units is not None and set(mine) == {u.split(".", 1)[1] for u in units
                                                              if u.startswith(part + ".")}
            items.append(Item(part, mode, () if everything else _ranges(mine)))
    return RecomputeSpec(tuple(items))


def _ranges(suffixes: list[str]) -> tuple[Selector, ...]:
    parsed = sorted((m.group(1) or "", int(m.group(2))) for m in map(_SEL.match, suffixes))
    out: list[Selector] = []
    for kind, i in parsed:
        if out and out[-1].kind == kind and out[-1].hi == i - 1:
            out[-1] = Selector(kind, out[-1].lo, i)
        else:
            out.append(Selector(kind, i, i))
    return tuple(out)


def compact(units: Sequence[str]) -> str:
    """`encoder.0, encoder.1, encoder.2` -> `encoder:0-2` (for messages)."""
    return str(from_units({u: "full" for u in units})) if units else ""
