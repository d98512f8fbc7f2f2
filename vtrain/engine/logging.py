"""Run logging on rank 0: rich progress bar with ETA, a log line every N steps, metrics.jsonl, eval.jsonl, and the
same numbers as scalars to Accelerate's trackers (TensorBoard, W&B) when --report-to asks for them."""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Any, Callable

import psutil

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from vtrain.errors import VtrainError

console = Console(stderr=False, highlight=False)


def memory_gb(device: torch.device) -> dict[str, float]:
    """Memory of this process (GiB) for a log line. On CUDA the peaks since the previous call, allocated and
    reserved (reserved is what nvidia-smi shows, allocator cache included), then the peaks are reset so each log
    interval shows its own; on every device the host RSS now and the process's peak RSS."""
    out = {}
    if device.type == "cuda":
        out["mem_alloc_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
        out["mem_reserved_gb"] = torch.cuda.max_memory_reserved(device) / 2**30
        torch.cuda.reset_peak_memory_stats(device)
    out["rss_gb"] = psutil.Process().memory_info().rss / 2**30
    out["rss_peak_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    return out


def scalars(record: dict[str, Any], prefix: str) -> dict[str, float]:
    """The numbers of a log record as tracker scalars (`prefix/key`); bools, strings and None are left out."""
    return {f"{prefix}/{k}": float(v) for k, v in record.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.3e}"
    return str(v)


class RunLogger:
    def __init__(self, output_dir: str | Path, enabled: bool, total_steps: int, start_step: int,
                 tracker: Callable[[dict[str, float], int], None] | None = None,
                 end_tracking: Callable[[], None] | None = None) -> None:
        self.enabled = enabled
        self.out = Path(output_dir)
        self.tracker, self.end_tracking = tracker, end_tracking
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

    def log_train(self, record: dict[str, Any], extra: dict[str, float] | None = None) -> None:
        """`extra`: tracker-only scalars (e.g. the LR of every parameter group), too many for a log line."""
        if not self.enabled:
            return
        with open(self.out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        console.print(" ".join(f"{k}={_fmt(v)}" for k, v in record.items()), soft_wrap=True)
        if self.tracker is not None:
            self.tracker({**scalars(record, "train"), **(extra or {})}, record["step"])

    def log_eval(self, step: int, metrics: dict[str, Any], table: Table) -> None:
        if not self.enabled:
            return
        flat = {k: v for k, v in metrics.items() if k != "rows"}
        with open(self.out / "eval.jsonl", "a") as f:
            f.write(json.dumps({"step": step, **flat}) + "\n")
        console.print(table)
        if self.tracker is not None:
            self.tracker(scalars(flat, "eval"), step)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        if self.end_tracking is not None:  # flushes the TensorBoard writer / finishes the W&B run
            end, self.end_tracking = self.end_tracking, None
            end()


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


def tracker_name(report_to: str) -> str | None:
    """The Accelerate tracker for --report-to, or a user error when its package is not installed."""
    if report_to == "none":
        return None
    import importlib.util

    if importlib.util.find_spec(report_to) is None:
        raise VtrainError(f"--report-to {report_to}: the {report_to} package is not installed (pip install "
                          f"{report_to}), or use --report-to none")
    return report_to


def flat_hparams(config: dict[str, Any]) -> dict[str, Any]:
    """The resolved config as tracker hyper-parameters: `section.key` -> int, float, str or bool (lists and
    None as text; TensorBoard's hparams accept scalars only)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in flat_hparams(value).items()})
        elif isinstance(value, (bool, int, float, str)):
            out[key] = value
        else:
            out[key] = str(value)
    return out
