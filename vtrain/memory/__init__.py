"""Training memory without a GPU: the pure core that `vtrain estimate-memory` (tools/) and `--grad-ckpt auto` (the
engine, before the first step) share. One fake-tensor trace of the real model (`trace`), its attribution to
modules (`tracker`), model-state sizing (`sizing`, `head` for the sharded face head) and the recompute planner
(`planner`). Nothing here allocates real memory for the model, renders a table or knows a launcher."""
