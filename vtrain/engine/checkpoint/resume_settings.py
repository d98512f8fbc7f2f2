"""The training settings a resumed run changes from its checkpoint's: each one is applied, and said in one log line,
so that the new run's config.yaml is what the run uses (what cannot change, the model, is refused earlier:
engine/checkpoint/content.py).

What a checkpoint would otherwise put back over this run's settings, silently:
- torch's `Optimizer.load_state_dict` (and DeepSpeed's) takes every parameter group's settings from the file: lr,
  weight_decay, betas. The LR is then set from the schedule; weight decay and betas stayed the checkpoint's.
- LambdaLR's state holds its base LRs (the peak LR of each group), so a changed --lr, --backbone-lr-mult or
  --layer-decay was written into config.yaml while the schedule went on from the checkpoint's peak. The shape of
  the schedule (warm-up, decay, horizon) is this run's own lambda in any case.

The choices, per setting:
- peak LRs: applied. The schedule's base LRs become this run's and it continues at the checkpoint's step from
  them: lowering the LR to go on from a checkpoint is ordinary practice. The LR of the first resumed step is
  computed from this run's schedule too (unchanged settings give the checkpoint's value bit for bit).
- weight decay and Adam betas: applied to every parameter group (the sharded head reads them from the config).
- the global batch (--batch-size x --grad-accum x processes): applied. `consumed_samples` counts samples, so the
  data continues where the checkpoint stopped; steps go on being counted, each of the new size.
- EMA decay and warm-up: applied; the average and its update count are the checkpoint's.
- the face head's training (`--arcface-grad`, `--head-update`): applied; the head's state (centres, moments,
  per-row step counts) is the same under both (docs/face_head.md).
"""

from __future__ import annotations

import math
from typing import Any

from vtrain.config import RunConfig

GROUP_SETTINGS = ("weight_decay", "betas")
"""The parameter-group settings vtrain's config decides besides the LR (engine/optim.py)."""


def run_settings(engine: Any, scheduler: Any) -> dict[str, Any]:
    """This run's own settings, as built, taken before the checkpoint is loaded over them."""
    return {"base_lrs": list(scheduler.base_lrs),
            "groups": [{k: _plain(g[k]) for k in GROUP_SETTINGS if k in g} for g in engine.param_groups()]}


def apply(mine: dict[str, Any], engine: Any, scheduler: Any, saved: RunConfig | None, cfg: RunConfig,
          state: Any, world: int) -> list[str]:
    """After the engine and the scheduler were loaded from the checkpoint: put this run's settings back where the
    checkpoint replaced them, set the LRs of the next step, and return one note per kind of change. `saved`: the
    checkpoint's config (None for a checkpoint without one), `state` its TrainState."""
    notes = []
    theirs = [float(x) for x in scheduler.base_lrs]
    if not _same(theirs, mine["base_lrs"]):
        scheduler.base_lrs = list(mine["base_lrs"])
        what = _changed(saved, cfg, "lr", "backbone_lr_mult", "layer_decay") or "peak LR"
        notes.append(f"{what} on resume: the schedule continues at step {state.step} from this run's peak LR "
                     f"{max(mine['base_lrs']):.4g} (the checkpoint's: {max(theirs):.4g})")
    lrs = [base * f(scheduler.last_epoch) for f, base in zip(scheduler.lr_lambdas, scheduler.base_lrs)]
    scheduler._last_lr = lrs  # what get_last_lr() and state_dict() give until the next step (LambdaLR's own)
    engine.set_lrs(lrs)
    changed = set()
    for group, want in zip(engine.param_groups(), mine["groups"]):
        for k, v in want.items():
            if _plain(group.get(k)) != v:
                changed.add(k)
                group[k] = tuple(v) if isinstance(v, list) else v
    if changed:
        what = _changed(saved, cfg, "weight_decay", "weight_decay_skip", "betas") or ", ".join(sorted(changed))
        notes.append(f"{what} on resume: applied to every parameter group (the checkpoint's optimizer state held "
                     "the old value)")
    if saved is not None:
        notes += _batch_note(saved, cfg, state, world) + head_notes(saved, cfg)
    if state.ema and cfg.train.ema_decay > 0:
        old = (state.ema.get("decay"), state.ema.get("warmup"))
        if old != (cfg.train.ema_decay, cfg.train.ema_warmup):
            notes.append(f"EMA decay/warm-up {old[0]}/{old[1]} -> {cfg.train.ema_decay}/{cfg.train.ema_warmup} on "
                         f"resume: the average goes on from the checkpoint's ({state.ema.get('updates')} updates) "
                         "with the new values")
    return notes


def _batch_note(saved: RunConfig, cfg: RunConfig, state: Any, world: int) -> list[str]:
    s, t = saved.train, cfg.train
    old, new = s.batch_size * s.grad_accum * state.world_size, t.batch_size * t.grad_accum * world
    if old == new:
        return []
    per_micro = t.batch_size * world
    at = state.consumed_samples // per_micro * per_micro  # engine/loader.py starts at whole micro-batches
    return [f"global batch {old} (batch {s.batch_size} x accum {s.grad_accum} x {state.world_size} processes) -> "
            f"{new} (batch {t.batch_size} x accum {t.grad_accum} x {world}) on resume: consumed_samples counts "
            f"samples, so the data goes on at sample {at} of its order ({state.consumed_samples} consumed); steps "
            f"go on from {state.step}, each of {new} samples (--max-steps, --save-every and the LR schedule count "
            "steps)"]


def head_notes(saved: RunConfig, cfg: RunConfig) -> list[str]:
    """One note per face-head training choice that differs from the checkpoint's config."""
    if cfg.task != "metric":
        return []
    out = []
    for name in ("arcface_grad", "head_update"):
        old, new = getattr(saved.model, name), getattr(cfg.model, name)
        if old != new:
            out.append(f"--{name.replace('_', '-')} {old} -> {new} on resume: the head trains on with {new} "
                       "(docs/face_head.md)")
    return out


def _changed(saved: RunConfig | None, cfg: RunConfig, *names: str) -> str:
    """`--lr 0.001 -> 0.5, --weight-decay 0.05 -> 0.1`: the optimizer fields that differ from the checkpoint's
    config."""
    if saved is None:
        return ""
    out = []
    for name in names:
        old, new = getattr(saved.optim, name), getattr(cfg.optim, name)
        if _plain(old) != _plain(new):
            out.append(f"{'optim.betas' if name == 'betas' else '--' + name.replace('_', '-')} {old} -> {new}")
    return ", ".join(out)


def _plain(v: Any) -> Any:
    return [float(x) for x in v] if isinstance(v, (list, tuple)) else v


def _same(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=1e-12, abs_tol=0.0) for x, y in zip(a, b))
