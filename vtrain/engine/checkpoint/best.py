"""`--keep-best METRIC`: the checkpoint with the best evaluation value, recorded in <output>/checkpoints/best.json
and kept outside --keep-last pruning (checkpoint.commit's `protect`).

best.json: {"step", "metric" (the key as evaluation names it), "value", "mode" (max|min), "run_id", "checkpoint"}.
It is written by rank 0 only once its checkpoint is complete, so it never names a missing checkpoint of its lineage.
Every field is checked when it is read back (`read`): an edited or foreign file is ignored on resume (with a note)
and an error naming the key for `--best`. A best superseded after its step was saved goes back into --keep-last
pruning at once (`Checkpointer.consider_best`), so no superseded best outlives the run.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from vtrain.engine.checkpoint import format as ckpt
from vtrain.errors import VtrainError
from vtrain.io.records import Record, RecordError, read_json

ALIASES = {"acc": "balanced_accuracy", "accuracy": "balanced_accuracy"}
LOWER_IS_BETTER = ("loss", "error", "err", "eer", "far_achieved")


def _norm(key: str) -> str:
    """Case-insensitive, and `x=1e-3` equals `x=0.001` (verification keys are formatted with :g)."""
    key = key.strip().lower()
    name, eq, value = key.partition("=")
    if eq:
        try:
            return f"{name}={float(value)!r}"
        except ValueError:
            pass
    return ALIASES.get(key, key)


def parse(spec: str) -> tuple[str, str]:
    """`AP` -> ("AP", "max"); `loss` -> ("loss", "min"); `X:min` / `X:max` say it explicitly."""
    name, mode = spec, ""
    if spec.endswith((":min", ":max")):
        name, _, mode = spec.rpartition(":")
    if not mode:
        mode = "min" if any(w in name.lower() for w in LOWER_IS_BETTER) else "max"
    return name, mode


def pick(metrics: dict[str, Any], name: str) -> tuple[str, float | None]:
    """The metric key matching `name` and its value (None when evaluation has no value for it, e.g. APs on a
    set without small objects). A name that matches nothing is a user error listing what exists."""
    want = _norm(name)
    for key, value in metrics.items():
        if _norm(key) == want:
            if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
                return key, None
            return key, float(value) if math.isfinite(value) else None
    numeric = [k for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    raise VtrainError(f"--keep-best {name}: evaluation reports no such metric; choose one of {', '.join(numeric)}")


class BestKeeper:
    def __init__(self, output_dir: Path, spec: str, run_id: str) -> None:
        self.out, self.run_id = Path(output_dir), run_id
        self.name, self.mode = parse(spec)
        self.best: dict[str, Any] | None = None

    @property
    def path(self) -> Path:
        return ckpt.checkpoint_dir(self.out) / ckpt.BEST

    def restore(self, resumed_step: int) -> str | None:
        """On resume: keep the lineage's best when its checkpoint is at or before the resumed step and still
        complete (a later one belongs to the abandoned future of the run). Returns a note for the log."""
        try:
            found = read(self.out)
        except RecordError as e:
            return f"--keep-best: ignoring the earlier record ({e})"
        if found is None or found["run_id"] != self.run_id or found["mode"] != self.mode:
            return None
        if _norm(found["metric"]) != _norm(self.name) and found.get("spec") != self.name:
            return None
        step = found["step"]
        if step > resumed_step or not ckpt.is_checkpoint(ckpt.final_path(self.out, step)):
            return None
        self.best = found
        return f"--keep-best: best so far {found['metric']} = {found['value']:.4g} at step {step}"

    def consider(self, step: int, metrics: dict[str, Any] | None) -> bool:
        """Rank 0, after an evaluation: whether this step is the new best."""
        if metrics is None:
            raise VtrainError(f"--keep-best {self.name}: the run has no evaluation data (give the evaluation "
                              "flags of the task, e.g. --val-data or --val-ann/--val-images)")
        key, value = pick(metrics, self.name)
        if value is None:
            return False
        if self.best is not None:
            old = float(self.best["value"])
            if (value <= old) if self.mode == "max" else (value >= old):
                return False
        self.best = {"step": step, "metric": key, "spec": self.name, "value": value, "mode": self.mode,
                     "run_id": self.run_id, "checkpoint": ckpt.final_path(self.out, step).name}
        return True

    def protect(self) -> tuple[Path, ...]:
        return (ckpt.final_path(self.out, self.best["step"]),) if self.best is not None else ()

    def write(self) -> bool:
        """Rank 0: record the best once its checkpoint is complete (call after every commit and evaluation).
        Returns whether it was written."""
        if self.best is None or not ckpt.is_checkpoint(ckpt.final_path(self.out, self.best["step"])):
            return False
        ckpt.write_json(self.path, self.best)
        return True


def read(output_dir: Path) -> dict[str, Any] | None:
    """checkpoints/best.json of a run, every field checked (a RecordError names the key); None when absent."""
    path = ckpt.checkpoint_dir(output_dir) / ckpt.BEST
    if not path.exists():
        return None
    r = Record(read_json(path), path)
    r.int("step")
    r.str("metric")
    r.number("value")
    r.str("mode", ("max", "min"))
    r.str("run_id")
    r.str("spec", default=None)
    return r.data


def best_checkpoint(run_dir: str | Path, flag: str) -> Path:
    """For `--best`: the checkpoint that checkpoints/best.json of a run directory names, verified."""
    run = Path(run_dir)
    if ckpt.is_checkpoint(run):
        raise VtrainError(f"{flag} --best: give the run directory, not the checkpoint {run}")
    try:
        found = read(run)
    except RecordError as e:
        raise VtrainError(f"{flag} --best: {e}") from None
    if found is None:
        raise VtrainError(f"{flag} --best: {ckpt.checkpoint_dir(run) / ckpt.BEST} is missing or unreadable (was the "
                          "run trained with --keep-best?)")
    path = ckpt.final_path(run, found["step"])
    if not ckpt.is_checkpoint(path):
        raise VtrainError(f"{flag} --best: {ckpt.BEST} names {path.name}, which is not a complete checkpoint")
    ckpt.verify_or_raise(path, flag)
    return path
