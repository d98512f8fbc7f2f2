"""Do short multi-process runs end cleanly? Many 2-process `vtrain train` runs in a row, and how each one exited.

A run that trained, saved and evaluated can still fail at interpreter exit: a native thread or handle that outlives
the process group aborts one rank ("terminate called without an active exception", SIGABRT), and the launcher
then reports a failed job. That happened now and then, so it needs many runs to see: this script runs `--runs`
short runs (engines in turn: DDP, FSDP2, DeepSpeed ZeRO-2, each with a checkpoint and an evaluation) through
`accelerate launch`, and reports for each engine how many exited 0, and for every other one its exit codes, the
ranks' own codes from the launcher's report and whether a rank aborted.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/exit_loop.py --runs 30
    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/exit_loop.py --runs 30 --busy 1   # one core kept busy

`--code DIR` runs the vtrain found in DIR (another checkout) instead of this one, for a before/after comparison.
Writes benchmarks/results/exit_loop.json (`--out` to change). The counts are what matters; times are those of a
machine that may be shared and are reported only as context.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENGINES = {  # name -> accelerate config, extra flags
    "ddp": ("ddp.yaml", []),
    "fsdp": ("fsdp.yaml", []),
    "zero2": ("ddp.yaml", ["--ds-config", "ds_configs/zero2.json"]),
}
ARGS = ["--num-workers", "0", "--embedding-dim", "16", "--head", "cosface", "--batch-size", "8", "--log-every", "1",
        "--max-steps", "2", "--save-every", "2", "--eval-every", "2"]
ABORT = re.compile(r"terminate called|SIGABRT|Signal 6\b|exitcode\s*:\s*-6")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_run(code: Path, engine: str, data: Path, out: Path, timeout: int) -> dict:
    acc_cfg, flags = ENGINES[engine]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(code / "accelerate_configs" / acc_cfg), "--num_processes", "2", "--num_machines", "1",
           "--main_process_port", str(_port()), "-m", "vtrain", "train", "--data", str(data), "--output-dir",
           str(out), *ARGS, *flags]
    env = dict(os.environ, PYTHONPATH=str(code), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=code, env=env, capture_output=True, text=True, timeout=timeout)
        rc, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = "timeout", (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
    return {"engine": engine, "rc": rc, "seconds": round(time.perf_counter() - t0, 1),
            "rank_codes": re.findall(r"exitcode\s*:\s*(-?\d+)", text), "aborted": bool(ABORT.search(text)),
            "saved": "saved " in text, "tail": "" if rc == 0 else text[-3000:]}


def _spin(_: int) -> None:
    while True:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--engines", default=",".join(ENGINES), help="comma-separated, run in turn")
    ap.add_argument("--busy", type=int, default=0, help="processes that keep a core busy meanwhile")
    ap.add_argument("--code", type=Path, default=ROOT, help="the checkout whose vtrain runs")
    ap.add_argument("--timeout", type=int, default=600, help="seconds before one run counts as hung")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "exit_loop.json")
    a = ap.parse_args()
    engines = a.engines.split(",")
    code = a.code.resolve()
    spinners = [multiprocessing.get_context("spawn").Process(target=_spin, args=(i,), daemon=True)
                for i in range(a.busy)]
    for p in spinners:
        p.start()
    results = []
    try:
        with tempfile.TemporaryDirectory(prefix="exit_loop_") as tmp:
            sys.path.insert(0, str(code))
            from vtrain.data.demo_faces import write_identity_tree

            data = Path(tmp) / "faces"
            write_identity_tree(data / "train", 0, 8, 4, seed=3)
            write_identity_tree(data / "val", 100, 4, 4, seed=3)
            for i in range(a.runs):
                r = one_run(code, engines[i % len(engines)], data, Path(tmp) / f"run{i}", a.timeout)
                results.append(r)
                print(f"run {i + 1}/{a.runs} {r['engine']}: exit {r['rc']} ranks {r['rank_codes'] or '-'}"
                      f"{' ABORT' if r['aborted'] else ''} ({r['seconds']} s)", flush=True)
    finally:
        for p in spinners:
            p.terminate()
    summary = {e: {"runs": sum(r["engine"] == e for r in results),
                   "exit_0": sum(r["engine"] == e and r["rc"] == 0 for r in results),
                   "aborted": sum(r["engine"] == e and r["aborted"] for r in results)} for e in engines}
    total = {"runs": len(results), "exit_0": sum(r["rc"] == 0 for r in results),
             "aborted": sum(r["aborted"] for r in results)}
    print("\n| engine | runs | exited 0 | a rank aborted |\n|---|---|---|---|")
    for e, s in {**summary, "all": total}.items():
        print(f"| {e} | {s['runs']} | {s['exit_0']} | {s['aborted']} |")
    for r in results:
        if r["rc"] != 0:
            print(f"\n--- {r['engine']}: exit {r['rc']} ---\n{r['tail']}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"code": str(code), "busy": a.busy, "summary": summary, "total": total,
                                 "runs": results}, indent=1))


if __name__ == "__main__":
    main()
