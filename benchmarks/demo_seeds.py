"""How much does `make demo`'s detection result depend on the seed? The demo's DINO recipe, run for several seeds.

The recipe is read from the Makefile (`DEMO_DINO_FLAGS`), so what is measured is what `make demo` runs; `--flags`
replaces it (to try another one) and `--extra` adds flags to it. Each seed is one `vtrain train --deterministic`
run in a fresh output folder with the given intra-op thread count (a run's numbers depend on it: docs/determinism.md
§2), whose final evaluation (COCO AP on the 40 held-out demo images, from the run's eval.jsonl) is reported with the
mean, the spread (max - min) and the largest distance from the mean.

    PYTHONPATH=$PWD python benchmarks/demo_seeds.py --seeds 1 2 3 --threads 2

Writes benchmarks/results/demo_seeds.md and .json (`--out` names another stem). Seeds run one after the other; to
run them side by side, give each its own `--out` and join their .json files with `--collect A.json B.json ...`
(same flags and thread count required). Times are those of a machine that may be shared and are given only as
context; `cpu_s` (the run's user + system CPU seconds, its loader worker included) says what the run itself cost.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def makefile_flags(makefile: Path = ROOT / "Makefile") -> list[str]:
    """The DINO demo's training flags, as the Makefile's `DEMO_DINO_FLAGS` variable holds them."""
    text = makefile.read_text().replace("\\\n", " ")
    m = re.search(r"^DEMO_DINO_FLAGS\s*:?=(.*)$", text, re.M)
    if m is None:
        sys.exit(f"error: {makefile} has no DEMO_DINO_FLAGS variable")
    return shlex.split(m.group(1))


def run_seed(flags: list[str], seed: int, threads: int, work: Path) -> dict:
    out = work / f"seed{seed}"
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "vtrain", "train", *flags, "--output-dir", str(out), "--seed", str(seed),
           "--deterministic", "--threads", str(threads)]
    t0, before = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    seconds, after = time.monotonic() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode != 0:
        sys.exit(f"error: seed {seed} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    last = json.loads((out / "eval.jsonl").read_text().splitlines()[-1])
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"seed": seed, "step": last["step"], "AP": 100 * last["AP"], "AP50": 100 * last["AP50"],
            "AP75": 100 * last["AP75"], "final_loss": losses[-1], "seconds": round(seconds, 1),
            "cpu_s": round(cpu, 1)}


def summary(rows: list[dict]) -> dict:
    aps = [r["AP"] for r in rows]
    mean = statistics.fmean(aps)
    return {"mean_AP": mean, "min_AP": min(aps), "max_AP": max(aps), "spread": max(aps) - min(aps),
            "max_dev": max(abs(a - mean) for a in aps), "mean_AP50": statistics.fmean(r["AP50"] for r in rows)}


def model_of(flags: list[str]) -> str:
    return flags[flags.index("--model") + 1] if "--model" in flags else "debug"


def render(flags: list[str], threads: int, rows: list[dict], s: dict, extra: str = "") -> str:
    lines = ["# DINO demo over seeds", "",
             f"`make demo`'s detection recipe (`{model_of(flags)}` from scratch on the built-in shapes, 40 held-out images, "
             "COCO AP of the final checkpoint), one `--deterministic` run per seed with "
             f"OMP_NUM_THREADS={threads} / `--threads {threads}`, made by", "",
             "    PYTHONPATH=$PWD python benchmarks/demo_seeds.py --seeds " + " ".join(str(r["seed"]) for r in rows)
             + f" --threads {threads}" + (f" --extra {shlex.quote(extra)}" if extra else ""), "",
             "Flags: `" + " ".join(flags) + "`", "",
             "| seed | step | AP | AP50 | AP75 | final loss | time (s) | CPU (s) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        cpu = f"{r['cpu_s']:.0f}" if "cpu_s" in r else "-"
        lines.append(f"| {r['seed']} | {r['step']} | {r['AP']:.1f} | {r['AP50']:.1f} | {r['AP75']:.1f} | "
                     f"{r['final_loss']:.3f} | {r['seconds']:.0f} | {cpu} |")
    lines += ["", f"AP {s['min_AP']:.1f} to {s['max_AP']:.1f} over {len(rows)} seeds: mean {s['mean_AP']:.1f}, "
                  f"largest distance from the mean {s['max_dev']:.1f} (AP50 mean {s['mean_AP50']:.1f}).", ""]
    return "\n".join(lines)


def collect(files: list[Path], out: Path) -> None:
    """Join the .json files of seeds run side by side (one `--out` each) into one table."""
    parts = [json.loads(f.read_text()) for f in files]
    first = parts[0]
    for f, part in zip(files, parts):
        if (part["flags"], part["threads"]) != (first["flags"], first["threads"]):
            sys.exit(f"error: {f} ran other flags or threads than {files[0]}")
    rows = sorted((r for part in parts for r in part["runs"]), key=lambda r: r["seed"])
    s = summary(rows)
    out.with_suffix(".json").write_text(json.dumps({"flags": first["flags"], "threads": first["threads"],
                                                    "runs": rows, "summary": s}, indent=1) + "\n")
    out.with_suffix(".md").write_text(render(first["flags"], first["threads"], rows, s))
    print(render(first["flags"], first["threads"], rows, s))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads (make demo runs --threads 2)")
    ap.add_argument("--flags", help="the recipe's flags as one string (default: the Makefile's DEMO_DINO_FLAGS)")
    ap.add_argument("--extra", default="", help="flags added to the recipe, as one string")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/demo_seeds"), help="output path without suffix")
    ap.add_argument("--collect", nargs="+", metavar="JSON", help="join these runs' .json files instead of training")
    args = ap.parse_args()
    flags = (shlex.split(args.flags) if args.flags else makefile_flags()) + shlex.split(args.extra)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.collect:
        collect([Path(f) for f in args.collect], out)
        return
    rows = []
    with tempfile.TemporaryDirectory(prefix="vtrain-demo-seeds-") as work:
        for seed in args.seeds:
            rows.append(run_seed(flags, seed, args.threads, Path(work)))
            print(json.dumps(rows[-1]), flush=True)
            # written after every seed, so an interrupted sweep keeps what it measured
            s = summary(rows)
            out.with_suffix(".json").write_text(json.dumps({"flags": flags, "threads": args.threads, "runs": rows,
                                                            "summary": s}, indent=1) + "\n")
            out.with_suffix(".md").write_text(render(flags, args.threads, rows, s, args.extra))
    print(render(flags, args.threads, rows, s, args.extra))


if __name__ == "__main__":
    main()
