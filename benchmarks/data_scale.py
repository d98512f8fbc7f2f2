"""Data at the scale users train on: start-up time and memory of `vtrain train` with DataLoader workers, on
synthetic sets of the real sizes, measured as a user runs it.

Face sets (`faces`): insightface RecordIO directories with the real line counts of MS1MV3 (5,179,510 images of
93,431 identities: 5.27M .idx lines), Glint360k (17,091,657 / 360,232: 17.45M) and WebFace42M (42,474,557 /
2,059,906: 44.5M), docs/face.md §1.3. The `train.idx` is real and full size, its offsets increasing and as long
as in a set of ~3 KB records; the `train.rec` is a sparse file of that size holding the header record, 64 tiny real
JPEG image records and 8 identity-range records that all lines point at (legal RecordIO: a reader only seeks to an
offset), so it takes a few KB of disk. The header's values are float32, as insightface writes them.

Per set the benchmark reports
- in a fresh process (`probe`): the index build (cold cache) and the open of the cached index in a new process,
  the data set's pickle (what each DataLoader worker receives), this rank's sampler memory per own sample at 8
  ranks (tracemalloc of what the epoch's iterator keeps), the index on disk;
- `vtrain train --task metric --data DIR --num-workers W` (debug model, 16-d embeddings so the 2M-class head fits
  this machine; Partial FC over 10% of the classes, as such sets are trained), with a fresh cache (cold: the index
  is built) and again with it (cached): time to the first logged step, the peak PSS of the whole process tree (sum
  of /proc/<pid>/smaps_rollup Pss over the tree, sampled every 0.2 s), the largest DataLoader worker's private
  memory (USS; and without the index pages only it has mapped so far) and the main process's.
The run is stopped (SIGKILL, by pid) after --steps logged steps. `--vtrain-root` picks the checkout to measure
(the before figures: an older checkout).

Detection sets (`detection`): COCO 2017 and Objects365 shaped COCO files (benchmarks/detection_sets.py says how
they are made); per set the data set opened in a fresh process (index build cold, open cached, the pickle per
worker, the index on disk) and `vtrain train --task dino --model debug` with workers, cold and cached.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/data_scale.py faces --sets glint360k,webface42m
    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/data_scale.py detection --sets coco2017 --workers 2,4
    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/data_scale.py detection --sets objects365 --workers 1,2,4
    python benchmarks/data_scale.py render          # benchmarks/results/data_scale.json -> .md
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import detection_sets  # (this folder: benchmarks/)
from face_sets import FACE_SETS, face_set
import psutil

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "data_scale"
GIB = 2**30


# ---- measuring ----------------------------------------------------------------------------------------------------
PROBE = r"""
import json, os, pickle, sys, time, tracemalloc
import psutil
from vtrain.data.recordio import RecordFaces
from vtrain.data.sampler import ShardedEpochSampler

me = psutil.Process()
rss0 = me.memory_info().rss
t = time.perf_counter()
ds = RecordFaces(sys.argv[1], 112)
opened = time.perf_counter() - t
rss = me.memory_info().rss - rss0
state = len(pickle.dumps(ds))
batch = 128 if len(ds) >= 8 * 128 else 1
s = ShardedEpochSampler(len(ds), batch, 0, 8, seed=0)
tracemalloc.start()
t = time.perf_counter()
it = iter(s)
next(it)
sampler_s = time.perf_counter() - t
kept = tracemalloc.get_traced_memory()[0]
tracemalloc.stop()
own = s.batches_per_epoch * batch
print(json.dumps({"open_s": opened, "rss_of_open": rss, "pickle_bytes": state, "sampler_s": sampler_s,
                  "sampler_bytes": kept, "sampler_bytes_per_own_sample": kept / own, "images": len(ds),
                  "note": getattr(ds, "note", None)}))
"""


def _env(vtrain_root: Path, cache: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(vtrain_root), "VTRAIN_CACHE": str(cache), "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1"}


def probe(data: Path, vtrain_root: Path, cache: Path) -> dict:
    """Open the set in a fresh process: (index build or) open time, pickle, sampler memory."""
    # in vtrain_root: `python -c` puts the working directory first on sys.path
    proc = subprocess.run([sys.executable, "-c", PROBE, str(data)], cwd=vtrain_root, env=_env(vtrain_root, cache),
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise RuntimeError(f"probe failed: {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _rollup(pid: int) -> dict[str, int]:
    """Pss / Private_* of a process in bytes, from /proc/<pid>/smaps_rollup ({} once it is gone)."""
    out = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                parts = line.split()
                if len(parts) == 3 and parts[2] == "kB":
                    out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return {}
    return out


def _private_of_files(pid: int, under: str) -> int:
    """Private bytes of a process's mappings of files below `under` (the data index): page-cache pages that count
    as private only while no other process maps them (/proc/<pid>/smaps)."""
    total, inside = 0, False
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                parts = line.split()
                if parts and "-" in parts[0] and not parts[0].endswith(":"):
                    inside = len(parts) >= 6 and parts[5].startswith(under)
                elif inside and parts[0] in ("Private_Clean:", "Private_Dirty:"):
                    total += int(parts[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return 0
    return total


class TreeMonitor(threading.Thread):
    """Samples the PSS of a process tree and each process's USS every `period` s; remembers the peaks. A worker's
    USS includes the pages of the shared index that only it maps so far (a fault maps a whole large folio of the
    page cache, up to 2 MiB); those are also recorded apart (`index_private`), and the rest is its own memory."""

    def __init__(self, pid: int, index_dir: str, period: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.pid, self.period, self.index_dir = pid, period, index_dir
        self.peak_pss = 0
        self.uss: dict[int, int] = {}
        self.own: dict[int, int] = {}
        self.role: dict[int, str] = {}
        self.stop = threading.Event()

    def _tree(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def _roles(self, procs: list[psutil.Process]) -> None:
        for p in procs:
            if p.pid in self.role:
                continue
            try:
                cmd, parent = " ".join(p.cmdline()), p.ppid()
            except psutil.Error:
                continue
            if p.pid == self.pid:
                self.role[p.pid] = "main"
            elif "forkserver" in cmd and parent == self.pid:
                self.role[p.pid] = "forkserver"
            elif self.role.get(parent) == "forkserver":
                self.role[p.pid] = "worker"
            elif "resource_tracker" in cmd:
                self.role[p.pid] = "resource_tracker"

    def run(self) -> None:
        while not self.stop.is_set():
            procs = self._tree()
            self._roles(procs)
            total = 0
            for p in procs:
                r = _rollup(p.pid)
                total += r.get("Pss", 0)
                uss = r.get("Private_Clean", 0) + r.get("Private_Dirty", 0)
                self.uss[p.pid] = max(self.uss.get(p.pid, 0), uss)
                if self.role.get(p.pid) == "worker":
                    own = uss - _private_of_files(p.pid, self.index_dir)
                    self.own[p.pid] = max(self.own.get(p.pid, 0), own)
            self.peak_pss = max(self.peak_pss, total)
            self.stop.wait(self.period)

    def largest(self, role: str, of: dict[int, int] | None = None) -> int:
        return max((u for pid, u in (self.uss if of is None else of).items() if self.role.get(pid) == role),
                   default=0)


FACE_RUN = ["--task", "metric", "--batch-size", "16", "--embedding-dim", "16", "--head-parallel", "sharded",
            "--sample-rate", "0.1"]


def train_run(data: Path | list[str], workers: int, cache: Path, vtrain_root: Path, steps: int, timeout: float,
              task: list[str] = FACE_RUN) -> dict:
    """`vtrain train TASK` on `data` (--data DIR, or the data flags) as a user runs it; stopped after `steps`
    logged steps."""
    out = Path(tempfile.mkdtemp(prefix="vtrain_scale_run_"))
    cmd = [sys.executable, "-m", "vtrain", "train", *task, *(data if isinstance(data, list) else ["--data", str(data)]),
           "--num-workers", str(workers), "--output-dir", str(out / "run"), "--max-steps", str(steps + 100),
           "--log-every", "1", "--mixed-precision", "no", "--save-every", "100000"]
    log = open(out / "log.txt", "w")
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=vtrain_root, env=_env(vtrain_root, cache), stdout=log, stderr=subprocess.STDOUT)
    mon = TreeMonitor(proc.pid, str(cache / "index"))
    mon.start()
    first = done = None
    metrics = out / "run" / "metrics.jsonl"
    try:
        while proc.poll() is None and time.perf_counter() - t0 < timeout:
            n = len(metrics.read_text().splitlines()) if metrics.is_file() else 0
            if n >= 1 and first is None:
                first = time.perf_counter() - t0
            if n >= steps:
                done = time.perf_counter() - t0
                break
            time.sleep(0.1)
        time.sleep(0.3)  # one more sample with every worker up
    finally:
        mon.stop.set()
        mon.join()
        for p in reversed(mon._tree()):  # the processes this run started, by pid
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.Error:
                pass
        proc.wait()
        log.close()
    text = (out / "log.txt").read_text()
    shutil.rmtree(out, ignore_errors=True)
    if first is None:
        raise RuntimeError(f"no step logged (exit {proc.returncode}):\n{text[-3000:]}")
    notes = [line.strip() for line in text.splitlines() if "float32" in line][:1]
    return {"first_step_s": first, "steps_s": done, "load_avg_1m": load, "peak_tree_pss": mon.peak_pss,
            "worker_uss_max": mon.largest("worker"), "worker_own_max": mon.largest("worker", mon.own),
            "main_uss": mon.largest("main"),
            "workers_seen": sum(r == "worker" for r in mon.role.values()), "log_note": notes[0] if notes else None}


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def faces(args: argparse.Namespace) -> list[dict]:
    rows = []
    where = Path(args.data_dir)
    for name in args.sets.split(","):
        t = time.perf_counter()
        data = face_set(name, where)
        print(f"{name}: set ready in {time.perf_counter() - t:.0f} s ({(data / 'train.idx').stat().st_size / GIB:.2f} "
              f"GiB train.idx)", flush=True)
        cache = Path(tempfile.mkdtemp(prefix="vtrain_scale_cache_"))
        try:
            cold = probe(data, args.vtrain_root, cache)
            warm = probe(data, args.vtrain_root, cache)
            row = {"kind": "faces", "set": name, "label": args.label, "images": cold["images"],
                   "index_build_s": cold["open_s"], "index_open_s": warm["open_s"],
                   "index_disk_bytes": _du(cache / "index") if (cache / "index").is_dir() else 0,
                   "rss_of_open": warm["rss_of_open"], "pickle_bytes": warm["pickle_bytes"],
                   "sampler_s": warm["sampler_s"], "sampler_bytes": warm["sampler_bytes"],
                   "sampler_bytes_per_own_sample": warm["sampler_bytes_per_own_sample"], "note": warm["note"],
                   "runs": []}
            print(json.dumps({k: v for k, v in row.items() if k != "runs"}), flush=True)
            for workers in [int(w) for w in args.workers.split(",") if w]:
                for state in ("cold", "cached"):
                    if state == "cold":  # a cache without this set's index: the run builds it
                        shutil.rmtree(cache / "index", ignore_errors=True)
                    r = {"workers": workers, "cache": state,
                         **train_run(data, workers, cache, args.vtrain_root, args.steps, args.timeout)}
                    print(json.dumps(r), flush=True)
                    row["runs"].append(r)
            rows.append(row)
        finally:
            shutil.rmtree(cache, ignore_errors=True)
        if args.clean:
            shutil.rmtree(data, ignore_errors=True)
    return rows


# ---- results ------------------------------------------------------------------------------------------------------
BEFORE = {  # measured before the shared index on this 2-core machine, as filed (ranges over repeated runs)
    "glint360k": {"index": "0.81 GB per process, pickled whole to every worker (47-49 bytes per line)",
                  "sampler": "a list of (epoch, index) tuples: 0.7 GB per rank, 2 s per epoch",
                  "run": "--num-workers 2: first step after 32-34 s; 5.8 GiB for the tree; 0.87 GiB private per "
                         "worker"},
    "webface42m": {"index": "2.0 GB per process, pickled whole to every worker (47-49 bytes per line)",
                   "sampler": "a list of (epoch, index) tuples: 1.7 GB per rank, 7 s per epoch",
                   "header": "float32 rounds the first identity key 42,474,558 to 42,474,560: two identity records "
                             "read as images"},
}


def save(rows: list[dict], machine: str) -> None:
    path = RESULTS.with_suffix(".json")
    old = json.loads(path.read_text()) if path.is_file() else {"rows": []}
    key = lambda r: (r["kind"], r["set"], r["label"], r.get("fraction"))  # noqa: E731
    keep = [r for r in old["rows"] if key(r) not in {key(n) for n in rows}]
    doc = {"machine": machine, "before_as_filed": BEFORE, "rows": keep + rows}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    render(doc)


def _size(b: int) -> str:
    return f"{b / 2**20:.0f} MiB" if b >= 2**20 else f"{b / 1024:.1f} KiB"


def render(doc: dict) -> None:
    g = lambda b: f"{b / GIB:.2f} GiB"  # noqa: E731
    m = lambda b: f"{b / 2**20:.0f} MiB"  # noqa: E731
    out = ["# Data at scale: start-up and memory of `vtrain train` on synthetic sets of real sizes", "",
           f"Machine: {doc['machine']}. Generated by `benchmarks/data_scale.py` (its docstring says how the sets are "
           "made and what is measured). Timings are from a machine shared with other jobs (the 1-minute load average "
           "at the start of each run is given beside it; 2 cores): read them as rough. Memory is what to compare. "
           "`before` is the code before the shared index (the same benchmark, the same machine); `tiny` (1,000 "
           "images) is the start-up that does not depend on the set's size.", "",
           "## Face sets (insightface RecordIO)", "",
           "| set | code | .idx lines | images read | index build (cold) | index open (cached, new process) | memory "
           "the open set adds to a process (RSS) | index on disk | pickle per worker | sampler per own sample (8 "
           "ranks) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in [r for r in doc["rows"] if r["kind"] == "faces"]:
        lines = r["images"] + 1 + FACE_SETS[r["set"]].identities
        out.append(f"| {r['set']} | {r['label']} | {lines / 1e6:.2f}M | {r['images']:,} | {r['index_build_s']:.1f} s | "
                   f"{r['index_open_s']:.2f} s | {m(r['rss_of_open'])} | {m(r['index_disk_bytes'])} | "
                   f"{_size(r['pickle_bytes'])} | {r['sampler_bytes_per_own_sample']:.1f} B |")
    out += ["", "`vtrain train --task metric --num-workers W` (debug model, batch 16, 16-d embeddings, Partial FC "
            "over 10% of the classes on one process), stopped after the logged steps. A worker's USS counts the "
            "pages of the shared index that no other process has mapped yet (each fault maps a large page-cache "
            "folio, up to 2 MiB); they are one copy in the page cache for all processes, and become shared as the "
            "other workers touch them. The next column is the worker's USS without them. The main process's USS "
            "holds the model and, for the large sets, the sharded face head with its AdamW moments (WebFace42M: "
            "2,059,906 rows x 16 x 4 B x 3, 0.37 GiB) and, on one process, the sampler's order of the whole epoch "
            "(4 B per sample, 162 MiB at WebFace42M); a cold run also builds the index (its peak).", "",
            "| set | code | workers | index cache | first step (load avg) | peak PSS, whole tree | largest worker USS "
            "| its memory besides index pages | main USS |", "|---|---|---|---|---|---|---|---|---|"]
    for r in [r for r in doc["rows"] if r["kind"] == "faces"]:
        for x in r["runs"]:
            load = f" ({x['load_avg_1m']:.0f})" if "load_avg_1m" in x else ""
            out.append(f"| {r['set']} | {r['label']} | {x['workers']} | {x['cache']} | "
                       f"{x['first_step_s']:.0f} s{load} | "
                       f"{g(x['peak_tree_pss'])} | {m(x['worker_uss_max'])} | "
                       f"{m(x['worker_own_max']) if 'worker_own_max' in x else '-'} | {g(x['main_uss'])} |")
    notes = {r["set"]: r["note"] for r in doc["rows"] if r["kind"] == "faces" and r.get("note")}
    if notes:
        out += ["", "The line the run logs where the header's float32 range is made exact:", ""]
        out += [f"- {name}: `{note}`" for name, note in notes.items()]
    out += ["", "`images read`: the code before reads WebFace42M's header as float32 and takes two identity records "
            "for images (42,474,559).", "", "Face sets before (as filed, the same machine):", ""]
    for name, figures in doc["before_as_filed"].items():
        out += [f"- **{name}**: " + "; ".join(f"{k}: {v}" for k, v in figures.items())]
    out += detection_sets.render(doc)
    RESULTS.with_suffix(".md").write_text("\n".join(out) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--workers", default="2,4")
    common.add_argument("--steps", type=int, default=5)
    common.add_argument("--timeout", type=float, default=900)
    common.add_argument("--label", default="after", help="the name of the code measured (after / before)")
    common.add_argument("--vtrain-root", type=Path, default=ROOT, help="the checkout whose vtrain is run")
    common.add_argument("--data-dir", default=str(Path(tempfile.gettempdir()) / "vtrain_data_scale"),
                        help="where the generated sets are kept and reused")
    common.add_argument("--machine", default=f"{psutil.cpu_count()} CPUs, {psutil.virtual_memory().total / GIB:.0f} "
                                             "GiB, shared with other jobs")
    sub = ap.add_subparsers(dest="what", required=True)
    f = sub.add_parser("faces", parents=[common], help="insightface RecordIO sets")
    f.add_argument("--sets", default="tiny,glint360k,webface42m", help=f"comma list of {', '.join(FACE_SETS)}")
    f.add_argument("--clean", action="store_true", help="delete each generated set after its runs")
    d = sub.add_parser("detection", parents=[common], help="COCO-format sets (benchmarks/detection_sets.py)")
    d.add_argument("--sets", default="coco2017", help=f"comma list of {', '.join(detection_sets.DETECTION_SETS)}")
    d.add_argument("--fraction", type=float, default=1.0, help="write and measure this share of each set")
    d.add_argument("--states", default="cold,cached", help="index cache states to run `vtrain train` in")
    sub.add_parser("render", help="rewrite the .md from the .json")
    args = ap.parse_args()
    if args.what == "render":
        render(json.loads(RESULTS.with_suffix(".json").read_text()))
        return
    args.vtrain_root = args.vtrain_root.resolve()
    if args.what == "detection":
        save(detection_sets.run(args, train_run, _env, _du), args.machine)
    else:
        save(faces(args), args.machine)


if __name__ == "__main__":
    main()
