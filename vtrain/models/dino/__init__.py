"""DINO detection model (DETR with improved denoising anchor boxes): our own code on timm, torchvision, scipy."""

from vtrain.models.dino.detector import DINO, DinoOptions, count_parameters, postprocess

__all__ = ["DINO", "DinoOptions", "count_parameters", "postprocess"]
