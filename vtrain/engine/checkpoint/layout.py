"""What each engine keeps of its own in a vtrain checkpoint, described once.

Every engine writes the same shared files (model.safetensors, train_state.json, ...: checkpoint/format.py); beside
them each keeps its own copy of model and optimizer in its own format. The engine classes (engine/engines/) carry
their layout, and whoever reads a checkpoint asks the layout of the engine that wrote it (`train_state.json`'s
`engine`) instead of testing the engine's name: the checkpointer, to refuse a resume across engines and to check
Accelerate's files before they are loaded; `vtrain consolidate`, for the folder that holds the engine's copy.
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

OF_ENGINE: dict[str, EngineLayout] = {"single": DDP, "ddp": DDP, "fsdp": FSDP2, "deepspeed": DEEPSPEED}
"""`train_state.json`'s `engine` (checkpoint.ENGINES: the plan that wrote it) -> the layout it wrote."""
