"""`vtrain eval --task metric --checkpoint RUN --ijb DIR`: IJB-B / IJB-C 1:1 verification of a face checkpoint as
insightface's `arcface_torch/eval_ijbc.py` computes it (docs/evaluation.md, docs/face.md §7). The command's
evaluate_checkpoint (tools/evaluate.py) checks the flags, loads the model and calls the steps here; the table and
--json are printed as any other evaluation's.

The protocol is read and checked first (data/ijb.py; one error line for any problem, before the model is built),
then every face is aligned from its five landmarks (data/face_align.py) in DataLoader workers, embedded with its
mirror image, and added to its template (eval/ijb.py), so no face feature is kept; the template pairs are scored
and the TAR@FAR table made. Peak memory: the protocol's arrays, the templates (T x D float64) and the pair scores.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from torch.utils.data import DataLoader, Dataset

from vtrain.config import DEFAULT_MAX_IMAGE_PIXELS
from vtrain.data.face_align import AlignmentError, align_face
from vtrain.data.faces import to_model_input
from vtrain.data.ijb import IjbFiles, IjbProtocol, read_ijb
from vtrain.data.images import decode_rgb
from vtrain.data.workers import worker_options
from vtrain.engine.logging import console
from vtrain.errors import VtrainError
from vtrain.eval.ijb import IJB_FARS, TemplateSums, pooling_weights, tar_at_far_table, template_pair_scores


@dataclass
class IjbReport:
    """What `vtrain eval` prints an IJB result with, as it prints a task's metrics."""
    name: str

    @staticmethod
    def metrics_table(metrics: dict[str, Any], title: str):
        return ijb_table(metrics, title)


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


def read_protocol(files: IjbFiles) -> IjbProtocol:
    """The protocol read and checked (data/ijb.py), said before and after: IJB-C's files take minutes."""
    console.print(f"reading the {files.name} protocol in {files.root} ...", soft_wrap=True)
    start = time.perf_counter()
    protocol = read_ijb(files)
    console.print(f"{files.name}: {len(protocol.names)} faces, {len(protocol.template_ids)} templates, "
                  f"{len(protocol.labels)} pairs ({int(protocol.labels.sum())} genuine), read in "
                  f"{time.perf_counter() - start:.1f} s", soft_wrap=True)
    return protocol


def verify(protocol: IjbProtocol, embed: Callable[[torch.Tensor], torch.Tensor], device: torch.device, size: int,
           batch_size: int, max_pixels: int, num_workers: int = 2,
           fars: tuple[float, ...] = IJB_FARS) -> tuple[np.ndarray, dict[str, Any]]:
    """Every face embedded into its template (`embed_templates`), every template pair scored, the TAR@FAR table:
    (the cosine score of each pair in the pair file's order, the table of eval/ijb.py's tar_at_far_table)."""
    sums = embed_templates(embed, device, protocol, size, batch_size, num_workers, max_pixels)
    console.print(f"scoring {len(protocol.labels)} template pairs ...", soft_wrap=True)
    scores = template_pair_scores(sums.normalized(), protocol.pairs)
    return scores, tar_at_far_table(protocol.labels, scores, fars)


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


def flat_metrics(target: str, table: dict, weights: str, checkpoint: str) -> dict[str, Any]:
    """The table as --json prints it: `ijbc/TAR@FAR=0.0001` (+ `/far`, `/threshold`, `/at_or_below`, ...), plus
    `rows` (what the table is drawn from)."""
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
