"""Two "machines" on 127.0.0.1, one CPU process each, then a resume of their checkpoint on one machine.

Each machine is its own `accelerate launch --num_machines 2 --machine_rank R` (torch elastic's static rendezvous at
--main_process_ip:--main_process_port, as on a cluster); both start at once and write one output directory, as
nodes sharing a file system do. What is checked is read from the run itself: the world size and the node and local
rank of every process (run_info.json), disjoint data per rank, a checkpoint whose manifest verifies and holds the
second machine's own files, and a resume on ONE machine with two processes that continues at the saved step and
data position (docs/multinode.md).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers.cli import env, launch, metrics, ok, run_info
from tests.helpers.paths import ROOT
from tests.helpers.ports import free_port as _port
from vtrain.data.sampler import ShardedEpochSampler
from vtrain.engine.checkpoint.format import complete_checkpoints, read_manifest, read_train_state, verify

pytestmark = pytest.mark.slow

ENGINES = {"ddp": ("ddp.yaml", "accelerate/random_states_1.pkl"),  # accelerate config, a file rank 1 writes
           "fsdp": ("fsdp.yaml", "fsdp/__1_0.distcp")}
BATCH, STEPS, MORE = 4, 3, 2
ARGS = ["--num-workers", "0", "--embedding-dim", "32", "--head", "cosface", "--batch-size", str(BATCH),
        "--log-every", "1"]
TIMEOUT = 600


def _start_machine(rank: int, port: int, acc_cfg: str, log, args: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "accelerate.commands.launch",
           "--config_file", str(ROOT / "accelerate_configs" / acc_cfg),
           "--num_machines", "2", "--machine_rank", str(rank), "--num_processes", "2",
           "--main_process_ip", "127.0.0.1", "--main_process_port", str(port),
           # a machine whose partner never arrives gives up after 2 min, not torch elastic's default 10
           "--rdzv_conf", "timeout=120", "-m", "vtrain", "train", *args]
    # a session of its own: on failure the launcher and its worker are killed together
    return subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _two_machines(tmp_path, acc_cfg: str, args0: list[str], args1: list[str] | None = None) -> tuple[list, str]:
    """Start both machines (machine 1 with `args1` when given), wait for both; a machine still running after the
    other failed, or after the timeout, is killed. Returns the exit codes and both logs."""
    logs = [open(tmp_path / f"machine{r}.log", "w") for r in (0, 1)]
    procs = []
    try:
        port = _port()
        procs = [_start_machine(r, port, acc_cfg, logs[r], a) for r, a in enumerate((args0, args1 or args0))]
        deadline = time.monotonic() + TIMEOUT
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                break  # one machine failed: the other would wait for it until the rendezvous times out
            time.sleep(0.5)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for f in logs:
            f.close()
    text = "\n".join(f"--- machine {r} ---\n{(tmp_path / f'machine{r}.log').read_text()[-6000:]}" for r in (0, 1))
    return [p.returncode for p in procs], text


@pytest.mark.parametrize("engine", list(ENGINES))
def test_two_machines_then_resume_on_one(engine, faces, tmp_path):
    acc_cfg, rank1_file = ENGINES[engine]
    out = tmp_path / "run"
    common = ["--data", str(faces), "--output-dir", str(out), *ARGS]
    codes, logs = _two_machines(tmp_path, acc_cfg, [*common, "--max-steps", str(STEPS)])
    assert codes == [0, 0], f"exit codes {codes}\n{logs}"

    # 1. one world of 2 over two nodes: each node's only process is its local rank 0
    info = run_info(out)
    ranks = info["ranks"]
    assert info["world_size"] == 2 and [r["rank"] for r in ranks] == [0, 1]
    assert all(r["dist_world_size"] == 2 and r["accelerate_num_processes"] == 2 for r in ranks)
    assert [r["node_rank"] for r in ranks] == [0, 1] and [r["local_rank"] for r in ranks] == [0, 0]
    assert [r["accelerate_is_main"] for r in ranks] == [True, False]
    assert not set(ranks[0]["first_batch_indices"]) & set(ranks[1]["first_batch_indices"])
    if engine == "fsdp":
        assert all(r["all_params_dtensor"] and abs(r["local_param_fraction"] - 0.5) < 0.05 for r in ranks)
    else:
        assert all(r["ddp_wrapped"] for r in ranks)

    # 2. one complete checkpoint (saved at the end) that verifies, with the second machine's share in it
    (ckpt,) = complete_checkpoints(out)
    assert ckpt.name == f"step_{STEPS}" and verify(ckpt) is None
    assert rank1_file in read_manifest(ckpt).files
    state = read_train_state(ckpt)
    assert state["world_size"] == 2 and state["consumed_samples"] == STEPS * BATCH * 2
    assert not list((out / "checkpoints").glob(".tmp-*")) and not (out / ".vtrain.lock").exists()

    # 3. resume on ONE machine with 2 processes: it continues at step 4 and at the saved data position
    ok(launch(2, "train", *common, "--max-steps", str(STEPS + MORE), "--resume", "auto", accelerate_config=acc_cfg))
    info = run_info(out)
    ranks = info["ranks"]
    assert info["world_size"] == 2 and info["resumed_from"] == str(ckpt)
    assert [r["node_rank"] for r in ranks] == [0, 0] and [r["local_rank"] for r in ranks] == [0, 1]
    assert [m["step"] for m in metrics(out)] == list(range(1, STEPS + MORE + 1))
    for r in ranks:  # the first batch after the resume is the sampler's batch at the saved position
        sampler = ShardedEpochSampler(96, BATCH, r["rank"], 2, seed=42)  # `faces`: 16 identities x 6 images
        sampler.set_position(0, STEPS)
        assert r["first_batch_indices"] == [i for _, i in list(sampler)[:BATCH]]
    final = complete_checkpoints(out)[-1]
    assert final.name == f"step_{STEPS + MORE}" and verify(final) is None
    assert read_train_state(final)["consumed_samples"] == (STEPS + MORE) * BATCH * 2


def test_output_dir_not_shared_is_refused_at_start(faces, tmp_path):
    """A node that writes --output-dir to a disk of its own (here: machine 1 given another path) would fail only
    at the first save; the run stops before training with one line naming the rank that does not see it."""
    common = ["--data", str(faces), *ARGS, "--max-steps", "2"]
    codes, logs = _two_machines(tmp_path, "ddp.yaml", ["--output-dir", str(tmp_path / "run"), *common],
                                ["--output-dir", str(tmp_path / "node1_local"), *common])
    assert 0 not in codes, logs
    assert f"--output-dir {tmp_path / 'run'} is not shared by every process (rank 1:" in logs, logs
    # one line from rank 0; rank 1 exits quietly and cleanly (no gloo abort at interpreter exit)
    assert logs.count("is not shared by every process") == 1 and "terminate called" not in logs, logs
    assert "exitcode  : 2" in logs, logs
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / ".vtrain.lock").exists()
