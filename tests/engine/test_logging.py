"""engine/logging.py: the log line's LR is the one in force at the logged step (the window's last), not the mean of
the window's; the other stats are means."""

from __future__ import annotations

import torch

from vtrain.engine.logging import StatsWindow


def test_the_logged_lr_is_the_last_steps():
    w = StatsWindow()
    for lr, loss in ((1e-3, 1.0), (2e-3, 2.0), (4e-3, torch.tensor(6.0))):
        w.add({"lr": lr, "loss": loss, "skipped": False})
    keys, vals = w.means(torch.device("cpu"))
    got = dict(zip(keys, vals.tolist()))
    assert got == {"loss": 3.0, "lr": 4e-3}
