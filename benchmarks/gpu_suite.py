"""Every GPU figure of vtrain in one command, on one GPU: benchmarks/results/<device>.json and .md.

    python benchmarks/gpu_suite.py                      # on a GPU machine, <= 19 min (--budget)
    python benchmarks/gpu_suite.py --out $OUT --budget 540   # a machine whose commands are cut at 10 min
    python benchmarks/gpu_suite.py --dry-run            # no GPU: the same plumbing at tiny CPU shapes (~2 min)

Each measurement ("unit") is one subprocess of an existing benchmark script, so an OOM, a crash or a hang ends
that unit only: it is recorded as failed with its last error line and the suite goes on. The results are
written after every unit. A unit that the budget left no time for is `pending`. Previous results for the same
device (in --out, else in benchmarks/results/) are kept and their pending units run next time, so the same
command run again continues where the last one stopped (`--retry-failed` also re-runs failed units).

Time budget on one H100 (expected = a guess from the earlier H100 figures in docs/gpu_benchmarks.md; cap = the
unit's timeout). A unit starts only when the budget left covers its expected time.

| part | script | units | expected s | cap s |
|---|---|---|---|---|
| msda | msda_op.py (encoder + decoder shapes, PyTorch vs Triton) | 1 | 90 | 300 |
| dino | dino_memory_matrix.py (Swin-L 5-scale, b2, 800x1333, bf16) | 3 (GC choices) | 150, 80, 80 | 300, 200, 200 |
| face | face_head.py --gpu (ViT-B, b256; 100k/1M/2M ids x 3 heads) | 9 | 25 each | 120 each |
| estimate | vtrain estimate-memory beside the replicated-head rows | 3 | 30 each | 120 each |
| loop | loop_overhead.py --gpu (face vit-b, dino swin-l) | 2 | 150, 200 | 360, 420 |
| loop | the same with --compile (regional torch.compile, docs/compile.md) | 2 | 300, 400 | 600, 600 |

The msda unit runs first and compiles the Triton kernels (Triton caches them for the DINO rows). Each dino row
carries estimate-memory's prediction for its configuration beside what was measured: the total (the largest
point of the step's timeline) against the peak allocated, where each puts the peak, and the forward, backward
and optimizer-step points against each phase's own peak (docs/memory_estimate.md). The --compile rows
compile in their warm-up steps; a dry run skips them (compiling takes minutes on a CPU).

Expected in all: about 18 min without the compile rows. The device name, the torch, Triton and CUDA versions, the
date and the git commit (`--git-commit` where the tree travels without .git) are recorded with the figures.
`python benchmarks/render_gpu_table.py` then rewrites the table of docs/gpu_benchmarks.md from the JSON (done here
too when --out is benchmarks/results/).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import render_gpu_table as render  # the sibling script: run as `python benchmarks/gpu_suite.py`

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PY = sys.executable
GPU_CLASSES = (100_000, 1_000_000, 2_000_000)  # face_head.py --gpu
FACE_MODES = (("none", 1.0), ("sharded", 1.0), ("sharded", 0.1))
COMPILE_FLAG = "--compile"  # loop_overhead.py's option for its compiled rows


@dataclass
class Unit:
    part: str
    label: str
    cmd: list[str]
    expect_s: float
    cap_s: float
    parse: str  # how the result is read: dino | msda | loop | face | estimate
    env: dict[str, str] = field(default_factory=dict)
    classes: int | None = None  # estimate units: the face rows they go with
    skip: str | None = None  # a unit that cannot run here, and why

    @property
    def key(self) -> str:
        return f"{self.part}/{self.label}"


# ---- the units ----------------------------------------------------------------------------------------------------

def _script(name: str, *args: str) -> list[str]:
    return [PY, str(HERE / name), *args]


def _has_compile_option() -> bool:
    return COMPILE_FLAG in (HERE / "loop_overhead.py").read_text()


def units(dry_run: bool) -> list[Unit]:
    """Every measurement, most wanted first. A dry run keeps one unit of each kind, at tiny CPU shapes."""
    out: list[Unit] = []
    # first: it compiles the Triton kernels alone, under its own cap, and the DINO rows then find them in Triton's
    # cache. The CPU run is msda_op.py's own: the interpreter at a small shape (one head: the interpreter is slow).
    cmd = _script("msda_op.py", *(["--heads", "1"] if dry_run else []), "--out", "{work}/msda.json")
    out.append(Unit("msda", "encoder + decoder", cmd, 30 if dry_run else 90, 300, "msda",
                    env={"TRITON_INTERPRET": "1"} if dry_run else {}))
    if dry_run:
        dino = ["--preset", "debug", "--image-size", "128x160", "--batch-size", "1", "--warmup", "1", "--steps", "1"]
        gcs, dino_times = ["none"], [(40, 240)]
    else:
        dino = ["--preset", "swin-l", "--image-size", "800x1333", "--batch-size", "2"]
        gcs, dino_times = ["none", "backbone", "backbone+encoder"], [(150, 300), (80, 200), (80, 200)]
    for gc, (expect, cap) in zip(gcs, dino_times):
        cmd = _script("dino_memory_matrix.py", *dino, "--precision", "bf16", "--gc", gc, "--engine", "single",
                      "--out-dir", "{work}")
        out.append(Unit("dino", gc, cmd, expect, cap, "dino"))
    if dry_run:
        rows, est = [(10_000, "none", 1.0)], [10_000]
        face = ["--world", "4", "--steps", "1"]
        estimate = ["--model", "debug", "--batch-size", "32", "--mixed-precision", "no"]
    else:
        rows, est = [(c, m, r) for c in GPU_CLASSES for m, r in FACE_MODES], list(GPU_CLASSES)
        face = ["--gpu", "--world", "8"]
        estimate = ["--model", "vit-b", "--batch-size", "256", "--mixed-precision", "bf16"]
    for c, mode, rate in rows:
        out.append(Unit("face", f"{c:,} {mode} {rate}", _script("face_head.py", *face, "--row", f"{c}:{mode}:{rate}"),
                        15 if dry_run else 25, 120, "face"))
    for c in est:
        out.append(Unit("estimate", f"metric {c:,} identities",
                        [PY, "-m", "vtrain", "estimate-memory", "--task", "metric", *estimate, "--image-size", "112",
                         "--num-classes", str(c), "--no-compare-gc", "--json"], 15 if dry_run else 30, 120,
                        "estimate", classes=c))
    cases = [("face debug", 30, 240)] if dry_run else [("face vit-b", 150, 360), ("dino swin-l", 200, 420)]
    steps = ["--warmup", "1", "--steps", "1"] if dry_run else ["--gpu"]
    for case, expect, cap in cases:
        out.append(Unit("loop", case, _script("loop_overhead.py", *steps, "--only", case, "--json", "{work}/loop.json"),
                        expect, cap, "loop"))
    for case, _, _ in cases:
        unit = Unit("loop", f"{case} {COMPILE_FLAG}", _script("loop_overhead.py", *steps, "--only", case,
                                                              COMPILE_FLAG, "--json", "{work}/loop.json"),
                    300 if "face" in case else 400, 600, "loop")
        if not _has_compile_option():
            unit.skip = f"benchmarks/loop_overhead.py has no {COMPILE_FLAG} option yet"
        elif dry_run:
            unit.skip = "not in a dry run: compiling takes minutes on a CPU"
        out.append(unit)
    return out


# ---- running one unit ---------------------------------------------------------------------------------------------

def last_error(stderr: str, stdout: str = "") -> str:
    """The line that says what went wrong: an OOM is named as such, else the last line of stderr (or stdout)."""
    text = stderr + "\n" + stdout
    if "OutOfMemoryError" in text or "CUDA out of memory" in text:
        m = re.search(r"Tried to allocate [\d.]+ [KMGT]?i?B", text)
        return "OOM" + (f": {m.group(0)}" if m else "")
    lines = [ln.strip() for ln in (stderr.strip() or stdout.strip()).splitlines() if ln.strip()]
    return (lines[-1] if lines else "no output")[-300:]


def run_command(cmd: list[str], env: dict[str, str], timeout: float, log_dir: Path) -> dict:
    """Run `cmd` in its own process group, killed whole (with the children it started) after `timeout` s."""
    out_p, err_p = log_dir / "stdout.txt", log_dir / "stderr.txt"
    t0 = time.monotonic()
    with open(out_p, "w") as out, open(err_p, "w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            timed_out = True
        finally:
            try:  # workers a finished benchmark left behind (DataLoader, compile pools) must not hold the GPU
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return {"returncode": proc.returncode, "timed_out": timed_out, "seconds": time.monotonic() - t0,
            "stdout": out_p.read_text(errors="replace"), "stderr": err_p.read_text(errors="replace")}


def parse(unit: Unit, stdout: str, work: Path) -> dict:
    """The unit's figures from what its script wrote; raises ValueError with a reason when there are none."""
    if unit.parse == "dino":
        (row,) = json.loads(next(work.glob("dino_memory_matrix_*.json")).read_text())
        if row.get("error"):
            raise ValueError(row["error"])
        return row
    if unit.parse == "msda":
        return {"rows": json.loads((work / "msda.json").read_text())}
    if unit.parse == "loop":
        return {"rows": json.loads((work / "loop.json").read_text())}
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    if not lines:
        raise ValueError("no JSON line in the output")
    data = json.loads(lines[-1])
    if unit.parse == "face":
        return data
    est = data["estimate_gib"]
    return {"classes": unit.classes, "estimate_gib": est["total"] - est["overhead"], "setup": data["setup"],
            "trace_seconds": data.get("trace_seconds")}


def run_unit(unit: Unit, timeout: float, budget_cut: bool, scratch: Path) -> dict:
    """Run one unit; its record for the results. `budget_cut`: `timeout` is what the budget left, not the cap,
    so a unit killed by it is pending (to run again), not failed."""
    work = Path(tempfile.mkdtemp(prefix=re.sub(r"\W+", "_", unit.key) + "_", dir=scratch))
    cmd = [c.replace("{work}", str(work)) for c in unit.cmd]
    env = dict(os.environ, PYTHONUNBUFFERED="1", **unit.env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # every benchmark is its own one-process world
    r = run_command(cmd, env, timeout, work)
    record = {"part": unit.part, "label": unit.label, "cap_s": unit.cap_s, "seconds": round(r["seconds"], 1),
              "command": " ".join(c.replace(str(ROOT) + "/", "").replace(PY, "python") for c in unit.cmd)}
    if r["timed_out"]:
        if budget_cut:
            return {**record, "status": "pending", "note": f"stopped after {timeout:.0f} s: the budget ran out"}
        return {**record, "status": "failed", "error": f"timeout after {timeout:.0f} s",
                "tail": r["stderr"].splitlines()[-15:]}
    if r["returncode"] != 0:
        return {**record, "status": "failed", "error": last_error(r["stderr"], r["stdout"]),
                "tail": r["stderr"].splitlines()[-15:]}
    try:
        return {**record, "status": "ok", "result": parse(unit, r["stdout"], work)}
    except (OSError, ValueError, KeyError, StopIteration) as e:
        return {**record, "status": "failed", "error": f"no result: {e}"[-300:], "tail": r["stderr"].splitlines()[-15:]}


def decide(unit: Unit, left_s: float) -> tuple[bool, float, bool]:
    """(start it?, its timeout, whether that timeout is the budget's rather than the unit's cap)."""
    if left_s < unit.expect_s:
        return False, 0.0, False
    return True, min(unit.cap_s, left_s), left_s < unit.cap_s


# ---- the device and the results file ------------------------------------------------------------------------------

def device_info(dry_run: bool) -> dict:
    """Asked in a child process, so that this one never holds a CUDA context (GPU memory) while units run."""
    code = ("import json, platform, torch\n"
            "try:\n import triton; tv = triton.__version__\nexcept Exception: tv = None\n"
            "c = torch.cuda.is_available()\n"
            "p = torch.cuda.get_device_properties(0) if c else None\n"
            "print(json.dumps({'cuda_available': c, 'name': torch.cuda.get_device_name(0) if c else "
            "'cpu (' + (platform.processor() or platform.machine()) + ')', 'capability': list(torch.cuda."
            "get_device_capability(0)) if c else None, 'memory_gib': p.total_memory / 2**30 if c else None, "
            "'torch': torch.__version__, 'triton': tv, 'cuda': torch.version.cuda, 'python': platform."
            "python_version()}))")
    info = json.loads(subprocess.run([PY, "-c", code], capture_output=True, text=True, check=True,
                                     cwd=ROOT).stdout.strip().splitlines()[-1])
    if dry_run:
        info["name"] = f"{info['name']}, dry run"
    return info


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def git_state(given: str | None) -> tuple[str, bool | None]:
    if given:
        return given, None
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                    capture_output=True, text=True, check=True).stdout.strip())
        return commit, dirty
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git repository; pass --git-commit)", None


def previous(out_dir: Path, name: str, dry_run: bool) -> dict | None:
    """Earlier results for this device: from --out, else from benchmarks/results/."""
    for folder in (out_dir, render.RESULTS):
        path = folder / f"{slug(name)}.json"
        if path.is_file():
            data = json.loads(path.read_text())
            if data.get("format") == render.FORMAT and data["device"]["name"] == name and \
                    bool(data.get("dry_run")) == dry_run:
                return data
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None,
                    help="folder for <device>.json and .md (default benchmarks/results/; a temp folder for --dry-run)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds this invocation may take (default 1140 = 19 min; 600 with --dry-run)")
    ap.add_argument("--dry-run", action="store_true", help="no GPU needed: one unit of each kind at tiny CPU shapes")
    ap.add_argument("--parts", default=None, help="comma list of parts to run (dino, msda, face, estimate, loop)")
    ap.add_argument("--retry-failed", action="store_true", help="run failed units of earlier invocations again")
    ap.add_argument("--git-commit", default=None, help="the commit measured, where the tree has no .git")
    a = ap.parse_args()
    t_start = time.monotonic()
    budget = a.budget or (600.0 if a.dry_run else 1140.0)
    device = device_info(a.dry_run)
    if not device["cuda_available"] and not a.dry_run:
        raise SystemExit("gpu_suite: no CUDA device here. On a GPU machine: python benchmarks/gpu_suite.py; "
                         "without one, --dry-run checks the plumbing at tiny CPU shapes (its numbers mean nothing)")
    out_dir = a.out or (Path(tempfile.gettempdir()) / "vtrain-gpu-suite" if a.dry_run else render.RESULTS)
    out_dir.mkdir(parents=True, exist_ok=True)
    commit, dirty = git_state(a.git_commit)
    run = {"started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "git_commit": commit, "git_dirty": dirty, "budget_s": budget, "torch": device["torch"],
           "triton": device["triton"]}
    res = previous(out_dir, device["name"], a.dry_run) or {
        "format": render.FORMAT, "version": 1, "dry_run": a.dry_run, "runs": [], "units": {}}
    res["device"] = device
    res["runs"].append(run)
    stem = out_dir / slug(device["name"])

    def save() -> None:
        run["seconds"] = round(time.monotonic() - t_start, 1)
        stem.with_suffix(".json").write_text(json.dumps(res, indent=1))
        stem.with_suffix(".md").write_text(f"# vtrain GPU suite: {device['name']}\n\n" +
                                           render.render(res, detail=True))

    parts = set(a.parts.split(",")) if a.parts else None
    print(f"gpu_suite: {device['name']}, torch {device['torch']}, Triton {device['triton']}; budget {budget:.0f} s; "
          f"results in {stem}.json", flush=True)
    with tempfile.TemporaryDirectory(prefix="vtrain-gpu-suite-") as scratch:
        for unit in units(a.dry_run):
            old = res["units"].get(unit.key)
            if parts is not None and unit.part not in parts:
                continue
            if unit.skip:
                res["units"][unit.key] = {"part": unit.part, "label": unit.label, "status": "skipped",
                                          "note": unit.skip}
                print(f"[{unit.key}] skipped: {unit.skip}", flush=True)
                continue
            if old and (old["status"] == "ok" or (old["status"] == "failed" and not a.retry_failed)):
                continue  # measured by an earlier invocation
            left = budget - (time.monotonic() - t_start)
            start, timeout, budget_cut = decide(unit, left)
            if not start:
                res["units"][unit.key] = {"part": unit.part, "label": unit.label, "status": "pending",
                                          "note": f"not started: {left:.0f} s of the budget left, "
                                                  f"it expects {unit.expect_s:.0f} s"}
                continue
            print(f"[{unit.key}] running (expected {unit.expect_s:.0f} s, timeout {timeout:.0f} s)", flush=True)
            record = run_unit(unit, timeout, budget_cut, Path(scratch))
            record["run"] = len(res["runs"]) - 1
            res["units"][unit.key] = record
            print(f"[{unit.key}] {record['status']} in {record['seconds']:.0f} s"
                  + (f": {record.get('error') or record.get('note')}" if record["status"] != "ok" else ""), flush=True)
            save()
    save()
    if out_dir.resolve() == render.RESULTS.resolve():
        render.DOC.write_text(render.rewrite(render.DOC, render.render_block(render.load_results())))
    print("\n" + render.render(res))
    pending = [k for k, u in res["units"].items() if u["status"] == "pending"]
    failed = [k for k, u in res["units"].items() if u["status"] == "failed"]
    print(f"wrote {stem}.json and .md; {len(pending)} pending"
          + (f" (run the same command again: {', '.join(pending)})" if pending else "")
          + f"; {len(failed)} failed" + (f" ({', '.join(failed)})" if failed else ""), flush=True)


if __name__ == "__main__":
    main()
