"""Collectives as small helpers that are no-ops on one process (the model: detectron2's `utils/comm.py`), so that
no call site tests the world size itself: one missed `if world > 1` guard hangs a multi-rank run, one missed
collective on one rank desyncs it.

The world is torch.distributed's: one process when no process group exists (a plain `vtrain train`, the offline
commands, a unit test that builds a shard of a simulated world). Every helper is collective when there is more
than one process: all ranks must call it, in the same order.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

from vtrain.errors import VtrainError

T = TypeVar("T")


class AgreedError(VtrainError):
    """An error rank 0 found and told the other ranks about: they exit quietly, rank 0 prints it once."""

    quiet = True


def world_size() -> int:
    """Number of processes in the default group (1 without one)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    """This process's rank in the default group (0 without one)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def is_main() -> bool:
    return rank() == 0


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj` (picklable), in rank order, on every rank; `[obj]` on one process."""
    if world_size() == 1:
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def gather_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's `t` (same shape and dtype everywhere), in rank order, on every rank; `[t]` on one process."""
    if world_size() == 1:
        return [t]
    out = [torch.empty_like(t) for _ in range(world_size())]
    dist.all_gather(out, t)
    return out


def all_true(flag: torch.Tensor | bool, device: torch.device | str | None = None) -> bool:
    """Whether `flag` (a bool, or a tensor read as one: nonzero is true) holds on every rank: a MIN all-reduce, and
    the call's one host sync (a tensor is read on one process too). A bool is sent from `device` (NCCL needs a CUDA
    tensor); on one process it is the answer, without a device round trip."""
    if not torch.is_tensor(flag):
        if world_size() == 1:
            return bool(flag)
        flag = torch.tensor(float(flag), device=device)
    t = flag.detach().to(torch.float32, copy=True).reshape(1)
    if world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item() > 0)


def all_sum(t: torch.Tensor) -> torch.Tensor:
    """The sum of `t` over ranks, as a new tensor (`t` itself is left alone); `t` on one process."""
    if world_size() == 1:
        return t
    t = t.clone()
    dist.all_reduce(t)
    return t


def all_mean_(t: torch.Tensor) -> torch.Tensor:
    """Replace `t` by its mean over ranks, in place (sum, then divide by the world size); returns `t`."""
    world = world_size()
    if world > 1:
        dist.all_reduce(t)
        t /= world
    return t


def all_max_(t: torch.Tensor) -> torch.Tensor:
    """Replace `t` by its elementwise maximum over ranks, in place; returns `t`."""
    if world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def mean_over_ranks(value: float, device: torch.device | str) -> float:
    """The mean of a host number over ranks, sent in float64 from `device` (NCCL needs a CUDA tensor); the number
    itself on one process, without a device round trip."""
    world = world_size()
    if world == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t.item()) / world


def broadcast_from_main(fn: Callable[[], T]) -> T:
    """Run `fn` on rank 0 and hand its result (picklable) to every rank. A user error (VtrainError) it raises is
    raised on every rank: on rank 0 as a VtrainError with its message, elsewhere as a quiet `AgreedError` (the CLI
    prints it once); on one process it propagates unchanged. Collective (one broadcast)."""
    result, error = None, None
    if is_main():
        try:
            result = fn()
        except VtrainError as e:
            if world_size() == 1:
                raise
            error = str(e)
    if world_size() > 1:
        box = [result, error]
        dist.broadcast_object_list(box, src=0)
        result, error = box
    if error is not None:
        raise VtrainError(error) if is_main() else AgreedError(error)
    return result  # type: ignore[return-value]


def agreed(fn: Callable[[], T]) -> T:
    """Run `fn` on every rank; a user error (VtrainError) raised on any rank is raised on every rank, with the
    message of the lowest rank that failed: on rank 0 as a VtrainError, elsewhere as a quiet `AgreedError` (the
    CLI prints it once). A check of what only one rank reads (its head shard) then stops all ranks with one line,
    instead of leaving the others waiting in the next collective. `fn` itself must run no collective. On one
    process a plain call. Collective (one all_gather)."""
    if world_size() == 1:
        return fn()
    result, error = None, None
    try:
        result = fn()
    except VtrainError as e:
        error = str(e)
    errors = [e for e in gather_objects(error) if e is not None]
    if errors:
        raise VtrainError(errors[0]) if is_main() else AgreedError(errors[0])
    return result  # type: ignore[return-value]


_groups_left = 0


def leave() -> None:
    """Destroy the default process group (and every other one), if any, while the objects it serves are alive.
    Its backends' threads may still run afterwards (an object that holds a backend keeps it): the CLI ends such a
    process without interpreter teardown (cli._exit)."""
    global _groups_left
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        _groups_left += 1


def groups_left() -> int:
    """How many times this process left a process group (`leave`)."""
    return _groups_left
