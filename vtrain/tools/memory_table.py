"""Rich tables for `vtrain estimate-memory` (the numbers come from tools/estimate_memory.py and vtrain/memory/)."""

from __future__ import annotations

from typing import Any

from rich.table import Table

COLUMNS = ("parameters", "gradients", "optimizer", "activations", "temporary", "overhead", "total")
GiB = 2**30


def render(report: dict[str, Any]) -> list[Any]:
    s = report["setup"]
    h, w = s["image_size"]
    title = (f"{s['task']} {s['preset']}: batch {s['batch_size']} at {h}x{w}, {s['precision']}, {s['gpus']} GPU(s); "
             f"{report['params_total'] / 1e6:.1f}M parameters ({report['params_trainable'] / 1e6:.1f}M trainable)")
    main = Table(title=title, caption="GiB per GPU at the step's peak (the largest point of its timeline, below); "
                                      "steady state: the optimizer's states exist from the first step on")
    main.add_column("configuration")
    for c in COLUMNS:
        main.add_column(c, justify="right")
    main.add_column(f"max batch @ {report['gpu_memory_gib']:g} GiB", justify="right")
    est = report["estimate_gib"]
    gc = "+".join(s["grad_ckpt"]) or "none"
    if s.get("ffn_units"):
        gc += f" (FFN remade: {len(s['ffn_units'])} units)"
    eng = "FSDP2" if s["fsdp"] else (f"ZeRO-{s['zero']}" if s["zero"] else "DDP")
    main.add_row(f"[bold]{eng}, offload {s['offload']}, GC {gc}", *(f"{est[c]:.2f}" for c in COLUMNS),
                 str(report["max_batch_size"]))
    for alt in report["alternatives"]:
        main.add_row(alt["label"], *(f"{alt[c]:.2f}" for c in COLUMNS), str(alt["max_batch_size"]))
    out: list[Any] = [main, render_timeline(report)]
    if est["cpu_offloaded"]:
        out.append(f"offloaded to CPU per GPU: {est['cpu_offloaded']:.2f} GiB")
    out += [f"note: {n}" for n in report["notes"]]
    if "plan" in report:
        p = report["plan"]
        out.append(f"[bold]--grad-ckpt auto[/bold]: {p['summary']} (--grad-ckpt {p['grad_ckpt']}; "
                   f"{p['traces']} traces, {p['seconds']:.0f} s)")
        out.append(f"why: {p['why']}")
        out.append(f"largest batch within {p['budget_gib']:g} GiB: {p['max_batch_size']} "
                   f"(activations scaled from the traced batch, with --grad-ckpt {p['max_batch_grad_ckpt']})")
    if "breakdown" in report:
        out += render_breakdown(report["breakdown"])
    out.append(f"traced in {report['trace_seconds']:.1f} s (fake tensors: no memory was allocated)")
    return out


def render_timeline(report: dict[str, Any]) -> Table:
    """The chosen configuration's step, point by point: the largest point of forward and of backward (and of a
    later micro-batch when accumulating) and the optimizer step; the peak is marked."""
    points = report["timeline"]
    top = max(points, key=lambda p: p["total"])
    t = Table(title=f"the step's timeline: peak {top['total']:.2f} GiB at {top['where']}",
              caption=f"activation peak alone (gradients left out): {report['estimate_gib']['activation_peak']:.2f} "
                      "GiB; gradients as the engine keeps them when each point is reached")
    t.add_column("point")
    for c in COLUMNS:
        t.add_column(c, justify="right")
    for p in points:
        mark = "[bold]" if p is top else ""
        t.add_row(f"{mark}{p['where']}", *(f"{mark}{p[c]:.2f}" for c in COLUMNS))
    return t


def _size(n: int) -> str:
    return f"{n / GiB:.3f} GiB" if n >= GiB else f"{n / 2**20:.2f} MiB"


def render_breakdown(b: dict[str, Any]) -> list[Any]:
    """The modules holding the activation bytes at the peak, and the same bytes per recompute unit."""
    total = b["activation_bytes"]
    t = Table(title=f"activations at the peak: {_size(total)}, by the module whose forward made them",
              caption="recompute: made again in backward (checkpointed units, remade tensors); backward: gradients "
                      "and temporaries of the backward, under the module whose autograd node made them")
    for col, justify in (("module", "left"), ("phase", "left"), ("bytes", "right"), ("share", "right")):
        t.add_column(col, justify=justify)
    for r in b["rows"]:
        t.add_row(r["module"] or "(the model itself)", r["phase"], _size(r["bytes"]),
                  f"{100 * r['bytes'] / max(total, 1):.1f}%")
    if b["other"]["rows"]:
        t.add_row(f"other ({b['other']['rows']} rows)", "", _size(b["other"]["bytes"]),
                  f"{100 * b['other']['bytes'] / max(total, 1):.1f}%")
    u = Table(title="the same bytes per recompute unit (--grad-ckpt names)")
    for col, justify in (("unit", "left"), ("bytes", "right"), ("share", "right")):
        u.add_column(col, justify=justify)
    for r in b["by_unit"]:
        u.add_row(r["unit"], _size(r["bytes"]), f"{100 * r['bytes'] / max(total, 1):.1f}%")
    return [t, u]
