"""`vtrain export` of a DINO checkpoint: the detector as one ONNX graph with a dynamic batch and image size, checked
with onnxruntime against PyTorch (tools/onnx_detector.py runs such a file for `vtrain predict --onnx`).

The graph (`DetectorGraph`):
- inputs `images`: float32 N x 3 x H x W, RGB, normalised as training does ((x / 255 - mean) / std, ImageNet
  statistics), any N, H and W; images of different sizes are padded together at the bottom and right (zeros, as
  vtrain's batches are); `image_sizes`: int64 N x 2, each image's (height, width) inside `images`, the rest being
  padding. The graph pads H and W up to a multiple of 32 itself and builds the pixel mask from `image_sizes`, as
  vtrain's evaluation batches are padded and masked (data/coco.py `collate`), so a file gives what `vtrain eval`
  and `predict` give for the same resized images.
- outputs, by default `scores` (N x K, sigmoid), `labels` (N x K int64, an index into the categories of the
  metadata) and `boxes` (N x K x 4, x0 y0 x1 y1 in pixels of the image inside `images`): the top K (query, class)
  pairs of each image, K = min(--top-k, queries x classes), the post-processing of evaluation
  (models/dino/detector.py `top_detections`). With `raw`: `logits` (N x Q x C) and `boxes` (N x Q x 4, cx cy w h
  normalised to each image's size), Q = min(queries, encoder tokens).
- everything that depends on the image size is computed in the graph from the input's shape: the padding, the
  masks, the level shapes, the sine positions, the encoder's reference points, the proposals and the number of
  queries (torch.export with symbolic H and W; models/dino code keeps symbolic sizes symbolic).

Deformable attention is traced as one opaque op (msda.py's `export` implementation, chosen for this trace only with
`auto_impl`: training never sees it, nor the custom op and Triton kernels it runs) and written as one of two ONNX
lowerings (models/dino/msda_onnx.py): `grid-sample` (one GridSample per level) or `gather` (index arithmetic and
GatherElements, no GridSample: for runtimes whose ONNX parser lacks it, such as TensorRT's; checked here with
onnxruntime only).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from vtrain.data.coco import MEAN, PAD_DIVISOR, STD
from vtrain.errors import VtrainError
from vtrain.models.dino import DINO
from vtrain.models.dino.detector import top_detections
from vtrain.models.dino.msda import auto_impl
from vtrain.models.dino.msda_onnx import LOWERINGS
from vtrain.tools.onnx_detector import OUTPUTS, session

INPUTS = ("images", "image_sizes")
RAW_OUTPUTS = ("logits", "boxes")
TOP_K = 300  # evaluation's detections per image (docs/dino.md §1.1)
TRACE = (2, 192, 256)  # batch, height, width of the example the export traces
# the checks after writing: batches of 1 and 4 at two sizes, one not a multiple of 32, neither of them traced
CHECKS = ((1, 256, 352), (4, 256, 352), (1, 223, 301), (4, 223, 301))
# onnxruntime against PyTorch: |score| difference, and box corners in pixels (absolute + relative to the side)
SCORE_TOL = 1e-4
BOX_TOL_PX, BOX_TOL_REL = 1e-2, 1e-5
LOGIT_TOL, RAW_BOX_TOL = 1e-4, 1e-5  # --raw: logits (relative to the largest, at least 1) and normalised boxes
SELECTION_GAP, DRAWS = 1e-5, 8  # check inputs: no two selection scores this close (`reference`), redrawn this often


class DetectorGraph(nn.Module):
    """What the exported graph computes (see the module docstring); run eagerly, it is the PyTorch reference the
    file is checked against."""

    def __init__(self, model: DINO, raw: bool = False, top_k: int = TOP_K, clip: bool = False) -> None:
        super().__init__()
        self.model, self.raw, self.top_k, self.clip = model, raw, top_k, clip

    def forward(self, images: torch.Tensor, image_sizes: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h, w = images.shape[-2:]
        # padded up to a multiple of 32 as vtrain's batches are (written so that the padded size is 32 x an
        # integer for torch.export's symbolic shapes, which keeps every level's size a simple expression)
        ph, pw = (h + PAD_DIVISOR - 1) // PAD_DIVISOR * PAD_DIVISOR, (w + PAD_DIVISOR - 1) // PAD_DIVISOR * PAD_DIVISOR
        images = F.pad(images, (0, pw - w, 0, ph - h))
        rows = torch.arange(ph, device=images.device)
        cols = torch.arange(pw, device=images.device)
        masks = (rows[None, :, None] >= image_sizes[:, 0, None, None]) | \
            (cols[None, None, :] >= image_sizes[:, 1, None, None])
        out = self.model(images=images, masks=masks)
        if self.raw:
            return out["pred_logits"], out["pred_boxes"]
        return top_detections(out["pred_logits"], out["pred_boxes"], image_sizes, self.top_k, self.clip)


def trace(graph: DetectorGraph, opset: int, msda: str):
    """torch.onnx's ONNXProgram of `graph` with dynamic batch, height and width."""
    b, h, w = TRACE
    example = (torch.randn(b, 3, h, w, generator=torch.Generator().manual_seed(1)),
               torch.tensor([[h, w]] + [[h - 32, w - 48]] * (b - 1)))
    dynamic = torch.export.Dim.DYNAMIC
    outputs = RAW_OUTPUTS if graph.raw else OUTPUTS
    quiet = logging.getLogger("onnxscript")  # its optimizer warns of every constant it does not fold
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    # deformable attention is traced as one opaque op and written as the chosen ONNX lowering
    lowering = {torch.ops.vtrain.ms_deform_attn_export.default: LOWERINGS[msda]}
    with warnings.catch_warnings(), torch.no_grad(), auto_impl("export"):
        warnings.simplefilter("ignore")  # the exporter's own chatter
        try:
            return torch.onnx.export(graph, example, dynamo=True, input_names=list(INPUTS), output_names=list(outputs),
                                     dynamic_shapes={"images": {0: dynamic, 2: dynamic, 3: dynamic},
                                                     "image_sizes": {0: dynamic}},
                                     custom_translation_table=lowering, opset_version=opset, verbose=False)
        finally:
            quiet.setLevel(level)


def failure(e: Exception) -> str:
    """One line from an exporter's failure: its exception summary when it has one (torch.onnx's own message
    starts with boilerplate), else its first line."""
    text = str(e)
    if "## Exception summary" in text:
        text = text.split("## Exception summary", 1)[1]
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return f"{type(e).__name__}: {' '.join(lines[:3])[:400]}" if lines else type(e).__name__


def metadata(graph: DetectorGraph, categories: list[dict[str, Any]], test_size: tuple[int, int],
             msda: str) -> dict[str, str]:
    """The facts a user of the file needs, as ONNX metadata_props (strings)."""
    mean, std = ",".join(map(str, MEAN)), ",".join(map(str, STD))
    meta = {"vtrain.task": "dino", "input_names": ",".join(INPUTS),
            "images": "float32 N x 3 x H x W, RGB, (x / 255 - mean) / std on 0..255 pixels; any H, W (padded "
                      f"inside to a multiple of {PAD_DIVISOR}); a batch of images of different sizes padded with "
                      "zeros at the bottom and right",
            "image_sizes": "int64 N x 2: (height, width) of each image inside `images`; the rest is padding",
            "mean": mean, "std": std, "input_color": "RGB", "pixel_scale": "255",
            "pad_multiple": str(PAD_DIVISOR), "test_size": f"{test_size[0]},{test_size[1]}",
            "test_resize": f"short side {test_size[0]}, longest side at most {test_size[1]} (vtrain eval's)",
            "categories": json.dumps(categories), "num_classes": str(len(categories)),
            "msda": msda}
    if graph.raw:
        meta.update({"output_names": ",".join(RAW_OUTPUTS), "output_convention": "raw",
                     "logits": "float32 N x Q x C: class logits of each query (sigmoid gives the scores), C in the "
                               "order of `categories`",
                     "boxes": "float32 N x Q x 4: cx, cy, w, h normalised to each image's size (image_sizes)"})
    else:
        meta.update({"output_names": ",".join(OUTPUTS), "output_convention": "topk", "top_k": str(graph.top_k),
                     "scores": f"float32 N x K: the top K = min({graph.top_k}, queries x classes) (query, class) "
                               "scores of each image, sigmoid, descending",
                     "labels": "int64 N x K: index into `categories`",
                     "boxes": "float32 N x K x 4: x0, y0, x1, y1 in pixels of the image inside `images`"
                              + (", clipped to it" if graph.clip else "")})
    return meta


@dataclass
class Check:
    batch: int
    height: int
    width: int
    score_diff: float
    """Largest |score| (raw: |logit|) difference, onnxruntime against PyTorch."""
    box_diff: float
    """Largest difference of a box coordinate, in pixels (raw: in normalised units)."""
    detections: int
    """Detections compared (raw: queries x images)."""


def check_inputs(batch: int, height: int, width: int, seeds: list[int] | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """A padded batch of random images (`seeds`: one per image): the first fills it, the others are smaller in
    height, width or both, with zeros in their padding, as vtrain's collate makes them."""
    seeds = seeds or list(range(batch))
    sizes = [(height, width), (height * 3 // 4, width), (height, width * 2 // 3), (height // 2, width // 2)]
    sizes = torch.tensor([sizes[i % 4] for i in range(batch)])
    images = torch.zeros(batch, 3, height, width)
    for i, (h, w) in enumerate(sizes.tolist()):
        images[i, :, :h, :w] = torch.randn(3, h, w, generator=torch.Generator().manual_seed(seeds[i] * 7919 + h))
    return images, sizes


@contextlib.contextmanager
def selection_scores(model: DINO) -> Iterator[list[torch.Tensor]]:
    """The scores `model` ranks encoder tokens by for its query selection, one (B, S) tensor per forward."""
    seen: list[torch.Tensor] = []
    own = model._selection_scores

    def spy(*args: Any) -> torch.Tensor:
        seen.append(own(*args))
        return seen[-1]

    model._selection_scores = spy
    try:
        yield seen
    finally:
        del model._selection_scores


def near_tie(scores: torch.Tensor, k: int) -> float:
    """The smallest gap between consecutive scores among an image's top k + 1 finite ones (inf: none)."""
    top = scores.topk(min(k + 1, scores.numel())).values
    top = top[torch.isfinite(top)]
    return float((top[:-1] - top[1:]).min()) if len(top) > 1 else float("inf")


def reference(graph: DetectorGraph, batch: int, height: int, width: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                   list[np.ndarray], list[int]]:
    """Inputs for one check and PyTorch's outputs on them. The rank of an encoder token's selection score decides
    which learned query it is paired with, so two scores closer than the runtimes' rounding differences (about
    1e-6 here) may be taken in either order, and the detections of both queries change. Such inputs say nothing
    about the export: an image whose top k + 1 scores have a gap below SELECTION_GAP is drawn again (at most
    DRAWS times). Returns the images, sizes, outputs and the images still drawn near a tie."""
    seeds = list(range(batch))
    for draw in range(DRAWS):
        images, sizes = check_inputs(batch, height, width, seeds)
        with torch.no_grad(), selection_scores(graph.model) as seen:
            want = [t.numpy() for t in graph(images, sizes)]
        k = min(graph.model.num_queries, seen[0].shape[1])
        ties = [i for i in range(batch) if near_tie(seen[0][i], k) < SELECTION_GAP]
        if not ties:
            break
        for i in ties:
            seeds[i] += batch * (draw + 1)
    return images, sizes, want, ties


def verify(path: Path, graph: DetectorGraph) -> list[Check]:
    """Run the file with onnxruntime on `CHECKS` and compare with `graph` run by PyTorch; a difference beyond the
    tolerances is an error naming the check (the caller leaves nothing behind)."""
    return [compare() for _, _, compare in comparisons(path, graph, "export --verify")]


def comparisons(path: Path, graph: DetectorGraph, what: str) -> Iterator[tuple[tuple[int, int, int], list[int],
                                                                                 Callable[[], Check]]]:
    """Each of `CHECKS` run by onnxruntime on the file and by PyTorch on `graph`: its (batch, h, w), the images whose
    selection scores stayed near-tied (`reference`), and the comparison of the two, to call: a `Check`, or a
    `VtrainError` naming the difference. `what` names the caller in onnxruntime's errors."""
    sess = session(path, what)
    for batch, h, w in CHECKS:
        images, sizes, want, ties = reference(graph, batch, h, w)
        got = sess.run(None, {"images": images.numpy(), "image_sizes": sizes.numpy()})
        where = f"{path.name}: onnxruntime on a batch of {batch} at {h} x {w}"
        if ties:
            where += (f" (images {ties} have selection scores within {SELECTION_GAP} of each other in every one "
                      f"of {DRAWS} draws: near-equal scores may be ranked either way by two runtimes)")
        yield (batch, h, w), ties, functools.partial(compare_raw if graph.raw else compare_top, got, want, where,
                                                     batch, h, w)


def compare_raw(got: list[np.ndarray], want: list[np.ndarray], where: str, batch: int, h: int, w: int) -> Check:
    _shapes(got, want, where)
    logit, box = float(np.abs(got[0] - want[0]).max()), float(np.abs(got[1] - want[1]).max())
    logit_tol = LOGIT_TOL * max(1.0, float(np.abs(want[0]).max()))
    if logit > logit_tol or box > RAW_BOX_TOL:
        raise VtrainError(f"{where}: logits differ from PyTorch by {logit:.3g} (tolerance {logit_tol:.3g}), boxes by "
                          f"{box:.3g} (tolerance {RAW_BOX_TOL}); the export is not faithful")
    return Check(batch, h, w, logit, box, want[0].shape[0] * want[0].shape[1])


def compare_top(got: list[np.ndarray], want: list[np.ndarray], where: str, batch: int, h: int, w: int) -> Check:
    """Every image's detections, in PyTorch's rank order: each must have onnxruntime's detection of the same label
    within the score and box tolerances at its rank. Where PyTorch's scores are within twice the score tolerance
    of each other, their order is not something the two runtimes can agree on: such a run of detections is
    matched as a set over the same ranks; and at the top-k cut, a detection that near-equal scores may push out of
    the other side's top k may be missing."""
    _shapes(got, want, where)
    box_tol = BOX_TOL_PX + BOX_TOL_REL * max(h, w)
    near = 2 * SCORE_TOL
    score_diff = box_diff = 0.0
    for i in range(want[0].shape[0]):
        ws, wl, wb = (x[i] for x in want)
        gs, gl, gb = (x[i] for x in got)
        k = len(ws)
        score_diff = max(score_diff, float(np.abs(gs - ws).max(initial=0.0)))
        start = 0
        while start < k:
            end = start + 1
            while end < k and ws[end - 1] - ws[end] <= near:
                end += 1
            free = list(range(start, end))
            for j in range(start, end):
                fits = [(float(np.abs(gb[c] - wb[j]).max()), c) for c in free
                        if gl[c] == wl[j] and abs(gs[c] - ws[j]) <= SCORE_TOL]
                fits = [f for f in fits if f[0] <= box_tol]
                if not fits:
                    if end == k and ws[j] - ws[k - 1] <= near:
                        continue  # at the cut: the other side may have ranked it k + 1
                    raise VtrainError(
                        f"{where}: image {i}, rank {j}: PyTorch has label {wl[j]} score {ws[j]:.6f} box "
                        f"{np.round(wb[j], 2).tolist()}, onnxruntime label {gl[j]} score {gs[j]:.6f} box "
                        f"{np.round(gb[j], 2).tolist()} (tolerances: score {SCORE_TOL}, box {box_tol:.3g} px); the "
                        "export is not faithful")
                d, c = min(fits)
                free.remove(c)
                box_diff = max(box_diff, d)
            start = end
    return Check(batch, h, w, score_diff, box_diff, int(want[0].size))


def _shapes(got: list[np.ndarray], want: list[np.ndarray], where: str) -> None:
    if [g.shape for g in got] != [x.shape for x in want]:
        raise VtrainError(f"{where}: output shapes {[g.shape for g in got]}, PyTorch's {[x.shape for x in want]}; "
                          "the export is not faithful")
