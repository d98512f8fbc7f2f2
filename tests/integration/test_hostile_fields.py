"""Every field of every file vtrain reads is checked for its type, its range and its depth at the input, once, with
the same rules for every reader: a COCO annotation file (for training, `eval --val-ann`, `predict --ann`), a
`--config` YAML and a `--ds-config` JSON, and a checkpoint's state beyond its weights (train_state.json, its
categories.json and config.yaml, the optimizer's moments in each engine's own files, the RNG states). What training
accepts, its checkpoint readers accept (`test_what_training_accepts_its_checkpoint_readers_accept`).

Every row of CASES is one `vtrain` command through the fork server (helpers/cli_server.py), on inputs of our own
design: a small COCO file changed in one field, a YAML or JSON file, or a copy of a finished run with one file
doctored and its manifest resealed (helpers/cli.py reseal: what is tested is the content, not the checksum). Each
asserts a non-zero exit with exactly one `error:` line holding the needles and no traceback (or exit 0 for an `ok`
row); the inputs byte-identical afterwards (a resumed run's own config.yaml and logs aside, which every resume
rewrites); no checkpoint left where a failed command's output goes; and the command's peak memory under PEAK_LIMIT_MB
(it runs under a data-segment limit, so a case that would allocate gigabytes fails fast instead).
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.helpers.cli import reseal
from tests.helpers.checkpoints import edit, metric_and_dino, METRIC, SHARD, snapshot as _snapshot
from tests.helpers.fork_server import Cli, PEAK_LIMIT_MB
from tests.helpers.scaffold import case_table, served, shown, verdict

PLAIN = ["--batch-size", "4", "--num-workers", "0", "--embedding-dim", "16", "--mixed-precision", "no"]
ENGINES = {"zero2": ["--ds-config", "ds_configs/zero2.json"], "fsdp": ["--fsdp"]}
# a 9-level "billion laughs" (each level lists the one before 9 times: 9^9 = 387M strings once expanded), inline in
# one value so that a reader reporting that value has to show it; about 400 bytes
BOMB = "[&a [lol,lol,lol,lol,lol,lol,lol,lol,lol], " + ", ".join(
    f"&{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]" for i in range(8)) + "]"


# ---- the prior runs ------------------------------------------------------------------------------------------------

@dataclass
class Prior:
    cli: Cli
    root: Path
    faces: Path
    """train/: 4 identities x 2 images."""
    coco: Path
    """ann.json (2 images, 4 boxes, 2 categories) and images/."""
    metric: Path
    """A metric run (sharded head, EMA), one checkpoint: step_1."""
    dino: Path
    """A detector run on `coco`, one checkpoint: step_1."""
    engines: dict

    def engine(self, kind: str) -> Path:
        """A one-process run with DeepSpeed ZeRO-2 or FSDP2 (step_1), made when a case first needs it."""
        if kind not in self.engines:
            out = self.root / kind
            rc, o, e, _ = self.cli.run(["train", "--data", str(self.faces), "--output-dir", str(out), *PLAIN,
                                        "--max-steps", "1", *ENGINES[kind]])
            assert rc == 0, o[-3000:] + e[-3000:]
            self.engines[kind] = out
        return self.engines[kind]


@pytest.fixture(scope="module")
def prior(tmp_path_factory) -> Prior:
    with served(tmp_path_factory, "fields") as (root, cli):
        faces, coco, metric, dino = metric_and_dino(root, cli, 4)
        yield Prior(cli, root, faces, coco, metric, dino, {})


# ---- building a case ------------------------------------------------------------------------------------------------

@dataclass
class Ctx:
    prior: Prior
    inputs: Path
    """Files a case writes or doctors live here; hashed before and after the command."""
    out: Path
    """Where the command's output goes: no checkpoint there after a failed one."""

    def file(self, name: str, text: str) -> Path:
        p = self.inputs / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        return p

    # COCO files: the prior's, with one change
    def ann(self, change: Callable[[dict], None] | None = None, raw: str | None = None) -> Path:
        doc = json.loads((self.prior.coco / "ann.json").read_text())
        if change is not None:
            change(doc)
        return self.file("ann.json", raw if raw is not None else json.dumps(doc))

    def train_dino(self, ann: Path) -> list[str]:
        return ["train", "--task", "dino", "--model", "debug-resnet", "--output-dir", str(self.out / "new"),
                "--train-ann", str(ann), "--train-images", str(self.prior.coco / "images"), "--val-ann", str(ann),
                "--val-images", str(self.prior.coco / "images"), "--image-size", "128",
                "--batch-size", "2", "--num-workers", "0", "--num-queries", "20", "--dn-queries", "0",
                "--mixed-precision", "no", "--max-steps", "1"]

    def coco(self, change: Callable[[dict], None] | None = None, raw: str | None = None) -> list[str]:
        return self.train_dino(self.ann(change, raw))

    def train_metric(self, *args: str) -> list[str]:
        return ["train", "--data", str(self.prior.faces), "--output-dir", str(self.out / "new"), *PLAIN,
                "--max-steps", "1", *args]

    # doctored copies of a prior run
    def copy(self, run: str) -> Path:
        """A copy of a prior run ("metric", "dino", "zero2", "fsdp"); returns its checkpoint step_1."""
        src = getattr(self.prior, run) if run in ("metric", "dino") else self.prior.engine(run)
        shutil.copytree(src, self.inputs / run)
        return self.inputs / run / "checkpoints" / "step_1"

    def resume(self, step: Path, *args: str) -> list[str]:
        run = step.parents[1].name
        flags = METRIC if run == "metric" else [*PLAIN, *ENGINES[run]]
        return ["train", "--data", str(self.prior.faces), "--output-dir", str(step.parents[1]), "--resume",
                str(step), *flags, "--max-steps", "2", *args]

    def edit_json(self, file: Path, change: Callable) -> None:
        data = json.loads(file.read_text())
        change(data)
        file.write_text(json.dumps(data))
        reseal(file.parent)

    def edit_torch(self, file: Path, change: Callable, step: Path) -> None:
        """Rewrite a torch-pickled engine file with `change` applied (read weights-only, with the types Accelerate's
        RNG states and DeepSpeed's optimizer states hold), then reseal `step`."""
        from accelerate.utils import load as accelerate_load

        from vtrain.io.safeio import _deepspeed_globals

        with torch.serialization.safe_globals(_deepspeed_globals()):
            data = accelerate_load(file)
        change(data)
        torch.save(data, file)
        reseal(step)

    def edit_dcp(self, step: Path, change: Callable[[dict], None]) -> None:
        """Rewrite FSDP2's distributed checkpoint (model and optimizer) with `change` applied, then reseal."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        flat = self.inputs / "dcp.pt"
        dcp_to_torch_save(str(step / "fsdp"), str(flat))
        state = torch.load(flat, weights_only=True)
        flat.unlink()
        change(state)
        shutil.rmtree(step / "fsdp")
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.simplefilter("ignore")
            dcp.save(state, checkpoint_id=str(step / "fsdp"), no_dist=True)
        reseal(step)

    def eval_dino(self, step: Path) -> list[str]:
        return ["eval", "--checkpoint", str(step), "--val-ann", str(self.prior.coco / "ann.json"), "--val-images",
                str(self.prior.coco / "images")]


@dataclass
class Case:
    build: Callable[[Ctx], list[str]]
    needles: tuple[str, ...]
    ok: bool = False


CASES, case = case_table(Case)


def coco_case(name: str, change: Callable[[dict], None], *needles: str) -> None:
    """`vtrain train --task dino` on the prior's COCO file with `change` applied."""
    case(name, "ann.json", *needles)(lambda c: c.coco(change))


def at(section: str, i: int, **values) -> Callable[[dict], None]:
    return lambda doc: doc[section][i].update(values)


INT64 = "an integer in -2^63..2^63-1"

# ---- COCO: every field of images, annotations and categories ---------------------------------------------------------

coco_case("coco-width-a-string", at("images", 0, width="128"), "images[0]: `width` must be an integer in "
          "1..2147483647, got '128'")
coco_case("coco-height-a-list", at("images", 1, height=[96]), "images[1]: `height` must be", "got [96]")
coco_case("coco-width-zero", at("images", 0, width=0), "images[0]: `width` must be", "got 0")
coco_case("coco-width-true", at("images", 0, width=True), "`width` must be", "got True")
coco_case("coco-width-missing", lambda d: d["images"][0].pop("width"), "images[0]: `width` is missing")
coco_case("coco-image-id-a-string", at("images", 0, id="1"), f"images[0]: `id` must be {INT64}, got '1'")
coco_case("coco-image-id-null", at("images", 1, id=None), f"images[1]: `id` must be {INT64}, got None")
coco_case("coco-image-id-a-fraction", at("images", 0, id=1.5), "`id` must be", "got 1.5")
coco_case("coco-image-id-integral-float", at("images", 0, id=1.0), "`id` must be", "got 1.0")
coco_case("coco-image-id-beyond-int64", at("images", 0, id=2**70), "`id` must be", f"got {2**70}")
coco_case("coco-file-name-a-number", at("images", 0, file_name=5), "images[0]: `file_name` must be a non-empty "
          "string", "got 5")
coco_case("coco-file-name-with-nul", at("images", 0, file_name="0.jpg\0.png"), "`file_name` must be")
coco_case("coco-image-ids-repeated", at("images", 1, id=1), "images[0] and images[1] have the same id 1")
coco_case("coco-annotation-ids-repeated", at("annotations", 3, id=1),
          "annotations[0] and annotations[3] have the same id 1")
coco_case("coco-category-ids-repeated", at("categories", 1, id=1), "categories: category id 1 is listed twice")
coco_case("coco-category-name-a-list", at("categories", 1, name=["orange"]),
          "categories[1]: `name` must be a string, got ['orange']")
coco_case("coco-category-id-a-string", at("categories", 0, id="1"), f"categories[0]: `id` must be {INT64}")


def _category_beyond_int64(doc: dict) -> None:
    doc["categories"][1]["id"] = 2**70
    for a in doc["annotations"]:
        if a["category_id"] == 2:
            a["category_id"] = 2**70


coco_case("coco-category-id-beyond-int64", _category_beyond_int64, "categories[1]: `id` must be", f"got {2**70}")
coco_case("coco-annotation-image-id-a-fraction", at("annotations", 0, image_id=1.5),
          f"annotations[0]: `image_id` must be {INT64}, got 1.5")
coco_case("coco-annotation-category-id-a-string", at("annotations", 2, category_id="2"),
          "annotations[2]: `category_id` must be")
coco_case("coco-annotation-bbox-holds-a-string", at("annotations", 1, bbox=["10", 12, 40, 30]),
          "annotations[1]: `bbox` must be a list of 4 numbers")
coco_case("coco-annotation-bbox-beyond-float-range", at("annotations", 1, bbox=[10**400, 12, 40, 30]),
          "annotations[1]: `bbox` must be a list of 4 numbers")
coco_case("coco-annotation-iscrowd-a-string", at("annotations", 0, iscrowd="no"),
          "annotations[0]: `iscrowd` must be 0 or 1, got 'no'")
coco_case("coco-annotation-area-a-string", at("annotations", 0, area="big"),
          "annotations[0]: `area` must be a finite number >= 0")
coco_case("coco-images-an-object", lambda d: d.update(images={"1": d["images"][0]}), "`images` must be a list")
coco_case("coco-annotation-a-number", lambda d: d["annotations"].__setitem__(0, 7),
          "annotations[0] must be an object, got 7")


@case("coco-nested-200000-deep", "ann.json is not valid JSON (nested too deep)")
def _(c):
    return c.coco(raw='{"images": ' + "[" * 200_000 + "]" * 200_000 + ', "annotations": [], "categories": []}')


@case("coco-1000000-categories", "categories: 1000000 categories; a detector holds at most 65536 classes")
def _(c):
    return c.coco(lambda d: d.update(categories=[{"id": i, "name": f"c{i}"} for i in range(1, 1_000_001)]))


@case("eval-val-ann-image-id-a-fraction", "ann.json: images[1]: `id` must be", "got 2.5")
def _(c):
    argv = c.eval_dino(c.prior.dino / "checkpoints" / "step_1")
    argv[argv.index("--val-ann") + 1] = str(c.ann(at("images", 1, id=2.5)))
    return argv


@case("predict-ann-image-ids-repeated", "ann.json: images[0] and images[1] have the same id 2")
def _(c):
    return ["predict", "--checkpoint", str(c.prior.dino / "checkpoints" / "step_1"), "--images",
            str(c.prior.coco / "images"), "--ann", str(c.ann(at("images", 0, id=2))), "--out", str(c.out / "pred"),
            "--num-workers", "0"]


# ---- a checkpoint's categories.json: the COCO reader's rules -------------------------------------------------------

@case("eval-categories-json-name-a-list", "--checkpoint", "categories.json[1]: `name` must be a string")
def _(c):
    step = c.copy("dino")
    c.edit_json(step / "categories.json", lambda cats: cats[1].update(name=["orange"]))
    return c.eval_dino(step)


@case("eval-categories-json-out-of-label-order", "categories.json: the category ids are not in label order")
def _(c):
    step = c.copy("dino")
    c.edit_json(step / "categories.json", lambda cats: cats.reverse())
    return c.eval_dino(step)


# ---- --config YAML and --ds-config JSON: depth and aliases --------------------------------------------------------

@case("config-yaml-nested-200000-deep", "--config", "c.yaml is refused: it nests deeper than 16 levels")
def _(c):
    return c.train_metric("--config", str(c.file("c.yaml", "train: " + "[" * 200_000 + "]" * 200_000 + "\n")))


@case("config-yaml-alias-bomb", "c.yaml is refused: it expands to more than 100000 values (aliases included)")
def _(c):
    return c.train_metric("--config", str(c.file("c.yaml", f"train: {{batch_size: {BOMB}}}\n")))


@case("config-yaml-alias-inside-itself", "c.yaml is refused: an alias refers to a value that contains it")
def _(c):
    return c.train_metric("--config", str(c.file("c.yaml", "train: {batch_size: &x [1, *x]}\n")))


@case("config-yaml-integer-of-5000-digits", "c.yaml is not valid YAML (Exceeds the limit (4300 digits)")
def _(c):
    return c.train_metric("--config", str(c.file("c.yaml", "train: {seed: " + "7" * 5000 + "}\n")))


@case("config-yaml-integer-beyond-float-range", "train.seed", "expected an integer, got an integer of 8000 bits")
def _(c):
    return c.train_metric("--config", str(c.file("c.yaml", "train: {seed: 0x" + "f" * 2000 + "}\n")))


@case("ds-config-nested-200000-deep", "--ds-config", "ds.json is not valid JSON (nested too deep)")
def _(c):
    return c.train_metric("--ds-config", str(c.file("ds.json", '{"x": ' + "[" * 200_000 + "]" * 200_000 + "}")))


@case("ds-config-nested-900-deep", "ds.json is not valid JSON (nested deeper than 16 levels)")
def _(c):
    # within json's own recursion, and deep-copied by the engine before: a RecursionError there
    return c.train_metric("--ds-config", str(c.file("ds.json", '{"zero_optimization": {"stage": 2}, "x": '
                                                    + "[" * 900 + "]" * 900 + "}")))


@case("estimate-memory-config-alias-bomb", "--config", "is refused: it expands to more than 100000 values")
def _(c):
    return ["estimate-memory", "--config", str(c.file("c.yaml", f"train: {{batch_size: {BOMB}}}\n"))]


@case("eval-checkpoint-config-yaml-alias-bomb", "checkpoint config", "config.yaml is refused: it expands to more")
def _(c):
    step = c.copy("metric")
    cfg = step / "config.yaml"
    assert "\n  batch_size: 4\n" in cfg.read_text()
    cfg.write_text(cfg.read_text().replace("\n  batch_size: 4\n", f"\n  batch_size: {BOMB}\n"))
    reseal(step)
    return ["eval", "--checkpoint", str(step), "--val-data", str(c.prior.faces / "train")]


@case("eval-checkpoint-config-yaml-nested-deep", "checkpoint config", "config.yaml is refused: it nests deeper")
def _(c):
    step = c.copy("metric")
    cfg = step / "config.yaml"
    cfg.write_text(cfg.read_text() + "extra: " + "[" * 200_000 + "]" * 200_000 + "\n")
    reseal(step)
    return ["eval", "--checkpoint", str(step), "--val-data", str(c.prior.faces / "train")]


@case("eval-checkpoint-config-data-of-the-wrong-type", "checkpoint config", "data.max_image_pixels",
      "expected an integer, got 'many'")
def _(c):
    step = c.copy("metric")
    cfg = step / "config.yaml"
    text = cfg.read_text()
    assert "\n  max_image_pixels: 89478485\n" in text
    cfg.write_text(text.replace("\n  max_image_pixels: 89478485\n", "\n  max_image_pixels: many\n"))
    reseal(step)
    return ["eval", "--checkpoint", str(step), "--val-data", str(c.prior.faces / "train")]


# ---- train_state.json: scheduler entries, counters, the step against the manifest ----------------------------------

def _state(change: Callable[[dict], None]) -> Callable[[Ctx], list[str]]:
    def build(c: Ctx) -> list[str]:
        step = c.copy("metric")
        c.edit_json(step / "train_state.json", change)
        return c.resume(step)
    return build


case("resume-scheduler-key-that-is-a-method", "--resume", "`step` is not a scheduler setting vtrain writes")(
    _state(lambda s: s["scheduler"].update(step=3)))
case("resume-scheduler-lr-lambdas-not-null", "`lr_lambdas` must be a list of", "nulls")(
    _state(lambda s: s["scheduler"].update(lr_lambdas=[5] * len(s["scheduler"]["base_lrs"]))))
case("resume-scheduler-step-count-a-string", "`_step_count` must be an integer in 0..2^53-1, got '2'")(
    _state(lambda s: s["scheduler"].update(_step_count="2")))
case("resume-scheduler-is-initial-a-number", "`_is_initial` must be true or false, got 0")(
    _state(lambda s: s["scheduler"].update(_is_initial=0)))
case("resume-consumed-samples-1e30", "`consumed_samples` must be an integer in 1..2^53-1",
     f"got {10**30}")(_state(lambda s: s.update(consumed_samples=10**30)))
case("resume-consumed-samples-fewer-than-steps", "`consumed_samples` must be an integer in 1..2^53-1, got 0")(
    _state(lambda s: s.update(consumed_samples=0)))
case("resume-skipped-steps-beyond-the-step", "`skipped_steps` must be an integer in 0..1, got 5")(
    _state(lambda s: s.update(skipped_steps=5)))
case("resume-step-1e15-where-manifest-and-folder-say-1", "--resume",
     "`step` is 1000000000000000, but the manifest says 1 and the folder step_1")(
    _state(lambda s: s.update(step=10**15, consumed_samples=10**15)))


@case("eval-step-1e15-where-manifest-and-folder-say-1", "--checkpoint", "`step` is 1000000000000000")
def _(c):
    step = c.copy("metric")
    c.edit_json(step / "train_state.json", lambda s: s.update(step=10**15, consumed_samples=10**15))
    return ["eval", "--checkpoint", str(step), "--val-data", str(c.prior.faces / "train")]


# ---- optimizer moments: Accelerate's optimizer.bin (one process), DeepSpeed's partitions, FSDP2's DCP ------------

def _optimizer(change: Callable[[dict], None]) -> Callable[[Ctx], list[str]]:
    def build(c: Ctx) -> list[str]:
        step = c.copy("metric")
        c.edit_torch(step / "accelerate" / "optimizer.bin", change, step)
        return c.resume(step)
    return build


def _moment(key: str, change: Callable[[torch.Tensor], torch.Tensor], index: int = 0) -> Callable[[dict], None]:
    return lambda sd: sd["state"][index].update({key: change(sd["state"][index][key])})


def _first(value: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def change(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t.view(-1)[0] = value
        return t
    return change


case("resume-optimizer-moment-of-another-shape", "--resume", "accelerate/optimizer.bin: tensor exp_avg of "
     "neck.proj.weight: expected (16, 64) float32, found (8, 64) float32")(
    _optimizer(_moment("exp_avg", lambda t: t[:8].clone())))
case("resume-optimizer-moment-nan", "optimizer.bin: tensor exp_avg of neck.proj.weight holds 1 inf/NaN values")(
    _optimizer(_moment("exp_avg", _first(math.nan))))
case("resume-optimizer-second-moment-negative", "optimizer.bin: tensor exp_avg_sq of neck.proj.weight holds 1 "
     "values below 0")(_optimizer(_moment("exp_avg_sq", _first(-1.0))))
case("resume-optimizer-state-of-a-parameter-no-group-lists", "optimizer.bin: holds the state of parameter 999")(
    _optimizer(lambda sd: sd["state"].update({999: sd["state"][0]})))
case("resume-optimizer-groups-of-other-sizes", "optimizer.bin: its parameter groups hold")(
    _optimizer(lambda sd: sd["param_groups"][0]["params"].append(999)))


@case("resume-head-shard-second-moment-negative", SHARD, "tensor exp_avg_sq holds 1 values below 0")
def _(c):
    step = c.copy("metric")
    edit(step / SHARD, lambda t: t.update(exp_avg_sq=_first(-1.0)(t["exp_avg_sq"])))
    reseal(step)
    return c.resume(step)


def _zero2(change: Callable[[dict], None]) -> Callable[[Ctx], list[str]]:
    def build(c: Ctx) -> list[str]:
        step = c.copy("zero2")
        f = step / "accelerate" / "pytorch_model" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
        c.edit_torch(f, lambda d: change(d["optimizer_state_dict"]["base_optimizer_state"]), step)
        return c.resume(step)
    return build


case("resume-zero2-moment-of-another-shape", "zero_pp_rank_0_mp_rank_00_optim_states.pt: tensor exp_avg of group 0: "
     "expected (1088,) float32, found (100,) float32 (after loading its deepspeed state)")(
    _zero2(_moment("exp_avg", lambda t: t[:100].clone())))
case("resume-zero2-second-moment-negative", "optim_states.pt: tensor exp_avg_sq of group 0 holds 1 values below 0")(
    _zero2(_moment("exp_avg_sq", _first(-1.0))))


def _fsdp(change: Callable[[dict], None]) -> Callable[[Ctx], list[str]]:
    def build(c: Ctx) -> list[str]:
        step = c.copy("fsdp")
        c.edit_dcp(step, lambda sd: change(sd["optim"]["state"]["neck.proj.weight"]))
        return c.resume(step)
    return build


case("resume-fsdp-moment-of-another-shape", "fsdp does not fit this run's model and optimizer: tensor "
     "optim.state.neck.proj.weight.exp_avg: expected (16, 64) float32, found (2, 64) float32")(
    _fsdp(lambda st: st.update(exp_avg=st["exp_avg"][:2].clone())))
case("resume-fsdp-moment-nan", "fsdp: tensor exp_avg of neck.proj.weight holds 1 inf/NaN values")(
    _fsdp(lambda st: st.update(exp_avg=_first(math.nan)(st["exp_avg"]))))

# ---- Accelerate's RNG states (which its load_state would skip silently) -------------------------------------------


def _rng(change: Callable[[dict], None]) -> Callable[[Ctx], list[str]]:
    def build(c: Ctx) -> list[str]:
        step = c.copy("metric")
        c.edit_torch(step / "accelerate" / "random_states_0.pkl", change, step)
        return c.resume(step)
    return build


case("resume-rng-torch-state-of-another-size", "random_states_0.pkl: tensor torch_manual_seed: expected (5056,) "
     "uint8, found (10,) uint8")(_rng(lambda s: s.update(torch_manual_seed=torch.zeros(10, dtype=torch.uint8))))
case("resume-rng-python-state-malformed", "random_states_0.pkl: `random_state` is not a state of its generator")(
    _rng(lambda s: s.update(random_state=(3, (1, 2, 3), None))))
case("resume-rng-numpy-state-malformed", "`numpy_random_seed` is not a state of its generator")(
    _rng(lambda s: s.update(numpy_random_seed=("MT19937", s["numpy_random_seed"][1][:5], 0, 0, 0.0))))
case("resume-rng-lacks-a-state", "random_states_0.pkl: lacks the random state numpy_random_seed")(
    _rng(lambda s: s.pop("numpy_random_seed")))


@case("resume-rng-file-is-junk", "random_states_0.pkl: not a readable torch file")
def _(c):
    step = c.copy("metric")
    (step / "accelerate" / "random_states_0.pkl").write_bytes(b"PK\x03\x04" + bytes(60))
    reseal(step)
    return c.resume(step)


@case("resume-optimizer-file-is-junk", "optimizer.bin: not a readable torch file")
def _(c):
    step = c.copy("metric")
    (step / "accelerate" / "optimizer.bin").write_bytes(b"PK\x03\x04" + bytes(60))  # a zip cut short
    reseal(step)
    return c.resume(step)


# ---- untouched checkpoints of every engine still resume (the checks admit what the engines write) ------------------

for _run in ("metric", "zero2", "fsdp"):
    case(f"resume-untouched-{_run}", "resumed from", "step_2", ok=True)(lambda c, r=_run: c.resume(c.copy(r)))


# ---- the table ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(CASES))
def test_hostile_fields(name, prior, tmp_path, record_property):
    from vtrain.engine.checkpoint.format import complete_checkpoints

    spec = CASES[name]
    c = Ctx(prior, tmp_path / "inputs", tmp_path / "out")
    c.inputs.mkdir()
    c.out.mkdir()
    argv = spec.build(c)
    before = _snapshot(c.inputs)
    rc, out, err, peak_mb = prior.cli.run(argv)
    record_property("peak_rss_mb", round(peak_mb))
    show = shown(rc, out, err, peak_mb)
    verdict(rc, out, err, spec.needles, spec.ok, show)
    if not spec.ok:
        assert not complete_checkpoints(c.out / "new") and not list(c.out.rglob(".tmp-step_*")), show
        assert _snapshot(c.inputs) == before, "a command changed a file it was given"
    assert peak_mb < PEAK_LIMIT_MB, show


def test_every_case_is_distinct():
    assert len(CASES) >= 60 and len({id(c.build) for c in CASES.values()}) == len(CASES)


# ---- what training accepts, its checkpoint readers accept --------------------------------------------------------

def test_what_training_accepts_its_checkpoint_readers_accept(prior, tmp_path):
    """Category ids at both ends of int64, a name left out and an empty one, ids listed out of order: a run trains
    on them and writes them into its checkpoint (in label order, names filled in), and eval, predict and a resume
    read that checkpoint back under the same rules."""
    doc = json.loads((prior.coco / "ann.json").read_text())
    ids = {1: 2**63 - 1, 2: -(2**63)}
    doc["categories"] = [{"id": ids[1], "name": ""}, {"id": ids[2]}]
    for a in doc["annotations"]:
        a["category_id"] = ids[a["category_id"]]
    c = Ctx(prior, tmp_path / "inputs", tmp_path / "out")
    ann = c.file("ann.json", json.dumps(doc))
    for argv in (c.train_dino(ann),
                 ["eval", "--checkpoint", str(c.out / "new"), "--val-ann", str(ann), "--val-images",
                  str(prior.coco / "images")],
                 ["predict", "--checkpoint", str(c.out / "new"), "--images", str(prior.coco / "images"), "--out",
                  str(c.out / "pred"), "--num-workers", "0"],
                 [*c.train_dino(ann)[:-1], "2", "--resume", "auto"]):
        rc, out, err, _ = prior.cli.run(argv)
        assert rc == 0 and "Traceback" not in out + err, f"{argv[0]}: exit {rc}\n{out[-2000:]}\n{err[-3000:]}"
    saved = json.loads((c.out / "new" / "checkpoints" / "step_1" / "categories.json").read_text())
    assert saved == [{"id": -(2**63), "name": str(-(2**63))}, {"id": 2**63 - 1, "name": ""}]
    assert json.loads((c.out / "pred" / "predictions.json").read_text()) is not None


# ---- the rules themselves, without a command ------------------------------------------------------------------------

def test_scheduler_state_admits_exactly_what_vtrain_writes():
    """The keys of the LambdaLR state vtrain's scheduler writes (this torch's), after steps and through JSON: a
    torch that adds a key fails here, not at a user's resume."""
    from vtrain.config import OptimConfig
    from vtrain.engine.optim import build_scheduler
    from vtrain.io.records import Record, scheduler_state

    opt = torch.optim.AdamW([{"params": [torch.nn.Parameter(torch.zeros(2))]},
                             {"params": [torch.nn.Parameter(torch.zeros(3))]}], lr=1e-3)
    sched = build_scheduler(opt, OptimConfig(), 10)
    for _ in range(3):
        opt.step()
        sched.step()
    state = json.loads(json.dumps(sched.state_dict()))
    assert scheduler_state(Record(copy.deepcopy(state), "s")) == state


@pytest.mark.parametrize("text,accepted", [
    ("optim: {lr: &lr 0.001}\ntrain: {batch_size: 4}\nmodel: {drop_path: *lr}\n", True),  # a small anchor reused
    ("a: &a [1, 2]\nb: [*a, *a, *a]\n", True),
    (f"train: {{batch_size: {BOMB}}}\n", False),
    ("a: &a [*a]\n", False),
    ("a: " + "[" * 17 + "]" * 17 + "\n", False),
    ("a: " + "[" * 15 + "]" * 15 + "\n", True),
])
def test_read_yaml_bounds_depth_and_aliases(text, accepted, tmp_path):
    from vtrain.config.values import read_yaml
    from vtrain.errors import ConfigError

    (tmp_path / "c.yaml").write_text(text)
    if accepted:
        assert isinstance(read_yaml(tmp_path / "c.yaml"), dict)
    else:
        with pytest.raises(ConfigError, match="is refused"):
            read_yaml(tmp_path / "c.yaml")


def test_shown_values_are_bounded():
    import yaml

    from vtrain.errors import shown

    bomb = yaml.safe_load(f"x: {BOMB}")["x"]  # shared lists: 387M strings if walked whole
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    for value in (bomb, deep, 10**5000, [10**5000], "x" * 10**6, {"k": bomb}):
        assert len(shown(value)) <= 80


# ---- 2 processes: the bad moment is in the partition only rank 1 holds ------------------------------------------

@pytest.mark.slow
def test_two_ranks_stop_with_one_line_when_only_rank_1_holds_a_negative_moment(prior, tmp_path):
    """ZeRO-2 over 2 processes: each rank loads its own optimizer partition, so only rank 1 sees the doctored one;
    the check once loaded is agreed, so both ranks stop (none waits in a collective) with one line naming it."""
    from tests.helpers.cli import launch
    from tests.helpers.paths import ROOT

    run = tmp_path / "run"
    argv = ["train", "--data", str(prior.faces), "--output-dir", str(run), *PLAIN, "--batch-size", "2",
            *ENGINES["zero2"]]
    proc = launch(2, *argv, "--max-steps", "1", accelerate_config="ddp.yaml", timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    step = run / "checkpoints" / "step_1"
    rank1 = step / "accelerate" / "pytorch_model" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    Ctx(prior, tmp_path, tmp_path).edit_torch(
        rank1, lambda d: _moment("exp_avg_sq", _first(-1.0))(d["optimizer_state_dict"]["base_optimizer_state"]), step)
    before = _snapshot(run)
    proc = launch(2, *argv, "--max-steps", "2", "--resume", str(step), accelerate_config="ddp.yaml", timeout=600)
    text = proc.stdout + proc.stderr
    lines = [line for line in text.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and len(lines) == 1, text[-6000:]
    assert f"{rank1}: tensor exp_avg_sq of group 0 holds 1 values below 0" in lines[0], lines[0]
    assert f'File "{ROOT / "vtrain"}' not in text, text[-6000:]  # the launcher's own report aside, no traceback
    assert _snapshot(run) == before
