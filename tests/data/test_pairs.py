"""Held-out verification pairs (vtrain/data/pairs.py): exactly every pair when the caps allow, else a seeded
uniform sample without duplicates; never an enumeration of all n(n-1)/2 pairs (memory measured at 32,000 images).
"""

from __future__ import annotations

import itertools
import tracemalloc

import numpy as np
import pytest

from vtrain.data.pairs import sample_pairs


def every_pair(labels) -> tuple[set, set]:
    """Genuine and impostor pairs (i < j) by brute force."""
    gen, imp = set(), set()
    for i, j in itertools.combinations(range(len(labels)), 2):
        (gen if labels[i] == labels[j] else imp).add((i, j))
    return gen, imp


def split(pairs: np.ndarray, same: np.ndarray) -> tuple[list, list]:
    return [tuple(p) for p in pairs[same].tolist()], [tuple(p) for p in pairs[~same].tolist()]


LAYOUTS = {
    "empty": [],
    "one-image": [4],
    "one-identity": [0, 0, 0, 0, 0],
    "singletons": [3, 1, 2, 0],
    "interleaved": [1, 0, 1, 2, 0, 1, 2, 2, 0],
    "unsorted-sparse-ids": [90, 7, 7, 1000, 90, 7, 5],
    "one-large-many-small": [0] * 12 + list(range(1, 9)),
}


@pytest.mark.parametrize("labels", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_below_the_caps_every_pair_once_in_index_order(labels):
    gen, imp = every_pair(labels)
    pairs, same = sample_pairs(labels, 10**6, seed=3, max_genuine=10**6)
    assert pairs.dtype == np.int64 and pairs.shape == (len(gen) + len(imp), 2)
    g, i = split(pairs, same)
    assert g == sorted(gen) and i == sorted(imp)  # each kind complete, in (i, j) order, genuine first
    assert same.tolist() == [True] * len(gen) + [False] * len(imp)


@pytest.mark.parametrize("labels,max_genuine,max_impostor", [
    (LAYOUTS["interleaved"], 4, 7),
    (LAYOUTS["one-large-many-small"], 10, 40),   # 66 genuine, 124 impostor: drawn from a permutation
    ([i // 3 for i in range(300)], 50, 100),     # 300 genuine, 44,550 impostor: drawn by rejection
    ([0] * 500 + [1], 30, 20),                   # 124,750 genuine, 500 impostor
])
def test_above_a_cap_a_sample_of_that_many_distinct_pairs_of_the_right_kind(labels, max_genuine, max_impostor):
    gen, imp = every_pair(labels)
    pairs, same = sample_pairs(labels, max_impostor, seed=11, max_genuine=max_genuine)
    g, i = split(pairs, same)
    assert len(g) == min(max_genuine, len(gen)) and len(i) == min(max_impostor, len(imp))
    assert len(set(g)) == len(g) and len(set(i)) == len(i)  # no duplicates
    assert set(g) <= gen and set(i) <= imp  # no same-identity impostor, no cross-identity genuine pair
    assert g == sorted(g) and i == sorted(i)
    again = sample_pairs(labels, max_impostor, seed=11, max_genuine=max_genuine)
    assert np.array_equal(again[0], pairs) and np.array_equal(again[1], same)  # every rank, every evaluation
    other = sample_pairs(labels, max_impostor, seed=12, max_genuine=max_genuine)[0]
    assert not np.array_equal(other, pairs)


@pytest.mark.parametrize("labels,cap", [
    ([0, 0, 0, 1, 1, 2, 3, 3, 3, 3], 9),  # 36 impostor pairs, 4 x cap: the permutation path
    ([0] * 6 + [1] * 3 + [2] * 2 + [3] * 9 + [4], 12),  # 150 impostor pairs: the rejection path
])
def test_impostor_samples_are_uniform_over_pairs_and_over_identity_pairs(labels, cap):
    """Over 4,000 seeds every impostor pair is drawn cap/I of the time, so an identity pair (a, b) takes
    c_a * c_b / I of the sample: the old sampler's law (a uniform subset of the enumerated list). The seeds are
    fixed, so the test is deterministic; the bounds are 5 standard deviations of a binomial count."""
    _, imp = every_pair(labels)
    imp = sorted(imp)
    seeds = 4000
    hits = dict.fromkeys(imp, 0)
    for seed in range(seeds):
        pairs, same = sample_pairs(labels, cap, seed=seed, max_genuine=1)
        for p in map(tuple, pairs[~same].tolist()):
            hits[p] += 1
    p = cap / len(imp)
    sd = (seeds * p * (1 - p)) ** 0.5
    assert all(abs(h - seeds * p) < 5 * sd for h in hits.values()), (min(hits.values()), max(hits.values()))
    counts = np.bincount(labels)
    by_identity: dict = {}
    for (i, j), h in hits.items():
        key = tuple(sorted((labels[i], labels[j])))
        by_identity[key] = by_identity.get(key, 0) + h
    for (a, b), h in by_identity.items():
        share = counts[a] * counts[b] / len(imp)
        expect, sd = seeds * cap * share, (seeds * cap * share * (1 - share)) ** 0.5
        assert abs(h - expect) < 5 * sd, ((a, b), h, expect)


def test_genuine_samples_are_uniform_over_pairs():
    labels = [0] * 8 + [1] * 4  # 28 + 6 genuine pairs, 5 drawn: the big identity's share is 28/34, not 1/2
    gen, _ = every_pair(labels)
    seeds, cap = 3000, 5
    hits = dict.fromkeys(sorted(gen), 0)
    for seed in range(seeds):
        pairs, same = sample_pairs(labels, 1, seed=seed, max_genuine=cap)
        for q in map(tuple, pairs[same].tolist()):
            hits[q] += 1
    p = cap / len(gen)
    sd = (seeds * p * (1 - p)) ** 0.5
    assert all(abs(h - seeds * p) < 5 * sd for h in hits.values())


@pytest.mark.parametrize("identities", [4000, 16000, 2, 1])  # 8 images each; 2 each; 16,000 each; one of 32,000
def test_32000_images_sample_in_bounded_memory(identities):
    """32,000 held-out images have 512 million pairs (8 GB of int64 index pairs when enumerated); sampling holds
    a few arrays of one entry per image and per pair returned. numpy's buffers are traced by tracemalloc."""
    n = 32000
    labels = np.random.default_rng(0).permutation(np.arange(n) % identities)
    tracemalloc.start()
    try:
        pairs, same = sample_pairs(labels, 200_000, seed=0, max_genuine=200_000)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    genuine = n * (n // identities - 1) // 2
    assert int(same.sum()) == min(genuine, 200_000) and int((~same).sum()) == min(n * (n - 1) // 2 - genuine, 200_000)
    assert np.array_equal(same, labels[pairs[:, 0]] == labels[pairs[:, 1]])
    assert len(np.unique(pairs[:, 0] * n + pairs[:, 1])) == len(pairs)
    assert peak < 200 * 2**20, f"{peak / 2**20:.0f} MB"


def test_a_malformed_pairs_line_is_one_bounded_line(tmp_path):
    """A pairs file (`path1 path2 0|1` per line) whose line is malformed names the file and line, and shows the line
    bounded: a 1 MB line is not echoed whole."""
    from vtrain.data.faces import read_pairs
    from vtrain.errors import VtrainError

    pairs = tmp_path / "pairs.txt"
    pairs.write_text("# comment\n" + "a.jpg b.jpg " + "x" * 2**20 + "\n")
    with pytest.raises(VtrainError, match=r"pairs\.txt:2: expected 'path1 path2 0\|1', got 'a\.jpg b\.jpg x+\.\.\.") as e:
        read_pairs(pairs)
    assert len(str(e.value)) < 200 + len(str(pairs))
