"""No rank hangs, no rank aborts: a write failing on one rank inside DeepSpeed's own save, a rank stuck in a
collective, and the exit of a finished multi-process run.

- DeepSpeed's `save_checkpoint` writes between its barriers; every one of those writes goes through vtrain's guard
  (engine/engines/ds_writes.py), so a failed write on one rank no longer strands it past a barrier the other ranks wait
  in. Fast: a stand-in engine that runs DeepSpeed's sequence (its collectives counted) over a real
  `TorchCheckpointEngine`, with each write failing in turn; the installed DeepSpeed still has what the guard
  hooks into. Slow: two real ranks with a file size limit on one of them from the start of the second save.
- A second signal ends a rank that waits inside native code (a collective the other rank never joins).
- Short 2-process runs all exit 0 (no rank aborts at interpreter exit).

The 2-process runs here start both ranks directly (torch.distributed's environment variables, no launcher), so
each rank's own exit code is seen and nothing ends a rank on another's behalf. A hang shows as the subprocess
timeout, never as a time measured.
"""

from __future__ import annotations

import errno
import inspect
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.helpers.cli import env
from tests.helpers.paths import ROOT
from tests.helpers.ports import free_port as _port
from vtrain.engine.checkpoint import format as ckpt
from vtrain.engine.engines import ds_writes
from vtrain.errors import VtrainError

HANG = 300  # seconds: far beyond what each run needs; reaching it is the failure a hang produces


# ---- the guard around DeepSpeed's writes, on one process -------------------------------------------------------

class FailingStore:
    """DeepSpeed's TorchCheckpointEngine whose write of the file named `fail` raises what torch.save raises on a
    full disk (a RuntimeError without an errno); makedirs of `fail` raises ENOSPC."""

    def __init__(self, fail: str) -> None:
        from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

        self.inner, self.fail = TorchCheckpointEngine(None), fail

    def save(self, state_dict, path: str) -> None:
        if Path(path).name == self.fail:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing "
                               "file data/0: file write failed")
        self.inner.save(state_dict, path)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        if Path(path).name == self.fail:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        self.inner.makedirs(path, exist_ok=exist_ok)


class StandIn:
    """DeepSpeed 0.19.8's `save_checkpoint` sequence (deepspeed/runtime/engine.py), its collectives counted: rank 0
    makes the folder, a barrier, every rank makes its tag folder and writes its states through the checkpoint
    engine, rank 0 copies the recovery script and writes `latest` (unless told not to), a last barrier."""

    def __init__(self, rank: int, fail: str) -> None:
        self.global_rank, self.fail = rank, fail
        self.checkpoint_engine = FailingStore(fail)
        self.collectives = 0

    def _copy_recovery_script(self, save_path: str) -> None:
        if self.fail == "zero_to_fp32.py":
            raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), f"{save_path}/zero_to_fp32.py")
        Path(save_path, "zero_to_fp32.py").write_text("# the recovery script\n")

    def save_checkpoint(self, save_dir: str, tag: str, save_latest: bool = True) -> None:
        if self.global_rank == 0:
            self.checkpoint_engine.makedirs(save_dir, exist_ok=True)
        self.collectives += 1
        self.checkpoint_engine.makedirs(f"{save_dir}/{tag}", exist_ok=True)
        self.checkpoint_engine.save({"w": torch.ones(4)}, f"{save_dir}/{tag}/model_states.pt")
        self.checkpoint_engine.save({"m": torch.ones(4)}, f"{save_dir}/{tag}/optim_states.pt")
        if self.global_rank == 0:
            self._copy_recovery_script(f"{save_dir}/{tag}")
        if save_latest and self.global_rank == 0:
            Path(save_dir, "latest").write_text(tag)
        self.collectives += 1


@dataclass
class Row:
    rank: int
    fail: str
    """The file (or folder) whose write fails; "" for none."""
    names: str | None
    """The start of the one error line: `cannot <operation> <path>`, the path relative to the save folder ("."
    for itself); None: no error."""
    written: tuple[str, ...]
    """What the save folder holds afterwards."""


ROWS = {
    "nothing-fails": Row(0, "", None, ("latest", "tag/model_states.pt", "tag/optim_states.pt", "tag/zero_to_fp32.py")),
    "nothing-fails-rank1": Row(1, "", None, ("tag/model_states.pt", "tag/optim_states.pt")),
    "the-save-folder": Row(0, "save", "create .", ()),
    "the-tag-folder": Row(1, "tag", "create tag", ()),
    "model-states-rank0": Row(0, "model_states.pt", "write tag/model_states.pt", ()),
    "optimizer-shard-rank1": Row(1, "optim_states.pt", "write tag/optim_states.pt", ("tag/model_states.pt",)),
    "recovery-script": Row(0, "zero_to_fp32.py", "write tag", ("tag/model_states.pt", "tag/optim_states.pt")),
    "latest": Row(0, "latest", "write latest", ("tag/model_states.pt", "tag/optim_states.pt", "tag/zero_to_fp32.py")),
}


@pytest.mark.parametrize("name", list(ROWS))
def test_a_failed_write_inside_deepspeeds_save_runs_every_collective_then_is_one_line(name, tmp_path):
    row = ROWS[name]
    save_dir = tmp_path / "save"
    if row.fail == "latest":
        (save_dir / "latest").mkdir(parents=True)  # a folder where the file goes: the write fails (EISDIR)
    engine = StandIn(row.rank, row.fail)
    store = engine.checkpoint_engine
    error = None
    try:
        with ds_writes.guarded_save(engine, save_dir, "tag") as kwargs:
            engine.save_checkpoint(str(save_dir), "tag", **kwargs)
    except VtrainError as e:
        error = str(e)
    assert engine.collectives == 2  # no rank skips a barrier, whichever write failed
    if row.names is None:
        assert error is None
    else:
        what, rel = row.names.split()
        assert error is not None and error.startswith(f"cannot {what} {save_dir / rel}: "), error
    held = sorted(str(p.relative_to(save_dir)) for p in save_dir.rglob("*") if p.is_file()) if save_dir.exists() \
        else []
    assert tuple(held) == row.written  # after the first failure, the later writes are skipped
    if "latest" in row.written:
        assert (save_dir / "latest").read_text() == "tag"
    # the engine is as it was: its own methods again, for the next save and for loading
    assert "save" not in vars(store) and "makedirs" not in vars(store)
    assert ds_writes.RECOVERY_SCRIPTS not in vars(engine)


def test_a_bug_inside_deepspeeds_save_stays_a_traceback_and_a_later_failure_names_the_first(tmp_path):
    engine = StandIn(0, "")
    with pytest.raises(ZeroDivisionError):  # not the environment: never turned into a user's error line
        with ds_writes.guarded_save(engine, tmp_path, "tag"):
            raise ZeroDivisionError
    assert "save" not in vars(engine.checkpoint_engine)
    engine = StandIn(1, "optim_states.pt")
    with pytest.raises(VtrainError, match="optim_states.pt"):  # DeepSpeed's failure came first
        with ds_writes.guarded_save(engine, tmp_path, "tag") as kwargs:
            engine.save_checkpoint(str(tmp_path), "tag", **kwargs)
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "random_states_1.pkl"))


def test_the_installed_deepspeed_writes_only_where_the_guard_looks():
    """What ds_writes.py relies on, read from the installed DeepSpeed: its save takes `save_latest` and writes
    `latest` only under it, copies its recovery scripts through the method the guard replaces, and sends its
    state files through the checkpoint engine's `save(state_dict, path)` and folders through `makedirs`."""
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine
    from deepspeed.runtime.engine import DeepSpeedEngine

    save = inspect.getsource(DeepSpeedEngine.save_checkpoint)
    assert "save_latest" in inspect.signature(DeepSpeedEngine.save_checkpoint).parameters
    writes = [line.strip() for line in save.splitlines() if "open(" in line or "torch.save" in line]
    assert writes == ["with open(os.path.join(save_dir, 'latest'), 'w') as fd:"]
    assert "if save_latest and self.global_rank == 0:" in save
    assert callable(getattr(DeepSpeedEngine, ds_writes.RECOVERY_SCRIPTS))
    assert f"self.{ds_writes.RECOVERY_SCRIPTS}(" in inspect.getsource(DeepSpeedEngine._save_zero_checkpoint)
    for method, params in (("save", ["self", "state_dict", "path"]), ("makedirs", ["self", "path", "exist_ok"])):
        assert list(inspect.signature(getattr(CheckpointEngine, method)).parameters) == params
    for fn in (DeepSpeedEngine._save_checkpoint, DeepSpeedEngine._save_zero_checkpoint):
        src = inspect.getsource(fn)
        assert "torch.save" not in src and "open(" not in src and "self.checkpoint_engine.save(" in src


# ---- two real ranks -------------------------------------------------------------------------------------------

def _two_ranks(tmp_path: Path, args: list[str], extra_env: dict[str, str]) -> list[tuple[int, str]]:
    """`python -m vtrain ARGS` as ranks 0 and 1 of one world; (exit code, output) of each. A rank still running
    after HANG seconds fails the test (and both are killed)."""
    port = str(_port())
    procs, logs = [], []
    try:
        for r in range(2):
            log = open(tmp_path / f"rank{r}.log", "w")
            logs.append(log)
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "vtrain", *args], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **extra_env)))
        for p in procs:
            p.wait(timeout=HANG)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for log in logs:
            log.close()
    return [(p.returncode, (tmp_path / f"rank{r}.log").read_text(errors="replace")) for r, p in enumerate(procs)]


DS_ROWS = {  # DeepSpeed config, the rank whose file size limit drops at the second save, the file that fails
    "zero2-rank1-optimizer-shard": ("zero2.json", 1, "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
    "zero3-rank0-model-states": ("zero3.json", 0, "zero_pp_rank_0_mp_rank_00_model_states.pt"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(DS_ROWS))
def test_a_write_failing_on_one_rank_inside_deepspeeds_save_stops_every_rank(name, faces, tmp_path):
    """A full disk on one rank only, inside DeepSpeed's save (RLIMIT_FSIZE from the start of the second save, SIGXFSZ
    ignored: its first state file fails with EFBIG): every rank exits 2, one error line names the file, the
    staging folder is gone and the first checkpoint still verifies. Before the guard, both ranks waited in
    different collectives until killed."""
    ds_config, rank, file = DS_ROWS[name]
    out = tmp_path / "run"
    args = ["train", "--data", str(faces), "--output-dir", str(out), "--num-workers", "0", "--embedding-dim", "32",
            "--head", "cosface", "--scale", "16", "--batch-size", "8", "--ds-config", f"ds_configs/{ds_config}",
            "--max-steps", "2", "--save-every", "1"]
    ranks = _two_ranks(tmp_path, args, {"VTRAIN_DEBUG_FILE_LIMIT_IN_SAVE": f"2@{rank}"})
    text = "\n".join(f"--- rank {r} ---\n{log[-5000:]}" for r, (_, log) in enumerate(ranks))
    assert [rc for rc, _ in ranks] == [2, 2], text
    lines = [line for _, log in ranks for line in log.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in text, text
    tmp = ckpt.tmp_path(out, 2)
    assert lines[0] == (f"error: saving checkpoint step_2: cannot write {tmp}/{ckpt.ACCELERATE}/{ckpt.DS_TAG}/"
                        f"{file}: File too large (the file size limit, ulimit -f, is 4096 bytes); removed the "
                        "unfinished .tmp-step_2; the earlier checkpoints are as they were (newest: step_1)")
    assert not tmp.exists()
    assert [p.name for p in ckpt.complete_checkpoints(out)] == ["step_1"]
    assert ckpt.verify(ckpt.final_path(out, 1)) is None


def _line(stream, timeout: float) -> str:
    """The next line of a child's pipe, or "" when none comes within `timeout` seconds (never blocks longer)."""
    import select

    ready, _, _ = select.select([stream], [], [], timeout)
    return stream.readline() if ready else ""


@pytest.mark.slow
def test_a_second_signal_ends_a_rank_waiting_in_a_collective(tmp_path):
    """Rank 0 waits in a barrier rank 1 never joins, inside native code where Python runs no handler: the first
    SIGTERM is announced, the second ends it with 143 (before: neither did anything; the rank waited on)."""
    port = str(_port())
    helper = str(ROOT / "tests" / "helpers" / "stuck_rank.py")
    ranks = [subprocess.Popen([sys.executable, helper, str(r), port], cwd=ROOT, env=env(PYTHONPATH=str(ROOT)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
             for r in range(2)]
    try:
        stuck = ranks[0]
        assert _line(stuck.stdout, HANG) == "waiting in a barrier\n"
        assert _line(stuck.stdout, 2) == ""  # the moment it takes to enter the barrier; it must not leave it
        stuck.send_signal(signal.SIGTERM)
        assert "received SIGTERM" in _line(stuck.stderr, HANG)  # announced although the handler cannot run
        assert stuck.poll() is None  # the first signal asks for a graceful stop; only the second ends it
        stuck.send_signal(signal.SIGTERM)
        assert stuck.wait(timeout=HANG) == 128 + signal.SIGTERM
        assert "left the barrier" not in stuck.stdout.read()
    finally:
        for p in ranks:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


# ---- the end of a multi-process run ---------------------------------------------------------------------------

def _helper_pair(script: str, mode: str) -> tuple[int, str]:
    """Ranks 0 and 1 of `tests/helpers/SCRIPT RANK PORT MODE`; rank 0's exit code and output."""
    port = str(_port())
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "helpers" / script), str(r), port, mode],
                              cwd=ROOT, env=env(PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True) for r in range(2)]
    try:
        out = procs[0].communicate(timeout=HANG)[0]
        procs[1].wait(timeout=HANG)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return procs[0].returncode, out


@pytest.mark.slow
def test_a_rank_ending_through_the_cli_is_not_aborted_by_a_native_thread_that_needs_python():
    """A gloo worker thread runs a Python callback while the rank ends (what a backend that outlives
    destroy_process_group can do). Ended as a Python program ends, the rank aborts ("terminate called without an
    active exception"): the control, which shows the scenario is the real one. Ended through vtrain's exit
    (cli._exit: flushed, then no interpreter teardown), it exits 0."""
    if sys.version_info < (3, 14):  # 3.14 parks such a thread instead of ending it (CPython gh-87135)
        rc, out = _helper_pair("late_callback.py", "interpreter")
        assert rc == -signal.SIGABRT and "terminate called without an active exception" in out, (rc, out)
    rc, out = _helper_pair("late_callback.py", "vtrain")
    assert rc == 0 and out == "rank 0 leaves\n", (rc, out)


LOOP = [  # engine (accelerate config, flags) of each short run, in turn
    ("ddp.yaml", ["--report-to", "tensorboard", "--num-workers", "2"]),
    ("fsdp.yaml", []),
    ("ddp.yaml", ["--ds-config", "ds_configs/zero2.json"]),
    ("ddp.yaml", []),
]


@pytest.mark.slow
def test_short_two_process_runs_all_exit_0_with_everything_written(faces, tmp_path):
    """Short complete runs through `accelerate launch` (train, save, evaluate, exit) all exit 0, and the explicit
    end of the process (cli._exit) loses nothing: the last metrics line, the evaluation, a verified checkpoint,
    TensorBoard's events, the lock released. A smoke check of the real path: how rarely a rank aborted at exit
    before is measured by benchmarks/exit_loop.py (benchmarks/RESULTS.md), the mechanism by the test above."""
    from tests.helpers.cli import launch

    for i, (acc_cfg, flags) in enumerate(LOOP):
        out = tmp_path / f"run{i}"
        proc = launch(2, "train", "--data", str(faces), "--output-dir", str(out), "--embedding-dim", "16",
                      "--head", "cosface", "--batch-size", "8", "--log-every", "1", "--max-steps", "2",
                      "--save-every", "2", "--eval-every", "2",
                      *(["--num-workers", "0"] if "--num-workers" not in flags else []), *flags,
                      accelerate_config=acc_cfg, timeout=HANG)
        text = proc.stdout + proc.stderr
        assert proc.returncode == 0 and "terminate called" not in text, f"run {i}: exit {proc.returncode}\n" + \
            text[-6000:]
        assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
        assert json.loads((out / "eval.jsonl").read_text().splitlines()[-1])["step"] == 2
        assert [p.name for p in ckpt.complete_checkpoints(out)] == ["step_2"]
        assert ckpt.verify(ckpt.final_path(out, 2)) is None
        assert not (out / ".vtrain.lock").exists()
        if "tensorboard" in flags:
            assert sum(f.stat().st_size for f in (out / "tensorboard").rglob("events.out.tfevents.*")) > 0
