"""Published checkpoint formats, recognised by their tensor names (docs/convert.md §2).

A file another codebase wrote holds its own tensor names; vtrain reads it only through `vtrain convert --from NAME`
(tools/convert.py), which maps every tensor. `detect` names the format of a state dict so that both `convert`
(a wrong `--from`) and `--pretrained` (models/backbones.py: a published file given where vtrain's own or a timm
backbone file is expected) can say in one line what the file is and which command reads it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from vtrain.errors import VtrainError, shown


@dataclass(frozen=True)
class Format:
    description: str
    """What wrote the file, for messages: the codebase and its model."""
    keys: tuple[str, ...] = ()
    """Tensor names that must all be present."""
    prefixes: tuple[str, ...] = ()
    """Name prefixes that must each begin at least one tensor name."""

    def matches(self, names: Iterable[str]) -> bool:
        names = set(names)
        return all(k in names for k in self.keys) and all(any(n.startswith(p) for n in names) for p in self.prefixes)


# the `--from` names of `vtrain convert`; each one's distinctive names (docs/convert.md §2 gives the sources)
FORMATS: dict[str, Format] = {
    # insightface recognition/arcface_torch/backbones/vit.py: its feature layer `feature.0-3`, no class token
    "arcface-vit": Format("an arcface_torch ViT (insightface recognition/arcface_torch)",
                          keys=("patch_embed.proj.weight", "pos_embed", "feature.0.weight", "feature.3.running_var")),
    # IDEA-Research/DINO models/dino/dino.py: backbone Joiner `backbone.0` (the Swin itself; `backbone.0.body` for
    # a ResNet), `input_proj`, `label_enc`
    "idea-dino": Format("an IDEA-Research DINO detector", keys=("label_enc.weight",),
                        prefixes=("backbone.0.", "input_proj.0.", "transformer.encoder.layers.")),
    # IDEA-Research/detrex projects/dino: `neck.convs`, `label_enc`, encoder layers with `attentions`
    "detrex-dino": Format("a detrex DINO detector", keys=("label_enc.weight",),
                          prefixes=("neck.convs.", "transformer.encoder.layers.")),
    # open-mmlab/mmdetection mmdet/models/detectors/dino.py: `bbox_head.cls_branches`, `dn_query_generator`
    "mmdet-dino": Format("an mmdetection DINO detector", keys=("dn_query_generator.label_embedding.weight",),
                         prefixes=("bbox_head.cls_branches.", "encoder.layers.")),
}

# containers that published files wrap their weights in, most specific first: arcface_torch's checkpoint_gpu_<rank>.pt
# (`state_dict_backbone`), mmdetection (`state_dict`), IDEA DINO and detectron2/detrex (`model`), DDP (`module`)
CONTAINERS = ("state_dict_backbone", "state_dict", "model", "module")


def is_state_dict(obj: Any) -> bool:
    return isinstance(obj, dict) and bool(obj) and all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                       for k, v in obj.items())


def unwrap(obj: Any) -> tuple[dict[str, torch.Tensor] | None, str | None]:
    """(the state dict, the container keys it was under, dotted, or None) of a loaded file, descending through
    nested containers (`{"model": {"module": ...}}`); (None, None) when it holds none."""
    keys: list[str] = []
    while not is_state_dict(obj):
        key = next((k for k in CONTAINERS if isinstance(obj, dict) and isinstance(obj.get(k), dict)), None)
        if key is None or len(keys) >= len(CONTAINERS):
            return None, None
        obj = obj[key]
        keys.append(key)
    return obj, ".".join(keys) or None


def detect(names: Iterable[str]) -> str | None:
    """The `--from` name of the format whose tensor names these are, or None (vtrain's own, timm's, unknown)."""
    names = set(names)
    return next((name for name, f in FORMATS.items() if f.matches(names)), None)


def convert_hint(path: str, name: str) -> str:
    """The sentence that says what a published file is and how vtrain reads it."""
    return (f"{path} is {FORMATS[name].description} checkpoint, which vtrain reads only through its converter: "
            f"vtrain convert {path} OUT --from {name}")


def non_state_dict(obj: Any) -> str:
    """Why `obj` (a loaded file) holds no state dict `unwrap` returns: the first entry of the dict of tensors (at the
    top or under the containers) whose name is not a string or whose value is not a tensor, or that none is there."""
    where: list[str] = []
    for _ in range(len(CONTAINERS) + 1):
        if not isinstance(obj, dict):
            break
        if any(isinstance(v, torch.Tensor) for v in obj.values()):
            at = f"the state dict{' under ' + '.'.join(where) if where else ''}"
            for k, v in obj.items():
                if not isinstance(k, str):
                    return f"{at} has a key {shown(k)} that is not a name"
                if not isinstance(v, torch.Tensor):
                    return f"{at} holds {shown(k)} as a {type(v).__name__}, not a tensor"
            break
        key = next((k for k in CONTAINERS if isinstance(obj.get(k), dict)), None)
        if key is None:
            break
        where.append(key)
        obj = obj[key]
    return f"it holds no state dict of tensors (neither at the top nor under {', '.join(CONTAINERS)})"


class AdapterError(VtrainError):
    """A published file that its converter cannot map (an unknown variant): one line naming the tensor."""


# ---- what a source tensor may be, checked before an adapter touches it (docs/convert.md §3) ------------------------

SOURCE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64,
                 torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
"""Float weights, integer buffers (BatchNorm counters, index buffers); nothing else is a published weight."""
BYTES_PER_FILE_BYTE = 4
BYTES_SLACK = 64 * 2**20
MAX_NAME = 1000
"""Characters in a tensor name: a layer index in a name is read as an int, and Python refuses to read more than 4300
digits (docs/input_limits.md §8)."""


def overlapping(t: torch.Tensor) -> bool:
    """Whether a strided tensor's elements can share memory: a zero stride on a dimension longer than 1 (an
    `expand`ed view, where one stored value stands for many), or strides too small for the sizes below them. Dense
    and permuted tensors, slices and tied copies (the same geometry twice) never do."""
    reach = 0  # the largest offset reachable by the dimensions taken so far, smallest stride first
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz > 1):
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


def tensor_problem(t: torch.Tensor) -> str | None:
    """Why a source tensor cannot be a published weight (None when it can): not a dense strided CPU tensor of a
    float or integer dtype, or a view whose elements overlap (it would take more memory than its storage holds)."""
    if t.is_quantized:
        return f"a quantized tensor ({str(t.dtype).replace('torch.', '')}); vtrain converts float weights"
    if t.layout != torch.strided or t.is_nested:
        return f"a {'nested' if t.is_nested else str(t.layout).replace('torch.', '')} tensor; published weights are dense"
    if t.device.type != "cpu":
        return f"a {t.device.type} tensor, which holds no values"
    if t.dtype not in SOURCE_DTYPES:
        return f"of dtype {str(t.dtype).replace('torch.', '')}, not a float or integer one"
    if t.numel() and overlapping(t):
        return (f"a view of shape {tuple(t.shape)} with strides {t.stride()} whose elements overlap (an expanded "
                f"tensor: {t.untyped_storage().nbytes() // t.element_size():,} stored values stand for {t.numel():,})")
    return None


def check_tensors(sd: dict[str, torch.Tensor], file_size: int) -> None:
    """Every source tensor is one an adapter may copy (`tensor_problem`), and all of them together hold at most
    BYTES_PER_FILE_BYTE x the file's size (+64 MiB) as float32 values: what an adapter and `fill` materialise is
    then bounded by the file, before anything is copied (names sharing one storage count once each)."""
    total, largest = 0, None
    for name, t in sd.items():
        if len(name) > MAX_NAME:  # the longest of the peers' full-size files is under 100 (tests/fixtures/*keys.json)
            raise AdapterError(f"a tensor name of {len(name):,} characters ({shown(name)}); names are at most "
                               f"{MAX_NAME}")
        problem = tensor_problem(t)
        if problem is not None:
            raise AdapterError(f"tensor {shown(name)} is {problem}")
        n = t.numel() * max(4, t.element_size())
        total += n
        if largest is None or n > largest[1]:
            largest = (name, n)
    limit = BYTES_PER_FILE_BYTE * file_size + BYTES_SLACK
    if total > limit:
        raise AdapterError(f"its {len(sd)} tensors hold {total:,} bytes as float32 values in a file of "
                           f"{file_size:,} (at most {BYTES_PER_FILE_BYTE} x its size + {BYTES_SLACK >> 20} MiB are "
                           f"converted; the largest, {shown(largest[0])}, {largest[1]:,}): many names share its "
                           "storage")


def need(sd: dict[str, torch.Tensor], key: str, ndim: int, what: str) -> torch.Tensor:
    """The tensor `key` an adapter reads a size from, with `ndim` dimensions (each at least 1); one line naming it
    when the file lacks it or it has another rank."""
    t = sd.get(key)
    if t is None:
        raise AdapterError(f"the file lacks {key} ({what})")
    if t.ndim != ndim or 0 in t.shape:
        raise AdapterError(f"tensor {key} ({what}): expected {ndim} non-empty dimensions, found shape "
                           f"{tuple(t.shape)}")
    return t


@dataclass
class Converted:
    """What an adapter (one per source, beside the model it fills) makes of a published state dict."""

    tensors: dict[str, torch.Tensor]
    """vtrain model names -> tensors; `vtrain convert` checks that they fill the model exactly."""
    read: set[str]
    """The source names those tensors were made from."""
    unused: dict[str, str] = field(default_factory=dict)
    """Source names deliberately left out -> why (e.g. a train-time-only token); any other source name that is
    neither read nor listed here makes `vtrain convert` refuse the file."""
    model: dict[str, Any] = field(default_factory=dict)
    """ModelConfig values the file decides (`preset` when its shapes name one, `embedding_dim`, ...)."""
    num_classes: int = 0
    """Rows of the classifier (0: a face embedding network without class centres)."""
    categories: list[dict[str, Any]] | None = None
    """Detection: COCO categories (id, name) in label order, written as the checkpoint's categories.json."""
    notes: list[str] = field(default_factory=list)
    origin: dict[str, str] = field(default_factory=dict)
    """vtrain name -> the source name it was made from, for messages (a name absent here is shown as vtrain's)."""
