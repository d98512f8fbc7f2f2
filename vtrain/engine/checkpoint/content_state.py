"""The engine's state beyond the weights, checked before a resume uses it, with content.py's mechanism (a `Spec` of
name -> shape, dtypes and least value; `compare`; `nonfinite`): the optimizer's moments and the random number
generators' states. Weights prove nothing about these: a moment of another shape loads silently and fails inside
the first update, a NaN or negative second moment turns the weights to NaN a few steps later, and a malformed RNG
file is skipped by Accelerate without a word. A problem is one line naming the file, the tensor and what was
expected and found. Where each check runs (before the engine reads a file, or on the state once loaded) is the
checkpointer's (engine/checkpoint/checkpointer.py) and the engine's (engine/engines/) business.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import torch

from vtrain.engine.checkpoint.content import ContentError, Found, Spec, Want, located, compare, nonfinite
from vtrain.errors import shown

ADAM = {"exp_avg": None, "exp_avg_sq": 0.0, "max_exp_avg_sq": 0.0}
"""The tensors AdamW keeps per parameter (torch.optim.AdamW, and DeepSpeed's optimizers over their flat
partitions) and the least value of each: second moments are running means of squares."""


def optimizer_problem(entries: Iterable[tuple[str, Any, Any]]) -> str | None:
    """The first problem of an optimizer's per-parameter state, as text; None when every entry is fine. `entries`:
    (name, parameter, state) for each parameter that has a state. Every tensor of a state is one of Adam's, of its
    parameter's shape and dtype (a DTensor's global shape), with finite values (second moments >= 0); `step` is a
    finite number >= 0. What a wrong moment does otherwise: a shape fails inside the first update, a NaN or a
    negative second moment turns the weights to NaN a few steps later."""
    for name, param, state in entries:
        if not isinstance(state, Mapping):
            return f"the state of {name} is {shown(state)}, not a mapping of tensors"
        found: Found = {}
        for key, v in state.items():
            if key == "step":
                number = v.item() if torch.is_tensor(v) and v.numel() == 1 else v
                if isinstance(number, bool) or not isinstance(number, (int, float)) or not 0 <= number < math.inf:
                    return f"`step` of {name}: expected a finite number >= 0, found {shown(v)}"
            elif not torch.is_tensor(v):
                return f"`{shown(key)}` of {name}: expected a tensor, found {shown(v)}"
            else:
                found[f"{key} of {name}"] = (tuple(v.shape), v.dtype)
        spec = {f"{k} of {name}": Want(tuple(param.shape), (param.dtype,), low) for k, low in ADAM.items()
                if k != "max_exp_avg_sq" or f"{k} of {name}" in found}  # amsgrad only
        problem = compare(found, spec, "AdamW's state")
        if problem:
            return problem
        for key, want in spec.items():
            value = state[key.split(" of ", 1)[0]]
            problem = nonfinite(key, value.to_local() if hasattr(value, "to_local") else value, want.low)
            if problem:
                return problem
    return None


def _load(file: Path, where: str, load: Callable[[], Any]) -> Any:
    """A torch-pickled engine file, read weights-only by `load`; a file that is no torch file at all (junk, cut
    short) is a ContentError naming it (a refused pickle is safeio's one line already)."""
    try:
        return load()
    except (RuntimeError, EOFError, ValueError, OSError) as e:
        raise ContentError(f"{where}: not a readable torch file ({' '.join(str(e).split())[:160]})") from None


def expect_optimizer(file: Path, groups: list[list[tuple[str, torch.Tensor]]], flag: str) -> None:
    """Accelerate's optimizer.bin (DDP, one process: torch.optim's state_dict) against this run's optimizer
    (`groups`: its parameters with their names, per group), before Accelerate loads it: torch's own loader checks
    only the number of parameters per group and takes any shape. Read weights-only and memory-mapped, so checking
    costs no copy of the moments. The saved state of the i-th parameter listed is the i-th live one's (torch pairs
    them in group order, `Optimizer.load_state_dict`)."""
    where = located(file, flag)
    try:
        saved = torch.load(str(file), map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # a legacy (not zip) file cannot be mapped: read it
        saved = _load(file, where, lambda: torch.load(str(file), map_location="cpu", weights_only=True))
    if not isinstance(saved, dict) or not isinstance(saved.get("state"), dict) or \
            not isinstance(saved.get("param_groups"), list):
        raise ContentError(f"{where}: not an optimizer state (a dict with `state` and `param_groups`)")
    sizes = [len(g["params"]) if isinstance(g, dict) and isinstance(g.get("params"), list) else None
             for g in saved["param_groups"]]
    if sizes != [len(g) for g in groups]:
        raise ContentError(f"{where}: its parameter groups hold {shown(sizes)} parameters; this run's optimizer "
                           f"{shown([len(g) for g in groups])}")
    index: dict[Any, tuple[str, torch.Tensor]] = {}
    for g, live in zip(saved["param_groups"], groups):
        for i, (name, p) in zip(g["params"], live):
            if isinstance(i, bool) or not isinstance(i, int) or i in index:
                raise ContentError(f"{where}: parameter id {shown(i)} in its groups is not a distinct integer")
            index[i] = (name, p)
    unknown = next((k for k in saved["state"] if k not in index), None)
    if unknown is not None:
        raise ContentError(f"{where}: holds the state of parameter {shown(unknown)}, which no group lists")
    problem = optimizer_problem((*index[k], st) for k, st in saved["state"].items())
    if problem:
        raise ContentError(f"{where}: {problem}")


def expect_dcp(folder: Path, state: Mapping[str, Any], flag: str) -> None:
    """A torch distributed checkpoint (FSDP2: model and optimizer) against the live state it is loaded into, from
    its metadata (global shapes and dtypes, no data) before DCP reads it: DCP's own planner stops a size mismatch
    with a traceback. Keys are the state's dotted paths, as DCP flattens them. Call after safeio.check_dcp."""
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    found: Found = {k: (tuple(m.size), m.properties.dtype) for k, m in saved.items() if hasattr(m, "properties")}
    spec: Spec = {}
    todo = [("", state)]
    while todo:
        prefix, d = todo.pop()
        for k, v in d.items():
            if isinstance(v, Mapping):
                todo.append((f"{prefix}{k}.", v))
            elif torch.is_tensor(v):
                spec[f"{prefix}{k}"] = Want(tuple(v.shape), (v.dtype,))
    problem = compare({k: v for k, v in found.items() if k in spec}, spec, "this run's state")
    if problem:
        raise ContentError(f"{located(folder, flag)} does not fit this run's model and optimizer: {problem}")


RNG_STATES = ("random_state", "numpy_random_seed", "torch_manual_seed")
"""What Accelerate's save_state writes into random_states_<rank>.pkl on every machine (accelerate/checkpointing.py
save_accelerator_state), besides `step` and one entry per accelerator kind."""


def expect_rng_state(file: Path, flag: str) -> None:
    """Accelerate's random_states_<rank>.pkl, checked before Accelerate reads it: its load_state restores the
    states inside `except Exception: "Could not load random states"`, so a malformed file would let a resumed run
    continue silently with other random numbers. Read weights-only (Accelerate's loader, which admits numpy's
    array types; a refused pickle is one line, io/safeio.py); the torch CPU state against the live generator's
    (`Want`), then each state is restored into a fresh generator of its kind (Python's `random.Random`, numpy's
    `RandomState`, a `torch.Generator`), which checks it without touching this process's own."""
    import random

    import numpy as np
    from accelerate.utils import load as accelerate_load

    where = located(file, flag)
    states = _load(file, where, lambda: accelerate_load(file))
    if not isinstance(states, dict):
        raise ContentError(f"{where}: not Accelerate's random states (a dict), got {shown(states)}")
    missing = [k for k in RNG_STATES if k not in states]
    if missing:
        raise ContentError(f"{where}: lacks the random state {', '.join(missing)}")
    step = states.get("step", 0)
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= 2**63 - 1:
        raise ContentError(f"{where}: `step` must be an integer >= 0, got {shown(step)}")
    cpu = states["torch_manual_seed"]
    found: Found = {"torch_manual_seed": (tuple(cpu.shape), cpu.dtype)} if torch.is_tensor(cpu) else {}
    problem = compare(found, {"torch_manual_seed": Want(tuple(torch.get_rng_state().shape), (torch.uint8,))},
                      "torch's CPU generator state")
    if problem:
        raise ContentError(f"{where}: {problem}")
    cuda = states.get("torch_cuda_manual_seed", [])
    if not isinstance(cuda, list) or any(not torch.is_tensor(t) or t.dtype != torch.uint8 or t.dim() != 1
                                         for t in cuda):
        raise ContentError(f"{where}: `torch_cuda_manual_seed` must be a list of uint8 tensors, got {shown(cuda)}")
    for key, restore in (("random_state", random.Random().setstate),
                         ("numpy_random_seed", np.random.RandomState().set_state),
                         ("torch_manual_seed", torch.Generator().set_state)):
        try:
            restore(states[key])
        except (TypeError, ValueError, OverflowError, KeyError, IndexError, RuntimeError) as e:
            raise ContentError(f"{where}: `{key}` is not a state of its generator ({' '.join(str(e).split())[:120]}; "
                               f"got {shown(states[key])})") from None
