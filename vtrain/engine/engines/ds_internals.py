"""The DeepSpeed internals vtrain patches, and the versions they were tested on.

`zero_norm_with_head` shadows a ZeRO optimizer's norm function for one step (the sharded head's share of the global
clip norm); engine/engines/ds_writes.py routes the DeepSpeed engine's checkpoint writes through the guarded writer. Both rely
on members DeepSpeed does not document as public, read in DeepSpeed 0.19.8 (deepspeed/runtime/zero/stage_1_and_2.py,
stage3.py, engine.py) and checked against the installed version by tests (tests/test_partial_fc.py,
tests/test_ranks.py). A run refuses another DeepSpeed at start-up, in one line (`check_version`, called by the
engine's `check_installed` before the Accelerator is built); pyproject.toml requires the same range.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from packaging.specifiers import SpecifierSet

from vtrain.errors import VtrainError

TESTED = ">=0.19.8,<0.20"
"""The DeepSpeed versions whose internals vtrain's patches were tested on (pyproject.toml requires the same)."""


def check_version(installed: str) -> None:
    """One line when `installed` is outside TESTED."""
    if installed not in SpecifierSet(TESTED):
        raise VtrainError(f"DeepSpeed {installed} is not supported: vtrain hooks into DeepSpeed's ZeRO optimizer and "
                          f"checkpoint internals, tested with deepspeed{TESTED}; install a version in that range "
                          f"(pip install 'deepspeed{TESTED}') or train with DDP or --fsdp")


@contextlib.contextmanager
def zero_norm_with_head(opt: Any, stage: int, head_norm: torch.Tensor):
    """Make the ZeRO optimizer's next `step()` clip by (and report) the global norm over its partitions AND the
    sharded head outside it, so `--clip-grad` is one global clip under DeepSpeed as under DDP/FSDP2.

    DeepSpeed computes the norm and applies the clip inside one `step()` that takes no outside term, so for that
    one call this shadows the instance's norm function (restored afterwards). It relies on DeepSpeed 0.19.8's
    internals: ZeRO-1/2 `DeepSpeedZeroOptimizer.step()` takes `scaled_global_norm()` (the loss-scaled norm, already
    reduced over ranks) for both `_global_grad_norm` and `unscale_and_clip_grads`; ZeRO-3
    `DeepSpeedZeroOptimizer_Stage3.step()` L2-combines the per-group norms of `_get_norm_groups()` with
    `combine_grad_norm_groups` and uses the result the same way (offload included). The head's norm (the same on
    every rank) enters as one more loss-scaled L2 term. Yields a dict that receives the backbone's unscaled
    norm ("norm") when DeepSpeed computed it."""
    name = {1: "scaled_global_norm", 2: "scaled_global_norm", 3: "_get_norm_groups"}.get(stage)
    if name is None or not callable(getattr(opt, name, None)) or not hasattr(opt, "loss_scale"):
        import deepspeed

        raise VtrainError(f"--head-parallel sharded under DeepSpeed {deepspeed.__version__} ZeRO-{stage}: its "
                          f"optimizer {type(opt).__name__} lacks `{name or 'scaled_global_norm'}`/`loss_scale`, "
                          "which one global clip norm over backbone and sharded head hooks into (written for "
                          "DeepSpeed 0.19.8 ZeRO-1/2/3); use a ZeRO stage 1-3 config or that DeepSpeed version")
    original, shadowed, seen = getattr(opt, name), vars(opt).get(name), {}

    def scaled_with_head(*args, **kwargs):
        out = original(*args, **kwargs)
        scale = float(opt.loss_scale)
        if stage == 3:  # a list of per-group norms (tensors or floats), which DeepSpeed L2-combines
            from deepspeed.runtime.utils import combine_grad_norm_groups

            dev = next((n.device for n in out if torch.is_tensor(n)), head_norm.device)
            seen["norm"] = combine_grad_norm_groups(out).to(dev) / scale if out else torch.zeros((), device=dev)
            return [*out, (head_norm * scale).to(dev)]
        seen["norm"] = out / scale  # the combined loss-scaled norm (an invalid one is inf: combining keeps it)
        return torch.sqrt(out ** 2 + (head_norm * scale).to(out.device) ** 2)

    setattr(opt, name, scaled_with_head)  # an instance attribute shadows the class method for this call
    try:
        yield seen
    finally:
        if shadowed is None:
            delattr(opt, name)
        else:
            setattr(opt, name, shadowed)
