"""benchmarks/gpu_suite.py without a GPU: its dry run end to end, how a unit's crash, OOM or hang becomes a row,
the budget rule, and the generated table of docs/gpu_benchmarks.md."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.helpers.cli import env
from tests.helpers.paths import ROOT
from tests.helpers.processes import running

sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_suite  # noqa: E402
import render_gpu_table as render  # noqa: E402


def _suite(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_suite.py"), *args], cwd=ROOT,
                          capture_output=True, text=True, env=env(), timeout=1200)


@pytest.mark.slow
def test_dry_run_measures_one_unit_of_each_kind_and_a_second_run_keeps_them(tmp_path):
    proc = _suite("--dry-run", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (path,) = tmp_path.glob("*.json")
    res = json.loads(path.read_text())
    assert res["format"] == render.FORMAT and res["dry_run"] and res["device"]["torch"]
    u = res["units"]
    assert {k: v["status"] for k, v in u.items()} == {
        "dino/none": "ok", "msda/encoder + decoder": "ok", "face/10,000 none 1.0": "ok",
        "estimate/metric 10,000 identities": "ok", "loop/face debug": "ok", "loop/face debug --compile": "skipped"}
    dino = u["dino/none"]["result"]
    assert dino["peak_gib"] > 0 and dino["estimate_gib"] > 0 and dino["gc"] == "none" and dino["preset"] == "debug"
    assert {r["impl"] for r in u["msda/encoder + decoder"]["result"]["rows"]} == {"pytorch", "triton"}
    assert u["face/10,000 none 1.0"]["result"]["mode"] == "none"
    assert u["estimate/metric 10,000 identities"]["result"]["estimate_gib"] > 0
    assert u["loop/face debug"]["result"]["rows"][0]["ratio"] > 0
    md = path.with_suffix(".md").read_text()
    for title in ("DINO training step", "Deformable attention alone", "Face training step", "Training loop overhead"):
        assert title in md
    # the same command again: everything measured is kept, nothing runs twice
    proc = _suite("--dry-run", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-4000:]
    again = json.loads(path.read_text())
    assert len(again["runs"]) == 2
    assert all(v.get("run", 0) == 0 for v in again["units"].values())
    assert again["units"]["dino/none"] == u["dino/none"]
    # a dry run never enters the docs table
    assert render.render_block(render.load_results(tmp_path)) == render.NO_RUN + "\n"


def _unit(code: str) -> gpu_suite.Unit:
    return gpu_suite.Unit("face", "x", [sys.executable, "-c", code], expect_s=1, cap_s=60, parse="face")


def test_a_crash_or_an_oom_is_a_failed_row_with_its_last_error_line(tmp_path):
    r = gpu_suite.run_unit(_unit("import sys; print('started'); sys.exit('ValueError: bad shape')"), 60, False,
                           tmp_path)
    assert r["status"] == "failed" and r["error"] == "ValueError: bad shape"
    oom = ("import sys; sys.stderr.write('Traceback ...\\ntorch.OutOfMemoryError: CUDA out of memory. Tried to "
           "allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB\\n'); sys.exit(1)")
    r = gpu_suite.run_unit(_unit(oom), 60, False, tmp_path)
    assert r["status"] == "failed" and r["error"] == "OOM: Tried to allocate 2.00 GiB"
    r = gpu_suite.run_unit(_unit("print('no json here')"), 60, False, tmp_path)
    assert r["status"] == "failed" and r["error"].startswith("no result")
    r = gpu_suite.run_unit(_unit("import json; print(json.dumps({'images_per_s': 1.5}))"), 60, False, tmp_path)
    assert r["status"] == "ok" and r["result"] == {"images_per_s": 1.5}


@pytest.mark.parametrize("budget_cut", [False, True])
def test_a_hang_is_killed_with_its_children(budget_cut, tmp_path):
    pid_file = tmp_path / "child.pid"
    code = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; "
            f"time.sleep(600)']); open({str(pid_file)!r}, 'w').write(str(c.pid)); time.sleep(600)")
    r = gpu_suite.run_unit(_unit(code), 5, budget_cut, tmp_path)
    # over its cap the unit failed; cut by the budget it waits for the next invocation
    assert r["status"] == ("pending" if budget_cut else "failed")
    assert ("budget" in r["note"]) if budget_cut else r["error"] == "timeout after 5 s"
    child = int(pid_file.read_text())
    for _ in range(50):  # killed with its process group; the orphan is reaped by init
        if not running(child):
            break
        time.sleep(0.1)
    else:
        pytest.fail("the benchmark's child process outlived the timeout")


def test_a_unit_starts_only_when_the_budget_covers_its_expected_time():
    u = gpu_suite.Unit("dino", "none", [], expect_s=100, cap_s=300, parse="dino")
    assert gpu_suite.decide(u, 99) == (False, 0.0, False)
    assert gpu_suite.decide(u, 200) == (True, 200, True)  # the budget, not the cap, would stop it
    assert gpu_suite.decide(u, 500) == (True, 300, False)


def _result() -> dict:
    dino = {"preset": "swin-l", "batch_size": 2, "image_size": [800, 1333], "precision": "bf16", "engine": "single",
            "msda": "triton", "gc": "none", "peak_gib": 40.0, "reserved_gib": 42.0, "s_per_iter": 0.5,
            "images_per_s": 4.0, "estimate_gib": 41.0, "estimate_phase": "backward", "peak_phase": "backward",
            "phase_peaks_gib": {"forward": 36.0, "backward": 40.0, "optimizer": 12.0},
            "estimate_phases_gib": {"forward": 36.9, "backward": 41.0, "optimizer": 11.4}}
    face = {"preset": "vit-b", "classes": 100_000, "mode": "none", "sample_rate": 1.0, "world": 8, "micro_batch": 256,
            "images_per_s": 6000.0, "peak_mb": 8 * 1024}
    return {"format": render.FORMAT, "dry_run": False,
            "device": {"name": "NVIDIA H100 80GB HBM3", "memory_gib": 79.2, "torch": "2.11.0", "triton": "3.6.0",
                       "cuda": "13.0"},
            "runs": [{"started": "2026-12-01T10:00:00+00:00", "git_commit": "0123456789abcdef", "git_dirty": False}],
            "units": {
                "dino/none": {"part": "dino", "label": "none", "status": "ok", "result": dino},
                "dino/backbone": {"part": "dino", "label": "backbone", "status": "failed", "error": "OOM"},
                "face/100,000 none 1.0": {"part": "face", "label": "100,000 none 1.0", "status": "ok", "result": face},
                "estimate/metric 100,000 identities": {"part": "estimate", "label": "metric 100,000 identities",
                                                       "status": "ok",
                                                       "result": {"classes": 100_000, "estimate_gib": 9.0}},
                "loop/face vit-b --compile": {"part": "loop", "label": "face vit-b --compile", "status": "skipped",
                                              "note": "no --compile option yet"}}}


def test_tables_show_estimate_errors_failures_and_skips():
    text = render.render(_result())
    assert "### NVIDIA H100 80GB HBM3, 79 GiB" in text and "at commit 0123456789" in text
    assert ("| none | 40.00 | 42.00 | 0.500 | 4.00 | 41.00 | +2.5% | backward / backward | 36.00 (+2.5%) | "
            "40.00 (+2.5%) | 12.00 (-5.0%) |") in text
    assert "| backbone | failed: OOM |" in text
    assert "| 100,000 | none | 1.0 | 6000.0 | 8.00 | 9.00 | +12.5% |" in text
    assert "| face vit-b --compile | skipped: no --compile option yet |" in text


def test_block_is_rewritten_between_the_markers_only(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text(f"# title\n\nbefore\n{render.BEGIN}\nold figures\n{render.END}\nafter\n")
    new = render.rewrite(doc, render.render_block([_result()]))
    assert new.startswith("# title\n\nbefore\n" + render.BEGIN + "\n### NVIDIA H100")
    assert new.endswith(render.END + "\nafter\n") and "old figures" not in new
    assert render.NO_RUN in render.rewrite(doc, render.render_block([]))
    doc.write_text("no markers\n")
    with pytest.raises(SystemExit):
        render.rewrite(doc, "x")


def test_docs_table_matches_the_committed_results():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "render_gpu_table.py"), "--check"], cwd=ROOT,
                          capture_output=True, text=True, env=env())
    assert proc.returncode == 0, proc.stderr
