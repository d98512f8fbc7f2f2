import numpy as np
import pytest

from vtrain.eval.verification import best_accuracy, tar_at_far, verification_metrics


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
