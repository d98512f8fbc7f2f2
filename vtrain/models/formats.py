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

from vtrain.errors import VtrainError


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
    # IDEA-Research/DINO models/dino/dino.py: backbone Joiner `backbone.0.body`, `input_proj`, `label_enc`
    "idea-dino": Format("an IDEA-Research DINO detector", keys=("label_enc.weight",),
                        prefixes=("backbone.0.body.", "input_proj.0.", "transformer.encoder.layers.")),
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
    """(the state dict, the container key it was under or None) of a loaded file; (None, None) when it holds none."""
    if is_state_dict(obj):
        return obj, None
    if isinstance(obj, dict):
        for key in CONTAINERS:
            if is_state_dict(obj.get(key)):
                return obj[key], key
    return None, None


def detect(names: Iterable[str]) -> str | None:
    """The `--from` name of the format whose tensor names these are, or None (vtrain's own, timm's, unknown)."""
    names = set(names)
    return next((name for name, f in FORMATS.items() if f.matches(names)), None)


def convert_hint(path: str, name: str) -> str:
    """The sentence that says what a published file is and how vtrain reads it."""
    return (f"{path} is {FORMATS[name].description} checkpoint, which vtrain reads only through its converter: "
            f"vtrain convert {path} OUT --from {name}")


class AdapterError(VtrainError):
    """A published file that its converter cannot map (an unknown variant): one line naming the tensor."""


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
