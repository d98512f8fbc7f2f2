"""timm backbones built from presets, local pretrained weights, activation checkpointing."""

from __future__ import annotations

import sys
from pathlib import Path

import timm
import torch
from torch import nn

from vtrain.errors import VtrainError
from vtrain.models.recompute_units import backbone_units, set_recompute
from vtrain.models.formats import convert_hint, detect, unwrap
from vtrain.models.swin_attention import use_shared_bias_attention
from vtrain.presets import METRIC_PRESETS
from vtrain.io.safeio import load_published


def build_backbone(preset: str, image_size: int, drop_path: float | None = None) -> nn.Module:
    """A timm model returning pooled features of size `backbone.num_features` (no classifier). Swin blocks use
    vtrain's shared-bias window attention (swin_attention.py)."""
    p = METRIC_PRESETS[preset]()
    kwargs = dict(p.kwargs)
    if p.takes_img_size:
        kwargs["img_size"] = image_size
    if drop_path is not None:
        kwargs["drop_path_rate"] = drop_path
    model = timm.create_model(p.timm_name, pretrained=False, num_classes=0, **kwargs)
    use_shared_bias_attention(model)
    return model


def read_state_dict(path: str | Path, flag: str = "") -> dict[str, torch.Tensor]:
    """Load a weights file (.safetensors, .pt/.pth/.bin) on CPU; unwrap common `{"model": ...}` containers. A
    published checkpoint of another codebase (models/formats.py) is one error naming it and the `vtrain convert`
    that reads it: its tensor names are not vtrain's or timm's."""
    path = Path(path)
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            sd = load_file(str(path))
        else:  # weights-only, admitting the data-only classes published files hold (an IDEA DINO `args` Namespace)
            sd = load_published(path)
    except VtrainError:  # e.g. safeio's refusal of a pickle that would run code: already one clear line
        raise
    except Exception as e:  # corrupt or foreign file: a user problem, not a crash
        raise VtrainError(f"cannot read weights from {path}: {' '.join(str(e).split())[:300]}") from None
    sd, _ = unwrap(sd)
    if sd is None:
        raise VtrainError(f"{path} does not hold a state dict of tensors")
    published = detect(sd)
    if published is not None:
        hint = convert_hint(str(path), published)
        raise VtrainError(f"{flag}: {hint}" if flag else hint)
    return sd


def load_strict(model: nn.Module, sd: dict[str, torch.Tensor], flag: str, what: str) -> None:
    """load_state_dict(strict=True) whose failure is a one-line user error naming the flag."""
    try:
        model.load_state_dict(sd, strict=True)
    except RuntimeError as e:
        raise VtrainError(f"{flag}: {what}: {' '.join(str(e).split())[:300]}") from None


def check_match(path: str, what: str, loaded: int, total: int, min_share: float, allow_partial: bool) -> str:
    """A --pretrained file must fill at least `min_share` of the target's tensors: fewer means a file of another
    model (it would silently train from scratch). Returns the share as text for the log."""
    share = loaded / max(total, 1)
    text = f"{loaded}/{total} tensors of the {what} ({share:.0%})"
    if share < min_share and not allow_partial:
        raise VtrainError(f"--pretrained: {path} fills only {text}, below --pretrained-min-match {min_share:g}; is it "
                          "a file of another model? (--allow-partial-pretrained loads it anyway)")
    return text


def load_backbone_weights(backbone: nn.Module, sd: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """Load timm-layout weights, adapting them with the model family's own `checkpoint_filter_fn`
    (position-embedding resampling, original Swin/ViT key layouts). Returns (missing, unexpected)."""
    filter_fn = getattr(sys.modules[type(backbone).__module__], "checkpoint_filter_fn", None)
    if filter_fn is not None:
        sd = filter_fn(sd, backbone)
    own = backbone.state_dict()
    # classifier weights of an ImageNet checkpoint have no place in a num_classes=0 backbone
    dropped = [k for k in sd if k not in own]
    sd = {k: v for k, v in sd.items() if k in own}
    bad = [k for k, v in sd.items() if v.shape != own[k].shape]
    if bad:
        raise VtrainError(f"--pretrained: shape mismatch for {len(bad)} tensors, e.g. {bad[0]}: "
                          f"{tuple(sd[bad[0]].shape)} vs model {tuple(own[bad[0]].shape)}")
    result = backbone.load_state_dict(sd, strict=False)
    return list(result.missing_keys), dropped


def set_backbone_checkpointing(backbone: nn.Module, enable: bool = True) -> None:
    """Non-reentrant checkpointing of every block of a timm backbone (all its units, models/recompute_units.py)."""
    units = backbone_units(backbone)
    if not units:
        raise VtrainError(f"--grad-ckpt backbone: {type(backbone).__name__} has no blocks to checkpoint")
    for blocks in units.values():
        for b in blocks:
            set_recompute(b, "full" if enable else None)
