"""engine/run_files.py: where `vtrain eval --save-predictions FILE` keeps its console (eval.log beside FILE), and
where it does not: in a checkpoint, over a link, a FIFO or a file vtrain did not write."""

from __future__ import annotations

import os

from vtrain.console import end_log, header, log_to
from vtrain.engine.run_files import eval_log


def test_eval_log_beside_the_predictions(tmp_path):
    log, why = eval_log(tmp_path / "pred.json")
    assert (log, why) == (tmp_path / "eval.log", "")
    log_to(log, header("eval"))
    end_log()
    assert eval_log(tmp_path / "other.json") == (tmp_path / "eval.log", "")  # appended to by the next evaluation


def test_no_eval_log_where_it_would_write_elsewhere_or_over_a_users_file(tmp_path):
    step = tmp_path / "run" / "checkpoints" / "step_1"
    step.mkdir(parents=True)
    (step / "COMPLETE").write_text("{}")
    assert eval_log(step / "pred.json")[0] is None
    for name, make in (("link", lambda p: p.symlink_to(tmp_path / "elsewhere")), ("fifo", os.mkfifo),
                       ("mine", lambda p: p.write_text("a user's notes\n"))):
        folder = tmp_path / name
        folder.mkdir()
        make(folder / "eval.log")
        log, why = eval_log(folder / "pred.json")
        assert log is None and "is not vtrain's eval log" in why, name
    assert not (tmp_path / "elsewhere").exists()
