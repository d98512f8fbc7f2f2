"""Face training step with a big class head: images/s and peak memory, head-parallel none vs sharded vs sampled.

One process measures what ONE rank of a W-process run computes and holds (`--world W`): its 1/W class shard of
fp32 weight + AdamW state, and logits of the gathered global batch (W x the micro-batch) against that shard. The
all-gather / all-reduce traffic itself is not measured (one process has none); `none` is the replicated head
(every rank holds all C classes and its own micro-batch's logits). Per step: forward, backward, backbone AdamW,
head AdamW (the sharded head's row-sparse AdamW, engine/head_shard.py).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/face_head.py                 # small CPU sizes
    PYTHONPATH=$PWD python benchmarks/face_head.py --gpu                              # the GPU sizes, one GPU

Writes benchmarks/results/face_head_<device>.json and .md.
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
MODES = [("none", 1.0), ("sharded", 1.0), ("sharded", 0.1)]


def peak_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # process peak RSS (never resets)


def measure(preset: str, classes: int, mode: str, rate: float, world: int, batch: int, steps: int, warmup: int,
            device: torch.device, dtype: torch.dtype | None) -> dict:
    cfg = RunConfig(task="metric", model=ModelConfig(preset=preset, head_parallel=mode, sample_rate=rate,
                                                     head="cosface"), optim=OptimConfig(lr=1e-3))
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
        if head is not None:
            head.step(1.0, None, 0.0)
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    head_rows = classes if head is None else head.fc.num_local
    return {"preset": preset, "classes": classes, "mode": mode, "sample_rate": rate, "world": world,
            "micro_batch": batch, "images_per_s": batch * steps / elapsed, "peak_mb": peak_mb(device),
            "head_rows_this_rank": head_rows, "loss": float(loss.detach())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpu", action="store_true", help="the GPU sizes: ViT-B, 100k/1M/2M identities, batch 256")
    ap.add_argument("--world", type=int, default=None, help="simulated number of processes for the sharded head")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--row", default=None, help=argparse.SUPPRESS)  # internal: one row, "classes:mode:rate"
    ap.add_argument("--classes", default=None, help="comma list of identity counts")
    args = ap.parse_args()
    if args.gpu:
        device, preset, batch, dtype = torch.device("cuda"), "vit-b", 256, torch.bfloat16
        classes, world, steps, warmup = [100_000, 1_000_000, 2_000_000], args.world or 8, args.steps or 30, 5
    else:
        device, preset, batch, dtype = torch.device("cpu"), "debug", 32, None
        classes, world, steps, warmup = [10_000, 100_000, 200_000], args.world or 4, args.steps or 5, 1
    if args.classes:
        classes = [int(c) for c in args.classes.split(",")]
    if args.row:
        c, mode, rate = args.row.split(":")
        print(json.dumps(measure(preset, int(c), mode, float(rate), world, batch, steps, warmup, device, dtype)))
        return
    rows = []
    for c in classes:
        for mode, rate in MODES:
            # a fresh process per row: its own peak (CPU peak RSS never resets), no allocator carry-over
            cmd = [sys.executable, __file__, "--row", f"{c}:{mode}:{rate}", "--world", str(world),
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
             f"| identities | head | sample rate | images/s | {mem} | head rows on this rank |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['classes']:,} | {r['mode']} | {r['sample_rate']} | {r['images_per_s']:.1f} | {r['peak_mb']:.0f} "
              f"| {r['head_rows_this_rank']:,} |" for r in rows]
    (out / f"face_head_{tag}{suffix}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
