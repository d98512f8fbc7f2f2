"""What one training step of `make demo`'s DINO recipe costs against another recipe's, measured in one process.

On a shared machine a run's seconds per step say more about the other jobs than about the recipe. Here both
recipes are built in one process (task, model, AdamW over vtrain's parameter groups, batches from the recipe's own
data settings, drawn before timing) and their steps alternate, each timed by the thread's CPU time, so a loaded
machine slows both alike and their ratio stands. With the old recipe's seconds per step on an idle machine, the
ratio predicts the new one's. The data loader's workers and evaluation are not in it (they run beside the steps).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/demo_step_cost.py \\
        --before "--model debug-resnet --image-size 192 --batch-size 4" --steps 16

`--setting fill` compares the recipe with and without the NaN-filling of new tensors that torch's deterministic mode
does by default and `--deterministic` turns off (docs/determinism.md §3).

`--after` defaults to the Makefile's DEMO_DINO_FLAGS (benchmarks/demo_seeds.py reads them the same way). Prints one
JSON line: CPU seconds per step of each and their ratio.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shlex
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo_seeds import makefile_flags  # noqa: E402

from vtrain.config.run import options, resolve  # noqa: E402
from vtrain.engine.optim import param_groups  # noqa: E402
from vtrain.tasks import build_task  # noqa: E402

# flags that do not change what a step computes (schedule, logging, checkpoints, the loader's workers)
NOT_THE_STEP = {"--max-steps", "--lr", "--warmup-steps", "--ema-decay", "--backbone-lr-mult", "--clip-grad",
                "--num-workers", "--log-every", "--eval-every", "--save-every", "--keep-last"}


def config(flags: list[str]):
    """A dino run config from `vtrain train` flags (each field's own flag; a bool field's flag takes no value), the
    flags of NOT_THE_STEP left out."""
    by_flag = {o.flag: o for o in options() if o.flag}
    out: dict[str, dict] = {}
    it = iter(flags)
    for flag in it:
        o = by_flag[flag]
        value = True if o.value_type is bool else next(it)
        if o.section is not None and flag not in NOT_THE_STEP:
            out.setdefault(o.section, {})[o.name] = value
    return resolve("dino", overrides=out)


class Recipe:
    def __init__(self, flags: list[str], steps: int, seed: int = 0) -> None:
        cfg = config(flags)
        torch.manual_seed(seed)
        self.task = build_task(cfg)
        data = self.task.train_dataset()
        self.model = self.task.build_model().train()
        self.opt = torch.optim.AdamW(param_groups(self.model, cfg.optim), lr=cfg.optim.lr)
        loader = DataLoader(data, batch_size=cfg.train.batch_size, collate_fn=self.task.collate_fn, shuffle=True,
                            generator=torch.Generator().manual_seed(seed))
        self.batches = list(itertools.islice(itertools.cycle(loader), steps + 1))
        self.seconds = 0.0

    def step(self, i: int, timed: bool) -> None:
        t0 = time.thread_time()
        loss = self.model(**self.task.model_inputs(self.batches[i]))["loss"]
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if timed:
            self.seconds += time.thread_time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", help="the recipe to compare with, as one flag string")
    ap.add_argument("--after", help="default: the Makefile's DEMO_DINO_FLAGS")
    ap.add_argument("--steps", type=int, default=16, help="timed steps of each (after one untimed)")
    ap.add_argument("--setting", choices=["fill"],
                    help="instead of --before: the --after recipe twice, trained side by side, with torch's default "
                         "(before) and vtrain's (after): fill = deterministic mode's NaN-filling of new tensors "
                         "(vtrain's --deterministic: off)")
    a = ap.parse_args()
    if (a.before is None) == (a.setting is None):
        ap.error("give --before or --setting")
    torch.set_num_threads(1)  # one thread: the settings below are the calling thread's (and CPU time is its own)
    texts = (("before", a.after if a.setting else a.before), ("after", a.after))
    recipes = {name: Recipe(shlex.split(text) if text else makefile_flags(), a.steps) for name, text in texts}
    if a.setting == "fill":
        torch.use_deterministic_algorithms(True)
    for i in range(a.steps + 1):
        for name, r in (recipes.items() if i % 2 else reversed(list(recipes.items()))):
            if a.setting == "fill":
                torch.utils.deterministic.fill_uninitialized_memory = name == "before"
            r.step(i, timed=i > 0)
    per = {k: r.seconds / a.steps for k, r in recipes.items()}
    print(json.dumps({"before_s_per_step": round(per["before"], 4), "after_s_per_step": round(per["after"], 4),
                      "ratio": round(per["after"] / per["before"], 3), "steps": a.steps}))


if __name__ == "__main__":
    main()
