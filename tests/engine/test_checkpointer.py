"""The checkpointer as a unit, on one process without a CLI: save -> verify -> choose -> load with the debug metric
model, a fake engine (the engine interface the checkpointer calls, over a plain model and AdamW) and a real LambdaLR.
The whole-run behaviours (crash mid-save, pruning next to a user's files, 2-process resumes) stay with the CLI tests
(tests/integration/); this is where a change to the protocol's single-process logic fails first."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from vtrain.config import resolve
from vtrain.engine.checkpoint import format as ckpt
from vtrain.engine.checkpoint import layout as engine_layout
from vtrain.engine.checkpoint.checkpointer import Checkpointer
from vtrain.engine.optim import build_scheduler
from vtrain.errors import VtrainError
from vtrain.tasks import build_model

CLASSES = 3


class FakeAccelerator:
    """What the checkpointer reads of Accelerate on one process."""
    process_index, num_processes, is_main_process = 0, 1, True

    def wait_for_everyone(self) -> None:
        pass


class FakeEngine:
    """The engine interface the checkpointer calls, over a plain module and AdamW: its own copy of the model is
    Accelerate's file of the DDP layout (engine_layout.DDP), which the checkpointer checks before `load`."""
    kind, layout = "single", engine_layout.DDP
    scaler = None

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        self.loaded: list[Path] = []

    def sync_buffers(self) -> None:
        pass

    def save(self, directory: Path) -> None:
        (directory / ckpt.ACCELERATE).mkdir()
        save_file(self.full_state_dict(), str(directory / self.layout.model_file))

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone().contiguous() for k, v in self.model.state_dict().items()}

    def load(self, directory: Path) -> None:
        self.model.load_state_dict(load_file(str(directory / self.layout.model_file)))
        self.loaded.append(directory)

    def needs_reshard(self, engine: str, world_size: int) -> bool:
        return False

    def reads_checkpoint_of(self, engine: str) -> bool:
        return engine in ("single", "ddp")

    def parameters_finite(self) -> bool:
        return all(bool(torch.isfinite(p).all()) for p in self.model.parameters())

    def optimizer_states(self):
        names = {p: n for n, p in self.model.named_parameters()}
        return [(names[p], p, s) for p, s in self.optimizer.state.items()]

    def optimizer_groups(self):
        return self.optimizer.param_groups

    def optimizer_file(self, directory: Path) -> Path:
        return directory / self.layout.optimizer_file

    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def set_lrs(self, lrs: list[float]) -> None:
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr


class Loop:
    """The trainer's part of train_state.json."""

    def __init__(self, step: int = 0, consumed: int = 0) -> None:
        self.step, self.consumed = step, consumed

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "consumed_samples": self.consumed, "skipped_steps": 0, "overflow_skips": 0,
                "consecutive_nonfinite": 0}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.consumed = state["step"], state["consumed_samples"]


def _run(out: Path, resume: str | None = None, seed: int = 0, keep_last: int = 3):
    """A checkpointer attached to a freshly built debug metric model (one process, the `single` plan)."""
    cfg = resolve("metric", overrides={"train": {"output_dir": str(out), "resume": resume, "keep_last": keep_last,
                                                 "max_steps": 10}})
    torch.manual_seed(seed)
    model = build_model("metric", cfg.model, CLASSES)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.max_steps)
    checkpointer = Checkpointer(cfg, FakeAccelerator())
    engine = FakeEngine(model, optimizer)
    point, notes = checkpointer.choose(engine)
    loop = Loop()
    checkpointer.attach(loop=loop, engine=engine, scheduler=scheduler, head=None, ema=None,
                        dataset=SimpleNamespace(num_classes=CLASSES))
    return SimpleNamespace(cfg=cfg, model=model, optimizer=optimizer, scheduler=scheduler, ckpt=checkpointer,
                           engine=engine, loop=loop, point=point, notes=notes)


def _train(r, steps: int) -> None:
    """`steps` AdamW updates on random embeddings' loss, the schedule stepped with them."""
    for _ in range(steps):
        out = r.model(torch.randn(2, 3, 112, 112))
        loss = sum(v.float().pow(2).mean() for v in (out.values() if isinstance(out, dict) else [out]))
        loss.backward()
        r.optimizer.step()
        r.optimizer.zero_grad()
        r.scheduler.step()
        r.loop.step += 1
        r.loop.consumed += 2


def test_save_verify_and_load_on_one_process(tmp_path):
    first = _run(tmp_path / "run")
    assert first.point is None and first.ckpt.run_id
    _train(first, 2)
    saved = first.ckpt.save(lambda line: None)
    assert saved == ckpt.final_path(tmp_path / "run", 2) and ckpt.verify(saved) is None
    manifest = ckpt.read_manifest(saved)
    assert manifest.step == 2 and manifest.run_id == first.ckpt.run_id
    assert {ckpt.MODEL, ckpt.TRAIN_STATE, ckpt.CONFIG, engine_layout.DDP.model_file} <= set(manifest.files)
    state = ckpt.TrainState.read(saved)
    assert (state.step, state.consumed_samples, state.engine, state.world_size) == (2, 4, "single", 1)
    weights = first.engine.full_state_dict()
    assert all(torch.equal(weights[k], v) for k, v in load_file(str(saved / ckpt.MODEL)).items())

    # a new run resuming it (another seed: other weights until the load)
    second = _run(tmp_path / "run", resume="auto", seed=1)
    point = second.point
    assert (point.path, point.step, point.reshard) == (saved, 2, False)
    assert point.run_id == second.ckpt.run_id == first.ckpt.run_id  # the lineage is kept
    assert point.config.to_dict() == first.cfg.to_dict()
    with pytest.raises(dataclasses.FrozenInstanceError):
        point.path = tmp_path  # type: ignore[misc]
    notes = second.ckpt.load(point)
    assert second.engine.loaded == [saved] and not notes
    assert (second.loop.step, second.loop.consumed) == (2, 4)
    assert second.scheduler.state_dict()["last_epoch"] == first.scheduler.state_dict()["last_epoch"]
    assert all(torch.equal(second.model.state_dict()[k], v) for k, v in weights.items())
    assert [g["lr"] for g in second.optimizer.param_groups] == [g["lr"] for g in first.optimizer.param_groups]


def test_auto_skips_a_damaged_newest_and_pruning_keeps_the_lineage(tmp_path):
    r = _run(tmp_path / "run", keep_last=2)
    for _ in range(3):
        _train(r, 1)
        r.ckpt.save(lambda line: None)
    names = [p.name for p in ckpt.complete_checkpoints(tmp_path / "run")]
    assert names == ["step_2", "step_3"]  # --keep-last 2
    newest = ckpt.final_path(tmp_path / "run", 3)
    with open(newest / ckpt.MODEL, "r+b") as f:  # one byte changed: the manifest's hash no longer matches
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    resumed = _run(tmp_path / "run", resume="auto")
    assert resumed.point.path == ckpt.final_path(tmp_path / "run", 2)
    assert len(resumed.notes) == 1 and "skipped the damaged checkpoint step_3" in resumed.notes[0]
    with pytest.raises(VtrainError, match="damaged checkpoint"):
        _run(tmp_path / "run", resume=str(newest))


def test_a_checkpoint_of_another_class_count_is_refused_before_the_engine_reads_it(tmp_path):
    r = _run(tmp_path / "run")
    _train(r, 1)
    saved = r.ckpt.save(lambda line: None)
    other = _run(tmp_path / "run", resume=str(saved))
    other.ckpt.dataset = SimpleNamespace(num_classes=CLASSES + 1)
    with pytest.raises(VtrainError, match="--resume"):
        other.ckpt.load(other.point)
    assert other.engine.loaded == []  # refused before the engine read anything
    assert json.loads((saved / ckpt.TRAIN_STATE).read_text())["step"] == 1
