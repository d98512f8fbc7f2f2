"""IJB-B / IJB-C 1:1 verification numbers as insightface's `arcface_torch/eval_ijbc.py` computes them (docs/face.md
§7), pure functions over arrays; in bounded memory at IJB-C's size (469,375 faces, 23,124 templates, 15,658,489
pairs).

- **Face features**: the embedding of the aligned crop plus that of its mirror image, not normalised (the norm
  acts as a quality weight), times the detector's faceness score.
- **Templates**: within a template the faces of one media (a photo, or the frames of one video) are averaged, the
  media are summed, and the sum is L2-normalised. Both steps are linear, so a template is the sum over its faces
  of score / (faces of that media in that template) x feature: `pooling_weights` gives those factors and
  `TemplateSums` adds faces in any order and batch (no per-template loop over the faces, and the faces' features
  need not be held at all).
- **Scores**: the cosine of the two templates of every pair, a block at a time (no template x template matrix).
- **TAR@FAR**: on the ROC curve as `sklearn.metrics.roc_curve(labels, scores)` makes it (a point per distinct score,
  accepted when score >= threshold; collinear points dropped, `drop_intermediate=True`), the point whose FAR is
  nearest the target (the first such point from the high-FAR end, i.e. the highest TAR among equally near points):
  eval_ijbc.py's rule, which is not interpolated and can lie above the target. Beside it, the TAR of the best
  operating point whose FAR does not exceed the target (vtrain's rule for the other protocols, docs/face.md §5).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

IJB_FARS = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1)
"""The FARs of eval_ijbc.py's table."""


def pooling_weights(template: np.ndarray, media: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """Per face: its faceness score divided by the number of faces of its (template, media), in float64. A
    template is then sum_i weight_i x feature_i (module docstring)."""
    template, media = np.asarray(template, np.int64), np.asarray(media, np.int64)
    order = np.lexsort((media, template))
    t, m = template[order], media[order]
    starts = np.flatnonzero(np.r_[True, (t[1:] != t[:-1]) | (m[1:] != m[:-1])])
    counts = np.diff(np.r_[starts, len(order)])
    per_face = np.empty(len(order), np.int64)
    per_face[order] = np.repeat(counts, counts)
    return np.asarray(scores, np.float64) / per_face


class TemplateSums:
    """Template features accumulated from batches of face features (float64)."""

    def __init__(self, num_templates: int, dim: int) -> None:
        self.sums = np.zeros((num_templates, dim), np.float64)

    def add(self, template: np.ndarray, weights: np.ndarray, features: np.ndarray) -> None:
        """Add weight_i x feature_i to template_i for a batch of faces."""
        np.add.at(self.sums, np.asarray(template, np.intp), np.asarray(weights, np.float64)[:, None] *
                  np.asarray(features, np.float64))

    def normalized(self) -> np.ndarray:
        """The L2-normalised templates; one whose sum is zero (every score 0) stays zero (its cosines are 0), as
        sklearn's `normalize` leaves it in eval_ijbc.py."""
        norms = np.linalg.norm(self.sums, axis=1, keepdims=True)
        return np.divide(self.sums, norms, out=np.zeros_like(self.sums), where=norms > 0)


def template_pair_scores(templates: np.ndarray, pairs: np.ndarray, chunk: int = 8192,
                         method: str | None = None) -> np.ndarray:
    """Cosine of every pair of normalised templates (P x 2 indices), in float64 as eval_ijbc.py, never as a
    templates x templates matrix. Two ways, the same numbers up to summation order (~1e-16):
    - "gather": `chunk` pairs at a time, both rows of each pair gathered (2 x chunk x dim floats at a time);
    - "blocks": the pairs grouped by a block of first templates, whose products with all templates come from one
      matrix product (BLAS), at most 2^22 floats at a time (32 MiB).
    The default takes blocks when templates^2 <= 64 x pairs (IJB-C: 23,124^2 = 34 x 15.7M; a block's product
    computes up to 64 unneeded dots per needed one and is still faster, measured in benchmarks/ijb_scale.py),
    else gathers."""
    templates = np.asarray(templates, np.float64)
    n = len(templates)
    if method is None:
        method = "blocks" if n * n <= 64 * len(pairs) else "gather"
    out = np.empty(len(pairs), np.float64)
    if method == "gather":
        for s in range(0, len(pairs), chunk):
            p = pairs[s:s + chunk]
            out[s:s + len(p)] = np.einsum("ij,ij->i", templates[p[:, 0]], templates[p[:, 1]])
        return out
    rows = max(1, min(256, (1 << 22) // max(n, 1)))
    block = pairs[:, 0] // rows
    order = np.argsort(block, kind="stable")
    bounds = np.searchsorted(block[order], np.arange(0, (n + rows - 1) // rows + 1))
    for k in range(len(bounds) - 1):
        sel = order[bounds[k]:bounds[k + 1]]
        if len(sel):
            products = templates[k * rows:(k + 1) * rows] @ templates.T
            out[sel] = products[pairs[sel, 0] - k * rows, pairs[sel, 1]]
    return out


def roc_curve(labels: np.ndarray, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    """(fpr, tpr, thresholds, genuine, impostors) as scikit-learn's `roc_curve(labels, scores)` with its defaults:
    one point per distinct score from the highest (accepted: score >= threshold), collinear points dropped, the
    point (0, 0) with threshold +inf first. Also the counts behind the rates."""
    labels = np.asarray(labels, bool)
    order = np.argsort(scores, kind="stable")[::-1]
    s = np.asarray(scores, np.float64)[order]
    y = labels[order]
    del order
    ends = np.r_[np.flatnonzero(s[1:] != s[:-1]), len(s) - 1]  # last index of each distinct score, descending
    tps = np.cumsum(y, dtype=np.int64)[ends]
    fps = ends + 1 - tps
    thresholds = s[ends]
    if len(fps) > 2:
        keep = np.r_[True, np.logical_or(np.diff(fps, 2) != 0, np.diff(tps, 2) != 0), True]
        tps, fps, thresholds = tps[keep], fps[keep], thresholds[keep]
    tps, fps = np.r_[0, tps], np.r_[0, fps]
    thresholds = np.r_[np.inf, thresholds]
    genuine, impostors = int(tps[-1]), int(fps[-1])
    if genuine == 0 or impostors == 0:
        raise ValueError("need at least one genuine and one impostor pair")
    return fps / impostors, tps / genuine, thresholds, genuine, impostors


@dataclass
class IjbTar:
    far_target: float
    tar: float
    """eval_ijbc.py's TAR: at the ROC point whose FAR is nearest the target."""
    far: float
    """The FAR of that point (may exceed the target)."""
    threshold: float
    """Its score threshold (pairs scoring >= it are accepted)."""
    tar_at_or_below: float
    """The highest TAR with FAR <= target (no point is above the target)."""
    far_at_or_below: float
    resolvable: bool
    """False when #impostor pairs < 1/far_target: the data cannot measure this FAR."""


def tar_at_far_table(labels: np.ndarray, scores: np.ndarray, fars: tuple[float, ...] = IJB_FARS) -> dict:
    """TAR@FAR rows (both rules, module docstring), the ROC's AUC and the pair counts."""
    fpr, tpr, thr, genuine, impostors = roc_curve(labels, scores)
    # eval_ijbc.py flips the curve (high FAR first) and takes min((|fpr - x|, index)): the first nearest point
    fpr_f, tpr_f, thr_f = fpr[::-1], tpr[::-1], thr[::-1]
    labels, scores = np.asarray(labels, bool), np.asarray(scores, np.float64)
    impostor = np.sort(scores[~labels])[::-1]
    genuine_sorted = np.sort(scores[labels])
    rows = []
    for x in fars:
        i = int(np.argmin(np.abs(fpr_f - x)))
        # at or below x: accept what scores above the (k+1)-th highest impostor, k = floor(x * impostors) (the
        # dropped collinear points matter here, so this is counted on the scores, not read off the curve)
        k = int(np.floor(x * impostors))
        cut = impostor[k] if k < impostors else -np.inf
        tar_below = (genuine - np.searchsorted(genuine_sorted, cut, side="right")) / genuine
        far_below = int(np.searchsorted(-impostor, -cut, side="left")) / impostors
        rows.append(IjbTar(x, float(tpr_f[i]), float(fpr_f[i]), float(thr_f[i]), float(tar_below),
                           float(far_below), impostors * x >= 1.0))
    auc = float(np.sum(np.diff(fpr) * (tpr[1:] + tpr[:-1]) / 2))
    return {"rows": [asdict(r) for r in rows], "auc": auc, "genuine_pairs": genuine, "impostor_pairs": impostors}
