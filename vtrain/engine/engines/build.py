"""The engine of a run, chosen once from its launch plan: the one place that maps a plan's engine to its class.

Each class (engine/engines/) applies its parallelism and precision to the built model and runs the step; the
Trainer, the checkpointer, the EMA and the sharded head call the same methods whatever the engine. DDP and DeepSpeed
go through Accelerate (`accelerator.prepare`); FSDP2 is applied with torch's `fully_shard` because Accelerate skips
it on CPU processes. The Accelerator the engine runs on is built by engine/engines/accelerator.py, from the class's own
settings.
"""

from __future__ import annotations

from accelerate import Accelerator

from vtrain.engine.engines.base import Engine
from vtrain.engine.engines.ddp import DDPEngine, SingleProcessEngine
from vtrain.engine.engines.deepspeed import DeepSpeedEngine
from vtrain.engine.engines.fsdp import FSDP2Engine
from vtrain.engine.engines.plan import Plan

ENGINES: dict[str, type[Engine]] = {"single": SingleProcessEngine, "ddp": DDPEngine, "fsdp": FSDP2Engine,
                                    "deepspeed": DeepSpeedEngine}
"""Plan.kind -> the engine class that runs it."""


def engine_class(plan: Plan) -> type[Engine]:
    """The class of the plan's engine: its class methods are what the launch needs before the engine exists."""
    return ENGINES[plan.kind]


def build_engine(plan: Plan, accelerator: Accelerator) -> Engine:
    """The run's engine, once the Accelerator exists."""
    return engine_class(plan)(plan, accelerator)
