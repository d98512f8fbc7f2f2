"""What the tensors of a checkpoint must be, checked before anything uses them.

A manifest (checkpoint.verify) proves that a file is the one that was written; it does not prove that it is what
the reader needs: a file edited and resealed, one copied from another run, a writer's bug. So every reader of
checkpoint tensors says what it expects as a `Spec` (name -> shape and accepted dtypes) and checks the file with
`expect_tensors` (or, for tensors already streamed, `compare`) before it uses them:

- a whole model (model.safetensors, ema.safetensors, Accelerate's model file, a consolidated file for
  --resume-weights-only): the state dict of the model the reader builds (`spec_of`, `model_spec`);
- a head shard (head/classes_<a>-<b>.safetensors): `head_spec` from its metadata and the model's embedding size, its
  class range against its name and the other shards (`head_files`);
- `consolidate`'s output: what was streamed, against the whole model the checkpoint records (`recorded_classes`).

Floating values must be finite: a NaN in the EMA or the head is refused like one in the model. The header (names,
shapes, dtypes) is checked first, without reading data; values are then read one tensor at a time. A problem is one
line naming the file, the tensor, and what was expected and found.

Before tensors, models: a resume first compares the model the checkpoint records (`describe`: its config.yaml and
class count) with the one the run builds, so a checkpoint of another preset is one line saying both.

The engine's state beyond the weights (optimizer moments, RNG states) is checked with the same `Spec` by
content_state.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors import SafetensorError, safe_open

from vtrain.config import RunConfig
from vtrain.engine.checkpoint import format as ckpt
from vtrain.errors import VtrainError
from vtrain.models.backbones import read_state_dict
from vtrain.presets import DINO_PRESETS
from vtrain.tasks import build_model, model_for_weights

FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
"""safetensors' dtype names (the `dtype` of its documented JSON header) -> torch dtypes."""
CLASSIFIER = {"metric": "head.weight", "dino": "cls_heads.0.weight"}
"""The tensor whose rows are a task's classes."""

Found = dict[str, tuple[tuple[int, ...], Any]]
"""name -> (shape, dtype) as a file holds them (a dtype torch does not know stays its safetensors name)."""


class ContentError(ckpt.CheckpointError):
    """A checkpoint or weights file whose tensors are not what the reader needs."""


@dataclass(frozen=True)
class Want:
    shape: tuple[int, ...]
    dtypes: tuple[torch.dtype, ...]
    """Accepted dtypes; a floating tensor's values must also be finite."""
    low: float | None = None
    """The least value allowed (0 for Adam's second moments, which are running means of squares)."""

    def __str__(self) -> str:
        return f"{self.shape} {'floating' if self.dtypes == FLOATS else _dtype(self.dtypes[0])}"


Spec = dict[str, Want]


def _dtype(d: Any) -> str:
    return str(d).replace("torch.", "")


def spec_of(state: Mapping[str, torch.Tensor], exact: bool = True) -> Spec:
    """The spec of a state dict (a model's, real or on the meta device). Floating tensors in fp32 when `exact` (vtrain
    writes its own files so), else in any floating dtype (a consolidated file may be bf16); others in their own."""
    return {k: Want(tuple(v.shape), ((torch.float32,) if exact else FLOATS) if v.is_floating_point() else (v.dtype,))
            for k, v in state.items()}


def model_spec(cfg: RunConfig, classes: int, whole: bool = False, exact: bool = True) -> Spec:
    """The spec of the model `cfg` builds with `classes` classes (built on the meta device: no memory, no init).
    `whole`: a sharded-head metric model with its head inside, as `consolidate` writes it; `exact`: as spec_of."""
    with torch.device("meta"):
        model = model_for_weights(cfg, {CLASSIFIER[cfg.task]: (classes,)}) if whole else \
            build_model(cfg.task, cfg.model, classes)
    return spec_of(model.state_dict(), exact)


def compare(found: Found, spec: Spec, owner: str = "the model") -> str | None:
    """The first difference between what a file holds and `spec` (names exactly, then shapes and dtypes), as text;
    None when they agree. `owner`: what `spec` describes, for a tensor it lacks."""
    missing = [k for k in spec if k not in found]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        return f"lacks tensor {missing[0]} (expected {spec[missing[0]]}){more}"
    extra = [k for k in found if k not in spec]
    if extra:
        shape, dtype = found[extra[0]]
        more = f" and {len(extra) - 1} more" if len(extra) > 1 else ""
        return f"holds tensor {extra[0]} ({shape} {_dtype(dtype)}), which {owner} does not have{more}"
    for k, want in spec.items():
        shape, dtype = found[k]
        if tuple(shape) != want.shape or dtype not in want.dtypes:
            return f"tensor {k}: expected {want}, found {tuple(shape)} {_dtype(dtype)}"
    return None


def nonfinite(name: str, t: torch.Tensor, low: float | None = None) -> str | None:
    """The problem of a floating tensor holding inf/NaN (or, with `low`, values below it), as text; None when its
    values are fine (or it is not floating)."""
    if not t.is_floating_point():
        return None
    bad = t.numel() - int(torch.isfinite(t).sum())
    if bad:
        return f"tensor {name} holds {bad} inf/NaN values (of {t.numel()})"
    below = int((t < low).sum()) if low is not None else 0
    return f"tensor {name} holds {below} values below {low:g} (of {t.numel()})" if below else None


def read_header(file: str | Path, flag: str = "") -> tuple[Found, dict[str, str]]:
    """Names, shapes and dtypes of a safetensors file, and its metadata, without reading tensor data."""
    try:
        with safe_open(str(file), "pt") as f:
            found = {}
            for k in f.keys():
                s = f.get_slice(k)
                found[k] = (tuple(s.get_shape()), DTYPES.get(s.get_dtype(), s.get_dtype()))
            return found, dict(f.metadata() or {})
    except SafetensorError as e:  # junk, or a header that does not describe the file
        raise ContentError(f"{located(file, flag)}: not a readable safetensors file "
                           f"({' '.join(str(e).split())[:200]})") from None


def located(file: str | Path, flag: str) -> str:
    """`file` as an error message names it: after the flag it was given with, if any."""
    return f"{flag}: {file}" if flag else str(file)


def expect_tensors(file: str | Path, spec: Spec | None, flag: str = "", model: str = "the model",
                   tensors: Mapping[str, torch.Tensor] | None = None) -> None:
    """Check weights file `file` against `spec` before it is used: names, shapes and dtypes (a safetensors file from
    its header), then the values of every floating tensor, one in memory at a time. `spec` None: any
    names (a --pretrained file, which its loader matches), values only. `tensors`: the file's contents when the
    caller holds them already; a file other than .safetensors is read weights-only. `model` names what the file
    must fit, for the message. A problem raises a ContentError: `FLAG: FILE does not fit MODEL: tensor ...`."""
    file = Path(file)
    if tensors is None and file.suffix != ".safetensors":
        tensors = read_state_dict(file, flag)
    found = {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()} if tensors is not None else \
        read_header(file, flag)[0]
    problem = compare(found, spec) if spec is not None else None
    if problem:
        raise ContentError(f"{located(file, flag)} does not fit {model}: {problem}")
    names = [k for k in (spec if spec is not None else found) if found[k][1] in FLOATS]
    low = {k: spec[k].low for k in names} if spec is not None else {}
    if tensors is not None:
        problem = next((p for k in names if (p := nonfinite(k, tensors[k], low.get(k)))), None)
    else:
        with safe_open(str(file), "pt") as f:
            problem = next((p for k in names if (p := nonfinite(k, f.get_tensor(k), low.get(k)))), None)
    if problem:
        raise ContentError(f"{located(file, flag)}: {problem}")


# ---- the sharded head's files: the format head_shard.py writes and reads -------------------------------------------

@dataclass(frozen=True)
class HeadShard:
    file: Path
    start: int
    """First class of the shard; it holds classes [start, start + n) of `classes`."""
    n: int
    classes: int


def shard_name(start: int, n: int) -> str:
    return f"classes_{start:09d}-{start + n:09d}.safetensors"


def head_spec(n: int, dim: int) -> Spec:
    """A shard of n classes: its rows of the weight and of the AdamW moments, and each row's step count."""
    rows = Want((n, dim), (torch.float32,))
    return {"weight": rows, "exp_avg": rows, "exp_avg_sq": Want((n, dim), (torch.float32,), low=0.0),
            "row_steps": Want((n,), (torch.int64,))}


def head_files(ckpt_dir: str | Path, dim: int | None = None, flag: str = "") -> list[HeadShard]:
    """The head shards of a checkpoint by class start: the files its manifest lists under head/ (every
    classes_*.safetensors there when it has no manifest), each checked before use: a class range in its metadata
    that its name and its tensors agree with (`head_spec`; `dim`: the model's embedding size, else the first
    shard's), one class count for all, and ranges that tile 0..classes exactly. Tensor values are checked by the
    reader of the rows (head_shard.read_rows), which reads only its own."""
    d = Path(ckpt_dir)
    manifest = ckpt.read_manifest(d)
    if manifest is not None and manifest.files:
        files = sorted(d / r for r in manifest.files if Path(r).parts[0] == ckpt.HEAD)
    else:
        files = sorted((d / ckpt.HEAD).glob("classes_*.safetensors"))
    shards = []
    for f in files:
        found, meta = read_header(f, flag)
        try:
            s = HeadShard(f, int(meta["class_start"]), int(meta["num_local"]), int(meta["num_classes"]))
        except (KeyError, ValueError):
            raise ContentError(f"{located(f, flag)}: not a vtrain head shard (no class range in its metadata)") \
                from None
        where = f"{located(f, flag)} (classes {s.start}..{s.start + s.n} of {s.classes}, its metadata says)"
        if not (0 <= s.start and s.n >= 1 and s.start + s.n <= s.classes) or f.name != shard_name(s.start, s.n):
            raise ContentError(f"{where}: a class range that does not fit the file's name or the class count")
        if dim is None:  # no model to say it: the first shard's width, which every other shard must share
            dim = found["weight"][0][-1] if found.get("weight", ((),))[0] else 0
        problem = compare(found, head_spec(s.n, dim))
        if problem:
            raise ContentError(f"{where}: {problem}")
        if shards and s.classes != shards[0].classes:
            raise ContentError(f"{where}: {shards[0].file.name} says {shards[0].classes} classes")
        shards.append(s)
    shards.sort(key=lambda s: s.start)
    expect = 0
    for s in shards:
        if s.start != expect:
            raise ContentError(f"{located(d, flag)}: head shards do not tile classes 0..{s.classes} (gap or overlap "
                               f"at {expect})")
        expect = s.start + s.n
    if shards and expect != shards[0].classes:
        raise ContentError(f"{located(d, flag)}: head shards end at class {expect}, not {shards[0].classes}")
    return shards


# ---- the model a checkpoint records ------------------------------------------------------------------------------

def recorded_classes(path: str | Path, cfg: RunConfig, flag: str = "") -> int | None:
    """The class count of checkpoint `path` (whose config is `cfg`): its head shards' metadata with
    --head-parallel sharded, else the rows of the classifier in its model.safetensors, which for detection must
    agree with categories.json; 0 for a face model without a head (a converted published one, tools/convert.py);
    None when it has no model.safetensors (vtrain <= 0.1: nothing records it)."""
    path = Path(path)
    if cfg.task == "metric" and cfg.model.head_parallel == "sharded":
        shards = head_files(path, cfg.model.embedding_dim, flag)
        if not shards:
            raise ContentError(f"{located(path, flag)}: a --head-parallel sharded checkpoint without head shards "
                               f"({ckpt.HEAD}/classes_*.safetensors)")
        return shards[0].classes
    if not (path / ckpt.MODEL).is_file():
        return None
    found, _ = read_header(path / ckpt.MODEL, flag)
    name = CLASSIFIER[cfg.task]
    if cfg.task == "metric" and name not in found:  # an embedding network without class centres (vtrain convert)
        return 0
    if name not in found or len(found[name][0]) != 2:
        raise ContentError(f"{located(path / ckpt.MODEL, flag)}: lacks the {cfg.task} classifier {name}")
    classes = found[name][0][0]
    if cfg.task == "dino":
        try:
            listed = ckpt.read_categories(path)  # the rules of the COCO reader (records.categories)
        except VtrainError as e:
            raise ContentError(f"{flag}: {e}" if flag else str(e)) from None
        if listed is not None and len(listed) != classes:
            raise ContentError(f"{located(path / ckpt.CATEGORIES, flag)}: lists {len(listed)} classes; the model's "
                               f"{name} has {classes} rows")
    return classes


def describe(cfg: RunConfig, classes: int | None) -> dict[str, Any]:
    """What decides a model's tensors: task, preset, class count (left out when None) and, per task, the sizes set
    by flags. Two models that differ here cannot load each other's weights."""
    m = cfg.model
    d: dict[str, Any] = {"task": cfg.task, "preset": m.preset}
    if cfg.task == "dino":
        preset = DINO_PRESETS.get(m.preset)
        d["num_queries"] = m.num_queries or (preset().queries if preset else None)
        # shared heads are stored once: another set of head tensors (models/dino/detector.py)
        d["class_head"] = "shared" if m.shared_class_head else "per layer"
        d["box_head"] = "shared" if m.shared_box_head else "per layer"
    else:
        d.update(embedding_dim=m.embedding_dim, neck_norm=m.neck_norm,
                 head="sharded" if m.head_parallel == "sharded" else "in the model")
    if classes is not None:
        d["classes"] = classes
    return d


def text(description: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in description.items())


def same_model(saved: dict[str, Any], run: dict[str, Any], where: str) -> None:
    """Refuse a checkpoint whose recorded model (`saved`) is not the run's, in one line saying both. What only one
    side describes (another task's sizes, a class count not recorded) is shown, not compared."""
    differ = [k for k in run if k in saved and saved[k] != run[k]]
    if differ:
        raise ContentError(f"{where} holds a model with {text(saved)}; this run builds {text(run)} "
                           f"({', '.join(differ)} differ{'s' if len(differ) == 1 else ''}; the checkpoint's settings "
                           "are in its config.yaml)")
