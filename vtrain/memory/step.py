"""The optimizer step's memory, traced: torch's own `clip_grad_norm_` and AdamW, run on fake tensors of the shapes
the engine steps, under the same tracker as the training step (tracker.py).

What the installed torch allocates is measured rather than assumed (torch 2.14, torch/optim/adam.py and
torch/nn/utils/clip_grad.py; docs/memory_estimate.md "The step's timeline"):
- AdamW's states are made lazily by its first step (`exp_avg`, `exp_avg_sq` like each parameter, and a 0-d `step`
  counter, on the CPU unless the optimizer is capturable or fused). From the second step on they exist before the
  forward: the estimate is for that steady state.
- On a GPU, torch picks the foreach implementation (`_default_to_fused_or_foreach`: CUDA tensors), whose
  temporary is `torch._foreach_sqrt(exp_avg_sqs)`: a copy of the second moments of one parameter group at once.
  On a CPU it picks the single-tensor one, whose temporaries are `exp_avg_sq.sqrt()` and its quotient: two
  tensors of the largest parameter's size.
- `clip_grad_norm_` computes one 0-d norm per gradient, their stacked norm and the clip coefficient, and scales
  the gradients in place: a few bytes per parameter.

The step is traced on fresh fake tensors (the engine decides their shapes: whole parameters, FSDP2's shards or
DeepSpeed's flat partitions, `groups`): one untracked step creates the states, the tracked second step gives the
temporaries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from vtrain.memory.tracker import LiveBytes, rounded

# the hyper-parameters only need to be non-zero: what the step allocates does not depend on their values
_LR, _WD, _CLIP = 1e-4, 1e-4, 0.1


@dataclass(frozen=True)
class StepCost:
    """Bytes of one optimizer step on the device: its states (steady state) and the most its clip and update
    allocate at once beyond the states, parameters and gradients (`temporary`)."""

    states: int
    temporary: int
    clip: int  # the clip's own share of `temporary` (its peak alone)


def optimizer_step(groups: list[list[tuple[int, ...]]], *, foreach: bool, granularity: int, host_steps: bool,
                   clip: bool = True) -> StepCost:
    """Trace `clip_grad_norm_` + `AdamW.step()` over fp32 tensors of these shapes, one list per parameter group.
    `foreach`: torch's choice on the target device (True on a GPU); `host_steps`: the step counters live on the
    host (a GPU run: they are not device memory)."""
    groups = [g for g in groups if g]
    if not groups:
        return StepCost(0, 0, 0)
    with FakeTensorMode():
        params = [[torch.nn.Parameter(torch.empty(shape)) for shape in g] for g in groups]
        flat = [p for g in params for p in g]
        for p in flat:
            p.grad = torch.empty_like(p)
        opt = torch.optim.AdamW([{"params": g} for g in params], lr=_LR, weight_decay=_WD, foreach=foreach)
        opt.step()  # the first step makes the states
        states = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        existing = [*flat, *(p.grad for p in flat), *states]
        clip_peak = 0
        if clip:
            clipping = LiveBytes(existing, granularity=granularity)
            with clipping:
                torch.nn.utils.clip_grad_norm_(flat, _CLIP)
            clip_peak = clipping.peak(set())
        stepping = LiveBytes(existing, granularity=granularity)
        with stepping:
            opt.step()
        temporary = max(clip_peak, stepping.peak(set()))
        state_bytes = sum(rounded(t.untyped_storage().nbytes(), granularity) for s in opt.state.values()
                          for k, t in s.items() if isinstance(t, torch.Tensor) and not (host_steps and k == "step"))
    return StepCost(state_bytes, temporary, clip_peak)
