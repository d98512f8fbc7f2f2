"""Bad input, as a careless or hostile user gives it: every case must end with a non-zero exit, exactly
one `error:` line that names the problem, no traceback, and nothing already on disk changed.

Most cases fail in config validation, before torch is imported (~0.5 s each). The few that need a checkpoint,
real data or a model share one tiny metric run built once for the module; a damaged checkpoint is always a copy
of it, and the run itself is hashed before and after every case.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.cli import ok, tree_hash, vtrain
from tests.helpers.scaffold import shown, verdict


# ---- helpers ------------------------------------------------------------------------------------------------------

def one_error_line(proc, *needles: str) -> str:
    return verdict(proc.returncode, proc.stdout, proc.stderr, needles, False,
                   shown(proc.returncode, proc.stdout, proc.stderr))


@dataclass
class Prior:
    """What exists before the bad command: a data tree, a finished run with two checkpoints, foreign weights."""
    data: Path
    run: Path
    dino_weights: Path
    coco_images: Path

    @property
    def ckpt(self) -> Path:
        return self.run / "checkpoints" / "step_2"


@pytest.fixture(scope="module")
def prior(tmp_path_factory) -> Prior:
    import torch
    from PIL import Image
    from safetensors.torch import save_file

    from vtrain.config import build_config
    from vtrain.data.demo_faces import write_identity_tree
    from vtrain.tasks import build_model

    root = tmp_path_factory.mktemp("bad_input")
    write_identity_tree(root / "faces" / "train", 0, 2, 2, seed=3)  # 4 images: one batch of 4 reads them all
    run = root / "run"
    ok(vtrain("train", "--data", str(root / "faces"), "--output-dir", str(run), "--max-steps", "2", "--batch-size",
              "4", "--save-every", "1", "--keep-last", "2", "--num-workers", "0", "--embedding-dim", "16",
              "--mixed-precision", "no"))
    # the other task's model, for --pretrained
    torch.manual_seed(0)
    dino = build_model("dino", build_config("dino").model, 3)
    weights = root / "dino.safetensors"
    save_file({k: v.detach().clone().contiguous() for k, v in dino.state_dict().items()}, str(weights))
    images = root / "coco_images"
    images.mkdir()
    for i in range(2):
        Image.new("RGB", (96, 64), (40 * i, 90, 160)).save(images / f"{i}.jpg")
    return Prior(root / "faces", run, weights, images)


@dataclass
class Ctx:
    """Per case: `inputs` (hashed before/after: copies a case damages live here), `out` (a fresh output dir)."""
    prior: Prior
    inputs: Path
    out: Path

    def file(self, name: str, text: str | bytes) -> str:
        p = self.inputs / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(text if isinstance(text, bytes) else text.encode())
        return str(p)

    def yaml(self, text: str) -> list[str]:
        return ["--config", self.file("c.yaml", text)]

    def ds(self, obj) -> list[str]:
        return ["--ds-config", self.file("ds.json", json.dumps(obj))]

    def train(self, *args: str) -> list[str]:
        return ["train", "--output-dir", str(self.out), *args]

    def run_copy(self) -> Path:
        dst = self.inputs / "run"
        shutil.copytree(self.prior.run, dst, symlinks=True)
        return dst

    def faces_copy(self) -> Path:
        dst = self.inputs / "faces"
        shutil.copytree(self.prior.data, dst, symlinks=True)
        return dst

    def coco(self, images: list[dict], annotations: list[dict], raw: str | None = None) -> list[str]:
        doc = {"images": images, "annotations": annotations,
               "categories": [{"id": 1, "name": "a"}, {"id": 2, "name": "b"}]}
        ann = self.file("ann.json", raw if raw is not None else json.dumps(doc))
        return self.train("--task", "dino", "--train-ann", ann, "--train-images", str(self.prior.coco_images),
                          "--val-ann", ann, "--val-images", str(self.prior.coco_images), "--image-size", "128", "--batch-size", "2", "--max-steps", "1", "--num-workers", "0",
                          "--dn-queries", "0", "--num-queries", "20", "--mixed-precision", "no")


def truncate(path: Path, keep: int = 1000) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def flip_bit(path: Path, offset: int = -100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _images(n: int = 2) -> list[dict]:
    return [{"id": i + 1, "file_name": f"{i}.jpg", "width": 96, "height": 64} for i in range(n)]


# ---- the cases -------------------------------------------------------------------------------------------------
# (id, build(ctx) -> argv [, env], substrings the error line must contain)

Build = Callable[[Ctx], "list[str] | tuple[list[str], dict[str, str]]"]
CASES: list[tuple[str, Build, tuple[str, ...]]] = []


def case(id_: str, *needles: str):
    def deco(fn: Build) -> Build:
        CASES.append((id_, fn, needles))
        return fn
    return deco


def flag_case(id_: str, args: list[str], *needles: str) -> None:
    CASES.append((id_, lambda c, a=args: c.train(*a), needles))


def yaml_case(id_: str, text: str, *needles: str) -> None:
    """`vtrain train --config C.yaml` with `text` as the file."""
    CASES.append((id_, lambda c, t=text: c.train(*c.yaml(t)), needles))


def ds_case(id_: str, obj: dict, *needles: str) -> None:
    """`vtrain train --ds-config DS.json` with `obj` as the JSON."""
    CASES.append((id_, lambda c, o=obj: c.train(*c.ds(o)), needles))


# flags: non-finite and out-of-range numbers, unknown choices, bad types (Click's own errors included)
flag_case("lr-inf", ["--lr", "inf"], "--lr (optim.lr)", "finite")
flag_case("lr-nan", ["--lr", "nan"], "optim.lr", "finite")
flag_case("lr-negative", ["--lr", "-1e-3"], "optim.lr", "> 0")
flag_case("lr-huge", ["--lr", "1e6"], "optim.lr", "<= 10")
flag_case("lr-not-a-number", ["--lr", "1e-3x"], "--lr")
flag_case("weight-decay-nan", ["--weight-decay", "nan"], "optim.weight_decay", "finite")
flag_case("weight-decay-inf", ["--weight-decay", "inf"], "optim.weight_decay", "finite")
flag_case("weight-decay-negative", ["--weight-decay", "-0.1"], "optim.weight_decay")
flag_case("seed-negative", ["--seed", "-1"], "train.seed", "got -1")
flag_case("seed-too-big", ["--seed", str(2**32)], "train.seed")
flag_case("seed-not-an-int", ["--seed", "abc"], "--seed")
flag_case("batch-size-1-batchnorm-neck", ["--batch-size", "1"], "--batch-size", "BatchNorm")
flag_case("batch-size-0", ["--batch-size", "0"], "train.batch_size")
flag_case("max-steps-0", ["--max-steps", "0"], "train.max_steps")
flag_case("max-steps-fraction", ["--max-steps", "2.7"], "--max-steps")
flag_case("epochs-0", ["--epochs", "0"], "train.epochs")
flag_case("grad-accum-negative", ["--grad-accum", "-2"], "train.grad_accum")
flag_case("save-every-0", ["--save-every", "0"], "train.save_every")
flag_case("keep-last-0", ["--keep-last", "0"], "train.keep_last")
flag_case("log-every-0", ["--log-every", "0"], "train.log_every")
flag_case("eval-every-negative", ["--eval-every", "-1"], "train.eval_every")
flag_case("max-nonfinite-0", ["--max-nonfinite", "0"], "train.max_nonfinite")
flag_case("warmup-negative", ["--warmup-steps", "-5"], "optim.warmup_steps")
flag_case("clip-grad-negative", ["--clip-grad", "-1"], "optim.clip_grad")
flag_case("backbone-lr-mult-0", ["--backbone-lr-mult", "0"], "optim.backbone_lr_mult")
flag_case("image-size-not-multiple-16", ["--image-size", "100"], "model.image_size", "multiple of 16")
flag_case("embedding-dim-0", ["--embedding-dim", "0"], "model.embedding_dim")
flag_case("margin-nan", ["--margin", "nan"], "model.margin", "finite")
flag_case("margin-too-big", ["--margin", "3"], "model.margin")
flag_case("scale-0", ["--scale", "0"], "model.scale")
flag_case("drop-path-1", ["--drop-path", "1.0"], "model.drop_path")
flag_case("num-workers-negative", ["--num-workers", "-1"], "data.num_workers")
flag_case("schedule-unknown", ["--schedule", "linear"], "optim.schedule")
flag_case("head-unknown", ["--head", "softmax"], "model.head")
flag_case("neck-norm-unknown", ["--neck-norm", "gn"], "model.neck_norm")
flag_case("mixed-precision-fp8", ["--mixed-precision", "fp8"], "--mixed-precision", "fp8")
flag_case("pretrained-min-match-above-1", ["--pretrained-min-match", "1.5"], "model.pretrained_min_match")
flag_case("unknown-option", ["--learning-rate", "1e-3"], "No such option", "--learning-rate")
flag_case("missing-pretrained-file", ["--pretrained", "/no/such/weights.safetensors"], "--pretrained", "not found")
flag_case("missing-resume-dir", ["--resume", "/no/such/checkpoint"], "--resume", "/no/such/checkpoint")
# detection sizes: the denoising mask and matcher grow with the square of the query count
flag_case("dino-dn-queries-huge", ["--task", "dino", "--dn-queries", "1000000"], "model.dn_queries")
flag_case("dino-num-queries-0", ["--task", "dino", "--num-queries", "0"], "model.num_queries")
flag_case("dino-max-size-below-stride", ["--task", "dino", "--max-size", "32"], "data.max_size", "stride")
flag_case("dino-image-size-below-stride", ["--task", "dino", "--image-size", "48"], "model.image_size", "stride")


# contradictory flags
@case("resume-and-resume-weights-only", "--resume-weights-only", "--resume")
def _(c):
    return c.train("--resume", str(c.prior.ckpt), "--resume-weights-only", str(c.prior.ckpt / "model.safetensors"))


@case("resume-and-overwrite-output-dir", "--overwrite-output-dir", "--resume")
def _(c):
    return c.train("--resume", "auto", "--overwrite-output-dir")


@case("pretrained-and-resume-weights-only", "--pretrained", "--resume-weights-only")
def _(c):
    w = str(c.prior.ckpt / "model.safetensors")
    return c.train("--pretrained", w, "--resume-weights-only", w)


@case("ds-config-and-fsdp", "--fsdp", "--ds-config")
def _(c):
    return c.train(*c.ds({"zero_optimization": {"stage": 2}}), "--fsdp")


# paths and environment
@case("output-dir-is-a-file", "--output-dir", "is a file")
def _(c):
    return ["train", "--output-dir", c.file("notadir", "x")]


@case("output-dir-inside-a-file", "--output-dir", "is a file")
def _(c):
    return ["train", "--output-dir", c.file("notadir", "x") + "/run"]


@case("vtrain-cache-is-a-file", "VTRAIN_CACHE", "is a file")
def _(c):
    return c.train(), {"VTRAIN_CACHE": c.file("cache", "x")}


@case("vtrain-cache-inside-a-file", "VTRAIN_CACHE", "is a file")
def _(c):
    return c.train(), {"VTRAIN_CACHE": c.file("cache", "x") + "/sub"}


# YAML config files: every key coerced or refused per its type, errors name section.key
yaml_case("yaml-lr-not-a-number", "optim: {lr: fast}\n", "optim.lr", "'fast'")
yaml_case("yaml-max-steps-fraction", "train: {max_steps: 2.7}\n", "train.max_steps", "integer")
yaml_case("yaml-batch-size-list", "train: {batch_size: [1, 2]}\n", "train.batch_size")
yaml_case("yaml-lr-infinite", "optim: {lr: .inf}\n", "optim.lr", "finite")
yaml_case("yaml-bool-not-bool", "parallel: {fsdp: maybe}\n", "parallel.fsdp", "true or false")
yaml_case("yaml-config-only-key-bad", "optim: {betas: [0.9]}\n", "optim.betas", "2 values")
yaml_case("yaml-unknown-key", "train: {batchsize: 4}\n", "train.batchsize", "unknown key")
yaml_case("yaml-unknown-section", "trainer: {batch_size: 4}\n", "'trainer'", "unknown section")
yaml_case("yaml-section-not-mapping", "train: 5\n", "'train'", "mapping")
yaml_case("yaml-top-level-list", "- a\n- b\n", "c.yaml", "mapping")


@case("yaml-python-tag-does-not-run", "c.yaml", "not valid YAML")
def _(c):
    # a YAML tag that would call os.system under yaml.load: safe_load refuses it, and nothing runs
    return c.train(*c.yaml(f'!!python/object/apply:os.system ["touch {c.inputs}/pwned"]\n'))


yaml_case("yaml-milestone-beyond-max-steps", "optim: {milestones: [50]}\ntrain: {max_steps: 10}\n",
          "optim.milestones", "beyond")
yaml_case("yaml-not-yaml", "model: {preset: [debug\n", "c.yaml", "not valid YAML")

# DeepSpeed JSON: its structure is checked with the config, before start-up
ds_case("ds-offload-optimizer-string", {"zero_optimization": {"stage": 2, "offload_optimizer": "cpu"}},
        "offload_optimizer", "object")
ds_case("ds-stage-7", {"zero_optimization": {"stage": 7}}, "zero_optimization.stage", "7")
ds_case("ds-optimizer-section", {"optimizer": {"type": "Adam"}}, "'optimizer'")
ds_case("ds-bf16-and-fp16", {"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "bf16 and fp16")
ds_case("ds-bf16-enabled-not-bool", {"bf16": {"enabled": "yes"}}, "bf16.enabled")
ds_case("ds-offload-param-stage-2", {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
        "offload_param", "stage 3")


@case("ds-not-json", "ds.json", "not valid JSON")
def _(c):
    return c.train("--ds-config", c.file("ds.json", "{stage: 2"))


# estimate-memory and consolidate flags
CASES += [
    ("estimate-gpu-memory-negative", lambda c: ["estimate-memory", "--gpu-memory", "-5"], ("--gpu-memory",)),
    ("estimate-gpu-memory-nan", lambda c: ["estimate-memory", "--gpu-memory", "nan"], ("--gpu-memory",)),
    ("estimate-gpus-0", lambda c: ["estimate-memory", "--gpus", "0"], ("--gpus",)),
    ("consolidate-dtype-fp8", lambda c: ["consolidate", str(c.prior.run), str(c.inputs / "m.safetensors"),
                                         "--dtype", "fp8"], ("--dtype",)),
]


# ---- cases that start vtrain's engine (a few seconds each): checkpoints, data, weights --------------------------

@case("resume-path-truncated-model", "model.safetensors", "truncated")
def _(c):
    run = c.run_copy()
    truncate(run / "checkpoints" / "step_2" / "model.safetensors")
    return c.train("--data", str(c.prior.data), "--resume", str(run / "checkpoints" / "step_2"))


@case("resume-auto-every-checkpoint-damaged", "--resume auto", "optimizer.bin", "checksum")
def _(c):
    run = c.run_copy()
    flip_bit(run / "checkpoints" / "step_2" / "accelerate" / "optimizer.bin")
    (run / "checkpoints" / "step_1" / "train_state.json").unlink()  # listed in the manifest
    return ["train", "--output-dir", str(run), "--data", str(c.prior.data), "--resume", "auto"]


@case("eval-bit-flipped-optimizer", "--checkpoint", "optimizer.bin", "checksum")
def _(c):
    run = c.run_copy()
    flip_bit(run / "checkpoints" / "step_2" / "accelerate" / "optimizer.bin")
    return ["eval", "--checkpoint", str(run / "checkpoints" / "step_2"), "--data", str(c.prior.data)]


@case("consolidate-missing-listed-file", "model.safetensors", "missing")
def _(c):
    run = c.run_copy()
    (run / "checkpoints" / "step_2" / "accelerate" / "model.safetensors").unlink()
    return ["consolidate", str(run / "checkpoints" / "step_2"), str(c.out / "m.safetensors")]


@case("consolidate-existing-output", "exists", "--overwrite")
def _(c):
    return ["consolidate", str(c.prior.run), c.file("m.safetensors", b"keep me")]


@case("new-run-into-another-runs-dir", "already holds checkpoints", "--resume auto")
def _(c):
    return ["train", "--output-dir", str(c.prior.run), "--data", str(c.prior.data), "--max-steps", "1"]


@case("pretrained-other-tasks-model", "--pretrained", "dino.safetensors", "--allow-partial-pretrained")
def _(c):
    return c.train("--data", str(c.prior.data), "--pretrained", str(c.prior.dino_weights), "--batch-size", "4",
                   "--max-steps", "1", "--num-workers", "0")


@case("data-truncated-jpeg-in-worker", "cannot decode image", "000.jpg", "--skip-bad-images")
def _(c):
    faces = c.faces_copy()
    truncate(faces / "train" / "id_00001" / "000.jpg", 300)
    return c.train("--data", str(faces), "--batch-size", "4", "--max-steps", "1", "--num-workers", "1",
                   "--embedding-dim", "16")


@case("data-symlink-loop", "symlink loop", "id_00000")
def _(c):
    faces = c.faces_copy()
    (faces / "train" / "id_00000" / "loop").symlink_to("..")
    return c.train("--data", str(faces), "--batch-size", "4", "--max-steps", "1", "--num-workers", "0")


@case("coco-nan-boxes-and-unknown-image-ids", "no usable boxes", "(NaN/inf coordinates) 2",
      "image ids not in 'images' 1")
def _(c):
    nan = float("nan")
    return c.coco(_images(), [
        {"id": 1, "image_id": 1, "category_id": 1, "bbox": [nan, 5, 10, 10], "area": 100, "iscrowd": 0},
        {"id": 2, "image_id": 2, "category_id": 2, "bbox": [5, 5, nan, 10], "area": 100, "iscrowd": 0},
        {"id": 3, "image_id": 99, "category_id": 1, "bbox": [5, 5, 10, 10], "area": 100, "iscrowd": 0}])


@case("coco-not-json", "ann.json", "not valid JSON")
def _(c):
    return c.coco([], [], raw='{"images": [')


# ---- the test -----------------------------------------------------------------------------------------------------

def test_every_case_has_its_own_id():
    ids = [i for i, _, _ in CASES]
    assert len(ids) == len(set(ids)) and len(ids) >= 60, len(ids)


def test_config_only_keys_are_exactly_those_without_a_flag():
    """Errors name `--flag (section.key)`, or `section.key` alone for a key without a flag (config.CONFIG_ONLY)."""
    from dataclasses import fields

    from vtrain.cli import FLAG_SECTIONS
    from vtrain.config import _SECTION_CLASSES, CONFIG_ONLY

    with_flag = {k for keys in FLAG_SECTIONS.values() for k in keys}
    every = {f.name for cls in _SECTION_CLASSES.values() for f in fields(cls)}
    assert CONFIG_ONLY == every - with_flag


@pytest.mark.parametrize("build,needles", [pytest.param(b, n, id=i) for i, b, n in CASES])
def test_bad_input_is_one_line_and_damages_nothing(build, needles, prior, tmp_path):
    from vtrain.engine.checkpoint.format import complete_checkpoints

    c = Ctx(prior, tmp_path / "inputs", tmp_path / "out")
    c.inputs.mkdir()
    built = build(c)
    argv, extra_env = built if isinstance(built, tuple) else (built, {})
    before = tree_hash(prior.run), tree_hash(c.inputs)
    proc = vtrain(*argv, extra_env=extra_env, timeout=300)
    one_error_line(proc, *needles)
    assert (tree_hash(prior.run), tree_hash(c.inputs)) == before, "a failed command changed files it was given"
    assert not complete_checkpoints(c.out), "a failed run left a checkpoint"
    assert not (c.inputs / "pwned").exists()
