"""The fuzz lane for the JSON records a checkpoint and a run hold (docs/testing.md, "The fuzz lane"):
`train_state.json`, the `COMPLETE` manifest, `checkpoints/best.json` and `categories.json`, each a valid record with
hostile edits (values of other types, huge and non-finite numbers, nesting 100,000 deep, keys deleted or added)
or with its bytes truncated or flipped. Each is read by the reader every command uses (records.py through
engine/checkpoint/format.py and engine/checkpoint/best.py), in this process, and must meet the contract (tests/helpers/fuzz.py):
the record, or one `error:` line by the CLI's own error mapping."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.helpers.fuzz import contract, corrupt, dumps, mutate
from vtrain.engine.checkpoint import best
from vtrain.engine.checkpoint import format as ckpt

pytestmark = pytest.mark.fuzz

TRAIN_STATE = {"step": 12, "consumed_samples": 96, "scheduler": {"base_lrs": [0.001, 0.0001], "last_epoch": 12,
                                                                   "lr_lambdas": [None, None], "_step_count": 13,
                                                                   "_get_lr_called_within_step": False,
                                                                   "_last_lr": [0.001, 0.0001],
                                                                   "verbose": False},
               "skipped_steps": 1, "overflow_skips": 0, "consecutive_nonfinite": 0, "world_size": 2,
               "engine": "deepspeed", "ema": {"decay": 0.999, "warmup": 0, "updates": 11},
               "scaler": {"scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000,
                          "_growth_tracker": 3}}
MANIFEST = {"format": ckpt.FORMAT, "version": 1, "step": 12, "run_id": "3f2a", "time": 1.7e9,
            "files": {"model.safetensors": {"size": 10, "sha256": "ab" * 32},
                      "accelerate/optimizer.bin": {"size": 0, "sha256": "00" * 32}}}
BEST = {"step": 12, "metric": "AP", "value": 0.25, "mode": "max", "run_id": "3f2a", "spec": "AP",
        "checkpoint": "step_12"}
CATEGORIES = [{"id": 1, "name": "person"}, {"id": 3, "name": "car"}, {"id": 90, "name": ""}]


def _read(kind: str, root: Path):
    if kind == "train_state":
        return ckpt.TrainState.read(root)
    if kind == "manifest":
        return ckpt.parse_manifest(root)
    if kind == "best":
        return best.read(root.parent)
    return ckpt.read_categories(root)


RECORDS = {"train_state": (ckpt.TRAIN_STATE, TRAIN_STATE), "manifest": (ckpt.COMPLETE, MANIFEST),
           "best": (ckpt.BEST, BEST), "categories": (ckpt.CATEGORIES, CATEGORIES)}


@given(st.data(), st.sampled_from(sorted(RECORDS)))
def test_checkpoint_records(data, kind):
    name, doc = RECORDS[kind]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "checkpoints"  # best.json lies in checkpoints/, the others in a checkpoint
        root.mkdir()
        raw = dumps(mutate(data, doc)).encode("utf-8", "surrogatepass")
        if data.draw(st.booleans(), label="corrupt"):
            raw = corrupt(data, raw)
        (root / name).write_bytes(raw)
        contract(_read, kind, root, watch=[Path(tmp)], input_bytes=len(raw))
