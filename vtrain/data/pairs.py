"""Verification pairs over a labelled image list (held-out identities), sampled without enumerating them.

n images have n(n-1)/2 pairs: 16,000 held-out images are 128 million, 2 GB as an index array, on every rank.
Instead the pairs of each kind are numbered in one fixed order and only the numbers drawn are turned into
(i, j): work and memory follow the number of images and the pairs returned, never the number of pairs.

- Order: images are sorted by identity (stably), so identity k holds the positions [s_k, e_k). Its genuine
  pairs are numbered within the block in triangle order (b, a) with a < b; its impostor pairs, counted once
  from the earlier block, are (p, q) with p in [s_k, e_k) and q in [e_k, n): (e_k - s_k) * (n - e_k) of them,
  numbered row by row. Per-identity cumulative counts turn a pair number into (k, offset) with one search.
- Draw: a kind with at most `cap` pairs is taken whole; else `cap` distinct numbers are drawn uniformly (every
  subset of `cap` pairs equally likely, the statistics of sampling the enumerated list without replacement),
  from one seeded generator, so every rank and every evaluation gets the same pairs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_DENSE = 4
"""Draw by a permutation of all numbers when there are at most this many times `cap` of them (rejection would
redraw often); above, redraw duplicates, which then stay below 1/_DENSE of the draws."""


def sample_pairs(labels: Sequence[int] | np.ndarray, max_impostor: int, seed: int = 0,
                 max_genuine: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Genuine pairs (same label; all, or a seeded uniform sample of `max_genuine`) and impostor pairs (all, or
    a seeded uniform sample of `max_impostor`) of a labelled image list.

    Returns `pairs` (P, 2) int64 with pairs[:, 0] < pairs[:, 1], genuine ones first, each kind in (i, j) order,
    no pair twice, and `same` (P,) bool. Memory: O(len(labels) + P)."""
    labels = np.asarray(labels)
    n = len(labels)
    order = np.argsort(labels, kind="stable")
    _, counts = np.unique(labels[order], return_counts=True)
    ends = np.cumsum(counts)
    starts = ends - counts
    rng = np.random.default_rng(seed)
    gen = _draw(counts * (counts - 1) // 2, max_genuine, rng)
    imp = _draw(counts * (n - ends), max_impostor, rng)
    gen_pos = _genuine(gen, starts, counts * (counts - 1) // 2)
    imp_pos = _impostor(imp, starts, ends, n, counts * (n - ends))
    out = []
    for pos in (gen_pos, imp_pos):
        pairs = np.sort(order[pos], axis=1)  # positions back to image indices, smaller index first
        out.append(pairs[np.lexsort((pairs[:, 1], pairs[:, 0]))])
    return (np.concatenate(out).astype(np.int64).reshape(-1, 2),
            np.concatenate([np.ones(len(out[0]), bool), np.zeros(len(out[1]), bool)]))


def _draw(per_identity: np.ndarray, cap: int | None, rng: np.random.Generator) -> np.ndarray:
    """Pair numbers in [0, sum(per_identity)): all of them, or `cap` distinct ones drawn uniformly."""
    total = int(per_identity.sum())
    if cap is None or total <= cap:
        return np.arange(total, dtype=np.int64)
    if total <= _DENSE * cap:
        return np.sort(rng.permutation(total)[:cap])
    picked = np.empty(0, np.int64)
    while len(picked) < cap:  # the first `cap` distinct values of a uniform stream: a uniform cap-subset
        draws = np.concatenate([picked, rng.integers(0, total, cap - len(picked) + cap // 8 + 16)])
        _, first = np.unique(draws, return_index=True)
        picked = draws[np.sort(first)][:cap]
    return np.sort(picked)


def _locate(numbers: np.ndarray, per_identity: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(identity, offset within that identity's pairs) of each pair number."""
    cum = np.cumsum(per_identity)
    k = np.searchsorted(cum, numbers, side="right")
    return k, numbers - (cum[k] - per_identity[k])


def _genuine(numbers: np.ndarray, starts: np.ndarray, per_identity: np.ndarray) -> np.ndarray:
    """Positions (s + a, s + b), a < b, of genuine pair r = b(b-1)/2 + a within its identity's block."""
    k, r = _locate(numbers, per_identity)
    b = ((1 + np.sqrt(1 + 8 * r.astype(np.float64))) / 2).astype(np.int64)
    b -= b * (b - 1) // 2 > r  # the float root may land one off either way
    b += (b + 1) * b // 2 <= r
    a = r - b * (b - 1) // 2
    return np.stack([starts[k] + a, starts[k] + b], 1)


def _impostor(numbers: np.ndarray, starts: np.ndarray, ends: np.ndarray, n: int,
              per_identity: np.ndarray) -> np.ndarray:
    """Positions (p, q) of impostor pair r: p in identity k's block, q in the blocks after it (row by row)."""
    k, r = _locate(numbers, per_identity)
    width = n - ends[k]  # > 0 wherever a number falls: a block with no later block has no impostor pairs
    return np.stack([starts[k] + r // width, ends[k] + r % width], 1)
