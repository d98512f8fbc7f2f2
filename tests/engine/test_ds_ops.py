"""engine/ds_ops.py: a DeepSpeed op that is not yet in the extensions folder is announced before and after its
build, on rank 0 only; a cached one loads without a word."""

from __future__ import annotations

import io
import os
import sys

from vtrain.engine import ds_ops


class _Builder:
    name = "cpu_adam"

    def sources(self):
        return ["csrc/adam/cpu_adam.cpp"]

    def deepspeed_src_path(self, path):
        return f"/site-packages/deepspeed/ops/{path}"

    def jit_load(self, verbose=True):
        print("(compiling)")
        return "module"


def test_a_build_is_announced_once_and_a_cached_op_is_not(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    screen = io.StringIO()
    monkeypatch.setattr(sys, "stdout", screen)
    load = ds_ops._announced(_Builder.jit_load)
    assert load(_Builder()) == "module"
    lines = screen.getvalue().splitlines()
    assert lines[0].startswith("building DeepSpeed's CPU Adam") and str(tmp_path / "cpu_adam") in lines[0]
    assert "compiled once on this machine" in lines[0] and lines[1] == "(compiling)"
    assert lines[2].startswith("built cpu_adam in 0:00:0")
    (tmp_path / "cpu_adam").mkdir()
    (tmp_path / "cpu_adam" / "cpu_adam.so").write_bytes(b"")
    # built by another installation (other source paths): ninja compiles again, so it is announced again
    ninja = tmp_path / "cpu_adam" / "build.ninja"
    ninja.write_text("build cpu_adam.o: compile /other/venv/deepspeed/ops/csrc/adam/cpu_adam.cpp\n")
    assert not ds_ops.is_built("cpu_adam", ["/site-packages/deepspeed/ops/csrc/adam/cpu_adam.cpp"])
    ninja.write_text("build cpu_adam.o: compile /site-packages/deepspeed/ops/csrc/adam/cpu_adam.cpp\n")
    assert not ds_ops.is_built("cpu_adam", ["/site-packages/deepspeed/ops/csrc/adam/cpu_adam.cpp"])  # being built
    os.utime(ninja, (1, 1))  # the library is newer: built
    assert ds_ops.is_built("cpu_adam", ["/site-packages/deepspeed/ops/csrc/adam/cpu_adam.cpp"])
    load(_Builder())
    monkeypatch.setenv("RANK", "1")
    (tmp_path / "cpu_adam" / "cpu_adam.so").unlink()
    load(_Builder())
    assert screen.getvalue().splitlines()[3:] == ["(compiling)", "(compiling)"]  # cached; not rank 0
