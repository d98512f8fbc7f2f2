"""Run logging on rank 0: rich progress bar with ETA, a log line every N steps, metrics.jsonl, eval.jsonl."""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

console = Console(stderr=False, highlight=False)


def peak_memory_gb(device: torch.device) -> tuple[str, float]:
    """Peak memory of this process: allocated device memory on CUDA, peak RSS on CPU."""
    if device.type == "cuda":
        return "mem_gb", torch.cuda.max_memory_allocated(device) / 2**30
    return "rss_gb", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.3e}"
    return str(v)


class RunLogger:
    def __init__(self, output_dir: str | Path, enabled: bool, total_steps: int, start_step: int) -> None:
        self.enabled = enabled
        self.out = Path(output_dir)
        self.progress: Progress | None = None
        if enabled:
            self.progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                                     console=console, transient=False, disable=not sys.stdout.isatty())
            self.task = self.progress.add_task("train", total=total_steps, completed=start_step)
            self.progress.start()

    def info(self, msg: str) -> None:
        if self.enabled:
            console.print(msg, soft_wrap=True)

    def advance(self) -> None:
        if self.progress is not None:
            self.progress.advance(self.task)

    def eta_seconds(self) -> float | None:
        if self.progress is None:
            return None
        return self.progress.tasks[0].time_remaining

    def log_train(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        console.print(" ".join(f"{k}={_fmt(v)}" for k, v in record.items()), soft_wrap=True)

    def log_eval(self, step: int, metrics: dict[str, Any], table: Table) -> None:
        if not self.enabled:
            return
        flat = {k: v for k, v in metrics.items() if k != "rows"}
        with open(self.out / "eval.jsonl", "a") as f:
            f.write(json.dumps({"step": step, **flat}) + "\n")
        console.print(table)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


def verification_table(metrics: dict[str, Any], title: str = "verification") -> Table:
    t = Table(title=title)
    for col in ("metric", "value", "threshold", "note"):
        t.add_column(col)
    for r in metrics.get("rows", []):
        note = "" if r["resolvable"] else f"unresolvable: < {1 / r['far_target']:.0f} impostor pairs"
        t.add_row(f"TAR@FAR={r['far_target']:g}", f"{r['tar']:.4f}", f"{r['threshold']:.4f}",
                  note or f"FAR achieved {r['far_achieved']:.2e}")
    t.add_row("best balanced accuracy", f"{metrics['balanced_accuracy']:.4f}", f"{metrics['accuracy_threshold']:.4f}", "")
    t.add_row("pairs", f"{metrics['genuine_pairs']} genuine / {metrics['impostor_pairs']} impostor", "", "")
    return t


class StepTimer:
    """time/iter and data_time over the optimizer steps since the last log line."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.t0 = time.perf_counter()
        self.data = 0.0
        self.steps = 0

    def add_data(self, seconds: float) -> None:
        self.data += seconds
