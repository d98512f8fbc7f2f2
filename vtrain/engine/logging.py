"""Run logging on rank 0: rich progress bar with ETA, a log line every N steps, metrics.jsonl, eval.jsonl, and the
same numbers as scalars to Accelerate's trackers (TensorBoard, W&B) when --report-to asks for them. Also what the
loop logs from: the run's first line (`describe_run`), the stats window between log lines (`StatsWindow`), and
`run_info.json` (what is really active on every rank)."""

from __future__ import annotations

import json
import math
import resource
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import psutil

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from vtrain.io import guarded
from vtrain.console import console, hms, show_progress
from vtrain.dist import gather_objects
from vtrain.engine.checkpoint.format import TENSORBOARD
from vtrain.errors import VtrainError
from vtrain.io.files import write_json_atomic

if TYPE_CHECKING:  # annotations only: the offline commands import this module for its console
    from accelerate import Accelerator

    from vtrain.engine.engines.base import Engine


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
            self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                                     console=console, transient=False, disable=not sys.stdout.isatty())
            self.task = self.progress.add_task("train", total=total_steps, completed=start_step)
            self.progress.start()
            show_progress(self.progress)

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
        append_line(self.out / "metrics.jsonl", json.dumps(record))
        # the time left also as h:mm:ss (the unit of every time vtrain prints) beside the file's seconds
        shown = " ".join(f"{k}={_fmt(v)}" + (f" eta={hms(v)}" if k == "eta_s" else "") for k, v in record.items())
        console.print(shown, soft_wrap=True)
        if self.tracker is not None:
            self.tracker({**scalars(record, "train"), **(extra or {})}, record["step"])

    def log_eval(self, step: int, metrics: dict[str, Any], table: Table) -> None:
        if not self.enabled:
            return
        flat = {k: v for k, v in metrics.items() if k != "rows"}
        append_line(self.out / "eval.jsonl", json.dumps({"step": step, **flat}))
        console.print(table)
        if self.tracker is not None:
            self.tracker(scalars(flat, "eval"), step)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            show_progress(None)
        if self.end_tracking is not None:  # flushes the TensorBoard writer / finishes the W&B run
            end, self.end_tracking = self.end_tracking, None
            end()


def append_line(path: Path, line: str) -> None:
    """One log line, appended (rundir.check_links made sure `path` is no link); a full disk is one error line."""
    with guarded.disk_op("append to", path), open(path, "a") as f:
        f.write(line + "\n")


class StatsWindow:
    """Sums of the per-step stats since the last log line (the LR: its last value, the one in force at the logged
    step). Device tensors are summed on the device (NaN values
    left out and counted there too, as a host-side `isnan` test would need a sync per step); host floats here."""

    def __init__(self) -> None:
        self.sums: dict[str, Any] = {}
        self.counts: dict[str, Any] = {}

    def add(self, stats: dict[str, Any]) -> None:
        for k, v in stats.items():
            if k == "skipped":
                continue
            if isinstance(v, torch.Tensor):
                v = v.detach().to(torch.float64)
                ok = ~torch.isnan(v)
                v, n = torch.where(ok, v, torch.zeros_like(v)), ok.to(torch.float64)
            elif math.isnan(v):
                continue
            else:
                n = 1
            if k == "lr":  # the LR in force at the logged step (the window's last), not the window's mean
                self.sums[k], self.counts[k] = v, n
                continue
            self.sums[k] = self.sums[k] + v if k in self.sums else v
            self.counts[k] = self.counts[k] + n if k in self.counts else n

    def means(self, device: torch.device) -> tuple[list[str], torch.Tensor]:
        """Sorted keys and their means as one float64 tensor on `device` (NaN where a key had no finite value).
        Every rank holds the same keys: skips are agreed, and a key appears once it was added at all."""
        keys = sorted(self.sums)
        as_t = lambda x: torch.as_tensor(x, dtype=torch.float64).to(device)  # noqa: E731
        if not keys:
            return keys, torch.zeros(0, dtype=torch.float64, device=device)
        sums = torch.stack([as_t(self.sums[k]) for k in keys])
        counts = torch.stack([as_t(self.counts[k]) for k in keys])
        return keys, sums / counts


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


def describe_run(engine: Engine, world: int, device: torch.device, batch_size: int, grad_accum: int,
                 local_param_fraction: float | None) -> str:
    """The run's first log line: engine, world, device, precision, batch arithmetic."""
    extra = ""
    if local_param_fraction is not None:
        extra = f" | local params {local_param_fraction:.3f} of model"
    return (f"engine: {engine.describe()} | world {world} | device {device} | precision "
            f"{engine.describe_precision()}"
            f" | micro-batch {batch_size} x accum {grad_accum} x {world} = global batch "
            f"{batch_size * grad_accum * world}{extra}")


def start_trackers(accelerator: Accelerator, report_to: str, output_dir: Path, run_id: str,
                   config: dict[str, Any]) -> tuple[Callable | None, Callable | None]:
    """--report-to: Accelerate's trackers (rank 0 only) with the resolved config as hyper-parameters. Returns the
    (log, finish) pair RunLogger takes: it sends every log line and evaluation to them and ends them on close. A
    write the tracker fails (a full disk) is one error line at the next log or at the end (`_writer_failure`)."""
    if report_to == "none":
        return None, None
    out = Path(output_dir)
    kwargs = {"wandb": {"dir": str(out), "name": out.name, "id": run_id, "resume": "allow"}}
    # TensorBoard writes <output-dir>/tensorboard/ (`tensorboard --logdir` on the run or its parent dir)
    where = out / TENSORBOARD if report_to == "tensorboard" else out
    _keep_writer_thread_errors()
    with guarded.disk_op(f"start {report_to} in", where):
        accelerator.init_trackers("tensorboard" if report_to == "tensorboard" else "vtrain",
                                  config=flat_hparams(config),
                                  init_kwargs={k: v for k, v in kwargs.items() if k == report_to})
        _writer_failure()

    def log(values: dict[str, float], step: int) -> None:
        with guarded.disk_op(f"write {report_to}'s events in", where):
            _writer_failure()
            accelerator.log(values, step=step)

    def finish() -> None:  # not accelerator.end_training: that also destroys the process group
        with guarded.disk_op(f"write {report_to}'s events in", where):
            for tracker in accelerator.trackers:
                tracker.finish()  # flushes and closes TensorBoard's event file
            _writer_failure()

    return log, finish


# TensorBoard's event file is written by a thread of its own (tensorboard's `_AsyncWriterThread`): a write that
# fails there ends the thread with the exception printed by threading.excepthook, a traceback of dozens of lines,
# and the file's writer raises it again only at its next write or flush, not when it is closed. So the exceptions
# of exactly those threads are kept here instead of printed, and `_writer_failure` raises the first at the next log
# line and at the end of the run, where disk_op makes it one line.
_writer_errors: list[BaseException] = []


def _keep_writer_thread_errors() -> None:
    """Install (once) a threading.excepthook that keeps the exception of a tracker's writer thread in
    `_writer_errors`; every other thread's goes to the hook that was there before."""
    try:
        from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread
    except ImportError:  # no tensorboard: no writer thread of its own
        return
    previous = threading.excepthook
    if getattr(previous, "vtrain_keeps_writer_errors", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        if isinstance(args.thread, _AsyncWriterThread) and args.exc_value is not None:
            _writer_errors.append(args.exc_value)
            return
        previous(args)

    hook.vtrain_keeps_writer_errors = True  # type: ignore[attr-defined]
    threading.excepthook = hook


def _writer_failure() -> None:
    """Raise the first failure a tracker's writer thread met (kept by `_keep_writer_thread_errors`), if any."""
    if _writer_errors:
        raise _writer_errors.pop(0)


def write_run_info(output_dir: Path, is_main: bool, run: dict[str, Any], mine: dict[str, Any]) -> None:
    """run_info.json: the run's facts and, under "ranks", every rank's `mine` (what is really active there, read
    from live objects), for users and tests. Written atomically by rank 0. Collective."""
    ranks = gather_objects(mine)
    if is_main:
        write_json_atomic(Path(output_dir) / "run_info.json", {**run, "ranks": ranks}, indent=1)


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
