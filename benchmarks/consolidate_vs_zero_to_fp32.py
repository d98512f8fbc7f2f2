"""Time and peak RSS of `vtrain consolidate` against DeepSpeed's own zero_to_fp32, on one ZeRO-3 checkpoint.

Creates (once) a 2-process ZeRO-3 checkpoint of the metric model with a large backbone (default vit-l,
303M backbone parameters: larger than DINO Swin-L's ~218M) by one training step on CPU, then runs each tool
in a fresh Python process that reports its own peak RSS. Prints a markdown table (commit it to
benchmarks/RESULTS.md).

    .venv/bin/python benchmarks/consolidate_vs_zero_to_fp32.py [--model vit-l] [--work /tmp/vtrain-bench]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TOOLS = {
    "vtrain consolidate -> .safetensors": """
from vtrain.tools.consolidate import consolidate
consolidate(CKPT, OUT + "/vtrain.safetensors")
""",
    "deepspeed convert_zero_checkpoint_to_fp32_state_dict (safetensors, 5GB shards)": """
from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict
convert_zero_checkpoint_to_fp32_state_dict(DS_DIR, OUT + "/ds_out", tag="pytorch_model", safe_serialization=True)
""",
    "deepspeed get_fp32_state_dict_from_zero_checkpoint + torch.save": """
import torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
sd = get_fp32_state_dict_from_zero_checkpoint(DS_DIR, tag="pytorch_model")
torch.save(sd, OUT + "/ds_eager.pt")
""",
}

PROBE = """
import json, resource, sys, time, os
os.environ.setdefault("DS_ACCELERATOR", "cpu")
CKPT, DS_DIR, OUT = sys.argv[1], sys.argv[2], sys.argv[3]
t0 = time.perf_counter()
exec(sys.argv[4])
print("RESULT " + json.dumps({"seconds": time.perf_counter() - t0,
                              "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def make_checkpoint(model: str, work: Path) -> Path:
    run = work / f"run-{model}"
    ckpts = sorted((run / "checkpoints").glob("step_*")) if (run / "checkpoints").exists() else []
    if ckpts:
        return ckpts[-1]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "accelerate_configs" / "ddp.yaml"), "--num_processes", "2", "-m", "vtrain", "train",
           "--model", model, "--data", "demo", "--output-dir", str(run), "--max-steps", "1", "--batch-size", "2",
           "--num-workers", "0", "--ds-config", str(ROOT / "ds_configs" / "zero3.json"), "--eval-every", "0"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(cmd, check=True, cwd=ROOT, env=env)
    return sorted((run / "checkpoints").glob("step_*"))[-1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="vit-l")
    ap.add_argument("--work", default="/tmp/vtrain-bench")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    ckpt = make_checkpoint(args.model, work)
    print(f"checkpoint {ckpt} ({time.perf_counter() - t0:.0f} s)")
    ds_dir = ckpt / "accelerate"
    size = sum(f.stat().st_size for f in (ds_dir / "pytorch_model").iterdir())
    rows = []
    for name, code in TOOLS.items():
        out = work / "out"
        subprocess.run(["rm", "-rf", str(out)], check=True)
        out.mkdir()
        proc = subprocess.run([sys.executable, "-c", PROBE, str(ckpt), str(ds_dir), str(out), code], cwd=ROOT,
                              capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="2"))
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            print(proc.stdout[-2000:], proc.stderr[-3000:])
            raise SystemExit(f"{name} failed")
        r = json.loads(line[7:])
        rows.append((name, r["seconds"], r["peak_rss_mib"]))
    print(f"\nZeRO-3 checkpoint of `{args.model}` (2 ranks, {size / 2**30:.2f} GiB on disk), "
          f"CPU: {os.cpu_count()} cores\n")
    print("| tool | wall time (s) | peak RSS (MiB) |")
    print("|---|---|---|")
    for name, sec, rss in rows:
        print(f"| {name} | {sec:.1f} | {rss:.0f} |")


if __name__ == "__main__":
    main()
