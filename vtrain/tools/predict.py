"""`vtrain predict`: run a trained checkpoint on image files, offline, in one process (on the GPU when there is one),
in batches, with a progress bar.

- detection: `<out>/<name>.jpg` per input with the boxes above the score threshold drawn (torchvision
  `draw_bounding_boxes`, one colour per class, "name 0.87" labels) and `<out>/predictions.json` in the COCO results
  format (+ `file_name`). Preprocessing and post-processing are evaluation's: the test-time resize, ImageNet
  normalisation, padded batches with masks, `postprocess` to boxes in original pixels, fp32.
- metric: one safetensors file with `embeddings` (N, D): evaluation's flip-averaged, L2-normalised embeddings
  (`flip_embeddings`); the input names are in its metadata (`files`, a JSON list, row order).

An unreadable image stops the run with one error line naming it, rather than leaving a silent hole. Every file
written is checked first (vtrain/io/guarded.py): never into a checkpoint, never over a FIFO or a device, an existing one
only with `--overwrite`, and each is written beside its name, checked to hold every byte, and renamed over it (a link
there is replaced, never written through).
"""

from __future__ import annotations

import glob
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from torch.utils.data import DataLoader, Dataset
from safetensors.torch import save_file
from torchcodec.encoders import JpegEncoder
from torchvision import tv_tensors
from torchvision.datasets.folder import IMG_EXTENSIONS
from torchvision.ops import nms
from torchvision.utils import draw_bounding_boxes

from vtrain.io import guarded
from vtrain.config import DEFAULT_MAX_IMAGE_PIXELS, DataConfig, TrainConfig
from vtrain.config.fields import check_value
from vtrain.data.coco import check_resizable, collate, load_coco, normalize, test_transforms
from vtrain.data.faces import load_image
from vtrain.data.images import decode_rgb
from vtrain.data.workers import worker_options
from vtrain.engine.checkpoint import format as ckpt
from vtrain.engine.logging import console
from vtrain.errors import VtrainError
from vtrain.eval.coco_eval import coco_detections
from vtrain.io.files import write_json_atomic
from vtrain.models.dino import postprocess
from vtrain.tasks.dino import chosen_test_sizes
from vtrain.tasks.metric import flip_embeddings
from vtrain.tools.evaluate import checkpoint_task, load_model
from vtrain.tools.onnx_detector import OnnxDetector

SCORE_THRESHOLD = 0.3
"""Detection: the default score a box must reach to be drawn and kept."""
# distinct colours for up to 20 classes (then repeated): Tableau-20 order, saturated ones first
PALETTE = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75),
           (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207), (174, 199, 232), (255, 187, 120),
           (152, 223, 138), (255, 152, 150), (197, 176, 213), (196, 156, 148), (247, 182, 210), (199, 199, 199),
           (219, 219, 141), (158, 218, 229)]


@dataclass
class PredictReport:
    task: str
    images: int
    outputs: list[Path]
    """Detection: the drawn images and predictions.json; metric: the embeddings file."""
    detections: int = 0
    """Detection: boxes at or above the score threshold, over all images."""
    device: str = "cpu"
    score_threshold: float | None = None
    """Detection: the threshold the boxes were kept at."""
    nms_iou: float | None = None
    """Detection: the IoU above which a box overlapping a higher-scoring one was dropped (None: no NMS)."""
    test_size: tuple[int, int] | None = None
    """Detection: the test resize used, (short side, longest side cap)."""


def find_images(inputs: list[str]) -> list[tuple[Path, str]]:
    """(file, name) per input image, in order: a folder gives its image files (torchvision's extensions, any depth,
    sorted, named by their path inside it), a file itself, a glob pattern its matches (named by file name)."""
    found: list[tuple[Path, str]] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in IMG_EXTENSIONS)
            if not files:
                raise VtrainError(f"--images: no image files ({', '.join(IMG_EXTENSIONS)}) in {p}")
            found += [(f, f.relative_to(p).as_posix()) for f in files]
        elif p.is_file():
            found.append((p, p.name))
        else:
            matches = sorted(Path(m) for m in glob.glob(item) if Path(m).is_file())
            if not matches:
                raise VtrainError(f"--images: no such file, folder or pattern: {item}")
            found += [(m, m.name) for m in matches]
    if not found:
        raise VtrainError("--images: give at least one image file or folder")
    return found


class _Inputs(Dataset):
    """`load(path)` per file; a load error comes back as a value (a DataLoader worker would wrap the exception in a
    multi-line traceback) and is raised in the main process."""

    def __init__(self, files: list[Path], load: Callable[[Path], dict[str, Any]]) -> None:
        self.files, self.load = files, load

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> dict[str, Any]:
        try:
            return {**self.load(self.files[i]), "index": torch.tensor(i)}
        except VtrainError as e:
            return {"error": str(e)}


class _Checked:
    """Collate that passes a sample's load error on instead of collating (a class: workers receive it pickled)."""

    def __init__(self, collate: Callable | None) -> None:
        self.collate = collate or torch.utils.data.default_collate

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        bad = next((s["error"] for s in samples if "error" in s), None)
        return {"error": bad} if bad else self.collate(samples)


def _loader(files: list[Path], load: Callable, batch_size: int, num_workers: int, collate: Callable | None,
            device: torch.device):
    # workers from a fork server, as everywhere in vtrain (data/workers.py); `load` and `collate` are picklable
    return DataLoader(_Inputs(files, load), batch_size=batch_size, num_workers=num_workers,
                      collate_fn=_Checked(collate), pin_memory=device.type == "cuda",
                      **worker_options(num_workers))


def _batch(given: int | None, cfg) -> int:
    """--batch-size, else the run's micro-batch, else (an ONNX file) 1; 0 is refused, never taken for "not
    given"."""
    check_value(TrainConfig, "batch_size", given)  # train's rule
    if given is None:
        return 1 if cfg is None else cfg.train.batch_size
    return given


def _max_pixels(given: int | None, saved_data: dict[str, Any]) -> int:
    """--max-image-pixels, else the run's own limit, else PIL's default."""
    check_value(DataConfig, "max_image_pixels", given)  # train's rule
    return given or saved_data.get("max_image_pixels") or DEFAULT_MAX_IMAGE_PIXELS


def _progress(total: int, what: str) -> Progress:
    p = Progress(TextColumn(f"[bold]{what}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                 TextColumn("eta"), TimeRemainingColumn(), console=console, disable=not sys.stdout.isatty())
    p.add_task(what, total=total)
    return p


def _batches(loader: DataLoader, progress: Progress):
    with progress:
        for batch in loader:
            if "error" in batch:
                raise VtrainError(batch["error"])
            yield batch
            progress.advance(progress.task_ids[0], len(batch["index"]))


def _reads(found: list[tuple[Path, str]], ann: str | None = None,
           onnx: str | Path | None = None) -> list[guarded.Read]:
    """What predict reads besides the checkpoint (whose files no output may be, guarded.claim_output): the images,
    the --ann file and the --onnx file."""
    return ([guarded.Read("--images", f) for f, _ in found] + ([guarded.Read("--ann", Path(ann))] if ann else [])
            + ([guarded.Read("--onnx", Path(onnx))] if onnx else []))


def _output(out: Path, is_dir: bool) -> None:
    if is_dir and out.exists() and not out.is_dir():
        raise VtrainError(f"--out: {out} exists and is not a folder")
    if not is_dir and out.is_dir():
        raise VtrainError(f"--out: {out} is a folder; give a file name such as embeddings.safetensors")


def predict(checkpoint: str | Path | None, inputs: list[str], out: str | Path, task: str | None = None,
            onnx: str | Path | None = None, **options: Any) -> PredictReport:
    """Detection or embeddings, by `task` or else by the checkpoint's own task; or detection by a file of `vtrain
    export` run with onnxruntime (`onnx`, instead of a checkpoint)."""
    _max_pixels(options.get("max_pixels"), {})  # a bad limit is reported before anything is loaded
    if onnx is not None:
        if checkpoint is not None:
            raise VtrainError("--onnx: give either --checkpoint or --onnx, not both")
        if task == "metric":
            raise VtrainError("--onnx: detectors only (an ONNX file `vtrain export` wrote from a DINO checkpoint)")
        return predict_detection(None, inputs, out, onnx=onnx, **options)
    if checkpoint is None:
        raise VtrainError("--checkpoint: give the checkpoint to run (or --onnx FILE, a detector `vtrain export` wrote)")
    task = task or checkpoint_task(checkpoint)
    if task == "metric":
        # else silently unused (a face model's input size is its own)
        for key, flag in (("ann", "--ann"), ("score_threshold", "--score-threshold"), ("nms_iou", "--nms-iou"),
                          ("image_size", "--image-size"), ("max_size", "--max-size")):
            if options.pop(key, None) is not None:
                raise VtrainError(f"{flag}: only for detection checkpoints")
        return predict_embeddings(checkpoint, inputs, out, **options)
    return predict_detection(checkpoint, inputs, out, **options)


# ---- detection ------------------------------------------------------------------------------------------------
def predict_detection(checkpoint: str | Path | None, inputs: list[str], out: str | Path,
                      score_threshold: float | None = None, nms_iou: float | None = None,
                      batch_size: int | None = None, ann: str | None = None, num_workers: int = 2,
                      max_pixels: int | None = None, overwrite: bool = False, image_size: int | None = None,
                      max_size: int | None = None, onnx: str | Path | None = None) -> PredictReport:
    """Draw and write the detections of every input image (see the module docstring). `ann`: a COCO annotation
    file whose `file_name`s give the image ids (and the class names if the checkpoint has none); otherwise the
    ids are 1..N in input order. `image_size` / `max_size`: the test resize instead of the run's
    (tasks/dino.py: chosen_test_sizes). `onnx`: a detector file of `vtrain export` instead of the checkpoint, run
    with onnxruntime on the same batches (its metadata gives the categories and the test resize; the default
    batch size is 1). `nms_iou`: after the score threshold, drop every box whose IoU with a higher-scoring kept box
    of any class exceeds it (class-agnostic NMS, as IDEA DINO's `PostProcess(nms_iou_threshold=...)`,
    docs/detection.md "Drawing detections"); None: no NMS, as DINO is trained and evaluated."""
    score_threshold = SCORE_THRESHOLD if score_threshold is None else score_threshold
    if not 0.0 <= score_threshold <= 1.0:
        raise VtrainError(f"--score-threshold: must be in [0, 1], got {score_threshold}")
    if nms_iou is not None and not 0.0 < nms_iou <= 1.0:
        raise VtrainError(f"--nms-iou: must be in (0, 1], got {nms_iou}")
    out = Path(out)
    _output(out, is_dir=True)
    found = find_images(inputs)
    names = [n for _, n in found]
    outputs = [out / Path(n).with_suffix(".jpg") for n in names]
    if len(set(outputs)) != len(outputs):
        dup = next(o for o in outputs if outputs.count(o) > 1)
        raise VtrainError(f"--images: two inputs would both be written to {dup}; give them separately")
    guarded.claim_output([*outputs, out / "predictions.json"], overwrite, "--out", ckpt.inside_checkpoint,
                         _reads(found, ann, onnx))
    coco = load_coco(ann) if ann else None
    image_ids = _image_ids(names, coco, ann) if coco is not None else list(range(1, len(names) + 1))

    if onnx is None:
        loaded = load_model(checkpoint, "dino")
        device, known, num_classes, saved = loaded.device, loaded.categories, loaded.model.num_classes, \
            loaded.saved_data
        run_size = (loaded.cfg.model.image_size, saved.get("max_size"))
        detect = _TorchDetector(loaded.model, device, loaded.cfg.model.clip_boxes)
        batch_size, source = _batch(batch_size, loaded.cfg), loaded.path
    else:
        detect = OnnxDetector(onnx)
        device, known, num_classes, saved = torch.device("cpu"), detect.categories, len(detect.categories), {}
        run_size = detect.test_size
        batch_size, source = _batch(batch_size, None), detect.path
    categories = known or (
        [{"id": c, "name": coco.cats[c].get("name", str(c))} for c in sorted(coco.getCatIds())] if coco else None)
    if categories is None:  # a checkpoint written before categories.json existed, and no --ann
        categories = [{"id": i, "name": f"class {i}"} for i in range(num_classes)]
    if len(categories) != num_classes:
        raise VtrainError(f"the model has {num_classes} classes but {len(categories)} categories are known "
                          f"({'--ann ' + str(ann) if not known else source})")
    cat_ids = [c["id"] for c in categories]
    size, max_size = chosen_test_sizes(image_size, max_size, *run_size)
    load = _DetectionInput(test_transforms(size, max_size), _max_pixels(max_pixels, saved), max_size)
    loader = _loader([f for f, _ in found], load, batch_size, num_workers, _collate_with_originals, device)
    dets: list[dict[str, Any]] = []
    kept = 0
    with torch.no_grad():
        for batch in _batches(loader, _progress(len(found), "predict")):
            results = detect(batch)
            for i, original, r in zip(batch["index"].tolist(), batch["original"], results):
                keep = r["scores"] >= score_threshold
                boxes, scores, labels = (r[k][keep].cpu() for k in ("boxes", "scores", "labels"))
                if nms_iou is not None:  # torchvision's nms keeps the survivors in decreasing score order
                    keep = nms(boxes.float(), scores.float(), nms_iou)
                    boxes, scores, labels = boxes[keep], scores[keep], labels[keep]
                kept += len(scores)
                for d in coco_detections(image_ids[i], boxes.numpy(), scores.numpy(), labels.numpy(), cat_ids):
                    dets.append({**d, "file_name": names[i]})
                drawn = draw(original, boxes, scores, labels, [c["name"] for c in categories])
                # encoded here and written by vtrain's checked writer: an encoder writing its own file may leave a
                # truncated JPEG under its final name after a short write (io/guarded.py)
                guarded.write_bytes(outputs[i], memoryview(JpegEncoder(drawn).to_tensor(quality=95).numpy()))
    write_json_atomic(out / "predictions.json", dets)
    return PredictReport("dino", len(found), [*outputs, out / "predictions.json"], kept, str(device), score_threshold,
                         nms_iou, (size, max_size))


class _TorchDetector:
    """The checkpoint's model on a collated batch: evaluation's forward and post-processing, boxes in original
    pixels."""

    def __init__(self, model: torch.nn.Module, device: torch.device, clip: bool) -> None:
        self.model, self.device, self.clip = model, device, clip

    def __call__(self, batch: dict[str, Any]) -> list[dict[str, torch.Tensor]]:
        res = self.model(images=batch["images"].to(self.device), masks=batch["masks"].to(self.device))
        return postprocess(res["pred_logits"], res["pred_boxes"], batch["orig_size"].to(self.device), clip=self.clip)


class _DetectionInput:
    """One input image for detection: evaluation's test-time resize and normalisation, and the original to draw on.
    An image too elongated for the resize is refused, naming it, as evaluation refuses it (data/coco.py)."""

    def __init__(self, resize: Callable, max_pixels: int, cap: int) -> None:
        self.resize, self.max_pixels, self.cap = resize, max_pixels, cap

    def __call__(self, path: Path) -> dict[str, Any]:
        img = decode_rgb(path, max_pixels=self.max_pixels)
        check_resizable(*img.shape[-2:], self.cap, str(path))
        return {"images": normalize(self.resize(tv_tensors.Image(img))), "original": img,
                "boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.long), "image_id": torch.tensor(0),
                "orig_size": torch.tensor(img.shape[-2:])}


def _collate_with_originals(samples: list[dict[str, Any]]) -> dict[str, Any]:
    return {**collate(samples), "original": [s["original"] for s in samples]}


def draw(image: torch.Tensor, boxes: torch.Tensor, scores: torch.Tensor, labels: torch.Tensor,
         class_names: list[str]) -> torch.Tensor:
    """Boxes (xyxy, image pixels) on a uint8 RGB image, one colour per class, labelled "name 0.87"."""
    if len(boxes) == 0:
        return image
    h, w = image.shape[-2:]
    boxes = boxes.clone()
    boxes[:, 0::2] = boxes[:, 0::2].clamp(0, w - 1)  # a box reaching past the image is drawn on its edge
    boxes[:, 1::2] = boxes[:, 1::2].clamp(0, h - 1)
    colors = [PALETTE[int(c) % len(PALETTE)] for c in labels]
    text = ["black" if 0.299 * r + 0.587 * g + 0.114 * b > 150 else "white" for r, g, b in colors]  # legible on fill
    return draw_bounding_boxes(image, boxes, labels=[f"{class_names[int(c)]} {float(s):.2f}" for c, s in
                                                      zip(labels, scores)],
                               colors=colors, width=max(2, round(max(h, w) / 300)), fill_labels=True,
                               label_colors=text)


def _image_ids(names: list[str], coco, ann: str) -> list[int]:
    by_name = {im["file_name"]: im["id"] for im in coco.imgs.values()}
    ids = []
    for n in names:
        image_id = by_name.get(n, by_name.get(Path(n).name))
        if image_id is None:
            raise VtrainError(f"--ann: {ann} lists no image named {n}")
        ids.append(image_id)
    return ids


# ---- metric ---------------------------------------------------------------------------------------------------
def predict_embeddings(checkpoint: str | Path, inputs: list[str], out: str | Path, batch_size: int | None = None,
                       num_workers: int = 2, max_pixels: int | None = None, overwrite: bool = False) -> PredictReport:
    """Evaluation's embeddings of every input image, written to one safetensors file (see the module docstring)."""
    out = Path(out)
    _output(out, is_dir=False)
    found = find_images(inputs)
    guarded.claim_output([out], overwrite, "--out", ckpt.inside_checkpoint, _reads(found))
    loaded = load_model(checkpoint, "metric")
    model, device, size = loaded.model, loaded.device, loaded.cfg.model.image_size
    loader = _loader([f for f, _ in found], _EmbeddingInput(size, _max_pixels(max_pixels, loaded.saved_data)),
                     _batch(batch_size, loaded.cfg), num_workers, None, device)
    chunks = []
    with torch.no_grad():
        for batch in _batches(loader, _progress(len(found), "embed")):
            chunks.append(flip_embeddings(lambda **x: model(**x), batch["images"].to(device)).cpu())
    embeddings = {"embeddings": torch.cat(chunks).contiguous()}
    meta = {"files": json.dumps([n for _, n in found]), "checkpoint": str(loaded.path), "image_size": str(size)}
    guarded.replace_file(out, lambda tmp: save_file(embeddings, str(tmp), metadata=meta))
    return PredictReport("metric", len(found), [out], device=str(device))


class _EmbeddingInput:
    """One input image for embeddings: evaluation's resize and [-1, 1] scaling."""

    def __init__(self, size: int, max_pixels: int) -> None:
        self.size, self.max_pixels = size, max_pixels

    def __call__(self, path: Path) -> dict[str, Any]:
        return {"images": load_image(path, self.size, self.max_pixels)}
