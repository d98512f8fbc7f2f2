"""IJB-C at its real size without the network: how long vtrain's IJB route takes, and how much memory it holds, to
read the protocol, pool face features into templates, score every template pair and make the TAR@FAR table.

A synthetic protocol of IJB-C's size is written first (not timed): 469,375 faces in 23,124 templates of 3,531
subjects (faces spread over media ids, some media shared by several faces as a video's frames), 15,658,489 template
pairs of which 19,557 genuine, the three files in the release layout (image names `<n>.jpg`, which are not created:
the image check and decoding are the network's side and are left out). Features are random 512-d vectors made batch
by batch as the embedding loop gets them (what the model would return), so no face feature is held.

    PYTHONPATH=$PWD python benchmarks/ijb_scale.py [--faces 469375 --templates 23124 --pairs 15658489]

The files are written by a separate process (this script with --write-only), so nothing of the writer's memory is
in the figures. The measuring process imports what the route uses (numpy, pandas, vtrain's IJB modules) and then runs
the phases in order. Per phase: its wall time, the resident memory at its start (what earlier phases still hold) and
its peak (the process's high-water mark, reset before the phase by writing 5 to /proc/self/clear_refs; Linux >= 4.0),
so each phase's figure is its own. Written to benchmarks/results/ijb_scale.json (the .md page is written by hand
from it). Times are those of a machine that may be shared (say so when you publish them); memory figures are stable.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
IJBC = {"faces": 469_375, "templates": 23_124, "subjects": 3_531, "pairs": 15_658_489, "genuine": 19_557}


def memory_mib() -> dict[str, float]:
    """This process's resident memory now and its high-water mark since the last `reset_peak` (MiB)."""
    status = Path("/proc/self/status").read_text()
    return {k: int(re.search(rf"{k}:\s+(\d+) kB", status).group(1)) / 1024 for k in ("VmRSS", "VmHWM")}


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark := the current resident memory


def write_protocol(root: Path, faces: int, templates: int, subjects: int, pairs: int, genuine: int,
                   rng: np.random.Generator) -> None:
    meta = root / "meta"
    meta.mkdir(parents=True)
    (root / "loose_crop").mkdir()
    tid = np.sort(rng.integers(0, templates, faces))
    tid[:templates] = np.arange(templates)  # every template has a face
    tid.sort()
    media = tid * 10 + rng.integers(0, 6, faces)  # a few media per template, shared by several faces
    subject = rng.integers(0, subjects, templates)
    names = np.char.add(np.arange(1, faces + 1).astype(str), ".jpg")
    ids = 1 + tid  # template ids as in the release: 1..
    with open(meta / "ijbc_face_tid_mid.txt", "w") as f:
        for a, b, c in zip(names, ids, media):
            f.write(f"{a} {b} {c}\n")
    lmk = " ".join(f"{v:.4f}" for v in (38.3, 51.7, 73.5, 51.5, 56.0, 71.7, 41.5, 92.4, 70.7, 92.2))
    score = rng.uniform(0.5, 1.0, faces)
    with open(meta / "ijbc_name_5pts_score.txt", "w") as f:
        for a, s in zip(names, score):
            f.write(f"{a} {lmk} {s:.6f}\n")
    # genuine pairs: templates of one subject; impostor pairs: random templates of two subjects
    by_subject = np.argsort(subject, kind="stable")
    g1 = rng.integers(0, templates, genuine * 4)
    starts = np.searchsorted(subject[by_subject], subject[g1])
    ends = np.searchsorted(subject[by_subject], subject[g1], side="right")
    g2 = by_subject[starts + (rng.random(len(g1)) * (ends - starts)).astype(int)]
    ok = g1 != g2
    gen = np.stack([g1[ok], g2[ok]], 1)[:genuine]
    imp = rng.integers(0, templates, (int((pairs - len(gen)) * 1.01) + 10, 2))
    imp = imp[subject[imp[:, 0]] != subject[imp[:, 1]]][: pairs - len(gen)]
    allp = np.concatenate([np.c_[gen + 1, np.ones(len(gen), int)], np.c_[imp + 1, np.zeros(len(imp), int)]])
    allp = allp[rng.permutation(len(allp))]
    with open(meta / "ijbc_template_pair_label.txt", "w") as f:
        for s in range(0, len(allp), 1_000_000):
            np.savetxt(f, allp[s:s + 1_000_000], fmt="%d")


def main() -> None:
    ap = argparse.ArgumentParser()
    for k, v in IJBC.items():
        ap.add_argument(f"--{k}", type=int, default=v)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--batch", type=int, default=256, help="faces per embedding batch")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "ijb_scale"))
    ap.add_argument("--write-only", metavar="DIR", help="only write the synthetic protocol to DIR/IJBC (the writer "
                    "process)")
    a = ap.parse_args()
    counts = [a.faces, a.templates, a.subjects, a.pairs, a.genuine]
    if a.write_only:
        write_protocol(Path(a.write_only) / "IJBC", *counts, np.random.default_rng(0))
        return
    import pandas  # noqa: F401  (read_ijb imports it on first use: here it is part of the baseline)

    from vtrain.data.ijb import find_ijb, read_ijb
    from vtrain.eval.ijb import TemplateSums, pooling_weights, tar_at_far_table, template_pair_scores

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "IJBC"
        t = time.perf_counter()
        sizes_args = [f"--{k}={v}" for k, v in zip(IJBC, counts)]
        subprocess.run([sys.executable, __file__, "--write-only", tmp, *sizes_args], check=True)
        sizes = {p.name: p.stat().st_size for p in (root / "meta").iterdir()}
        print(f"protocol written in {time.perf_counter() - t:.0f} s (another process): {sizes}", flush=True)

        def phase(name: str, fn):
            start, at_start = time.perf_counter(), memory_mib()["VmRSS"]
            reset_peak()
            value = fn()
            rows.append({"phase": name, "seconds": round(time.perf_counter() - start, 2),
                         "rss_at_start_mib": round(at_start, 1), "peak_rss_mib": round(memory_mib()["VmHWM"], 1)})
            print(rows[-1], flush=True)
            return value

        base = memory_mib()["VmRSS"]
        protocol = phase("read the protocol (3 files)", lambda: read_ijb(find_ijb(root), check_images=False))

        def pool():
            weights = pooling_weights(protocol.template, protocol.media, protocol.scores)
            sums = TemplateSums(len(protocol.template_ids), a.dim)
            feat_rng = np.random.default_rng(1)
            for s in range(0, len(protocol.names), a.batch):
                rows_ = np.arange(s, min(s + a.batch, len(protocol.names)))
                feats = feat_rng.standard_normal((len(rows_), a.dim), np.float32)
                sums.add(protocol.template[rows_], weights[rows_], feats)
            return sums.normalized()

        templates = phase(f"pool {len(protocol.names)} random {a.dim}-d features into templates", pool)
        scores = phase(f"score {len(protocol.labels)} template pairs", lambda: template_pair_scores(templates,
                                                                                                  protocol.pairs))
        table = phase("ROC and TAR@FAR table", lambda: tar_at_far_table(protocol.labels, scores))
    result = {"machine": f"{platform.machine()}, {platform.system()}, python {sys.version.split()[0]}, numpy "
                         f"{np.__version__}", "sizes": {**vars(a), "file_bytes": sizes},
              "baseline_rss_mib": round(base, 1), "phases": rows,
              "counts": {"faces": len(protocol.names), "templates": len(protocol.template_ids),
                         "pairs": len(protocol.labels), "genuine": int(protocol.labels.sum())},
              "table_of_random_features": table["rows"]}
    out = Path(a.out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"| {r['phase']} | {r['seconds']} | {r['rss_at_start_mib']} | {r['peak_rss_mib']} |" for r in rows]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
