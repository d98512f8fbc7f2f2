"""vtrain/launch.py: `accelerate launch --num_processes N` that started one process alone is recognised from the
launcher's command line (or the accelerate config it read) and the environment; every launch of several processes
and every single-process launch passes. The real launch: tests/integration/test_first_hour.py (slow)."""

from __future__ import annotations

import pytest

from vtrain.launch import launcher_args, one_process_launch, requested_processes

PY = "/venv/bin/python"
ACC = [PY, "/venv/bin/accelerate", "launch"]
TAIL = ["-m", "vtrain", "train", "--data", "demo", "--config", "x.yaml"]


@pytest.mark.parametrize("parent", [
    [*ACC, "--num_processes", "2", *TAIL],
    [*ACC, "--num-processes=2", *TAIL],
    [PY, "-m", "accelerate.commands.launch", "--num_processes", "4", "--main_process_port", "1234", *TAIL],
    [PY, "/venv/bin/accelerate-launch", "--num_processes", "2", "/repo/train.py", "--num_processes", "1"],
])
def test_the_launch_that_starts_one_process_alone_is_refused(parent):
    line = one_process_launch(environ={"ACCELERATE_MIXED_PRECISION": "no"}, parent=parent, script="/repo/train.py")
    assert line is not None and "started this one alone" in line
    assert "--config_file accelerate_configs/ddp.yaml" in line and "--multi_gpu" in line


@pytest.mark.parametrize("environ,parent", [
    ({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}, [*ACC, "--multi_gpu", "--num_processes", "2", *TAIL]),
    ({"LOCAL_RANK": "0"}, [*ACC, "--config_file", "accelerate_configs/ddp.yaml", *TAIL]),  # torchrun's child
    ({}, [*ACC, "--num_processes", "1", *TAIL]),
    ({}, [*ACC, *TAIL]),  # no count anywhere (no default accelerate config in this HOME)
    ({}, [PY, "-m", "vtrain", "train"]),  # not launched by accelerate
    ({}, ["/bin/bash", "-c", "vtrain train --num_processes 2"]),
])
def test_every_other_launch_passes(environ, parent, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    assert one_process_launch(environ=environ, parent=parent, script="/repo/vtrain/__main__.py") is None


def test_the_count_of_an_accelerate_config_file(tmp_path, monkeypatch):
    cfg = tmp_path / "cpu.yaml"
    cfg.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\nnum_processes: 3\n")
    args = launcher_args([*ACC, "--config_file", str(cfg), *TAIL])
    assert args == ["--config_file", str(cfg)] and requested_processes(args) == 3
    line = one_process_launch(environ={}, parent=[*ACC, "--config_file", str(cfg), *TAIL], script="")
    assert line is not None and "asked for 3 processes" in line
    # accelerate's default config (read unless --cpu), under HF_HOME
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    (tmp_path / "accelerate").mkdir()
    (tmp_path / "accelerate" / "default_config.yaml").write_text("num_processes: 2\n")
    assert requested_processes(launcher_args([*ACC, *TAIL])) == 2
    assert requested_processes(launcher_args([*ACC, "--cpu", *TAIL])) == 1
