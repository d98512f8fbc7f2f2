"""Face training step with a big class head: images/s and peak memory, head-parallel none vs sharded vs sampled.

One process measures what ONE rank of a W-process run computes and holds (`--world W`): its 1/W class shard of
fp32 weight + AdamW state, and logits of the gathered global batch (W x the micro-batch) against that shard. The
all-gather / all-reduce traffic itself is not measured (one process has none); `none` is the replicated head
(every rank holds all C classes and its own micro-batch's logits). Per step: forward, backward, backbone AdamW,
the head's clip norm and its AdamW (engine/head_shard.py; at sample rate 0.1 under both `--head-update` modes).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/face_head.py                 # small CPU sizes
    PYTHONPATH=$PWD python benchmarks/face_head.py --gpu                              # the GPU sizes, one GPU

Writes benchmarks/results/face_head_<device>.json and .md.

`--profile` measures the sharded head alone (no backbone) with torch.profiler on the CPU: forward on the gathered
batch, backward, the squared norm for clipping, the AdamW update, per step and by phase, for each `--head-update`
at sample rate 0.1, one rank's shard (`--classes C --world W`, gathered batch W x `--batch`):

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/face_head.py --profile --classes 100000 --world 1 --batch 128
    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/face_head.py --profile --classes 2000000 --world 8 --batch 32

Writes benchmarks/results/face_head_profile_<C>.json (`--out` names another file).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from vtrain.config import ModelConfig, OptimConfig, RunConfig
from vtrain.engine.head_shard import ShardedHead
from vtrain.models.metric import MarginHead
from vtrain.tasks import build_model

ROOT = Path(__file__).resolve().parent.parent
MODES = [("none", 1.0, "dense"), ("sharded", 1.0, "dense"), ("sharded", 0.1, "dense"), ("sharded", 0.1, "sampled")]
PHASES = ("head forward", "head backward", "head clip norm", "head update")


def peak_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # process peak RSS (never resets)


def measure(preset: str, classes: int, mode: str, rate: float, world: int, batch: int, steps: int, warmup: int,
            device: torch.device, dtype: torch.dtype | None, update: str = "dense") -> dict:
    cfg = RunConfig(task="metric", model=ModelConfig(preset=preset, head_parallel=mode, sample_rate=rate,
                                                     head="cosface", head_update=update if mode == "sharded"
                                                     else "dense"), optim=OptimConfig(lr=1e-3))
    torch.manual_seed(0)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    model = build_model("metric", cfg.model, 0).to(device)  # backbone + neck; the head below
    head_none = MarginHead(cfg.model.embedding_dim, classes, "cosface", 0.4).to(device) if mode == "none" else None
    params = list(model.parameters()) + (list(head_none.parameters()) if head_none is not None else [])
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.05)
    # one rank's shard of a `world`-process run, built in this process (rank 0's range)
    head = ShardedHead(cfg, classes, 0, world, device) if mode == "sharded" else None
    size = cfg.model.image_size
    images = torch.randn(batch, 3, size, size, device=device)
    gen = torch.Generator(device="cpu").manual_seed(1)
    t0 = None
    for i in range(warmup + steps):
        if i == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        # the gathered batch's labels: uniform over all identities (a 1/W share falls in this shard)
        labels = torch.randint(0, classes, (batch * (world if head is not None else 1),), generator=gen).to(device)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            emb = model(images)["embedding"]
        if head is None:
            loss, _ = head_none(emb, labels)
        else:  # the all-gathered embeddings of W ranks: this rank computes against W x the micro-batch
            loss = head.fc(emb.repeat(world, 1), labels)["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if head is not None:  # clipped by its own norm here (a run adds the backbone's): the same work
            head.step(1.0, head.grad_sq_norm().sqrt(), 1.0)
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    head_rows = classes if head is None else head.fc.num_local
    return {"preset": preset, "classes": classes, "mode": mode, "sample_rate": rate, "update": update, "world": world,
            "micro_batch": batch, "images_per_s": batch * steps / elapsed, "peak_mb": peak_mb(device),
            "head_rows_this_rank": head_rows, "loss": float(loss.detach())}


def profile_head(cfg: RunConfig, classes: int, world: int, gathered: int, steps: int = 5, warmup: int = 2) -> dict:
    """The sharded head of `cfg` alone, rank 0 of `world`, on CPU: torch.profiler's CPU time per step (ms) of each
    phase and the ops with the most self time, and the wall time of unprofiled steps. Labels uniform over all
    classes (1/W of them positives on this rank). Takes the config whole, so it runs on earlier versions too."""
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.manual_seed(0)
    head = ShardedHead(cfg, classes, 0, world, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    dim = cfg.model.embedding_dim

    cpu = dict.fromkeys(PHASES, 0.0)  # this thread's CPU seconds per phase (a shared machine's load aside)

    def phase(name: str, fn):
        t0 = time.thread_time()
        with record_function(name):
            out = fn()
        cpu[name] += time.thread_time() - t0
        return out

    def step() -> None:
        emb = torch.randn(gathered, dim, generator=gen).requires_grad_(True)
        labels = torch.randint(0, classes, (gathered,), generator=gen)
        loss = phase(PHASES[0], lambda: head.fc(emb, labels)["loss"])
        phase(PHASES[1], loss.backward)
        norm = phase(PHASES[2], lambda: head.grad_sq_norm().sqrt())
        phase(PHASES[3], lambda: head.step(1.0, norm, 1.0))

    for _ in range(warmup):
        step()
    cpu = dict.fromkeys(PHASES, 0.0)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    wall = (time.perf_counter() - t0) / steps
    thread_ms = {k: v * 1e3 / steps for k, v in cpu.items()}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    events = prof.key_averages()
    phases = {e.key: e.cpu_time_total / 1e3 / steps for e in events if e.key in PHASES}
    ops = sorted((e for e in events if e.key not in PHASES), key=lambda e: -e.self_cpu_time_total)[:8]
    return {"classes": classes, "world": world, "rows": head.fc.num_local, "gathered_batch": gathered,
            "sample_rate": cfg.model.sample_rate, "update": getattr(cfg.model, "head_update", "sampled (before)"),
            "wall_ms": wall * 1e3, "thread_cpu_ms": thread_ms, "phases_ms": {k: phases.get(k, 0.0) for k in PHASES},
            "total_ms": sum(phases.values()), "top_ops_ms": {e.key: e.self_cpu_time_total / 1e3 / steps for e in ops}}


def render_profile(rows: list[dict], note: str = "") -> str:
    first = rows[0]
    lines = [f"# Sharded face head per step, CPU profiler time ({first['classes']:,} identities)", "",
             f"One rank's shard: {first['rows']:,} x 512 rows of {first['classes']:,} identities over {first['world']} "
             f"processes, gathered batch {first['gathered_batch']}, sample rate {first['sample_rate']}; "
             "torch.profiler CPU time per step (ms), OMP_NUM_THREADS=1, on a shared 2-core machine (times under "
             "load: compare the rows of one table, measured in one session).", ""]
    if note:
        lines += [note, ""]
    lines += ["Profiler time (ms per step):", "",
              "| code | head update | forward | backward | clip norm | update | total | wall (unprofiled) |",
              "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        p = r["phases_ms"]
        lines.append(f"| {r.get('code', '')} | {r['update']} | " + " | ".join(f"{p[k]:.1f}" for k in PHASES)
                     + f" | {r['total_ms']:.1f} | {r['wall_ms']:.1f} |")
    lines += ["", "The same phases in this thread's CPU time (ms per step, unprofiled steps; less affected by the "
              "machine's load):", "", "| code | head update | forward | backward | clip norm | update | total |",
              "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        p = r["thread_cpu_ms"]
        lines.append(f"| {r.get('code', '')} | {r['update']} | " + " | ".join(f"{p[k]:.1f}" for k in PHASES)
                     + f" | {sum(p.values()):.1f} |")
    lines += ["", "Ops with the most self time (ms per step):", ""]
    for r in rows:
        ops = ", ".join(f"{k} {v:.1f}" for k, v in r["top_ops_ms"].items())
        lines.append(f"- {r.get('code', '')} {r['update']}: {ops}")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpu", action="store_true", help="the GPU sizes: ViT-B, 100k/1M/2M identities, batch 256")
    ap.add_argument("--world", type=int, default=None, help="simulated number of processes for the sharded head")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--row", default=None, help=argparse.SUPPRESS)  # internal: one row, "classes:mode:rate"
    ap.add_argument("--classes", default=None, help="comma list of identity counts")
    ap.add_argument("--profile", action="store_true", help="the sharded head alone under torch.profiler (CPU)")
    ap.add_argument("--batch", type=int, default=32, help="--profile: micro-batch per process")
    ap.add_argument("--rows-from", type=Path, default=None, help="--profile: a JSON of earlier rows to show first")
    ap.add_argument("--out", type=Path, default=None, help="--profile: output .json (the .md beside it)")
    args = ap.parse_args()
    if args.profile:
        classes = int(args.classes or 100_000)
        world, rows = args.world or 1, []
        if args.rows_from is not None:
            rows = json.loads(args.rows_from.read_text())["rows"]
        for update in ("dense", "sampled"):
            cfg = RunConfig(task="metric", model=ModelConfig(head_parallel="sharded", sample_rate=0.1,
                                                             head_update=update), optim=OptimConfig(lr=1e-3))
            row = {"code": "this", **profile_head(cfg, classes, world, world * args.batch, args.steps or 5)}
            rows.append(row)
            print(json.dumps(row), flush=True)
        out = args.out or ROOT / "benchmarks" / "results" / f"face_head_profile_{classes}.json"
        out.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
        out.with_suffix(".md").write_text(render_profile(rows))
        return
    if args.gpu:
        device, preset, batch, dtype = torch.device("cuda"), "vit-b", 256, torch.bfloat16
        classes, world, steps, warmup = [100_000, 1_000_000, 2_000_000], args.world or 8, args.steps or 30, 5
    else:
        device, preset, batch, dtype = torch.device("cpu"), "debug", 32, None
        classes, world, steps, warmup = [10_000, 100_000, 200_000], args.world or 4, args.steps or 5, 1
    if args.classes:
        classes = [int(c) for c in args.classes.split(",")]
    if args.row:  # classes:mode:rate[:update]
        c, mode, rate, *update = args.row.split(":")
        print(json.dumps(measure(preset, int(c), mode, float(rate), world, batch, steps, warmup, device, dtype,
                                 *update)))
        return
    rows = []
    for c in classes:
        for mode, rate, update in MODES:
            # a fresh process per row: its own peak (CPU peak RSS never resets), no allocator carry-over
            cmd = [sys.executable, __file__, "--row", f"{c}:{mode}:{rate}:{update}", "--world", str(world),
                   "--steps", str(steps)] + (["--gpu"] if args.gpu else [])
            r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
            rows.append(r)
            print(json.dumps(r), flush=True)
    tag = "gpu" if args.gpu else "cpu"
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.cuda.get_device_name() if args.gpu else "CPU (2 shared cores, OMP_NUM_THREADS=1)"
    suffix = ""
    (out / f"face_head_{tag}{suffix}.json").write_text(json.dumps({"device": dev, "rows": rows}, indent=1))
    mem = "peak allocated MiB" if args.gpu else "process peak RSS MiB (one process per row)"
    lines = [f"# face head benchmark ({dev})", "", f"{preset}, micro-batch {batch}, simulated world {world} "
             "for sharded rows (one rank's cost, no communication).", "",
             f"| identities | head | sample rate, head update | images/s | {mem} | head rows on this rank |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['classes']:,} | {r['mode']} | {r['sample_rate']} | {r['images_per_s']:.1f} | {r['peak_mb']:.0f} "
              f"| {r['head_rows_this_rank']:,} |" for r in rows]
    (out / f"face_head_{tag}{suffix}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
