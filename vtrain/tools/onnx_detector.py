"""A detector file written by `vtrain export` (tools/export_detection.py), run with onnxruntime: `vtrain predict
--onnx`. Its metadata gives the categories, the test resize and the output convention; the batches are
evaluation's (data/coco.py `collate`: images padded together, masks True on padding), and the boxes come back in
original pixels as evaluation's `postprocess` gives them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from vtrain.errors import VtrainError

OUTPUTS = ("scores", "labels", "boxes")


def session(path: Path, what: str):
    """An onnxruntime CPU session of `path`; a missing onnxruntime or a file it cannot load is one error line."""
    try:
        import onnxruntime as ort
    except ImportError:
        hint = " (or pass --no-verify)" if "verify" in what else ""
        raise VtrainError(f"{what} needs onnxruntime: pip install onnxruntime{hint}") from None
    try:  # an onnxruntime older than the opset, a file that is not ONNX: one line, not its traceback
        return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime raises its own pybind exception types
        hint = " (a lower --opset, or --no-verify)" if "verify" in what else ""
        raise VtrainError(f"{what}: onnxruntime {ort.__version__} cannot load {path.name}: "
                          f"{str(e).strip().splitlines()[0][:300]}{hint}") from None


class OnnxDetector:
    """`detector(batch)` -> per image scores, labels and boxes (xyxy, original pixels) of a collated batch."""

    def __init__(self, path: str | Path, flag: str = "--onnx") -> None:
        path = Path(path)
        if not path.is_file():
            raise VtrainError(f"{flag}: no such file: {path}")
        self.session = session(path, f"{flag} {path.name}")
        meta = self.session.get_modelmeta().custom_metadata_map
        if meta.get("vtrain.task") != "dino":
            raise VtrainError(f"{flag}: {path} is not a detector written by `vtrain export` (its metadata has no "
                              "vtrain.task=dino)")
        if meta.get("output_convention") != "topk":
            raise VtrainError(f"{flag}: {path} returns raw logits and boxes (exported with --raw); predict needs the "
                              "top-k outputs: export it again without --raw")
        try:
            self.categories = json.loads(meta["categories"])
            self.test_size = tuple(int(x) for x in meta["test_size"].split(","))
            names = [c["name"] for c in self.categories] + [c["id"] for c in self.categories]
        except (KeyError, ValueError, TypeError) as e:
            raise VtrainError(f"{flag}: {path}: unreadable vtrain metadata ({type(e).__name__}: {e})") from None
        if not names or len(self.test_size) != 2:
            raise VtrainError(f"{flag}: {path}: unreadable vtrain metadata (categories, test_size)")
        self.path = path

    def __call__(self, batch: dict[str, Any]) -> list[dict[str, torch.Tensor]]:
        masks = batch["masks"]
        sizes = torch.stack([(~masks[:, :, 0]).sum(1), (~masks[:, 0, :]).sum(1)], 1)  # (h, w) inside the batch
        scores, labels, boxes = self.session.run(list(OUTPUTS), {"images": batch["images"].numpy(),
                                                                 "image_sizes": sizes.numpy()})
        sy, sx = (batch["orig_size"].float() / sizes.float()).unbind(1)  # input pixels -> original pixels
        scale = torch.stack([sx, sy, sx, sy], 1)[:, None]
        boxes = torch.from_numpy(boxes) * scale
        return [{"scores": torch.from_numpy(s), "labels": torch.from_numpy(lab), "boxes": b}
                for s, lab, b in zip(scores, labels, boxes)]
