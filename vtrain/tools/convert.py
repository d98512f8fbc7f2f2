"""`vtrain convert SRC OUT --from SOURCE`: a published checkpoint of another codebase -> a vtrain run directory
whose checkpoint `vtrain eval`, `predict`, `export`, `consolidate` and `train --pretrained` accept as they are
(docs/convert.md).

The steps, each a one-line error when it fails, nothing written before the last:
1. OUT is claimed: a new directory (or an empty one); an earlier `vtrain convert` output only with --overwrite;
   never a directory vtrain did not write, never inside a checkpoint. --categories FILE is read.
2. SRC is read without running code from it (safeio.load_published: weights-only, a small allowlist), and only
   after the sizes its zip records declare were checked against its real size.
3. Every source tensor is one an adapter may copy (models/formats.check_tensors: dense, on the CPU, a float or
   integer dtype, no overlapping view; all together bounded by the file's size), before anything is copied.
4. Its format is recognised by its tensor names (models/formats.py): a file of another source names that source.
5. The source's adapter (one module per source, beside the model it fills) maps every tensor as a view; a source
   tensor the adapter neither maps nor lists as known-unused is refused, naming it.
6. The model of the preset is built on the meta device and every one of its tensors must be filled with its shape
   and a dtype of its kind; only then is each copied (`fill`), in the model's dtype, and checked finite.
7. The run directory is staged beside OUT, checked as its readers check it (engine/checkpoint/content.py: the model its
   config.yaml and categories.json describe, every tensor finite) and renamed into place: run marker, config.yaml,
   and checkpoints/step_0 (model.safetensors, config.yaml, train_state.json, categories.json for detection) under a
   verified manifest (engine/checkpoint/format.py).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from vtrain.io import guarded
from vtrain.io import records
from vtrain.config import build_config
from vtrain.engine.checkpoint import format as ckpt
from vtrain.engine import rundir
from vtrain.engine.checkpoint import content
from vtrain.errors import VtrainError, shown
from vtrain.io.files import digest_share
from vtrain.models.dino.adapters.detrex import from_detrex
from vtrain.models.dino.adapters.idea import from_idea
from vtrain.models.dino.adapters.mmdet import from_mmdet
from vtrain.models.formats import FORMATS, AdapterError, Converted, check_tensors, detect, non_state_dict, unwrap
from vtrain.models.metric_adapters.arcface import from_arcface_vit
from vtrain.io.safeio import load_published
from vtrain.tasks import build_model

Adapter = Callable[[dict[str, torch.Tensor], Any], Converted]


@dataclass(frozen=True)
class Source:
    adapter: Adapter
    """(source state dict, the whole loaded file) -> Converted."""
    preset: str
    """The preset used when neither --model nor the file's shapes name one."""
    task: str


# `--from` names (each also a key of models/formats.FORMATS, which recognises its files)
SOURCES: dict[str, Source] = {
    "arcface-vit": Source(from_arcface_vit, "vit-t-af", "metric"),
    "idea-dino": Source(from_idea, "swin-l", "dino"),
    "detrex-dino": Source(from_detrex, "swin-l", "dino"),
    "mmdet-dino": Source(from_mmdet, "swin-l", "dino"),
}

STEP = 0  # the converted weights are checkpoint step_0 of the new run directory


@dataclass
class Report:
    out: Path
    checkpoint: Path
    preset: str
    filled: int
    """Model tensors filled (all of them)."""
    unused: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


CATEGORIES_FILE_LIMIT = 64 * 2**20
"""--categories FILE: 65,536 categories (records.MAX_CATEGORIES) with long names fit in a few MiB."""


def convert(src: str | Path, out: str | Path, source: str, preset: str | None = None,
            overwrite: bool = False, categories: str | Path | None = None) -> Report:
    """Convert `src` (a `source` checkpoint) into the run directory `out` (see the module docstring). `categories`:
    a JSON file naming the detector's classes (read_categories_file)."""
    src, out = Path(src), Path(out)
    if source not in SOURCES:
        raise VtrainError(f"--from: unknown source {source!r}; choose one of {', '.join(SOURCES)}")
    spec = SOURCES[source]
    if categories is not None and spec.task != "dino":
        raise VtrainError(f"--categories: names the classes of a detector; --from {source} is a face model")
    replaced = claim(out, overwrite)
    reads = [guarded.Read("SRC", src)] + ([guarded.Read("--categories", Path(categories))] if categories else [])
    guarded.check_not_input([], reads, "OUT", replaced=[out] if replaced else [])
    given = read_categories_file(Path(categories)) if categories is not None else None
    if not src.is_file():
        raise VtrainError(f"SRC: {src} is not a file")
    whole = load_published(src)
    sd, _ = unwrap(whole)
    if sd is None:
        raise VtrainError(f"SRC: {src}: {non_state_dict(whole)}")
    try:
        check_tensors(sd, src.stat().st_size)
    except AdapterError as e:
        raise VtrainError(f"SRC: {src}: {e}") from None
    found = detect(sd)
    if found != source:
        if found is not None:
            raise VtrainError(f"--from {source}: {src} is {FORMATS[found].description} checkpoint, not "
                              f"{FORMATS[source].description} one; use --from {found}")
        raise VtrainError(f"--from {source}: {src} is not {FORMATS[source].description} checkpoint (it lacks "
                          f"{_lacks(FORMATS[source], sd)}; it holds e.g. {', '.join(shown(k) for k in sorted(sd)[:3])})")
    try:
        conv = spec.adapter(sd, whole, given) if given is not None else spec.adapter(sd, whole)
    except AdapterError as e:
        raise VtrainError(f"SRC: {src}: {e}") from None
    strange = sorted(set(sd) - conv.read - set(conv.unused))
    if strange:
        raise VtrainError(f"SRC: {src} holds {len(strange)} tensors that the {source} converter does not know, e.g. "
                          f"{', '.join(shown(k) for k in strange[:3])} (another variant of the model?); refusing to "
                          "drop them")
    name = preset or conv.model.get("preset") or spec.preset
    cfg = build_config(spec.task, overrides={"model": {**conv.model, "preset": name},
                                             "train": {"output_dir": str(out)}})
    with torch.device("meta"):  # names, shapes and dtypes only: no memory, however large the model
        own = build_model(spec.task, cfg.model, conv.num_classes).state_dict()
    tensors = fill(own, conv.tensors, f"--model {name}", conv.origin, f"SRC: {src}: ")
    written = write(out, replaced, cfg, tensors, conv.categories, {"source": source, "file": str(src.resolve())})
    return Report(out, written, name, len(tensors), conv.unused, conv.notes)


def read_categories_file(path: Path) -> list[dict[str, Any]]:
    """--categories FILE: a JSON list of COCO categories (objects with `id` and `name`), an object holding one under
    `categories` (a COCO annotation file's), or a list of names (ids 1..N in that order). The rules of the COCO reader
    and of a checkpoint's categories.json apply (records.categories)."""
    where = f"--categories {path}"
    try:
        size = path.stat().st_size
    except OSError as e:
        raise VtrainError(f"{where}: cannot read it ({e.strerror or e})") from None
    if not path.is_file():
        raise VtrainError(f"{where}: not a file")
    if size > CATEGORIES_FILE_LIMIT:
        raise VtrainError(f"{where}: {size:,} bytes; a categories list is read up to {CATEGORIES_FILE_LIMIT >> 20} MiB "
                          "(give the `categories` list alone, not a whole annotation file)")
    data = records.read_json(path)
    if isinstance(data, dict) and "categories" in data:
        data = data["categories"]
    if isinstance(data, list) and data and all(isinstance(n, str) for n in data):
        data = [{"id": i + 1, "name": n} for i, n in enumerate(data)]
    cats = records.categories(data, where)
    return [{"id": c["id"], **({"name": c["name"]} if c.get("name") is not None else {})} for c in cats]


def _lacks(fmt, sd: dict[str, torch.Tensor]) -> str:
    names = set(sd)
    missing = [k for k in fmt.keys if k not in names] + [f"{p}*" for p in fmt.prefixes
                                                         if not any(n.startswith(p) for n in names)]
    return ", ".join(missing[:3])


def check_fill(own: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], what: str,
               origin: dict[str, str] | None = None) -> None:
    """Names and shapes only (no data): every tensor of the model (`own`: its state dict, e.g. on the meta device)
    is in `tensors` with its shape, and nothing else is; one error naming the first that is not (and the source
    tensor it was made from, `origin`)."""
    missing = [k for k in own if k not in tensors]
    if missing:
        raise VtrainError(f"{what}: the converted file leaves {len(missing)} of the model's {len(own)} tensors empty: "
                          f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
    extra = [k for k in tensors if k not in own]
    if extra:
        src = f" (made from {(origin or {})[extra[0]]})" if (origin or {}).get(extra[0], extra[0]) != extra[0] else ""
        raise VtrainError(f"{what}: the model has no tensor {extra[0]}{src} ({len(extra)} converted tensors have no "
                          "place in it); is it the preset of this file?")
    bad = [k for k in own if tuple(tensors[k].shape) != tuple(own[k].shape)]
    if bad:
        k = bad[0]
        src = f" (the file's {(origin or {})[k]})" if (origin or {}).get(k, k) != k else ""
        raise VtrainError(f"{what}: {len(bad)} tensors differ in shape, e.g. {k}{src}: {tuple(tensors[k].shape)} in "
                          f"the file, {tuple(own[k].shape)} in the model; is it the preset of this file?")


def _dt(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def fill(own: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], what: str,
         origin: dict[str, str] | None = None, where: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of the model (`own`: its state dict, e.g. on the meta device) from `tensors`, each a new tensor
    in the model's dtype and shape (a view, a tied or an expanded source is never written as it is), once
    `check_fill` has found all of them with their shapes. Values that the model's dtype does not hold are one error
    naming the source tensor (`origin`: model name -> source name; `where`: the prefix of those messages): an
    integer tensor for a float weight, a float counter that is not a whole number, NaN, inf, float64 beyond
    float32's range."""
    check_fill(own, tensors, what, origin)
    origin = origin or {}

    def named(k: str) -> str:
        return f"{where}tensor {origin[k]} (the model's {k})" if origin.get(k, k) != k else f"{where}tensor {k}"

    out = {}
    for k, ref in own.items():
        t = tensors[k].detach()
        if ref.is_floating_point() and not t.is_floating_point():
            raise VtrainError(f"{named(k)}: {_dt(t.dtype)} values where the model holds {_dt(ref.dtype)} weights")
        new = torch.empty(ref.shape, dtype=ref.dtype)
        if not ref.is_floating_point() and t.is_floating_point():  # a counter saved as a float (`.float()` of a whole
            whole = torch.isfinite(t).all() and bool((t == t.round()).all()) and bool((t.abs() < 2.0**53).all())
            if not whole:  # state dict): whole numbers only
                raise VtrainError(f"{named(k)}: {_dt(t.dtype)} values that are not whole numbers, where the model "
                                  f"holds a {_dt(ref.dtype)} counter")
        new.copy_(t)
        if new.is_floating_point():
            bad = new.numel() - int(torch.isfinite(new).sum())
            if bad:
                beyond = bad - (t.numel() - int(torch.isfinite(t).sum()))
                why = f"; {beyond} of them finite {_dt(t.dtype)} values beyond its range" if beyond else ""
                raise VtrainError(f"{named(k)}: holds {bad} inf/NaN values as {_dt(ref.dtype)} (of {new.numel()}"
                                  f"{why}); refusing to write a model that no command would load")
        out[k] = new
    return out


# ---- the output directory ---------------------------------------------------------------------------------------

def claim(out: Path, overwrite: bool) -> bool:
    """Check OUT before anything is read or written. Returns whether an earlier conversion is to be replaced."""
    problem = guarded.utf8_problem(out)
    if problem is not None:
        raise VtrainError(f"OUT: {problem}")
    holder = ckpt.inside_checkpoint(out)
    if holder is not None:
        raise VtrainError(f"OUT: {out} is inside the checkpoint {holder}; vtrain never writes into a checkpoint")
    if out.is_symlink() or (out.exists() and guarded.is_mount(out)):
        raise VtrainError(f"OUT: {guarded.describe_crossing(out)}; give a new directory")
    if not os.path.lexists(out) or (out.is_dir() and not any(out.iterdir())):
        return False
    if not out.is_dir():
        raise VtrainError(f"OUT: {out} exists and is not a directory")
    foreign = not_converted(out)
    if foreign is not None:
        raise VtrainError(f"OUT: {out} exists and is not a directory vtrain convert wrote ({foreign}); it replaces "
                          "only its own output: choose a new OUT")
    if not overwrite:
        raise VtrainError(f"OUT: {out} holds an earlier conversion; --overwrite replaces it")
    return True


def not_converted(out: Path) -> str | None:
    """Why `out` is not exactly a directory `vtrain convert` wrote (None when it is): its marker records the
    conversion, and it holds nothing but the marker, config.yaml and the verified checkpoint step_0."""
    try:
        if (out / rundir.MARKER).stat().st_size > 2**20:  # vtrain's marker is a few hundred bytes
            return f"{rundir.MARKER} is not vtrain's"
        marker = json.loads((out / rundir.MARKER).read_text())
        if not (isinstance(marker, dict) and marker.get("format") == rundir.MARKER_FORMAT
                and isinstance(marker.get("converted_from"), dict)):
            return f"its {rundir.MARKER} records no conversion"
    except (OSError, ValueError, RecursionError):  # absent, unreadable, not JSON
        return f"no vtrain run marker {rundir.MARKER}"
    step = ckpt.final_path(out, STEP)
    problem = ckpt.verify(step) if step.is_dir() and not step.is_symlink() else f"no {step.relative_to(out)}"
    if problem is not None:
        return problem
    listed = {f"{ckpt.CHECKPOINTS}/step_{STEP}/{r}" for r in [*ckpt.parse_manifest(step).files, ckpt.COMPLETE]}
    own = listed | {rundir.MARKER, ckpt.CONFIG}
    for p in sorted(out.rglob("*")):
        rel = p.relative_to(out).as_posix()
        if p.is_symlink() or (p.is_file() and rel not in own) or not (p.is_file() or p.is_dir()):
            return f"it holds {rel}"
    return None


def write(out: Path, replace: bool, cfg, tensors: dict[str, torch.Tensor], categories: list | None,
          origin: dict[str, Any]) -> Path:
    """Stage the run directory beside `out`, then rename it into place (replacing an earlier conversion when
    `replace`); on any error the staging folder is removed and `out` is as it was."""
    stage = out.parent / f".{out.name}.convert-{uuid.uuid4().hex[:8]}"
    old = out.parent / f".{out.name}.replaced-{uuid.uuid4().hex[:8]}"
    try:
        with guarded.disk_op("write", stage):
            out.parent.mkdir(parents=True, exist_ok=True)
            stage.mkdir()
            _stage(stage, cfg, tensors, categories, origin)
            if replace:
                os.rename(out, old)
            elif out.is_dir():  # an empty directory the user made for it
                out.rmdir()
            try:
                os.rename(stage, out)
            except BaseException:
                if replace and not os.path.lexists(out):  # the earlier conversion back in place
                    os.rename(old, out)
                raise
    finally:
        if stage.exists():
            guarded.rmtree(out.parent, stage)
    if old.exists():
        guarded.rmtree(out.parent, old)
    return ckpt.final_path(out, STEP)


def _stage(stage: Path, cfg, tensors: dict[str, torch.Tensor], categories: list | None,
           origin: dict[str, Any]) -> None:
    ckpt.write_json(stage / rundir.MARKER, {"format": rundir.MARKER_FORMAT, "version": 1, "created": time.time(),
                                            "converted_from": origin})
    cfg.save(stage / ckpt.CONFIG)
    tmp = ckpt.begin(stage, STEP, True)
    save_file(tensors, str(tmp / ckpt.MODEL), metadata={"converted_from": origin["source"]})
    cfg.save(tmp / ckpt.CONFIG)
    # a state for the record: no step trained, no optimizer or scheduler (`--resume` from it is refused; start a run
    # from the weights with `vtrain train --pretrained .../model.safetensors`)
    ckpt.TrainState(step=0, consumed_samples=0,
                    scheduler={"base_lrs": [cfg.optim.lr], "last_epoch": 0, "lr_lambdas": [None]},
                    world_size=1, engine="single").write(tmp)
    if categories is not None:
        ckpt.write_json(tmp / ckpt.CATEGORIES, categories)
    # what the readers of a checkpoint check (eval, predict, export, --pretrained, consolidate), checked here: the
    # model its config.yaml and class count describe (categories.json agreeing), every tensor of it, finite
    classes = content.recorded_classes(tmp, cfg, "OUT")
    content.expect_tensors(tmp / ckpt.MODEL, content.model_spec(cfg, classes or 0), "OUT")
    if categories is not None:
        ckpt.read_categories(tmp)
    files = digest_share(tmp, ckpt.payload_files(tmp))
    ckpt.commit(stage, STEP, uuid.uuid4().hex, files, keep_last=1)
