import numpy as np
import pytest

from vtrain.eval.verification import (best_accuracy, kfold_accuracy, kfold_splits, pack_metrics, tar_at_far,
                                     verification_metrics)


def brute_tar_at_far(gen, imp, far):
    """Highest TAR over every threshold whose FAR (score > t) does not exceed the target."""
    best = 0.0
    for t in np.concatenate([[-np.inf], gen, imp]):
        if np.mean(imp > t) <= far:
            best = max(best, np.mean(gen > t))
    return best


def brute_accuracy(gen, imp):
    return max(0.5 * (np.mean(gen > t) + np.mean(imp <= t)) for t in np.concatenate([[-np.inf], gen, imp]))


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("far", [0.1, 0.01, 0.003])
def test_tar_at_far_matches_brute_force(seed, far):
    rng = np.random.default_rng(seed)
    gen = rng.normal(0.6, 0.2, 150).round(2)  # rounding creates ties
    imp = rng.normal(0.1, 0.2, 700).round(2)
    r = tar_at_far(gen, imp, far)
    assert r.tar == pytest.approx(brute_tar_at_far(gen, imp, far))
    assert r.far_achieved <= far
    assert np.mean(imp > r.threshold) == r.far_achieved


@pytest.mark.parametrize("seed", range(5))
def test_best_accuracy_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    gen, imp = rng.normal(0.5, 0.2, 80).round(2), rng.normal(0.0, 0.3, 300).round(2)
    acc, thr = best_accuracy(gen, imp)
    assert acc == pytest.approx(brute_accuracy(gen, imp))
    assert 0.5 * (np.mean(gen > thr) + np.mean(imp <= thr)) == pytest.approx(acc)


def test_unresolvable_far_is_flagged_and_perfect_separation():
    gen, imp = np.linspace(0.8, 0.9, 20), np.linspace(-0.5, 0.5, 50)
    m = verification_metrics(np.concatenate([gen, imp]), np.r_[np.ones(20, bool), np.zeros(50, bool)])
    assert m["TAR@FAR=0.1"] == 1.0 and m["TAR@FAR=0.1/resolvable"] is True
    assert m["TAR@FAR=0.001/resolvable"] is False  # 50 impostor pairs cannot measure FAR 1e-3
    assert m["balanced_accuracy"] == 1.0
    assert m["genuine_pairs"] == 20 and m["impostor_pairs"] == 50


def test_chance_scores_give_chance_accuracy():
    rng = np.random.default_rng(0)
    gen, imp = rng.random(5000), rng.random(20000)
    assert best_accuracy(gen, imp)[0] < 0.53
    assert tar_at_far(gen, imp, 0.1).tar == pytest.approx(0.1, abs=0.02)


def brute_kfold(dist, same, n_folds=10):
    """LFW/insightface protocol straight from its definition: contiguous folds, the first n % 10 one larger;
    per fold, the first threshold of arange(0, 4, 0.01) with the best accuracy of `dist < t` on the other folds."""
    n = len(dist)
    bounds = np.cumsum([0] + [n // n_folds + (f < n % n_folds) for f in range(n_folds)])
    accs = []
    for f in range(n_folds):
        test = np.zeros(n, bool)
        test[bounds[f]:bounds[f + 1]] = True
        best_t, best_acc = None, -1.0
        for t in np.arange(0, 4, 0.01):
            acc = np.mean((dist[~test] < t) == same[~test])
            if acc > best_acc:
                best_t, best_acc = t, acc
        accs.append(np.mean((dist[test] < best_t) == same[test]))
    return np.mean(accs), np.std(accs)


def test_kfold_splits_like_sklearn():
    folds = kfold_splits(103)
    assert [len(f) for f in folds] == [11, 11, 11] + [10] * 7
    assert np.array_equal(np.concatenate(folds), np.arange(103))


@pytest.mark.parametrize("seed", range(3))
def test_kfold_accuracy_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = 203 + seed  # uneven folds
    same = rng.random(n) < 0.5
    dist = np.where(same, rng.normal(0.9, 0.35, n), rng.normal(1.5, 0.35, n)).clip(0, 4).round(2)  # grid ties
    k = kfold_accuracy(dist, same)
    mean, std = brute_kfold(dist, same)
    assert k.mean == pytest.approx(mean) and k.std == pytest.approx(std)
    assert 0.75 < k.mean < 1.0 and len(k.folds) == 10


def test_pack_metrics_from_embeddings():
    rng = np.random.default_rng(0)
    e = rng.normal(size=(400, 16))
    e /= np.linalg.norm(e, axis=1, keepdims=True)
    same = np.arange(200) % 2 == 0
    e2 = e[1::2].copy()
    e2[same] = e[0::2][same] + 0.3 * rng.normal(size=(same.sum(), 16))  # genuine pairs: close
    e2 /= np.linalg.norm(e2, axis=1, keepdims=True)
    m = pack_metrics(e[0::2], e2, same)
    assert m["acc"] == pytest.approx(kfold_accuracy(((e[0::2] - e2) ** 2).sum(1), same).mean)
    assert m["acc"] > 0.95 and m["acc_std"] < 0.1 and m["genuine_pairs"] == 100 and m["impostor_pairs"] == 100
    assert m["TAR@FAR=0.1"] == verification_metrics((e[0::2] * e2).sum(1), same)["TAR@FAR=0.1"]
