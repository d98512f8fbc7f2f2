"""Real training steps on CPU with every tensor storage counted by the CPU allocator itself: the reference
`benchmarks/estimate_memory_cpu.py` holds `vtrain estimate-memory`'s totals against.

How the bytes are counted (docs/memory_estimate.md, "Validation on CPU"): torch's CPU allocator passes every
tensor storage it allocates or frees through c10's ProfiledCPUMemoryReporter. With c10's flag
`caffe2_report_cpu_memory_usage` on (set through ctypes as the process starts, before any tensor exists) the
reporter keeps the running total of live bytes over every thread; with the profiler on (`profile_memory=True`,
from before the model is built) each allocation and free of the main thread is reported with its size, address
and that running total. So the live bytes at every allocation event are exact: every storage of the run counts
(parameters, buffers, optimizer states, the engine's own buffers such as DDP's buckets and DeepSpeed's flat
partitions, the batch, activations, gradients, temporaries), at its requested size, with no allocator cache
(the CPU allocator frees at once) and no Python heap, library or interpreter memory (RSS would include them).
Frees on other threads (gloo's workers release collective buffers) reach the total too, which summing the
reported events alone would miss.

Gradients are identified by address: every parameter gets a post-accumulate-grad hook that notes its gradient's
address inside a `record_function` marker; the gradient is the last allocation at that address before the
marker. Under DeepSpeed ZeRO the engine's own gradient and parameter traffic runs inside its hooks (stage 1/2:
the gradient's copy into the reduction bucket and its partition; stage 3 also the all-gather of each module's
parameters and their release, and its module hooks): those hooks are wrapped in a `vt_engine` marker, and
every storage allocated inside one (with its later free) is the engine's, not the model's. That includes every
gradient hook DeepSpeed registers (ZeRO-1/2's `process_gradients` sets buckets up and may copy gradients there,
outside the reduction function itself). The activation curve is the live curve of
what the step allocates (from its first forward op) without those gradient and engine storages, the
estimator's activation figure, the same quantity under every engine.

Each row runs in fresh processes (one per rank, gloo between them): an engine owns process-global state.

    python benchmarks/step_memory.py '<row JSON>'    # one rank of one row, prints one JSON line
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
ENGINES = {"single": {}, "ddp": {}, "fsdp2": {"fsdp": True}, "zero1": {"ds_config": "ds_configs/zero1.json"},
           "zero2": {"ds_config": "ds_configs/zero2.json"}, "zero3": {"ds_config": "ds_configs/zero3.json"}}
PHASES = ("forward", "backward", "optimizer")


def row_setup(row: dict):
    """estimate-memory's Setup for a row (the CPU target: CPU autocast, the PyTorch deformable attention)."""
    from vtrain.memory.setup import Setup

    eng = ENGINES[row["engine"]]
    zero = {"zero1": 1, "zero2": 2, "zero3": 3}.get(row["engine"], 0)
    return Setup(task=row["task"], preset=row["preset"], batch_size=row["batch_size"],
                 image_size=tuple(row["image_size"]), precision=row["precision"], grad_ckpt=tuple(row["grad_ckpt"]),
                 ffn_recompute=row.get("ffn_recompute", True),
                 ffn_units=tuple(row["ffn_units"]) if row.get("ffn_units") is not None else None,
                 zero=zero, fsdp=bool(eng.get("fsdp")), gpus=row["world"], num_classes=row["num_classes"],
                 num_targets=row.get("num_targets", 10), embedding_dim=row.get("embedding_dim", 512),
                 head_parallel=row.get("head_parallel", "none"), sample_rate=row.get("sample_rate", 1.0),
                 grad_accum=row.get("grad_accum", 1), autocast_policy="cpu")


def _run_config(row: dict):
    from vtrain.config import ModelConfig, OptimConfig, ParallelConfig, RunConfig, TrainConfig

    eng = ENGINES[row["engine"]]
    model = ModelConfig(preset=row["preset"], grad_ckpt=list(row["grad_ckpt"]), head_parallel=row.get(
        "head_parallel", "none"), sample_rate=row.get("sample_rate", 1.0), embedding_dim=row.get("embedding_dim", 512))
    return RunConfig(task=row["task"], model=model, optim=OptimConfig(lr=1e-4, weight_decay=1e-4, clip_grad=0.1),
                     parallel=ParallelConfig(mixed_precision=row["precision"], fsdp=bool(eng.get("fsdp")),
                                             ds_config=str(ROOT / eng["ds_config"]) if "ds_config" in eng else None),
                     train=TrainConfig(batch_size=row["batch_size"], grad_accum=row.get("grad_accum", 1),
                                       output_dir="/tmp/vtrain-step-memory"))


class Marks:
    """Gradient markers: a post-accumulate-grad hook on every parameter notes its gradient's address."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.handles = [p.register_post_accumulate_grad_hook(self._hook) for p in params]

    @staticmethod
    def _hook(p: torch.Tensor) -> None:
        g = p.grad
        if g is None:
            return
        local = g.to_local() if hasattr(g, "to_local") else g
        with torch.profiler.record_function(f"vt_grad:{local.untyped_storage().data_ptr()}"):
            pass


ENGINE_HOOKS = {
    "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer": (
        "reduce_ready_partitions_and_remove_grads", "independent_gradient_partition_epilogue"),
    "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3": (
        "reduce_ready_partitions_and_remove_grads", "independent_gradient_partition_epilogue"),
    "deepspeed.runtime.zero.partitioned_param_coordinator.PartitionedParameterCoordinator": (
        "fetch_sub_module", "release_sub_module"),
    "deepspeed.runtime.zero.parameter_offload.DeepSpeedZeRoOffload": (
        "pre_sub_module_forward_function", "post_sub_module_forward_function", "pre_sub_module_backward_function",
        "post_sub_module_backward_function"),
}
# modules that register DeepSpeed's per-parameter gradient hooks through `register_grad_hook` (imported by name)
GRAD_HOOK_MODULES = ("deepspeed.runtime.zero.stage_1_and_2", "deepspeed.runtime.zero.stage3")
# methods during which every module hook registered is DeepSpeed's own (ZeRO-3's forward and backward module hooks)
MODULE_HOOK_SETUP = ("deepspeed.runtime.zero.parameter_offload.DeepSpeedZeRoOffload", "setup_zero_stage3_hooks")


def mark_engine_hooks() -> None:
    """Run DeepSpeed's gradient, parameter and module hooks inside a `vt_engine` marker (module docstring): the
    named methods, every hook it registers through `register_grad_hook` (ZeRO-1/2's `process_gradients`: bucket set-up
    and gradient copies outside the reduction itself), and ZeRO-3's module hooks."""
    import functools
    import importlib

    from torch.profiler import record_function

    def wrap(fn):
        @functools.wraps(fn)
        def marked(*args, **kwargs):
            with record_function("vt_engine"):
                return fn(*args, **kwargs)
        return marked

    for path, names in ENGINE_HOOKS.items():
        mod, cls = path.rsplit(".", 1)
        klass = getattr(importlib.import_module(mod), cls)
        for name in names:
            setattr(klass, name, wrap(getattr(klass, name)))
    for mod in GRAD_HOOK_MODULES:
        m = importlib.import_module(mod)
        register = m.register_grad_hook
        m.register_grad_hook = functools.wraps(register)(lambda param, hook, _r=register: _r(param, wrap(hook)))
    path, name = MODULE_HOOK_SETUP
    mod, cls = path.rsplit(".", 1)
    klass = getattr(importlib.import_module(mod), cls)
    setup = getattr(klass, name)

    @functools.wraps(setup)
    def registering(*args, **kwargs):
        module_cls = torch.nn.Module
        pre, post = module_cls.register_forward_pre_hook, module_cls.register_forward_hook
        module_cls.register_forward_pre_hook = lambda self, hook, *a, **k: pre(self, wrap(hook), *a, **k)
        module_cls.register_forward_hook = lambda self, hook, *a, **k: post(self, wrap(hook), *a, **k)
        try:
            return setup(*args, **kwargs)
        finally:
            module_cls.register_forward_pre_hook, module_cls.register_forward_hook = pre, post

    setattr(klass, name, registering)


def child(row: dict) -> dict:
    """One rank of one row: build through vtrain's engine, run `row['steps']` steps under the profiler, analyse."""
    from torch.profiler import ProfilerActivity, profile, record_function

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    prof.start()  # before anything is built: every storage of the run is seen
    from vtrain.engine.engines.accelerator import build_accelerator
    from vtrain.engine.head_shard import ShardedHead
    from vtrain.engine.optim import build_optimizer
    from vtrain.engine.engines.build import build_engine
    from vtrain.engine.engines.plan import resolve_plan
    from vtrain.memory.trace import build_model, step_inputs
    from vtrain.models.dino.msda import auto_impl

    setup = row_setup(row)
    cfg = _run_config(row)
    if row["engine"].startswith("zero"):
        mark_engine_hooks()
    plan = resolve_plan(cfg)
    accelerator = build_accelerator(plan, cfg.train.grad_accum)
    engine = build_engine(plan, accelerator)
    rank, world = plan_rank(), plan.world_size
    torch.manual_seed(0)
    with record_function("vt_build"):
        model = engine.shard(build_model(setup))
        head = (ShardedHead(cfg, row["num_classes"], rank, world, accelerator.device)
                if setup.sharded_head else None)
        # before the engine's own hooks (DeepSpeed moves a gradient into its bucket in a hook of the same kind)
        marks = Marks([p for p in model.parameters() if p.requires_grad] +
                      ([head.fc.weight] if head is not None else []))
        model, _ = engine.prepare(model, build_optimizer(model, cfg.optim, plan), head)
        # a constant schedule: the sharded head's update takes the schedule's multiplier (engine/head_shard.py), and
        # the engine steps it after each update and writes its LRs back (engines/base.py): the groups' own LRs
        engine.follow(types.SimpleNamespace(lr_lambdas=[lambda step: 1.0], last_epoch=0, step=lambda: None,
                                            get_last_lr=lambda: [g["lr"] for g in engine.param_groups()]))
        model.train()
    torch.manual_seed(1 + rank)
    inputs = {k: v.to(accelerator.device) for k, v in step_inputs(setup, torch.device("cpu")).items()}
    inputs["images"] = inputs["images"].to(engine.input_dtype)
    times = []
    for k in range(row["steps"]):
        t0 = time.perf_counter()
        with record_function(f"vt_step:{k}"):
            for i in range(cfg.train.grad_accum):
                with engine.sync_context(i == cfg.train.grad_accum - 1), auto_impl(setup.resolved_msda_impl()):
                    with record_function("vt_phase:forward"):
                        with engine.forward_context():
                            out = model(**inputs)
                        if head is not None:
                            out = head.loss(out, inputs["labels"])
                    with record_function("vt_phase:backward"):
                        engine.backward(out["loss"], cfg.train.grad_accum)
                    del out
            with record_function("vt_phase:optimizer"):
                engine.step(cfg.optim.clip_grad)
        times.append(time.perf_counter() - t0)
    for h in marks.handles:
        h.remove()
    prof.stop()
    active = _active(engine)
    accelerator.free_memory()
    del model, head, inputs, engine, marks  # the run's memory is free before the events are read
    gc.collect()
    result = analyse(prof)
    result.update(rank=rank, world=world, seconds=times, engine_active=active)
    return result


def plan_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _active(engine) -> dict:
    """What really ran (never trust a launch flag): the engine class, DDP wrap, ZeRO stage, DTensor parameters."""
    m = engine.model
    info = {"engine": type(engine).__name__, "ddp": isinstance(m, torch.nn.parallel.DistributedDataParallel),
            "world": torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1}
    stage = getattr(getattr(m, "zero_optimization_stage", None), "__call__", None)
    if stage is not None:
        info["zero_stage"] = m.zero_optimization_stage()
    info["dtensor"] = any(type(p).__name__ == "DTensor" for p in engine.module.parameters())
    return info


def _walk(nodes):
    stack = list(reversed(nodes))
    while stack:
        n = stack.pop()
        yield n
        stack.extend(reversed(n.children))


def analyse(prof) -> dict:
    """Live bytes over the run from the allocator's events; per step its peak and the phase it falls in, its
    activation peak (gradients left out) and what was live when it began."""
    from torch._C._profiler import _EventType

    allocs, marks = [], []
    for n in _walk(prof.profiler.kineto_results.experimental_event_tree()):
        if n.typed[0] == _EventType.Allocation:
            a = n.typed[1]
            if a.device.type == "cpu":
                allocs.append((n.start_time_ns, a.ptr, a.alloc_size, a.total_allocated))
        elif n.name.startswith("vt_"):
            marks.append((n.start_time_ns, n.end_time_ns, n.name))
    allocs.sort(key=lambda x: x[0])
    marks.sort()
    import bisect

    times = [t for t, _, _, _ in allocs]

    # gradients: the last allocation at the marked address before the marker
    grad_alloc: set[int] = set()
    last_at: dict[int, int] = {}
    grad_marks = sorted((t, int(name.split(":")[1])) for t, _, name in marks if name.startswith("vt_grad:"))
    gi = 0
    for i, (t, ptr, n, _) in enumerate(allocs):
        while gi < len(grad_marks) and grad_marks[gi][0] < t:
            at = last_at.get(grad_marks[gi][1])
            if at is not None:
                grad_alloc.add(at)
            gi += 1
        if n > 0:
            last_at[ptr] = i
    for _, ptr in grad_marks[gi:]:
        if ptr in last_at:
            grad_alloc.add(last_at[ptr])
    # the engine's storages: allocated inside a `vt_engine` marker
    spans: list[tuple[int, int]] = []
    for s, e, name in marks:  # sorted by start; nested markers merged into the outer one
        if name == "vt_engine":
            if spans and s <= spans[-1][1]:
                spans[-1] = (spans[-1][0], max(e, spans[-1][1]))
            else:
                spans.append((s, e))
    starts = [s for s, _ in spans]
    engine_alloc = set()
    for i, (t, _, n, _) in enumerate(allocs):
        k = bisect.bisect_right(starts, t) - 1
        if n > 0 and k >= 0 and t <= spans[k][1]:
            engine_alloc.add(i)
    # each gradient or engine allocation's matching free (the next free at its address) leaves the activation
    # curve too
    open_grad: dict[int, int] = {}
    open_engine: dict[int, int] = {}
    is_grad = [False] * len(allocs)
    is_engine = [False] * len(allocs)
    for i, (t, ptr, n, _) in enumerate(allocs):
        if n > 0 and i in grad_alloc:
            open_grad[ptr] = i
            is_grad[i] = True
        elif n > 0 and i in engine_alloc:
            open_engine[ptr] = i
            is_engine[i] = True
        elif n < 0 and ptr in open_grad:
            is_grad[i] = True
            del open_grad[ptr]
        elif n < 0 and ptr in open_engine:
            is_engine[i] = True
            del open_engine[ptr]
    live = [total for _, _, _, total in allocs]  # the reporter's running total over every thread
    steps = []
    for t0, t1, name in marks:
        if not name.startswith("vt_step:"):
            continue
        a, b = bisect.bisect_left(times, t0), bisect.bisect_right(times, t1)
        start = live[a - 1] if a else 0
        peak, at = start, a
        for i in range(a, b):
            if live[i] > peak:
                peak, at = live[i], i
        phases = [(s, e, nm.split(":")[1]) for s, e, nm in marks if nm.startswith("vt_phase:") and t0 <= s <= t1]
        where = next((p for s, e, p in phases if s <= times[at] <= e), "between phases") if at < len(times) else "-"
        phase_peaks = {}
        for s, e, p in phases:
            i0, i1 = bisect.bisect_left(times, s), bisect.bisect_right(times, e)
            phase_peaks[p] = max([phase_peaks.get(p, 0)] + live[i0:i1])
        # activations: what forward + backward allocate, gradients left out, from the step's start
        fb = [(s, e) for s, e, p in phases if p in ("forward", "backward")]
        act = cur = 0
        if fb:
            i0, i1 = bisect.bisect_left(times, fb[0][0]), bisect.bisect_right(times, fb[-1][1])
            for i in range(i0, i1):
                if not is_grad[i] and not is_engine[i]:
                    cur += allocs[i][2]
                    act = max(act, cur)
        grads_live = sum(allocs[i][2] for i in range(b) if is_grad[i] and allocs[i][2] > 0) - \
            sum(-allocs[i][2] for i in range(b) if is_grad[i] and allocs[i][2] < 0)
        steps.append({"peak": peak, "start": start, "phase": where, "phase_peaks": phase_peaks,
                      "activation": act, "grads_at_end": grads_live})
    return {"steps": steps, "grad_allocations": len(grad_alloc), "engine_allocations": len(engine_alloc),
            "events": len(allocs)}


def count_every_thread() -> None:
    """c10's flag: the CPU allocator's reporter keeps the live total over every thread (module docstring)."""
    import ctypes

    lib = Path(torch.__file__).parent / "lib" / "libc10.so"
    ctypes.c_bool.in_dll(ctypes.CDLL(str(lib)), "FLAGS_caffe2_report_cpu_memory_usage").value = True


def main() -> None:
    count_every_thread()
    row = json.loads(sys.argv[1])
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    print(json.dumps(child(row)), flush=True)


if __name__ == "__main__":
    main()


def run_row(row: dict, timeout: float = 3600) -> list[dict]:
    """Run one row in `row['world']` fresh processes (gloo between them); their results, by rank."""
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    procs = []
    for rank in range(row["world"]):
        e = dict(env)
        if row["world"] > 1:
            e.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(row["world"]), MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, __file__, json.dumps(row)], cwd=ROOT, env=e,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out = []
    for p in procs:
        so, se = p.communicate(timeout=timeout)
        lines = [ln for ln in so.splitlines() if ln.startswith("{")]
        if p.returncode != 0 or not lines:
            raise RuntimeError(f"rank failed ({p.returncode}): {se.strip().splitlines()[-1:] if se.strip() else so[-300:]}")
        out.append(json.loads(lines[-1]))
    return out
