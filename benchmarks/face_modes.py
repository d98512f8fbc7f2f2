"""The face demo under the face head's training choices, over seeds: `--head-update dense` against `sampled` (the demo's
own CosFace recipe with Partial FC at rate 0.5), and ArcFace's `--arcface-grad straight` against `chain`.

The recipe is `make demo`'s face command, read from the Makefile; each variant changes only its own flags (ArcFace
replaces `--head cosface` by `--head arcface`, margin 0.5, the demo's scale). Each seed is one `vtrain train` run in
a fresh output folder (`--seed S`, one thread), whose final evaluation is reported: TAR@FAR on the held-out
identities' sampled pairs (1,400 genuine / 78,400 impostor pairs), the 10-fold accuracy on the held-out `.bin`
pack, and the time: the median logged step time and the run's CPU seconds (user + system, evaluation included).

    PYTHONPATH=$PWD python benchmarks/face_modes.py --compare partial-fc --seeds 1 2 3
    PYTHONPATH=$PWD python benchmarks/face_modes.py --compare arcface --seeds 1 2 3

Writes benchmarks/results/face_modes_<compare>.md and .json. A run whose result is already in `--work` is not run
again (an interrupted comparison goes on). Times are those of a machine that may be shared: compare CPU seconds.
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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {
    "partial-fc": {"dense": ["--head-update", "dense"], "sampled": ["--head-update", "sampled"]},
    "arcface": {"straight": ["--head", "arcface", "--arcface-grad", "straight"],
                "chain": ["--head", "arcface", "--arcface-grad", "chain"]},
}
METRICS = [("TAR@FAR=0.1", "held-out TAR@FAR=0.1"), ("TAR@FAR=0.01", "held-out TAR@FAR=0.01"),
           ("TAR@FAR=0.001", "held-out TAR@FAR=0.001"), ("heldout/acc", "pack 10-fold accuracy")]


def makefile_face_flags(makefile: Path = ROOT / "Makefile") -> list[str]:
    """`make demo`'s face training flags (the `vtrain train --task metric` line of the demo recipe), without
    --output-dir."""
    text = makefile.read_text().replace("\\\n", " ")
    m = re.search(r"vtrain train (--task metric\b.*)$", text, re.M)
    if m is None:
        sys.exit(f"error: {makefile} has no `vtrain train --task metric` line")
    flags = shlex.split(m.group(1))
    i = flags.index("--output-dir") if "--output-dir" in flags else None
    return flags if i is None else flags[:i] + flags[i + 2:]


def with_flags(flags: list[str], extra: list[str]) -> list[str]:
    """`flags` with each option of `extra` set to its value there (replaced where `flags` has it)."""
    out = list(flags)
    for name, value in zip(extra[::2], extra[1::2]):
        if name in out:
            out[out.index(name) + 1] = value
        else:
            out += [name, value]
    return out


def run(flags: list[str], out: Path, seed: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "vtrain", "train", *flags, "--output-dir", str(out), "--seed", str(seed),
           "--threads", "1", "--overwrite-output-dir"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        sys.exit(f"error: {' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    last = json.loads((out / "eval.jsonl").read_text().splitlines()[-1])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"seed": seed, "step": last["step"], **{k: last[k] for k, _ in METRICS},
            "final_loss": rows[-1]["loss"], "train_acc": rows[-1]["train_acc"],
            "step_s": statistics.median(r["time"] for r in rows),
            "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), "wall_s": wall}


def summary(rows: list[dict]) -> dict:
    keys = [k for k, _ in METRICS] + ["final_loss", "step_s", "cpu_s"]
    return {k: {"mean": statistics.fmean(r[k] for r in rows), "min": min(r[k] for r in rows),
                "max": max(r[k] for r in rows)} for k in keys}


def render(compare: str, base: list[str], results: dict[str, list[dict]], seeds: list[int]) -> str:
    lines = [f"# Face demo: {compare} modes over seeds", "",
             "`make demo`'s face recipe (`debug` model from scratch on the built-in identities, 300 steps), one run per "
             "seed and variant, one thread, on a shared 2-core machine; final evaluation at step 300. Made by", "",
             f"    PYTHONPATH=$PWD python benchmarks/face_modes.py --compare {compare} --seeds "
             + " ".join(map(str, seeds)), "", "Base flags: `" + " ".join(base) + "`", ""]
    for name, extra in VARIANTS[compare].items():
        lines.append(f"- {name}: `{' '.join(extra)}`")
    lines += ["", "| variant | seed | " + " | ".join(label for _, label in METRICS)
              + " | final loss | step (s, median) | CPU s |", "|---|---:|" + "---:|" * (len(METRICS) + 3)]
    for name, rows in results.items():
        for r in rows:
            lines.append(f"| {name} | {r['seed']} | " + " | ".join(f"{r[k]:.4f}" for k, _ in METRICS)
                         + f" | {r['final_loss']:.3f} | {r['step_s']:.2f} | {r['cpu_s']:.0f} |")
    lines += ["", "Mean (min to max) over the seeds:", "",
              "| variant | " + " | ".join(label for _, label in METRICS) + " | final loss | step (s) | CPU s |",
              "|---|" + "---:|" * (len(METRICS) + 3)]
    for name, rows in results.items():
        s = summary(rows)
        cells = [f"{s[k]['mean']:.4f} ({s[k]['min']:.4f} to {s[k]['max']:.4f})" for k, _ in METRICS]
        cells += [f"{s['final_loss']['mean']:.3f}", f"{s['step_s']['mean']:.2f}", f"{s['cpu_s']['mean']:.0f}"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compare", choices=sorted(VARIANTS), required=True)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--work", type=Path, default=Path("/tmp/vtrain-face-modes"), help="the runs' output folders")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    base = makefile_face_flags()
    results: dict[str, list[dict]] = {}
    for seed in args.seeds:  # seed by seed, so that an interrupted comparison has every variant of its seeds
        for name, extra in VARIANTS[args.compare].items():
            out = args.work / f"{args.compare}-{name}-s{seed}"
            done = out / "face_modes.json"
            if done.is_file():
                row = json.loads(done.read_text())
            else:
                print(f"{args.compare} {name} seed {seed}: training ({out})", flush=True)
                row = run(with_flags(base, extra), out, seed)
                done.write_text(json.dumps(row))
            print(json.dumps({"variant": name, **row}), flush=True)
            results.setdefault(name, []).append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"face_modes_{args.compare.replace('-', '_')}"
    stem.with_suffix(".json").write_text(json.dumps({"base": base, "variants": VARIANTS[args.compare],
                                                     "results": results}, indent=1) + "\n")
    stem.with_suffix(".md").write_text(render(args.compare, base, results, args.seeds))


if __name__ == "__main__":
    main()
