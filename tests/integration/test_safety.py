"""Hostile and careless input: no code runs from a file vtrain reads, a run deletes only its own
checkpoints and holds its output dir alone, a damaged checkpoint is named (and `--resume auto` falls back), and
SIGTERM/SIGINT finish the step, save and exit 143/130.

Most cases are short commands, so they run through one fork server (helpers/cli_server.py): the ~10 s import of
torch, timm and DeepSpeed is paid once, and every command is still the CLI's own `main()` in a fresh process. The
SIGTERM case runs a plain `python -m vtrain train` as a scheduler would see it. The 2-process interrupt is in
test_distributed.py.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.cli import env, ok, reseal
from tests.helpers.paths import ROOT
from tests.helpers.processes import running
from vtrain.engine.checkpoint import format as ckpt
from vtrain.engine.rundir import LOCK, STALE_AFTER_S, OutputDirLock
from vtrain.errors import VtrainError
from tests.helpers.fork_server import Cli

ARGS = ["--batch-size", "4", "--num-workers", "0", "--embedding-dim", "32", "--log-every", "1"]


# ---- running the CLI ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    c = Cli(tmp_path_factory.mktemp("cli"))
    yield c
    c.close()


def train(cli, faces: Path, out: Path, *args: str, **kw) -> subprocess.CompletedProcess:
    return cli("train", "--data", str(faces), "--output-dir", str(out), *ARGS, *args, **kw)


def one_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """A refusal: non-zero exit, no traceback, exactly one `error:` line, holding every needle."""
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-6000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-6000:]
    for n in needles:
        assert n in errors[0], (n, errors[0])
    return errors[0]


def copy_run(run: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(run, dst)
    return dst


# ---- one prior run per engine (copied per case) -------------------------------------------------------------------

def _pickled_files(run: Path) -> set[str]:
    """The files of a run's newest checkpoint that are not a safe format: each one is a case in PICKLES (a new
    file type written by vtrain or an engine shows up here and needs a case)."""
    step = ckpt.complete_checkpoints(run)[-1]
    safe = (".safetensors", ".json", ".yaml", ".py", "latest")  # zero_to_fp32.py is DeepSpeed's, never run by us
    return {f for f in ckpt.payload_files(step) if not f.endswith(safe)}


@pytest.fixture(scope="module")
def single(cli, faces, tmp_path_factory):
    """A one-process run with step_1 and step_2 (Accelerate: model.safetensors, optimizer.bin, random_states)."""
    out = tmp_path_factory.mktemp("single") / "run"
    ok(train(cli, faces, out, "--max-steps", "2", "--save-every", "1", "--keep-last", "2"))
    # no scheduler.bin / custom_checkpoint_*.pkl: nothing is registered with Accelerate beyond model and optimizer
    assert _pickled_files(out) == {"accelerate/optimizer.bin", "accelerate/random_states_0.pkl"}
    return out


@pytest.fixture(scope="module")
def zero2(cli, faces, tmp_path_factory):
    """DeepSpeed ZeRO-2 on one process: mp_rank_00_model_states.pt and one *_optim_states.pt."""
    out = tmp_path_factory.mktemp("zero2") / "run"
    ok(train(cli, faces, out, "--max-steps", "1", "--ds-config", "ds_configs/zero2.json"))
    assert _pickled_files(out) == {"accelerate/pytorch_model/mp_rank_00_model_states.pt",
                                   "accelerate/pytorch_model/zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                   "accelerate/random_states_0.pkl"}
    return out


@pytest.fixture(scope="module")
def fsdp(cli, faces, tmp_path_factory):
    """FSDP2 on one process: a torch distributed checkpoint (a pickled `.metadata` + `.distcp` shards)."""
    out = tmp_path_factory.mktemp("fsdp") / "run"
    ok(train(cli, faces, out, "--max-steps", "1", "--fsdp"))
    assert _pickled_files(out) == {"fsdp/.metadata", "fsdp/__0_0.distcp", "accelerate/random_states_0.pkl"}
    return out


# ---- 1. no code runs from a file ----------------------------------------------------------------------------------

class _Call:
    """Unpickles as the call `fn(*args)`: what a doctored file does to whoever loads it with plain pickle."""

    def __init__(self, fn, *args) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _payload(marker: Path, how: str) -> tuple[_Call, str]:
    """The object to plant and the global its pickle names (as the refusal should quote it)."""
    fn, args = {"system": (os.system, (f"touch {marker}",)), "open": (open, (str(marker), "w"))}[how]
    return _Call(fn, *args), f"{fn.__module__}.{fn.__qualname__}"


def _torch_plant(path: Path, obj) -> None:
    """Add `obj` to the dict pickled in `path` (read here with the types DeepSpeed and Accelerate legitimately
    store), so the doctored file is the real one plus a payload."""
    from accelerate.utils.other import TORCH_SAFE_GLOBALS

    from vtrain.io.safeio import _deepspeed_globals

    with torch.serialization.safe_globals([*TORCH_SAFE_GLOBALS, *_deepspeed_globals()]):
        state = torch.load(path, map_location="cpu", weights_only=True)
    state["vtrain_test_payload"] = obj
    torch.save(state, path)


def _resume(run, faces, max_steps: int, *flags):
    """The command that resumes the prior run `run` from its newest checkpoint, reading the planted file."""
    return ["train", "--data", faces, "--output-dir", run, *ARGS, "--max-steps", str(max_steps), "--resume", "auto",
            *flags]


def _plant_accelerate(name):
    def plant(run, obj, tmp_path, faces):
        f = run / "checkpoints" / "step_2" / "accelerate" / name
        _torch_plant(f, obj)
        reseal(f.parents[1])
        return f, _resume(run, faces, 3)
    return plant


def _plant_legacy_train_state(run, obj, tmp_path, faces):
    """A vtrain <= 0.1 checkpoint: `train_state.pt` and a COMPLETE marker holding the step number."""
    step = run / "checkpoints" / "step_2"
    state = json.loads((step / ckpt.TRAIN_STATE).read_text())
    (step / ckpt.TRAIN_STATE).unlink()
    torch.save({**state, "vtrain_test_payload": obj}, step / ckpt.LEGACY_TRAIN_STATE)
    (step / ckpt.COMPLETE).write_text("2")
    return step / ckpt.LEGACY_TRAIN_STATE, _resume(run, faces, 3)


def _weights_pt(run, obj, tmp_path, prefix=""):
    sd = load_file(str(run / "checkpoints" / "step_2" / "model.safetensors"))
    f = tmp_path / "weights.pt"
    torch.save({**{k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}, "vtrain_test_payload": obj}, f)
    return f


def _plant_pretrained(run, obj, tmp_path, faces):
    f = _weights_pt(run, obj, tmp_path, prefix="backbone.")
    return f, ["train", "--data", faces, "--output-dir", tmp_path / "new", *ARGS, "--max-steps", "1", "--pretrained", f]


def _plant_resume_weights_only(run, obj, tmp_path, faces):
    f = _weights_pt(run, obj, tmp_path)
    return f, ["train", "--data", faces, "--output-dir", tmp_path / "new", *ARGS, "--max-steps", "1",
               "--resume-weights-only", f]


def _plant_consolidate_pt(run, obj, tmp_path, faces):
    f = _weights_pt(run, obj, tmp_path)
    return f, ["consolidate", f, tmp_path / "out.safetensors"]


def _plant_deepspeed(glob, command):
    def plant(run, obj, tmp_path, faces):
        step = ckpt.complete_checkpoints(run)[-1]
        f = next((step / "accelerate" / "pytorch_model").glob(glob))
        _torch_plant(f, obj)
        reseal(step)
        if command == "consolidate":
            return f, ["consolidate", run, tmp_path / "out.safetensors"]
        return f, _resume(run, faces, 2, "--ds-config", "ds_configs/zero2.json")
    return plant


def _read_dcp(run, step, tmp_path, faces, command):
    """The command that reads the doctored FSDP checkpoint `step` of `run`: consolidate it, or resume the run."""
    reseal(step)
    if command == "consolidate":
        return ["consolidate", step, tmp_path / "out.safetensors"]
    return _resume(run, faces, 2, "--fsdp")


def _plant_dcp(command):
    def plant(run, obj, tmp_path, faces):
        from vtrain.io.safeio import _dcp_globals, restricted_load

        step = ckpt.complete_checkpoints(run)[-1]
        f = step / "fsdp" / ".metadata"
        meta = restricted_load(f, _dcp_globals())
        meta.planner_data = {"vtrain_test_payload": obj}
        f.write_bytes(pickle.dumps(meta))
        return f, _read_dcp(run, step, tmp_path, faces, command)
    return plant


def _plant_dcp_item(fqn, command):
    """Replace one item of a `.distcp` shard (DCP torch.load-s each from an unnamed buffer): appended to the
    shard, with the `.metadata` pointing to it."""
    def plant(run, obj, tmp_path, faces):
        import dataclasses
        import io

        from vtrain.io.safeio import _dcp_globals, restricted_load

        step = ckpt.complete_checkpoints(run)[-1]
        folder = step / "fsdp"
        meta = restricted_load(folder / ".metadata", _dcp_globals())
        index = next(k for k in meta.storage_data if k.fqn == fqn)
        info = meta.storage_data[index]
        blob = io.BytesIO()
        torch.save({"vtrain_test_payload": obj}, blob)
        shard = folder / info.relative_path
        offset = shard.stat().st_size
        with open(shard, "ab") as f:
            f.write(blob.getvalue())
        meta.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(blob.getvalue()))
        (folder / ".metadata").write_bytes(pickle.dumps(meta))
        return folder, _read_dcp(run, step, tmp_path, faces, command)
    return plant


PICKLES = {  # case -> (prior run, how the payload calls out, where it is planted and which command reads it)
    "accelerate-optimizer.bin": ("single", "system", _plant_accelerate("optimizer.bin")),
    "accelerate-random_states": ("single", "open", _plant_accelerate("random_states_0.pkl")),
    "legacy-train_state.pt": ("single", "system", _plant_legacy_train_state),
    "pretrained": ("single", "system", _plant_pretrained),
    "resume-weights-only": ("single", "open", _plant_resume_weights_only),
    "consolidate-pt": ("single", "system", _plant_consolidate_pt),
    "deepspeed-model_states-resume": ("zero2", "system", _plant_deepspeed("mp_rank_00_model_states.pt", "resume")),
    "deepspeed-optim_states-resume": ("zero2", "open", _plant_deepspeed("*_optim_states.pt", "resume")),
    "deepspeed-model_states-consolidate": ("zero2", "open",
                                           _plant_deepspeed("mp_rank_00_model_states.pt", "consolidate")),
    "deepspeed-optim_states-consolidate": ("zero2", "system", _plant_deepspeed("*_optim_states.pt", "consolidate")),
    "fsdp-dcp-metadata-resume": ("fsdp", "system", _plant_dcp("resume")),
    "fsdp-dcp-metadata-consolidate": ("fsdp", "open", _plant_dcp("consolidate")),
    "fsdp-dcp-item-resume": ("fsdp", "system", _plant_dcp_item("optim.param_groups.0.lr", "resume")),
    "fsdp-dcp-tensor-consolidate": ("fsdp", "open", _plant_dcp_item("model.head.weight", "consolidate")),
}


@pytest.mark.parametrize("case", list(PICKLES))
def test_malicious_pickle_is_refused_and_never_runs(case, cli, faces, tmp_path, request):
    prior, how, plant = PICKLES[case]
    run = copy_run(request.getfixturevalue(prior), tmp_path)
    marker = tmp_path / "PWNED"
    obj, name = _payload(marker, how)
    pickle.loads(pickle.dumps(obj))  # the payload is live: plain unpickling runs it
    assert marker.exists()
    marker.unlink()
    f, args = plant(run, obj, tmp_path, faces)
    proc = cli(*args)
    one_error(proc, "refusing to unpickle", str(f), f"`{name}`")
    assert not marker.exists()
    assert not (tmp_path / "out.safetensors").exists()
    if "--resume" in args:  # nothing was trained or saved past the refused checkpoint
        assert [p.name for p in ckpt.complete_checkpoints(run)][-1] == f.relative_to(run).parts[1]


@pytest.mark.parametrize("where", ["--config", "checkpoint config.yaml (eval)"])
def test_yaml_python_tags_are_refused(where, cli, single, faces, tmp_path):
    marker = tmp_path / "PWNED"
    tag = f'!!python/object/apply:os.system ["touch {marker}"]'
    if where == "--config":
        f = tmp_path / "evil.yaml"
        f.write_text(f"optim:\n  lr: {tag}\n")
        proc = train(cli, faces, tmp_path / "new", "--config", str(f), "--max-steps", "1")
    else:
        run = copy_run(single, tmp_path)
        step = run / "checkpoints" / "step_2"
        f = step / "config.yaml"
        f.write_text(f.read_text().replace("optim:\n", f"optim:\n  evil: {tag}\n", 1))
        reseal(step)
        proc = cli("eval", "--checkpoint", str(step), "--data", str(faces))
    one_error(proc, str(f), "python/object/apply:os.system")
    assert not marker.exists()


# ---- 2. lineage: a run deletes only its own checkpoints, holds its output dir alone -------------------------------

def test_pruning_keeps_user_files_and_a_used_dir_needs_resume(cli, faces, tmp_path):
    out = tmp_path / "run"
    user_dir = out / "checkpoints" / "step_0"  # not a vtrain checkpoint (no manifest): never touched
    user_dir.mkdir(parents=True)
    (user_dir / "notes.txt").write_text("mine")
    ok(train(cli, faces, out, "--max-steps", "2", "--save-every", "1", "--keep-last", "1"))
    assert [p.name for p in ckpt.complete_checkpoints(out)] == ["step_2"]
    assert (user_dir / "notes.txt").read_text() == "mine"
    # a file a user put inside the run's own checkpoint is not in its manifest: pruning leaves it
    (out / "checkpoints" / "step_2" / "eval_notes.txt").write_text("mine too")

    one_error(train(cli, faces, out, "--max-steps", "3"), "already holds checkpoints", "--resume auto",
              "--overwrite-output-dir")
    assert [p.name for p in ckpt.complete_checkpoints(out)] == ["step_2"]

    ok(train(cli, faces, out, "--max-steps", "3", "--save-every", "1", "--keep-last", "1", "--resume", "auto"))
    assert [p.name for p in ckpt.complete_checkpoints(out)] == ["step_3"]
    pruned = out / "checkpoints" / "step_2"
    assert sorted(p.name for p in pruned.iterdir()) == ["eval_notes.txt"]
    assert (user_dir / "notes.txt").read_text() == "mine"
    assert ckpt.verify(out / "checkpoints" / "step_3") is None


def _foreign(single: Path, out: Path, step: int) -> Path:
    """A checkpoint of another run (another lineage), numbered higher than anything this run will write: its
    train state, manifest and folder name agree on the step, as in a checkpoint that run wrote."""
    dst = out / "checkpoints" / f"step_{step}"
    shutil.copytree(single / "checkpoints" / "step_2", dst)
    state = json.loads((dst / ckpt.TRAIN_STATE).read_text())
    state.update(step=step, consumed_samples=max(step, state["consumed_samples"]))
    (dst / ckpt.TRAIN_STATE).write_text(json.dumps(state))
    manifest = json.loads((dst / ckpt.COMPLETE).read_text())
    manifest.update(step=step, run_id="another-run")
    (dst / ckpt.COMPLETE).write_text(json.dumps(manifest))
    reseal(dst)
    return dst


def test_another_runs_checkpoints_are_never_pruned(cli, single, faces, tmp_path):
    # resuming one's own checkpoint in a dir that also holds a newer foreign one: only this lineage is pruned
    run = copy_run(single, tmp_path)
    foreign = _foreign(single, run, 50)
    ok(train(cli, faces, run, "--max-steps", "4", "--save-every", "1", "--keep-last", "1", "--resume",
             str(run / "checkpoints" / "step_2")))
    assert [p.name for p in ckpt.complete_checkpoints(run)] == ["step_4", "step_50"]
    assert ckpt.verify(foreign) is None and ckpt.read_manifest(foreign).run_id == "another-run"
    assert ckpt.read_train_state(run / "checkpoints" / "step_4")["step"] == 4

    # a new run into a dir holding another run's checkpoints: refused, or started over on request
    new = tmp_path / "new"
    foreign = _foreign(single, new, 50)
    (new / "checkpoints" / "step_0").mkdir()
    (new / "checkpoints" / "step_0" / "notes.txt").write_text("mine")
    one_error(train(cli, faces, new, "--max-steps", "2"), "already holds checkpoints of an earlier run (step_50)")
    assert ckpt.verify(foreign) is None
    proc = ok(train(cli, faces, new, "--max-steps", "2", "--save-every", "1", "--keep-last", "1",
                    "--overwrite-output-dir"))
    assert "--overwrite-output-dir: deleted 1 checkpoints" in proc.stdout + proc.stderr
    assert [p.name for p in ckpt.complete_checkpoints(new)] == ["step_2"]
    assert (new / "checkpoints" / "step_0" / "notes.txt").read_text() == "mine"


def _wait_for(path: Path, proc_alive, what: str, timeout: float = 300) -> None:
    t0 = time.monotonic()
    while not (path.is_file() and path.stat().st_size):
        assert proc_alive(), f"the run ended before {what}"
        assert time.monotonic() - t0 < timeout, f"no {what} after {timeout} s"
        time.sleep(0.05)


def test_a_killed_runs_lock_is_taken_over(cli, faces, tmp_path):
    out = tmp_path / "run"
    job = cli.start("train", "--data", str(faces), "--output-dir", str(out), *ARGS, "--max-steps", "1000",
                    "--save-every", "1000")
    _wait_for(out / LOCK, lambda: running(job["pid"]), "lock file")
    os.kill(job["pid"], signal.SIGKILL)
    assert cli.wait(job).returncode == -signal.SIGKILL
    assert (out / LOCK).is_file()  # left behind: its process is gone
    proc = ok(train(cli, faces, out, "--max-steps", "1", "--resume", "auto"))
    assert [p.name for p in ckpt.complete_checkpoints(out)] == ["step_1"]
    assert not (out / LOCK).exists(), proc.stderr


def _write_lock(path: Path, host: str, pid: int, started: float, age_s: float) -> None:
    path.write_text(json.dumps({"host": host, "pid": pid, "started": started, "token": "x"}))
    t = time.time() - age_s
    os.utime(path, (t, t))


def test_lock_rules_on_one_host_and_across_hosts(tmp_path):
    """The lock file as another process (here, or on another node of a shared file system) would have left it."""
    import psutil

    me = psutil.Process()
    lock_file = tmp_path / LOCK
    cases = [  # (host, pid, process start time, age of the heartbeat, taken over?)
        ("other-node", 4242, 1.0, 5.0, False),  # another host, heartbeat fresh: that run is alive
        ("other-node", 4242, 1.0, STALE_AFTER_S + 60, True),  # another host, no heartbeat for long: stale
        (socket.gethostname(), os.getpid(), me.create_time(), STALE_AFTER_S + 60, False),  # alive here, however old
        (socket.gethostname(), os.getpid(), me.create_time() - 1000, 0.0, True),  # that pid is another process now
        (socket.gethostname(), 2**22 + 17, 1.0, 0.0, True),  # no such process
    ]
    for host, pid, started, age, stale in cases:
        _write_lock(lock_file, host, pid, started, age)
        lock = OutputDirLock(tmp_path)
        if stale:
            lock.acquire()
            held = json.loads(lock_file.read_text())
            assert held["pid"] == os.getpid() and held["token"] == lock.owner["token"]
            lock.release()
            assert not lock_file.exists()
        else:
            with pytest.raises(VtrainError, match=re.escape(f"in use by another vtrain run (pid {pid} on {host},")):
                lock.acquire()
            assert json.loads(lock_file.read_text())["pid"] == pid  # untouched
    # an unreadable lock: being written right now when fresh, stale when old
    lock_file.write_text("")
    with pytest.raises(VtrainError, match="unreadable lock"):
        OutputDirLock(tmp_path).acquire()
    os.utime(lock_file, (time.time() - STALE_AFTER_S - 60,) * 2)
    lock = OutputDirLock(tmp_path)
    lock.acquire()
    lock.release()


# ---- 3. integrity: a damaged checkpoint is named; --resume auto falls back ----------------------------------------

def _truncate(f: Path) -> None:
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _flip_bit(f: Path) -> None:
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x10
    f.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["truncated model.safetensors", "bit-flipped accelerate/optimizer.bin"])
def test_damaged_newest_checkpoint_is_named_and_skipped_by_resume_auto(damage, cli, single, faces, tmp_path):
    how, rel = damage.split(" ")
    run = copy_run(single, tmp_path)
    newest = run / "checkpoints" / "step_2"
    f = newest / rel
    (_truncate if how == "truncated" else _flip_bit)(f)
    problem = "truncated or replaced" if how == "truncated" else "checksum mismatch"
    one_error(train(cli, faces, run, "--max-steps", "3", "--resume", str(newest)), "damaged checkpoint", str(f),
              problem)
    one_error(cli("eval", "--checkpoint", str(newest), "--data", str(faces)), str(f), problem)
    one_error(cli("consolidate", str(newest), str(tmp_path / "out.safetensors")), str(f), problem)
    assert not (tmp_path / "out.safetensors").exists()
    # a run dir: consolidate (and eval) use the newest checkpoint that verifies, and say which one they skipped
    proc = cli("consolidate", str(run), str(tmp_path / "older.safetensors"))
    assert proc.returncode == 0 and "skipping a damaged checkpoint" in proc.stderr and str(f) in proc.stderr

    proc = ok(train(cli, faces, run, "--max-steps", "3", "--save-every", "1", "--resume", "auto"))
    log = proc.stdout + proc.stderr
    assert "--resume auto: skipped the damaged checkpoint step_2" in log and str(f) in log
    assert f"resumed from {run / 'checkpoints' / 'step_1'} at step 1" in log
    # the damaged step_2 (of this run's lineage) was replaced by a good one
    assert [p.name for p in ckpt.complete_checkpoints(run)] == ["step_1", "step_2", "step_3"]
    assert [ckpt.verify(p) for p in ckpt.complete_checkpoints(run)] == [None] * 3


# ---- 4. preemption: SIGTERM / SIGINT ------------------------------------------------------------------------------

STEPS = 10
SIG_ARGS = ["--max-steps", str(STEPS), "--save-every", str(STEPS), "--seed", "5"]


@pytest.fixture(scope="module")
def uninterrupted(cli, faces, tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    ok(train(cli, faces, out, *SIG_ARGS))
    return load_file(str(ckpt.complete_checkpoints(out)[-1] / "model.safetensors"))


def _interrupted(proc: subprocess.CompletedProcess, out: Path, sig: signal.Signals) -> int:
    """The promised exit: code 128 + signal, one message naming the step and checkpoint; returns the step."""
    assert proc.returncode == 128 + sig, (proc.returncode, proc.stderr[-4000:])
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("interrupted at step")]
    assert len(lines) == 1, proc.stderr[-4000:]
    step = int(lines[0].split()[3])
    path = ckpt.final_path(out, step)
    assert lines[0] == (f"interrupted at step {step} ({sig.name}); checkpoint written to {path}; continue with "
                        "--resume auto")
    assert 1 <= step < STEPS
    assert [p.name for p in ckpt.complete_checkpoints(out)] == [path.name] and ckpt.verify(path) is None
    assert ckpt.read_train_state(path)["step"] == step
    assert not (out / LOCK).exists()
    return step


def _resume_matches(cli, faces, out: Path, step: int, uninterrupted: dict) -> None:
    proc = ok(train(cli, faces, out, *SIG_ARGS, "--resume", "auto"))
    assert f"resumed from {ckpt.final_path(out, step)} at step {step}" in proc.stdout + proc.stderr
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == \
        list(range(1, STEPS + 1))  # the logs read as one uninterrupted run
    got = load_file(str(ckpt.final_path(out, STEPS) / "model.safetensors"))
    assert got.keys() == uninterrupted.keys()
    for k in got:
        assert torch.equal(got[k], uninterrupted[k]), k


def test_sigterm_saves_exits_143_and_resumes_exactly_while_the_dir_stays_locked(cli, faces, uninterrupted, tmp_path):
    """A plain `python -m vtrain train` gets SIGTERM from outside after it has logged a step. While it runs,
    a second run into the same dir is refused (the first is held stopped meanwhile, so it certainly runs)."""
    out = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "vtrain", "train", "--data", str(faces), "--output-dir", str(out),
                          *ARGS, *SIG_ARGS], cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        _wait_for(out / "metrics.jsonl", lambda: p.poll() is None, "logged step")
        p.send_signal(signal.SIGSTOP)
        try:
            second = train(cli, faces, out, *SIG_ARGS, "--resume", "auto")
            one_error(second, f"--output-dir {out} is in use by another vtrain run (pid {p.pid}")
            p.send_signal(signal.SIGTERM)
        finally:
            p.send_signal(signal.SIGCONT)
        stdout, stderr = p.communicate(timeout=600)
    finally:
        p.kill()
    proc = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
    assert "received SIGTERM: finishing this step and writing a checkpoint" in stderr
    step = _interrupted(proc, out, signal.SIGTERM)
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["step"] == step
    _resume_matches(cli, faces, out, step, uninterrupted)


def test_sigint_saves_exits_130_and_resumes_exactly(cli, faces, uninterrupted, tmp_path):
    out = tmp_path / "run"
    job = cli.start("train", "--data", str(faces), "--output-dir", str(out), *ARGS, *SIG_ARGS)
    _wait_for(out / "metrics.jsonl", lambda: running(job["pid"]), "logged step")
    os.kill(job["pid"], signal.SIGINT)
    step = _interrupted(cli.wait(job), out, signal.SIGINT)
    _resume_matches(cli, faces, out, step, uninterrupted)


def test_sigterm_to_the_whole_job_with_loader_workers_saves_and_exits_143(tmp_path):
    """A scheduler signals every process of a job, DataLoader workers and their fork server included. Sent to the
    run's process group right after step 10 is logged, while its evaluation (2 workers) or the training loader (2
    workers) reads: the run finishes, writes its checkpoint and exits 143. Before the workers and the server ignored
    it (data/workers.py), the read failed: exit 1, a ConnectionResetError traceback, no checkpoint."""
    out = tmp_path / "run"
    log = tmp_path / "log.txt"
    with open(log, "w") as f:
        p = subprocess.Popen([sys.executable, "-m", "vtrain", "train", "--task", "dino", "--model", "debug-resnet",
                              "--data", "demo", "--image-size", "128", "--batch-size", "2", "--max-steps", "40",
                              "--num-workers", "2", "--eval-every", "10", "--save-every", "100", "--log-every", "5",
                              "--mixed-precision", "no", "--output-dir", str(out)], cwd=ROOT, env=env(),
                             stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        t0 = time.monotonic()
        while "step=10 " not in log.read_text():
            assert p.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() - t0 < 600, "no step 10 after 600 s"
            time.sleep(0.05)
        os.killpg(p.pid, signal.SIGTERM)
        rc = p.wait(timeout=600)
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # what is left of the group, if the test failed
        except ProcessLookupError:
            pass
    text = log.read_text()
    assert rc == 128 + signal.SIGTERM and "Traceback" not in text, text[-3000:]
    line = next(line for line in text.splitlines() if line.startswith("interrupted at step"))
    step = int(line.split()[3])
    assert [c.name for c in ckpt.complete_checkpoints(out)] == [f"step_{step}"], text[-3000:]
    assert ckpt.verify(ckpt.final_path(out, step)) is None


def test_debug_signal_at_step_and_a_second_signal_exits_at_once(cli, faces, tmp_path):
    # the fault-injection hook interrupts exactly at a step (what the 2-process test relies on)
    out = tmp_path / "run"
    proc = train(cli, faces, out, *SIG_ARGS, extra_env={"VTRAIN_DEBUG_SIGNAL_AT_STEP": "3"})
    assert _interrupted(proc, out, signal.SIGTERM) == 3
    # two signals at once (both pending when the run is continued): the second one exits without saving
    out = tmp_path / "twice"
    job = cli.start("train", "--data", str(faces), "--output-dir", str(out), *ARGS, "--max-steps", "1000",
                    "--save-every", "1000")
    _wait_for(out / "metrics.jsonl", lambda: running(job["pid"]), "logged step")
    os.kill(job["pid"], signal.SIGSTOP)
    os.kill(job["pid"], signal.SIGTERM)
    os.kill(job["pid"], signal.SIGINT)
    os.kill(job["pid"], signal.SIGCONT)
    proc = cli.wait(job)
    assert proc.returncode in (128 + signal.SIGINT, 128 + signal.SIGTERM), proc.stderr[-3000:]
    assert "received SIG" in proc.stderr and "interrupted at step" not in proc.stderr
    assert not (out / "checkpoints").exists()  # no checkpoint was begun, let alone completed
