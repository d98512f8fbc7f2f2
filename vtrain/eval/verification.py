"""Face verification metrics over genuine / impostor similarity scores: TAR@FAR and best accuracy.

A pair is accepted when its score is strictly above the threshold. For a target FAR x the threshold is the
(k+1)-th highest impostor score with k = floor(x * #impostors), so that at most k impostors pass and the
achieved FAR never exceeds x (face.md §5). FAR x is only resolvable with at least 1/x impostor pairs; below
that the row is flagged instead of pretending a precision the data does not have.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

DEFAULT_FARS = (1e-1, 1e-2, 1e-3)


@dataclass
class TarAtFar:
    far_target: float
    tar: float
    threshold: float
    far_achieved: float
    resolvable: bool
    """False when #impostor pairs < 1/far_target: the data cannot measure this FAR."""


def tar_at_far(genuine: np.ndarray, impostor: np.ndarray, far: float) -> TarAtFar:
    genuine, impostor = np.asarray(genuine, np.float64), np.asarray(impostor, np.float64)
    if len(genuine) == 0 or len(impostor) == 0:
        raise ValueError("need at least one genuine and one impostor score")
    desc = np.sort(impostor)[::-1]
    k = min(int(math.floor(far * len(desc))), len(desc) - 1)
    thr = float(desc[k])
    return TarAtFar(far, float(np.mean(genuine > thr)), thr, float(np.mean(impostor > thr)),
                    len(impostor) * far >= 1.0)


def best_accuracy(genuine: np.ndarray, impostor: np.ndarray) -> tuple[float, float]:
    """Best balanced accuracy over thresholds: max_t (TAR(t) + TRR(t)) / 2, so chance is 0.5 however unbalanced
    the pairs are (sampled impostor pairs outnumber genuine ones ~50:1). Equals plain accuracy on balanced
    protocols such as LFW's. Returns (accuracy, threshold)."""
    g, i = np.sort(np.asarray(genuine, np.float64)), np.sort(np.asarray(impostor, np.float64))
    cand = np.concatenate([[-np.inf], np.unique(np.concatenate([g, i]))])
    tp = len(g) - np.searchsorted(g, cand, side="right")  # genuine strictly above t
    tn = np.searchsorted(i, cand, side="right")  # impostors at or below t
    acc = 0.5 * (tp / len(g) + tn / len(i))
    best = int(np.argmax(acc))
    return float(acc[best]), float(cand[best])


def verification_metrics(scores: np.ndarray, same: np.ndarray, fars: tuple[float, ...] = DEFAULT_FARS) -> dict:
    """All verification numbers as one flat dict (for eval.jsonl / --json) plus detailed rows."""
    scores, same = np.asarray(scores, np.float64), np.asarray(same, bool)
    gen, imp = scores[same], scores[~same]
    rows = [tar_at_far(gen, imp, f) for f in fars]
    acc, acc_thr = best_accuracy(gen, imp)
    out: dict = {"balanced_accuracy": acc, "accuracy_threshold": acc_thr, "genuine_pairs": int(len(gen)),
                 "impostor_pairs": int(len(imp))}
    for r in rows:
        key = f"TAR@FAR={r.far_target:g}"
        out[key] = r.tar
        out[f"{key}/threshold"] = r.threshold
        out[f"{key}/resolvable"] = r.resolvable
    out["rows"] = [asdict(r) for r in rows]
    return out
