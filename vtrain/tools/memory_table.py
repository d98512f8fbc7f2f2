"""Rich tables for `vtrain estimate-memory` (the numbers come from tools/memory.py)."""

from __future__ import annotations

from typing import Any

from rich.table import Table

COLUMNS = ("parameters", "gradients", "optimizer", "activations", "temporary", "overhead", "total")


def render(report: dict[str, Any]) -> list[Any]:
    s = report["setup"]
    h, w = s["image_size"]
    title = (f"{s['task']} {s['preset']}: batch {s['batch_size']} at {h}x{w}, {s['precision']}, {s['gpus']} GPU(s); "
             f"{report['params_total'] / 1e6:.1f}M parameters ({report['params_trainable'] / 1e6:.1f}M trainable)")
    main = Table(title=title, caption="GiB per GPU; activations at the peak of one traced forward + backward")
    main.add_column("configuration")
    for c in COLUMNS:
        main.add_column(c, justify="right")
    main.add_column(f"max batch @ {report['gpu_memory_gib']:g} GiB", justify="right")
    est = report["estimate_gib"]
    gc = "+".join(s["grad_ckpt"]) or "none"
    eng = "FSDP2" if s["fsdp"] else (f"ZeRO-{s['zero']}" if s["zero"] else "DDP")
    main.add_row(f"[bold]{eng}, offload {s['offload']}, GC {gc}", *(f"{est[c]:.2f}" for c in COLUMNS),
                 str(report["max_batch_size"]))
    for alt in report["alternatives"]:
        main.add_row(alt["label"], *(f"{alt[c]:.2f}" for c in COLUMNS), str(alt["max_batch_size"]))
    out: list[Any] = [main]
    if est["cpu_offloaded"]:
        out.append(f"offloaded to CPU per GPU: {est['cpu_offloaded']:.2f} GiB")
    out += [f"note: {n}" for n in report["notes"]]
    out.append(f"traced in {report['trace_seconds']:.1f} s (fake tensors: no memory was allocated)")
    return out
