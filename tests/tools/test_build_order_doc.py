"""docs/architecture.md's build order is the code's: the page's section is what vtrain/tools/build_order_doc.py
generates from `Trainer.__init__`'s numbered comments, the steps are numbered 1..N in source order, and each step's
comment sits over the calls it names, in the order it names them (a moved call fails here, not in a review)."""

from __future__ import annotations

import re

from tests.helpers.paths import ROOT
from vtrain.tools import build_order_doc as doc

# step -> calls that must lie between its comment and the next step's, in this order (the `->` chains of the comments)
CALLS = {
    1: ["resolve_plan(", "build_accelerator(", "build_engine("],
    2: ["self._claim_output_dir", "self.checkpointer.choose(self.engine)", "determinism.apply(", "cfg.save("],
    3: ["set_seed(", "build_task(", "train_dataset()", "check_eval_data()"],
    4: ["self.task.build_model()", "autoplan.apply(", "head_shard.build(", "self._load_weights(", "compile_regions(",
        "self.engine.shard("],
    5: ["build_optimizer("],
    6: ["ShardedEpochSampler(", "MicroBatches("],
    7: ["self.engine.prepare(", "build_scheduler(", "self.engine.verify(", "WeightEMA("],
    8: ["self.checkpointer.attach(", "self.checkpointer.load(self.resume)", "RunLogger("],
}


def test_the_page_holds_the_generated_build_order():
    page = (ROOT / "docs" / "architecture.md").read_text()
    assert doc.rewrite(page) == page, "docs/architecture.md is stale: run `python -m vtrain.tools.build_order_doc`"


def _problems(source: str) -> list[str]:
    """What is out of place in `source`: step numbers not 1..N in order, or a step's calls missing or reordered."""
    numbers = [n for n, _ in doc.steps(source)]
    if numbers != list(range(1, len(numbers) + 1)) or sorted(CALLS) != numbers:
        return [f"steps numbered {numbers}"]
    starts = [re.search(rf"^\s*# {n}\. ", source, re.M).start() for n in numbers] + [len(source)]
    problems = []
    for n, begin, end in zip(numbers, starts, starts[1:]):
        body, at = source[begin:end], -1
        for i, call in enumerate(CALLS[n]):
            found = body.find(call, at + 1)
            if found <= at:
                problems.append(f"step {n}: {call} is not there" + (f" after {CALLS[n][i - 1]}" if i else ""))
                break
            at = found
    return problems


def test_the_steps_are_numbered_in_source_order_and_name_their_calls():
    assert _problems(doc.TRAINER.read_text()) == []


def test_a_moved_call_or_step_is_caught():
    source = doc.TRAINER.read_text()
    assert _problems(source.replace("# 5. ", "# 9. ", 1))
    head = next(line for line in source.splitlines() if "head_shard.build(" in line)
    moved = source.replace(head + "\n", "", 1).replace("        model = self.engine.shard(model)\n",
                                                        "        model = self.engine.shard(model)\n" + head + "\n", 1)
    assert moved != source and _problems(moved) == ["step 4: self._load_weights( is not there after head_shard.build("]
