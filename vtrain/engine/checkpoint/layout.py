"""What each engine keeps of its own in a vtrain checkpoint, described once.

Every engine writes the same shared files (model.safetensors, train_state.json, ...: checkpoint/format.py); beside
them each keeps its own copy of model and optimizer in its own format. The engine classes (engine/engines/) carry
their layout and say which engines' checkpoints they read (`reads_checkpoint_of`, from `train_state.json`'s `engine`):
the checkpointer asks the run's engine, never tests a name, to refuse a resume across engines and to check
Accelerate's files before they are loaded; `vtrain consolidate` reads the folders on disk.
"""

from __future__ import annotations

from dataclasses import dataclass

from vtrain.engine.checkpoint import format as ckpt


@dataclass(frozen=True)
class EngineLayout:
    name: str
    """The family a checkpoint resumes within (one process is DDP of one)."""
    state_dir: str
    """The folder, relative to the checkpoint, that holds the engine's own copy of model and optimizer."""
    model_file: str | None = None
    """Accelerate's model file (relative to the checkpoint): checked against this run's model before it is read."""
    optimizer_file: str | None = None
    """Accelerate's optimizer file: checked against this run's parameter groups before it is read."""


DDP = EngineLayout("ddp", ckpt.ACCELERATE, f"{ckpt.ACCELERATE}/model.safetensors", f"{ckpt.ACCELERATE}/optimizer.bin")
FSDP2 = EngineLayout("fsdp", ckpt.FSDP)
DEEPSPEED = EngineLayout("deepspeed", f"{ckpt.ACCELERATE}/{ckpt.DS_TAG}")
