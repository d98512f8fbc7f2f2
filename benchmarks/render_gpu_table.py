"""Markdown tables from `benchmarks/gpu_suite.py` results, and the generated block of docs/gpu_benchmarks.md.

The block between `<!-- gpu-table:begin -->` and `<!-- gpu-table:end -->` is rewritten from every suite result in
benchmarks/results/ (`<device>.json`; dry runs are never included), one section per device. Everything outside
the markers is left as it is. With no GPU result the block says so, with no figures.

    python benchmarks/render_gpu_table.py            # rewrite the block
    python benchmarks/render_gpu_table.py --check    # exit 1 if the block differs from what the results give
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORMAT = "vtrain-gpu-suite"
BEGIN, END = "<!-- gpu-table:begin -->", "<!-- gpu-table:end -->"
DOC = ROOT / "docs" / "gpu_benchmarks.md"
RESULTS = ROOT / "benchmarks" / "results"
NO_RUN = ("No GPU run of `benchmarks/gpu_suite.py` has been committed yet, so this block holds no figures. "
          "It is generated: after a GPU run, `python benchmarks/render_gpu_table.py` fills it from "
          "`benchmarks/results/<device>.json`.")


def load_results(folder: Path = RESULTS) -> list[dict]:
    """The suite's GPU results in `folder` (dry runs left out), sorted by device name."""
    found = []
    for path in sorted(Path(folder).glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and data.get("format") == FORMAT and not data.get("dry_run"):
            found.append(data)
    return sorted(found, key=lambda d: d["device"]["name"])


def _f(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _err(est, measured) -> str:
    """estimate-memory's error against the measured peak, in % of the measurement."""
    if est is None or not measured:
        return "-"
    return f"{100 * (est - measured) / measured:+.1f}%"


def _not_ok(u: dict) -> str:
    if u["status"] == "failed":
        return f"failed: {u.get('error') or 'unknown error'}"
    return u["status"] + (f": {u['note']}" if u.get("note") else "")


def _units(res: dict, part: str) -> list[dict]:
    return [u for u in res["units"].values() if u["part"] == part]


def _header(res: dict) -> list[str]:
    d = res["device"]
    runs = res["runs"]
    commits = sorted({r["git_commit"][:10] + (" (modified)" if r.get("git_dirty") else "") for r in runs})
    dates = sorted({r["started"][:10] for r in runs})
    mem = f", {d['memory_gib']:.0f} GiB" if d.get("memory_gib") else ""
    title = f"### {d['name']}{mem}" + (" (tiny CPU shapes: the numbers mean nothing)" if res.get("dry_run") else "")
    return [title, "", f"torch {d.get('torch')}, Triton {d.get('triton') or '-'}, CUDA {d.get('cuda') or '-'}; "
            f"measured {', '.join(dates)} at commit {', '.join(commits)} by `benchmarks/gpu_suite.py` "
            f"({len(runs)} invocation{'s' if len(runs) > 1 else ''}).", ""]


def _dino(res: dict) -> list[str]:
    units = _units(res, "dino")
    if not units:
        return []
    first = next((u["result"] for u in units if u["status"] == "ok"), None)
    what = (f"{first['preset']}, batch {first['batch_size']}, {first['image_size'][0]}x{first['image_size'][1]}, "
            f"{first['precision']}, {first['engine']}, deformable attention: {first['msda']}") if first else ""
    out = [f"**DINO training step** (`dino_memory_matrix.py`; {what}). Peak = `torch.cuda.max_memory_allocated` "
           "of the steps after the warm-up, per phase (forward, backward, optimizer step); estimate = `vtrain "
           "estimate-memory`'s timeline (the largest point is the total) without its fixed 0.5 GiB CUDA-context "
           "allowance.", "",
           "| GC | peak allocated GiB | reserved GiB | s/iter | images/s | estimate GiB | estimate error | peak at "
           "(estimate / measured) | forward | backward | optimizer step |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for u in units:
        r = u.get("result") or {}
        if u["status"] != "ok":
            out.append(f"| {u['label']} | {_not_ok(u)} | | | | {_f(r.get('estimate_gib'), '.2f')} | | | | | |")
            continue
        measured, predicted = r.get("phase_peaks_gib") or {}, r.get("estimate_phases_gib") or {}
        phases = [f"{_f(measured.get(p), '.2f')} ({_err(predicted.get(p), measured.get(p))})"
                  for p in ("forward", "backward", "optimizer")]
        out.append(f"| {u['label']} | {_f(r['peak_gib'], '.2f')} | {_f(r.get('reserved_gib'), '.2f')} | "
                   f"{_f(r['s_per_iter'], '.3f')} | {_f(r['images_per_s'], '.2f')} | {_f(r['estimate_gib'], '.2f')} "
                   f"| {_err(r['estimate_gib'], r['peak_gib'])} | {r.get('estimate_phase') or '-'} / "
                   f"{r.get('peak_phase') or '-'} | {' | '.join(phases)} |")
    out.append("")
    out.append("Phase columns: measured peak GiB (the estimate's error for that point of its timeline).")
    return out + [""]


def _msda(res: dict) -> list[str]:
    units = _units(res, "msda")
    if not units:
        return []
    out = ["**Deformable attention alone** (`msda_op.py`: forward + backward, value bf16; peak = extra allocated "
           "memory during forward + backward).", "",
           "| shape | queries | impl | fwd ms | fwd+bwd ms | saved for backward MiB | peak MiB | max abs diff |",
           "|---|---|---|---|---|---|---|---|"]
    for u in units:
        if u["status"] != "ok":
            out.append(f"| {u['label']} | {_not_ok(u)} | | | | | | |")
            continue
        for r in u["result"]["rows"]:
            out.append(f"| {r['shape']} | {r['queries']:,} | {r['impl']} | {r['fwd_ms']:.2f} | {r['fwd_bwd_ms']:.2f} "
                       f"| {r['saved_mib']:.1f} | {r['peak_mib']:.1f} | {r['max_abs_diff']:.1e} |")
    return out + [""]


def _loop(res: dict) -> list[str]:
    units = _units(res, "loop")
    if not units:
        return []
    out = ["**Training loop overhead** (`loop_overhead.py`: `vtrain train` against a bare loop on the same model, "
           "data and precision; images/s after warm-up).", "",
           "| case | flags | bare images/s | vtrain images/s | vtrain / bare |", "|---|---|---|---|---|"]
    for u in units:
        if u["status"] != "ok":
            out.append(f"| {u['label']} | {_not_ok(u)} | | | |")
            continue
        for r in u["result"]["rows"]:
            flags = " ".join(r.get("flags", [])) + (" --compile" if r.get("compile") else "")
            out.append(f"| {r['case']} | `{flags}` | {r['bare_images_per_s']:.1f} | {r['vtrain_images_per_s']:.1f} | "
                       f"{r['ratio']:.3f} |")
    return out + [""]


def _face(res: dict) -> list[str]:
    units = _units(res, "face")
    if not units:
        return []
    est = {u["result"]["classes"]: u["result"]["estimate_gib"] for u in _units(res, "estimate")
           if u["status"] == "ok"}
    first = next((u["result"] for u in units if u["status"] == "ok"), None)
    what = (f"{first['preset']}, micro-batch {first['micro_batch']}, sharded rows simulate world "
            f"{first['world']}: one rank's share, no communication") if first else ""
    out = [f"**Face training step with a big class head** (`face_head.py`; {what}). Estimate = "
           "`vtrain estimate-memory --task metric` for the replicated head, without the 0.5 GiB allowance.", "",
           "| identities | head | sample rate | images/s | peak allocated GiB | estimate GiB | estimate error |",
           "|---|---|---|---|---|---|---|"]
    for u in units:
        if u["status"] != "ok":
            out.append(f"| {u['label']} | {_not_ok(u)} | | | | | |")
            continue
        r = u["result"]
        peak = r["peak_mb"] / 1024
        e = est.get(r["classes"]) if r["mode"] == "none" else None
        out.append(f"| {r['classes']:,} | {r['mode']} | {r['sample_rate']} | {r['images_per_s']:.1f} | {peak:.2f} | "
                   f"{_f(e, '.2f')} | {_err(e, peak)} |")
    bad = [u for u in _units(res, "estimate") if u["status"] != "ok"]
    out += [f"- estimate for {u['label']}: {_not_ok(u)}" for u in bad]
    return out + [""]


def render(res: dict, detail: bool = False) -> str:
    """One device's section; `detail` adds every unit's status and time (the suite's own .md)."""
    lines = _header(res) + _dino(res) + _msda(res) + _face(res) + _loop(res)  # each unit is a row (or a note)
    if detail:
        lines += ["", "| unit | status | seconds | cap s | command |", "|---|---|---|---|---|"]
        lines += [f"| {k} | {u['status']} | {_f(u.get('seconds'), '.0f')} | {u.get('cap_s', '-')} | "
                  f"`{u.get('command', '')}` |" for k, u in res["units"].items()]
    return "\n".join(lines).rstrip() + "\n"


def render_block(results: list[dict]) -> str:
    if not results:
        return NO_RUN + "\n"
    return "\n".join(render(r) for r in results)


def rewrite(doc: Path, block: str) -> str:
    """The text of `doc` with the marked block replaced by `block`."""
    text = doc.read_text()
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise SystemExit(f"{doc}: needs exactly one {BEGIN} ... {END} block")
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    return f"{head}{BEGIN}\n{block}{END}{tail}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", type=Path, default=RESULTS, help="folder of <device>.json suite results")
    ap.add_argument("--doc", type=Path, default=DOC, help="the Markdown file holding the marked block")
    ap.add_argument("--check", action="store_true", help="exit 1 if the block is not what the results give")
    a = ap.parse_args()
    new = rewrite(a.doc, render_block(load_results(a.results)))
    if a.check:
        if new != a.doc.read_text():
            print(f"{a.doc}: the GPU block is out of date; run python benchmarks/render_gpu_table.py",
                  file=sys.stderr)
            sys.exit(1)
        return
    a.doc.write_text(new)
    print(f"rewrote the GPU block of {a.doc}")


if __name__ == "__main__":
    main()
