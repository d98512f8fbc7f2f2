"""`vtrain eval --task metric --checkpoint RUN --ijb DIR`: IJB-B / IJB-C 1:1 verification of a face checkpoint as
insightface's `arcface_torch/eval_ijbc.py` computes it (docs/evaluation.md, docs/face.md §7).

The protocol is read and checked first (data/ijb.py; one error line for any problem, before the model is built),
then every face is aligned from its five landmarks (data/face_align.py) in DataLoader workers, embedded with its
mirror image, and added to its template (eval/ijb.py), so no face feature is kept; the template pairs are scored
and the TAR@FAR table made. Peak memory: the protocol's arrays, the templates (T x D float64) and the pair scores.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from torch.utils.data import DataLoader, Dataset

from vtrain.config import DEFAULT_MAX_IMAGE_PIXELS, MAX_IMAGE_PIXELS_CEILING
from vtrain.data.face_align import AlignmentError, align_face
from vtrain.data.faces import to_model_input
from vtrain.data.ijb import IjbProtocol, find_ijb, read_ijb
from vtrain.data.images import decode_rgb
from vtrain.data.workers import worker_options
from vtrain.engine.logging import console
from vtrain.errors import VtrainError
from vtrain.eval.ijb import IJB_FARS, TemplateSums, pooling_weights, tar_at_far_table, template_pair_scores
from vtrain.tools.evaluate import checkpoint_task, load_model


@dataclass
class IjbResult:
    metrics: dict[str, Any]
    """Flat keys for --json: `ijbc/TAR@FAR=0.0001` (+ `/far`, `/threshold`, `/at_or_below`, ...), plus `rows`."""
    scores: np.ndarray
    """The cosine score of every template pair, in the pair file's order."""
    labels: np.ndarray


class _Crops(Dataset):
    """Aligned 112 x 112 crops of the faces, as model inputs; an error comes back as a value (a DataLoader worker
    would wrap the exception in a traceback) and is raised in the main process. Picklable (workers)."""

    def __init__(self, protocol: IjbProtocol, size: int, max_pixels: int) -> None:
        self.images, self.names, self.landmarks = protocol.files.images, protocol.names, protocol.landmarks
        self.where = f"{protocol.files.rel(protocol.files.landmarks)}"
        self.size, self.max_pixels = size, max_pixels

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, i: int) -> dict[str, Any]:
        try:
            rgb = decode_rgb(self.images / self.names[i], max_pixels=self.max_pixels)
            crop = align_face(rgb.permute(1, 2, 0).numpy(), self.landmarks[i])
            return {"images": to_model_input(torch.from_numpy(crop).permute(2, 0, 1), self.size),
                    "index": torch.tensor(i)}
        except (AlignmentError, VtrainError) as e:
            return {"error": f"{self.where}:{i + 1}: {e}"}


def _collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    bad = next((s["error"] for s in samples if "error" in s), None)
    return {"error": bad} if bad else torch.utils.data.default_collate(samples)


def evaluate_ijb(checkpoint: str | Path, root: str | Path, target: str | None = None, batch_size: int | None = None,
                 weights_choice: str | None = None, num_workers: int = 2, max_pixels: int | None = None,
                 fars: tuple[float, ...] = IJB_FARS, report_json: bool | None = None) -> IjbResult:
    """The whole evaluation (module docstring). `target`: ijbb or ijbc (default: from the files). `report_json`
    not None: print the table, and with True the metrics as one JSON object on the last line (`vtrain eval`)."""
    if batch_size is not None and batch_size < 1:
        raise VtrainError(f"--batch-size: must be >= 1, got {batch_size}")
    if max_pixels is not None and not 1 <= max_pixels <= MAX_IMAGE_PIXELS_CEILING:
        raise VtrainError(f"--max-image-pixels: must be in 1..{MAX_IMAGE_PIXELS_CEILING} pixels, got {max_pixels}")
    files = find_ijb(root, target)
    found = checkpoint_task(checkpoint)  # a missing or foreign checkpoint before the protocol is read
    if found != "metric":
        raise VtrainError(f"--ijb: only for face (metric) checkpoints; {checkpoint} is a {found} checkpoint")
    console.print(f"reading the {files.name} protocol in {files.root} ...", soft_wrap=True)
    start = time.perf_counter()
    protocol = read_ijb(files)
    console.print(f"{files.name}: {len(protocol.names)} faces, {len(protocol.template_ids)} templates, "
                  f"{len(protocol.labels)} pairs ({int(protocol.labels.sum())} genuine), read in "
                  f"{time.perf_counter() - start:.1f} s", soft_wrap=True)
    loaded = load_model(checkpoint, "metric", weights_choice=weights_choice, task_flag="--ijb")
    limit = max_pixels or loaded.saved_data.get("max_image_pixels") or DEFAULT_MAX_IMAGE_PIXELS
    sums = embed_templates(lambda x: loaded.model(images=x)["embedding"], loaded.device, protocol,
                           loaded.cfg.model.image_size,
                           loaded.cfg.train.batch_size if batch_size is None else batch_size, num_workers, limit)
    console.print(f"scoring {len(protocol.labels)} template pairs ...", soft_wrap=True)
    scores = template_pair_scores(sums.normalized(), protocol.pairs)
    table = tar_at_far_table(protocol.labels, scores, fars)
    result = IjbResult(_flat(files.target, table, loaded.weights, str(loaded.path)), scores, protocol.labels)
    if report_json is not None:
        m = result.metrics
        console.print(ijb_table(m, f"{m['benchmark'].upper()} 1:1 verification: {checkpoint} ({m['weights']} "
                                   "weights)"))
        if report_json:
            print(json.dumps({k: v for k, v in m.items() if k != "rows"}))
    return result


def embed_templates(embed: Callable[[torch.Tensor], torch.Tensor], device: torch.device, protocol: IjbProtocol,
                    size: int, batch_size: int, num_workers: int = 2,
                    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> TemplateSums:
    """Every face aligned, embedded with its mirror (`embed`: model inputs -> N x D embeddings, on `device`) and
    added to its template with its pooling weight; the template sums (not normalised)."""
    loader = DataLoader(_Crops(protocol, size, max_pixels), batch_size=batch_size, num_workers=num_workers,
                        collate_fn=_collate, pin_memory=device.type == "cuda", **worker_options(num_workers))
    weights = pooling_weights(protocol.template, protocol.media, protocol.scores)
    sums: TemplateSums | None = None
    console.print(f"embedding {len(protocol.names)} aligned faces and their mirror images on {device} ...",
                  soft_wrap=True)
    with torch.no_grad(), _progress(len(protocol.names), "embed") as progress:
        for batch in loader:
            if "error" in batch:
                raise VtrainError(batch["error"])
            x = batch["images"].to(device)
            # image + mirror, not normalised (eval_ijbc.py's "F2" test mode: the norm weighs the face)
            emb = embed(torch.cat([x, x.flip(-1)])).float()
            feats = (emb[: len(x)] + emb[len(x):]).cpu().numpy()
            rows = batch["index"].numpy()
            if sums is None:
                sums = TemplateSums(len(protocol.template_ids), feats.shape[1])
            sums.add(protocol.template[rows], weights[rows], feats)
            progress.advance(progress.task_ids[0], len(rows))
    assert sums is not None  # read_ijb refuses a protocol without faces
    return sums


def _progress(total: int, what: str) -> Progress:
    p = Progress(TextColumn(f"[bold]{what}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                 TextColumn("eta"), TimeRemainingColumn(), console=console, disable=not sys.stdout.isatty())
    p.add_task(what, total=total)
    return p


def _flat(target: str, table: dict, weights: str, checkpoint: str) -> dict[str, Any]:
    out: dict[str, Any] = {"benchmark": target, "checkpoint": checkpoint, "weights": weights}
    for r in table["rows"]:
        key = f"{target}/TAR@FAR={r['far_target']:g}"
        out[key] = r["tar"]
        out[f"{key}/far"] = r["far"]
        out[f"{key}/threshold"] = r["threshold"]
        out[f"{key}/at_or_below"] = r["tar_at_or_below"]
        out[f"{key}/resolvable"] = r["resolvable"]
    out[f"{target}/auc"] = table["auc"]
    out[f"{target}/genuine_pairs"] = table["genuine_pairs"]
    out[f"{target}/impostor_pairs"] = table["impostor_pairs"]
    out["rows"] = table["rows"]
    return out


def ijb_table(metrics: dict[str, Any], title: str):
    """The TAR@FAR table (rich)."""
    from rich.table import Table

    target = metrics["benchmark"]
    t = Table(title=title)
    for col in ("FAR", "TAR", "its FAR", "threshold", "TAR, FAR<=", "note"):
        t.add_column(col, no_wrap=True)
    for r in metrics["rows"]:
        note = "" if r["resolvable"] else f"< {1 / r['far_target']:.0e} impostors"
        t.add_row(f"{r['far_target']:.0e}", f"{100 * r['tar']:.2f}%", f"{r['far']:.2e}", f"{r['threshold']:.4f}",
                  f"{100 * r['tar_at_or_below']:.2f}%", note)
    t.caption = (f"TAR: at the ROC point whose FAR is nearest (eval_ijbc.py); TAR, FAR<=: the best with FAR <= "
                 f"target. {metrics[f'{target}/genuine_pairs']} genuine / {metrics[f'{target}/impostor_pairs']} "
                 f"impostor pairs; AUC {metrics[f'{target}/auc']:.6f}")
    return t
