"""Face verification metrics: TAR@FAR and best balanced accuracy over genuine / impostor similarity scores, and
the standard 10-fold accuracy of insightface's `.bin` packs (LFW, CFP-FP, AgeDB-30).

A pair is accepted when its score is strictly above the threshold. For a target FAR x the threshold is the
(k+1)-th highest impostor score with k = floor(x * #impostors), so that at most k impostors pass and the
achieved FAR never exceeds x (docs/face.md §5). FAR x is only resolvable with at least 1/x impostor pairs; below
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


# ---- the insightface / LFW 10-fold protocol (docs/face.md §1.5) -----------------------------------------------------------
KFOLD_THRESHOLDS = np.arange(0, 4, 0.01)
"""Squared-Euclidean distance thresholds of unit embeddings (range 0..4), as insightface's verification.py."""


def kfold_splits(n: int, n_folds: int = 10) -> list[np.ndarray]:
    """Contiguous folds as sklearn's KFold(n_folds, shuffle=False): the first n % n_folds folds hold one more."""
    if n < n_folds:
        raise ValueError(f"{n} pairs cannot be split into {n_folds} folds")
    sizes = np.full(n_folds, n // n_folds)
    sizes[: n % n_folds] += 1
    return np.split(np.arange(n), np.cumsum(sizes)[:-1])


@dataclass
class KFoldAccuracy:
    mean: float
    std: float
    """Population std over the folds (numpy's default, as insightface reports it)."""
    folds: list[float]
    thresholds: list[float]
    """Distance threshold chosen on the other folds, one per held-out fold."""


def kfold_accuracy(dist: np.ndarray, same: np.ndarray, n_folds: int = 10,
                   thresholds: np.ndarray = KFOLD_THRESHOLDS) -> KFoldAccuracy:
    """Accuracy of `same = dist < threshold` with the threshold picked on n_folds - 1 folds (the first best one)
    and scored on the held-out fold, for every fold (insightface eval/verification.py calculate_roc)."""
    dist, same = np.asarray(dist, np.float64), np.asarray(same, bool)
    folds = kfold_splits(len(dist), n_folds)
    # correct[f, t]: pairs of fold f classified correctly at threshold t; one pass per fold over sorted distances
    correct = np.empty((n_folds, len(thresholds)), np.int64)
    for f, idx in enumerate(folds):
        d_gen, d_imp = np.sort(dist[idx][same[idx]]), np.sort(dist[idx][~same[idx]])
        accepted_gen = np.searchsorted(d_gen, thresholds, side="left")  # dist < t
        rejected_imp = len(d_imp) - np.searchsorted(d_imp, thresholds, side="left")  # dist >= t
        correct[f] = accepted_gen + rejected_imp
    sizes = np.array([len(i) for i in folds])
    accs, chosen = [], []
    for f in range(n_folds):
        train_acc = (correct.sum(0) - correct[f]) / (sizes.sum() - sizes[f])
        best = int(np.argmax(train_acc))
        chosen.append(float(thresholds[best]))
        accs.append(float(correct[f, best] / sizes[f]))
    return KFoldAccuracy(float(np.mean(accs)), float(np.std(accs)), accs, chosen)


def pack_metrics(emb1: np.ndarray, emb2: np.ndarray, same: np.ndarray, fars: tuple[float, ...] = DEFAULT_FARS) -> dict:
    """A `.bin` pack's numbers from the L2-normalised embeddings of its pairs: 10-fold accuracy on squared
    Euclidean distance plus TAR@FAR / balanced accuracy on cosine similarity (= 1 - dist / 2 for unit vectors)."""
    emb1, emb2 = np.asarray(emb1, np.float64), np.asarray(emb2, np.float64)
    dist = np.square(emb1 - emb2).sum(1)
    k = kfold_accuracy(dist, same)
    out = {"acc": k.mean, "acc_std": k.std, "acc_threshold": float(np.mean(k.thresholds))}
    out.update(verification_metrics((emb1 * emb2).sum(1), same, fars))
    return out
