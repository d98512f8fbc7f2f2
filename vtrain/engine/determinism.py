"""Same seed, same result: the intra-op thread count, `--deterministic`, and the data loader's own generator.

Where runs with one seed went apart (measured, docs/determinism.md §1):
- DataLoader: each loader iterator draws its workers' base seed from the generator it is given, else from the
  global torch generator. That one draw shifted the global stream the model's own random draws follow (DINO's
  denoising noise, drop-path), and it happened at the first batch of a run, so a resumed run drew other noise than
  an uninterrupted one from its first step on. The loader now always has its own generator (`loader_generator`).
- Threads: oneDNN's convolutions and the reductions of many CPU kernels split their work by the intra-op thread
  count, so the sums come out in another order and the last bits differ within a few steps (§1). A
  training run amplifies them: two thread counts give other losses within a few steps and another AP at the end.
- Algorithms: torch.use_deterministic_algorithms refuses (or warns about) the kernels that have no deterministic
  version (§2).
"""

from __future__ import annotations

import os

import numpy as np
import torch

from vtrain.config import RunConfig


def loader_generator(seed: int, rank: int) -> torch.Generator:
    """The DataLoader's own generator, from the run seed and the rank. Its iterator draws the workers' base seed
    from it (torch then seeds each worker's `random`, numpy and torch generators from base + worker id), never
    from the global generator, so the model's random draws do not depend on when or how often a loader iterator
    is made (once per run with persistent workers, once per epoch without). Each rank's workers get their own
    seeds; per-sample augmentation is seeded by (seed, epoch, index) in the datasets themselves."""
    state = np.random.SeedSequence([seed, rank]).generate_state(1, np.uint64)[0]
    return torch.Generator().manual_seed(int(state) & (2**63 - 1))


def keep_from_checkpoint(cfg: RunConfig, saved: RunConfig | None) -> list[str]:
    """On a resume: --deterministic and the thread count are the run's, recorded in its checkpoint's config. A
    checkpoint of a --deterministic run keeps this run deterministic; its thread count is used unless --threads
    says otherwise (then said once, since the losses then differ from an uninterrupted run's). Returns notes."""
    if saved is None:
        return []
    t, s = cfg.train, saved.train
    notes = []
    if s.deterministic and not t.deterministic:
        t.deterministic = True
        notes.append("--deterministic: kept from the checkpoint's run")
    if t.threads == 0:
        t.threads = s.threads
    elif s.threads and t.threads != s.threads:
        notes.append(f"--threads {t.threads} on resume (the checkpoint's run used {s.threads}): the losses will not "
                     "be those of an uninterrupted run bit for bit (docs/determinism.md §2)")
    return notes


def apply(cfg: RunConfig, device: torch.device) -> list[str]:
    """Before anything is built or computed: the intra-op thread count (--threads; under --deterministic the
    count this process runs with when none is given, written into the config before it is saved) and, under
    --deterministic, torch's deterministic mode. Returns the note for the log."""
    t = cfg.train
    if t.deterministic and t.threads == 0:
        t.threads = torch.get_num_threads()  # recorded in config.yaml, so a resume uses the same count
    if t.threads:
        torch.set_num_threads(t.threads)
    if not t.deterministic:
        return []
    # cuBLAS needs a fixed workspace for reproducible results; read at its first use (docs/determinism.md §3)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # On CPU every op vtrain runs has a deterministic version, so a new one that does not is an error, not a silent
    # difference. On GPUs some have none (grid_sample's backward, scatter-adds; vtrain's Triton deformable-attention
    # backward adds with atomics), and refusing them would refuse every DINO run: there torch warns instead.
    strict = device.type == "cpu"
    torch.use_deterministic_algorithms(True, warn_only=not strict)
    # Deterministic mode also fills every new uninitialized tensor with NaN (or an integer's maximum), so that an op
    # that wrongly reads memory it never wrote gives the same result each run. No vtrain op reads such memory (the
    # bit-identical rerun tests would show it), and the fills cost ~3,000 tensor writes per DINO demo step; PyTorch's
    # documentation of `torch.utils.deterministic.fill_uninitialized_memory` says a valid program stays
    # deterministic without them (PT-U in docs/determinism.md §2, §3).
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    where = ("every op deterministic (an op without a deterministic version is an error)" if strict else
             "deterministic algorithms where they exist (atomic adds remain: equal to rounding, not bit for bit)")
    return [f"--deterministic: {t.threads} intra-op threads, {where}, loader workers seeded from --seed and the rank"]
