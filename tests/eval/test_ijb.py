"""IJB metric functions (vtrain/eval/ijb.py) against brute-force computations from their definitions: template pooling
as eval_ijbc.py writes it (a loop over templates and media), the ROC curve of sklearn's roc_curve (every distinct
score, collinear points dropped), the nearest-point and at-or-below TAR rules; chunked scores and bounded memory."""

import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vtrain.eval.ijb import TemplateSums, pooling_weights, roc_curve, tar_at_far_table, template_pair_scores


def pooled_by_loops(feats, scores, template, media):
    """eval_ijbc.py's image2template_feature, written as its loops read: per template, the mean of each media's
    score-weighted features, summed over media, then L2-normalised."""
    out = {}
    for t in np.unique(template):
        f = feats[template == t] * scores[template == t, None]
        m = media[template == t]
        total = sum(f[m == u].mean(0) for u in np.unique(m))
        out[t] = total / np.linalg.norm(total) if np.linalg.norm(total) > 0 else total
    return np.stack([out[t] for t in np.unique(template)])


def full_roc(labels, scores):
    """Every distinct score as a threshold (accept >= t), from the highest, then sklearn's drop of points whose
    neighbours make a straight line with them, (0, 0) first."""
    pts = [(0, 0)]
    for t in np.unique(scores)[::-1]:
        pts.append((int(np.sum(scores[~labels] >= t)), int(np.sum(scores[labels] >= t))))
    fp, tp = np.array(pts[1:]).T
    if len(fp) > 2:
        keep = [True] + [(fp[i + 1] - fp[i]) != (fp[i] - fp[i - 1]) or (tp[i + 1] - tp[i]) != (tp[i] - tp[i - 1])
                         for i in range(1, len(fp) - 1)] + [True]
        fp, tp = fp[keep], tp[keep]
    return np.r_[0, fp] / (~labels).sum(), np.r_[0, tp] / labels.sum()


@pytest.mark.parametrize("seed", range(4))
def test_pooling_equals_the_loops(seed):
    rng = np.random.default_rng(seed)
    n, dim = 300, 16
    template = rng.integers(0, 40, n) * 7 + 3  # template ids, not indices
    media = rng.integers(0, 5, n) + 100 * (rng.random(n) < 0.3)
    scores = rng.uniform(0, 1, n).astype(np.float32)
    scores[template == template[0]] = 0  # a template of zero scores stays zero
    feats = rng.normal(size=(n, dim)).astype(np.float32)
    ids, index = np.unique(template, return_inverse=True)
    weights = pooling_weights(index, media, scores)
    sums = TemplateSums(len(ids), dim)
    order = rng.permutation(n)  # any order and batching
    for batch in np.array_split(order, 7):
        sums.add(index[batch], weights[batch], feats[batch])
    got, want = sums.normalized(), pooled_by_loops(feats, scores, template, media)
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert not got[np.searchsorted(ids, template[0])].any()


def test_pair_scores_in_chunks_equal_one_pass():
    rng = np.random.default_rng(0)
    t = rng.normal(size=(50, 8))
    t /= np.linalg.norm(t, axis=1, keepdims=True)
    pairs = rng.integers(0, 50, (1001, 2)).astype(np.int32)
    want = (t[pairs[:, 0]] * t[pairs[:, 1]]).sum(1)
    for chunk in (1, 7, 1000, 5000):
        np.testing.assert_allclose(template_pair_scores(t, pairs, chunk, "gather"), want, atol=1e-15)
    np.testing.assert_allclose(template_pair_scores(t, pairs, method="blocks"), want, atol=1e-15)
    assert template_pair_scores(t, pairs[:10]).tolist() == template_pair_scores(t, pairs[:10], method="gather").tolist()


@settings(deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(-6, 6)), min_size=2, max_size=60))
def test_roc_and_both_tar_rules_equal_their_definitions(points):
    labels = np.array([p[0] for p in points])
    scores = np.array([p[1] / 3 for p in points], np.float64)  # few distinct values: ties and straight runs
    if labels.all() or not labels.any():
        with pytest.raises(ValueError):
            roc_curve(labels, scores)
        return
    fpr, tpr, thr, genuine, impostors = roc_curve(labels, scores)
    want_fpr, want_tpr = full_roc(labels, scores)
    np.testing.assert_array_equal(fpr, want_fpr)
    np.testing.assert_array_equal(tpr, want_tpr)
    assert thr[0] == np.inf and (genuine, impostors) == (labels.sum(), (~labels).sum())
    fars = (1e-3, 0.05, 0.1, 0.25, 0.5)
    table = tar_at_far_table(labels, scores, fars)
    for row, x in zip(table["rows"], fars):
        # eval_ijbc.py: on the flipped curve, min over (|fpr - x|, index)
        ff, tf = fpr[::-1], tpr[::-1]
        _, i = min(zip(np.abs(ff - x), range(len(ff))))
        assert row["tar"] == tf[i] and row["far"] == ff[i]
        # at or below: the best of every threshold whose FAR does not exceed x
        best = max((np.mean(scores[labels] >= t), np.mean(scores[~labels] >= t))
                   for t in np.r_[np.inf, np.unique(scores)] if np.mean(scores[~labels] >= t) <= x)
        assert row["tar_at_or_below"] == pytest.approx(best[0]) and row["far_at_or_below"] <= x
        assert row["resolvable"] == (impostors * x >= 1)
    assert table["auc"] == pytest.approx(np.trapezoid(tpr, fpr))


def test_nearest_point_can_lie_above_the_target_and_at_or_below_never_does():
    # 10 impostors: FAR moves in steps of 0.1; at x = 0.14 the nearest point is 0.1, at x = 0.16 it is 0.2
    labels = np.array([True] * 4 + [False] * 10)
    scores = np.r_[[0.9, 0.8, 0.7, 0.6], np.linspace(0.95, 0.05, 10)]
    rows = tar_at_far_table(labels, scores, (0.14, 0.16))["rows"]
    assert rows[0]["far"] == pytest.approx(0.1) and rows[1]["far"] == pytest.approx(0.2)
    assert rows[1]["far_at_or_below"] == pytest.approx(0.1) and rows[1]["tar_at_or_below"] < rows[1]["tar"]


def test_scores_and_table_in_bounded_memory():
    """1M pairs of 64-d templates: the scores hold a block (<= 32 MiB) and the pairs' order at a time besides the
    result, the table a few arrays of one entry per pair (traced by tracemalloc: numpy reports its buffers)."""
    rng = np.random.default_rng(0)
    t = rng.normal(size=(2000, 64))
    t /= np.linalg.norm(t, axis=1, keepdims=True)
    pairs = rng.integers(0, 2000, (1_000_000, 2)).astype(np.int32)
    labels = rng.random(1_000_000) < 0.01
    tracemalloc.start()
    try:
        scores = template_pair_scores(t, pairs)
        scoring_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        tar_at_far_table(labels, scores)
        table_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert scoring_peak < 8e6 * 3 + 2 * 256 * 2000 * 8  # result, order, block ids + a block's products
    assert table_peak < 60e6  # about 6 arrays of 1M float64 / int64; a pairs x pairs matrix would be 8 TB
