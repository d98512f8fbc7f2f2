"""DeepSpeed's own checkpoint writes, kept from stranding a rank between its barriers.

`DeepSpeedEngine.save_checkpoint` writes between collectives (docs/safety.md, "What the file rules rely on"): rank 0
makes the folder, then a barrier; every rank writes its states through the engine's checkpoint engine (the model
states on data-parallel rank 0, each rank its optimizer partition), rank 0 copies the recovery scripts and writes
`latest`; then a last barrier. A write that raises on one rank (a full disk, a file size limit) skips that last
barrier on that rank only: it goes on to the next collective of vtrain's save, which meets the other ranks'
barrier, and from there every rank waits in a different collective until the process group times out.

`guarded_save` routes each of those writes through one `guarded.Writes` for the length of one save: the checkpoint
engine's `save` and `makedirs` (DeepSpeed's `CheckpointEngine`, the abstraction its state files go through), the
copy of the recovery scripts, and `latest`, which DeepSpeed is told not to write (`save_latest=False`) and which is
written here once its save has returned. The first failed write is kept as one line naming its file and the rest
are skipped, while every collective still runs on every rank; it is raised when the save is over, and the
checkpointer agrees on it with the other ranks (checkpoint/checkpointer.py `_stage`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from vtrain.io import guarded
from vtrain.errors import VtrainError

# the engine's methods that write, patched on the instance for one save (checked by tests/integration/test_ranks.py against the
# installed DeepSpeed, so that a rename there fails a test instead of silently leaving a write unguarded)
RECOVERY_SCRIPTS = "_copy_recovery_script"
LATEST = "latest"
_UNSET = object()


@contextmanager
def guarded_save(engine: Any, save_dir: Path, tag: str) -> Iterator[dict[str, Any]]:
    """Around `accelerator.save_state(save_dir, **kwargs)` of a DeepSpeed engine: yields the keyword arguments for
    DeepSpeed's `save_checkpoint`; raises the first failed write as one line (a VtrainError) once the save is
    over. A failure outside DeepSpeed's writes (Accelerate's own files) propagates as it is, unless DeepSpeed's
    failed first."""
    writes = guarded.Writes()
    store, recovery = engine.checkpoint_engine, getattr(engine, RECOVERY_SCRIPTS)
    save, makedirs = store.save, store.makedirs

    def guarded_store_save(state_dict: Any, path: str) -> None:
        writes("write", path, save, state_dict, path)

    def guarded_makedirs(path: str, exist_ok: bool = False) -> None:
        writes("create", path, makedirs, path, exist_ok=exist_ok)

    def guarded_recovery(save_path: str) -> None:
        writes("write", save_path, recovery, save_path)

    # instance attributes shadow the class's methods for this save only (put back as they were below)
    shadowed = [(store, "save", guarded_store_save), (store, "makedirs", guarded_makedirs),
                (engine, RECOVERY_SCRIPTS, guarded_recovery)]
    before = [(obj, name, vars(obj).get(name, _UNSET)) for obj, name, _ in shadowed]
    for obj, name, fn in shadowed:
        setattr(obj, name, fn)
    try:
        yield {"save_latest": False}
    except Exception:
        if writes.problem is None:
            raise
        raise VtrainError(writes.problem) from None  # DeepSpeed's failure came first: it is the one to name
    finally:
        for obj, name, old in before:
            if old is _UNSET:
                delattr(obj, name)
            else:
                setattr(obj, name, old)
    if engine.global_rank == 0:  # where DeepSpeed writes it, once every state file is in place
        latest = Path(save_dir) / LATEST
        writes("write", latest, latest.write_text, tag)
    if writes.problem is not None:
        raise VtrainError(writes.problem)
