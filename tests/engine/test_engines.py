"""One class per parallel engine (vtrain/engine/engines/), chosen once from the launch plan (engine/engines/build.py):
which class each configuration gets, that no other module tests which engine runs, that the DeepSpeed internals
vtrain patches are refused in one line on an untested DeepSpeed, and that the tests' fault injection is read once.
The engines' behaviour itself is covered by the 2-process runs (test_distributed.py, test_face_head_train.py)."""

from __future__ import annotations

import ast
import re
import tomllib
import types
from pathlib import Path

import pytest
import torch

from tests.helpers.paths import ROOT
from vtrain.config import ParallelConfig, RunConfig, TrainConfig
from vtrain.engine.checkpoint import format as ckpt
from vtrain.engine import faults
from vtrain.engine.checkpoint import layout as engine_layout
from vtrain.engine.engines.accelerator import build_accelerator
from vtrain.engine.engines import deepspeed as ds_engine
from vtrain.engine.engines import ds_internals
from vtrain.engine.engines import base
from vtrain.engine.engines.ddp import DDPEngine, SingleProcessEngine
from vtrain.engine.engines.torch_engine import TorchEngine
from vtrain.engine.engines.deepspeed import DeepSpeedEngine
from vtrain.engine.engines.fsdp import FSDP2Engine
from vtrain.engine.engines.build import ENGINES, build_engine, engine_class
from vtrain.engine.engines.plan import Plan, resolve_plan
from vtrain.errors import VtrainError

PACKAGE = ROOT / "vtrain"
ENGINE_NAMES = set(ENGINES)  # single, ddp, fsdp, deepspeed: what a plan's kind can be


@pytest.mark.parametrize("world, parallel, cls, layout", [
    ("1", {}, SingleProcessEngine, engine_layout.DDP),
    ("2", {}, DDPEngine, engine_layout.DDP),
    ("2", {"fsdp": True}, FSDP2Engine, engine_layout.FSDP2),
    ("1", {"fsdp": True}, FSDP2Engine, engine_layout.FSDP2),
    ("2", {"ds_config": "ds_configs/zero2.json"}, DeepSpeedEngine, engine_layout.DEEPSPEED),
    ("1", {"ds_config": "ds_configs/zero3_offload.json"}, DeepSpeedEngine, engine_layout.DEEPSPEED),
])
def test_each_configuration_gets_its_engine_class(world, parallel, cls, layout, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", world)
    for var in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP"):
        monkeypatch.delenv(var, raising=False)
    if "ds_config" in parallel:
        parallel = {"ds_config": str(ROOT / parallel["ds_config"])}
    cfg = RunConfig(parallel=ParallelConfig(**parallel), train=TrainConfig(output_dir=str(tmp_path / "run")))
    plan = resolve_plan(cfg)
    assert engine_class(plan) is cls
    engine = build_engine(plan, types.SimpleNamespace(device=torch.device("cpu")))
    assert type(engine) is cls and engine.layout is layout
    assert engine.kind == plan.kind and engine.reads_checkpoint_of(plan.kind)  # what its checkpoints are read as


def test_a_run_chooses_its_engine_once():
    """The Trainer builds the engine once; nothing else in the package builds one or picks a class by name."""
    calls = [f"{p.relative_to(PACKAGE)}" for p, src in _sources().items() for line in src.splitlines()
             if re.search(r"\bbuild_engine\(", line) and not line.lstrip().startswith("def ")]
    assert calls == ["engine/trainer.py"]
    lookups = [f"{p.relative_to(PACKAGE)}" for p, src in _sources().items() if "ENGINES[" in src]
    assert lookups == ["engine/engines/build.py"]


def test_the_tables_name_the_same_engines():
    """Each class names itself as the table does, and reads the checkpoints of exactly the engines of its layout
    (one process is DDP of one); the checkpoint format names no engine."""
    assert ENGINE_NAMES == {"single", "ddp", "fsdp", "deepspeed"}
    assert all(cls.kind == k for k, cls in ENGINES.items())
    for cls in ENGINES.values():
        assert set(cls.reads) == {k for k, other in ENGINES.items() if other.layout is cls.layout}
    assert not hasattr(ckpt, "ENGINES") and not hasattr(engine_layout, "OF_ENGINE")


def test_every_engine_implements_the_interface_and_deepspeed_owns_its_facts():
    """Every class answers every member of the protocol (engine/engines/base.py); DeepSpeed shares base.Shared
    with the torch engine, never the torch engine's step, precision or files."""
    assert not issubclass(DeepSpeedEngine, TorchEngine) and issubclass(DeepSpeedEngine, base.Shared)
    assert all(issubclass(cls, TorchEngine) for cls in (SingleProcessEngine, DDPEngine, FSDP2Engine))
    methods = [n for n in vars(base.Engine) if not n.startswith("_")]
    for kind, cls in ENGINES.items():
        assert all(hasattr(cls, n) for n in methods), (cls, [n for n in methods if not hasattr(cls, n)])
        # what Shared leaves to each engine is the engine's own
        own = ("_update", "zero_grad", "_stepping_optimizer", "local_tensor", "partitions", "run_facts")
        assert all(getattr(cls, n) is not getattr(base.Shared, n) for n in own), cls
        engine = cls(Plan(kind, 1, "no"), types.SimpleNamespace(device=torch.device("cpu")))
        assert all(hasattr(engine, n) for n in ("plan", "accelerator", "model", "scaler", "norm_parts", "kind",
                                                "layout"))


def test_the_engine_steps_the_schedule_and_returns_the_lr_each_step_used():
    engine = SingleProcessEngine(Plan("single", 1, "no"), types.SimpleNamespace(device=torch.device("cpu")))
    model = torch.nn.Linear(2, 1)
    engine.model = model
    engine.optimizer = torch.optim.AdamW(model.parameters(), lr=1.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda s: 1 / (s + 1))
    engine.follow(schedule)
    used = []
    for _ in range(3):
        model(torch.ones(1, 2)).sum().backward()
        update = engine.step(0.0)
        assert update.applied and update.grad_norm.ndim == 0
        used.append(update.lr)
    assert used == pytest.approx([1.0, 1 / 2, 1 / 3])  # each the LR in force at its step
    assert engine.optimizer.param_groups[0]["lr"] == pytest.approx(1 / 4)  # the next step's
    model(torch.ones(1, 2)).sum().backward()
    skipped = engine.skip()  # a non-finite window: gradients dropped, the schedule stays
    assert (skipped.grad_norm, skipped.applied, skipped.lr) == (None, False, pytest.approx(1 / 4))
    assert schedule.last_epoch == 3 and all(p.grad is None for p in model.parameters())


def _sources() -> dict[Path, str]:
    return {p: p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def _names_an_engine(node: ast.AST) -> bool:
    """A string constant that is an engine's name, or a tuple/list/set holding one."""
    if isinstance(node, ast.Constant):
        return node.value in ENGINE_NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_an_engine(e) for e in node.elts)
    return False


def test_no_module_tests_which_engine_runs():
    """Engine knowledge is a method of the engine: nowhere in the package (the engine classes included, which know
    what they are) is a value compared with an engine's name (`kind == "deepspeed"`, `in ("fsdp", "deepspeed")`);
    the plan's kind picks the class in engine/engines/build.py by a table lookup."""
    found = []
    for path, src in _sources().items():
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.Compare) and any(_names_an_engine(n) for n in [node.left, *node.comparators]):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "engine names compared outside the engine classes:\n" + "\n".join(found)
    # the check itself finds what it looks for
    assert _names_an_engine(ast.parse('plan.kind in ("fsdp", "x")').body[0].value.comparators[0])


ENGINE_FIELDS = re.compile(r"\.(zero_stage|ds_precision_mode|fsdp_offload|fsdp_reshard_after_forward|offload_params|"
                           r"offload_optimizer)\b")


def test_the_plans_engine_settings_are_read_by_the_engine_classes():
    """A plan's engine-specific fields are read by the engine classes only (besides plan.py, which resolves them,
    ds_config.py, which fills the JSON they come from, and the trainer's record of them in run_info.json; the
    estimator reads the same names off its own Setup and the DeepSpeed JSON)."""
    allowed = {PACKAGE / "engine" / "engines" / "plan.py", PACKAGE / "engine" / "engines" / "ds_config.py",
               PACKAGE / "tools" / "estimate_memory.py"}
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p, src in _sources().items()
             if p.parent.name != "engines" and p not in allowed
             for i, line in enumerate(src.splitlines(), 1) if ENGINE_FIELDS.search(line)]
    assert not found, "\n".join(found)
    trainer = (PACKAGE / "engine" / "trainer.py").read_text()
    assert "self.plan." not in trainer  # run_info.json's engine facts come from the live engine (run_facts)
    assert "**self.engine.run_facts()" in trainer


# ---- DeepSpeed: the internals vtrain patches, checked at start-up -------------------------------------------------

@pytest.mark.parametrize("version, ok", [("0.19.8", True), ("0.19.12", True), ("0.19.8+cu130", True),
                                         ("0.19.7", False), ("0.17.0", False), ("0.20.0", False), ("1.0.0", False)])
def test_deepspeed_version_range(version, ok):
    if ok:
        ds_internals.check_version(version)
        return
    with pytest.raises(VtrainError) as e:
        ds_internals.check_version(version)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"DeepSpeed {version} is not supported") and ds_internals.TESTED in msg


def test_an_untested_deepspeed_is_refused_at_start_up_before_anything_is_set_up(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("RANK", raising=False)
    cfg = RunConfig(parallel=ParallelConfig(ds_config=str(ROOT / "ds_configs/zero2.json")),
                    train=TrainConfig(output_dir=str(tmp_path / "run")))
    plan = resolve_plan(cfg)
    DeepSpeedEngine.check_installed()  # the installed one is in the range
    monkeypatch.setattr(ds_engine, "version", lambda name: "0.17.5")
    with pytest.raises(VtrainError, match=r"^DeepSpeed 0\.17\.5 is not supported: .*deepspeed>="):
        build_accelerator(plan, 1)
    assert "RANK" not in __import__("os").environ  # refused before the rendezvous DeepSpeed would need


def test_pyproject_requires_the_tested_deepspeed_range():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert [d for d in deps if re.match(r"deepspeed\b", d)] == [f"deepspeed{ds_internals.TESTED}"]


# ---- fault injection: parsed once -----------------------------------------------------------------------------

def test_faults_are_parsed_once_and_mean_what_they_say(monkeypatch):
    f = faults.Faults({"VTRAIN_DEBUG_NONFINITE": "loss@3", "VTRAIN_DEBUG_SIGNAL_AT_STEP": "2@1"})
    assert [f.nonfinite("loss", s) for s in (2, 3, 9)] == [False, True, True]
    assert not f.nonfinite("param", 5)
    assert not faults.Faults({"VTRAIN_DEBUG_NONFINITE": "loss@x"}).nonfinite("loss", 5)
    none = faults.Faults({})
    none.crash("VTRAIN_DEBUG_CRASH_AT_STEP", 1)  # nothing set: nothing happens
    none.send_signal(1, 0)
    none.file_size_limit(1, 0)
    f.send_signal(2, 0)  # another rank's signal: nothing happens here
    monkeypatch.setattr(faults, "_injected", None)
    monkeypatch.setenv("VTRAIN_DEBUG_NONFINITE", "param@4")
    first = faults.injected()
    monkeypatch.setenv("VTRAIN_DEBUG_NONFINITE", "loss@1")
    assert faults.injected() is first and first.nonfinite("param", 4) and not first.nonfinite("loss", 1)


def test_the_loop_and_the_save_read_no_environment():
    """The variables are read once, by faults.injected() at start-up: the loop and the checkpointer's save only
    call the parsed object."""
    for name in ("trainer.py", "checkpoint/checkpointer.py"):
        src = (PACKAGE / "engine" / name).read_text()
        assert "os.environ" not in src and "getenv" not in src
        assert "faults.injected()" in src
    src = (PACKAGE / "engine" / "faults.py").read_text()
    assert src.count("os.environ") == 1  # in injected()
