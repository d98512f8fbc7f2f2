"""Autocast under DeepSpeed ZeRO-3: the engine's forward context turns torch's weight-cast cache off, without
which a head called twice in one forward (as DINO calls its box heads) fails in backward
(engine/precision.py `no_weight_cast_cache`). One process, plain DeepSpeed, the engine's context chosen by
the DeepSpeed engine's `forward_context` for a ZeRO-3 torch_autocast plan."""

import subprocess
import sys

import torch

from tests.helpers.cli import env
from tests.helpers.paths import ROOT
from tests.helpers.ports import free_port as _port
from vtrain.engine.precision import no_weight_cast_cache

HELPER = str(ROOT / "tests" / "helpers" / "ds_z3_reused_head.py")


def test_weight_cast_cache_off_inside_and_restored():
    assert torch.is_autocast_cache_enabled()
    with no_weight_cast_cache():
        with torch.autocast("cpu", dtype=torch.bfloat16):  # as DeepSpeed opens it: cache_enabled inherited
            assert not torch.is_autocast_cache_enabled()
    assert torch.is_autocast_cache_enabled()


def _one_process(mode: str) -> subprocess.CompletedProcess:
    rank = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, HELPER, mode], cwd=ROOT, capture_output=True, text=True,
                          env=env(**rank), timeout=600)


def test_zero3_autocast_head_called_twice_trains_under_the_engine_context():
    bare = _one_process("bare")
    assert bare.returncode != 0 and "must match the size of tensor" in bare.stderr  # the failure this guards
    ours = _one_process("vtrain")
    assert ours.returncode == 0 and "trained" in ours.stdout, ours.stderr[-3000:]
