"""Same seed, same result (docs/determinism.md): two `--deterministic` DINO runs give bit-identical losses and
checkpoints, a crashed and resumed run continues with the uninterrupted run's losses bit for bit, the data loader
draws its workers' seeds from its own generator, and a resume keeps the run's --deterministic and thread count."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from tests.helpers.cli import metrics, ok, vtrain
from vtrain.config import RunConfig, TrainConfig
from vtrain.engine import determinism
from vtrain.engine.checkpoint.format import complete_checkpoints


@pytest.fixture(scope="module")
def few_images(tmp_path_factory) -> list[str]:
    """The first 8 demo training images as their own COCO file (train = val), as data flags."""
    from vtrain.data.demo_shapes import ensure_demo_shapes

    demo = ensure_demo_shapes()
    d = json.loads((demo / "annotations" / "instances_train2017.json").read_text())
    ids = {im["id"] for im in d["images"][:8]}
    sub = {"images": d["images"][:8], "annotations": [a for a in d["annotations"] if a["image_id"] in ids],
           "categories": d["categories"]}
    ann = tmp_path_factory.mktemp("few") / "eight.json"
    ann.write_text(json.dumps(sub))
    images = str(demo / "train2017")
    return ["--train-ann", str(ann), "--train-images", images, "--val-ann", str(ann), "--val-images", images]


# debug-resnet at 96 px, 6 steps of batch 2 (more than an epoch of 8 images: the second epoch's loader position
# is exercised), one loader worker (its seed comes from the loader's generator), fp32
RUN = ["--task", "dino", "--model", "debug-resnet", "--image-size", "96", "--max-size", "128", "--batch-size", "2",
       "--max-steps", "6", "--lr", "1e-3", "--backbone-lr-mult", "1", "--mixed-precision", "no", "--num-workers", "1",
       "--log-every", "1", "--save-every", "3", "--eval-every", "0", "--deterministic", "--threads", "2"]


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics(run)}


def _final(run: Path) -> Path:
    return complete_checkpoints(run)[-1] / "model.safetensors"


@pytest.fixture(scope="module")
def first_run(few_images, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("det") / "first"
    ok(vtrain("train", *RUN, *few_images, "--output-dir", str(run)))
    return run


@pytest.mark.slow  # two and three DINO runs: ~1 min or more on a shared 2-core machine
def test_two_deterministic_runs_are_bit_identical(first_run, few_images, tmp_path):
    second = tmp_path / "second"
    proc = ok(vtrain("train", *RUN, *few_images, "--output-dir", str(second)))
    assert "--deterministic: 2 intra-op threads, every op deterministic" in proc.stdout
    a, b = _losses(first_run), _losses(second)
    assert sorted(a) == list(range(1, 7)) and a == b  # float equality: bit for bit
    assert _final(first_run).read_bytes() == _final(second).read_bytes()
    train = yaml.safe_load((second / "config.yaml").read_text())["train"]
    assert train["deterministic"] is True and train["threads"] == 2  # recorded with the run


@pytest.mark.slow
def test_resumed_run_continues_bit_identically(first_run, few_images, tmp_path):
    """Without loader workers here (the first run has one): a hard kill leaves a worker process behind, and the
    values must not depend on where the samples are made (augmentation is seeded per sample, and the loader no
    longer draws from the model's generator; without workers the old code drew at every epoch)."""
    run = tmp_path / "crashed"
    args = [*RUN[:-3], *few_images, "--output-dir", str(run), "--num-workers", "0"]
    assert RUN[-3:] == ["--deterministic", "--threads", "2"]
    proc = vtrain("train", *args, *RUN[-3:], extra_env={"VTRAIN_DEBUG_CRASH_AT_STEP": "5"})
    assert proc.returncode == 17  # a hard kill while training step 5, after the save of step 3
    # resumed without --deterministic and --threads: both come from the checkpoint's config
    proc = ok(vtrain("train", *args, "--resume", "auto"))
    assert "resumed from" in proc.stdout and "--deterministic: kept from the checkpoint's run" in proc.stdout
    assert _losses(run) == _losses(first_run)  # steps 4-6 after the resume too, bit for bit
    a, b = load_file(_final(first_run)), load_file(_final(run))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    train = yaml.safe_load((run / "config.yaml").read_text())["train"]
    assert train["deterministic"] is True and train["threads"] == 2


class _Numbers(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return i


@pytest.mark.parametrize("own_generator", [True, False])
def test_loader_iterator_draws_from_its_own_generator(own_generator):
    """torch draws a loader iterator's worker base seed from the loader's generator, else from the global one:
    without its own generator, making an iterator (at the start of a run, a resume, or each epoch without
    persistent workers) moves the stream the model's random draws follow. This is the negative control."""
    gen = determinism.loader_generator(7, 0) if own_generator else None
    torch.manual_seed(0)
    before = torch.get_rng_state()
    list(DataLoader(_Numbers(), batch_size=2, generator=gen))
    assert torch.equal(torch.get_rng_state(), before) is own_generator


def test_loader_generator_depends_on_seed_and_rank():
    draw = lambda seed, rank: int(torch.randint(2**62, (1,), generator=determinism.loader_generator(seed, rank)))  # noqa: E731
    assert draw(1, 0) == draw(1, 0)
    assert len({draw(1, 0), draw(1, 1), draw(2, 0), draw(2, 1)}) == 4


def _cfg(deterministic: bool = False, threads: int = 0) -> RunConfig:
    return RunConfig(train=TrainConfig(output_dir="runs/x", deterministic=deterministic, threads=threads))


@pytest.mark.parametrize("saved,given,want,note", [
    (None, (False, 0), (False, 0), None),                      # a fresh run: nothing to keep
    ((True, 4), (False, 0), (True, 4), "kept from the checkpoint"),
    ((True, 4), (True, 0), (True, 4), None),
    ((True, 4), (True, 2), (True, 2), "--threads 2 on resume (the checkpoint's run used 4)"),
    ((False, 3), (False, 0), (False, 3), None),                # --threads alone is kept too
    ((False, 0), (True, 0), (True, 0), None),                  # turned on at the resume: apply() fixes the count
])
def test_resume_keeps_the_checkpoints_settings(saved, given, want, note):
    cfg = _cfg(*given)
    notes = determinism.keep_from_checkpoint(cfg, None if saved is None else _cfg(*saved))
    assert (cfg.train.deterministic, cfg.train.threads) == want
    assert (note is None and notes == []) or (note is not None and len(notes) == 1 and note in notes[0])


@pytest.mark.parametrize("threads,ok_", [(0, True), (1, True), (1024, True), (-1, False), (1025, False)])
def test_threads_range(threads, ok_):
    from vtrain.errors import ConfigError

    if ok_:
        assert TrainConfig(output_dir="runs/x", threads=threads).threads == threads
    else:
        with pytest.raises(ConfigError, match=r"--threads \(train.threads\): must be in 0..1024"):
            TrainConfig(output_dir="runs/x", threads=threads)


def test_deterministic_mode_leaves_new_tensors_unfilled():
    """--deterministic turns torch's deterministic algorithms on but not its NaN-filling of every new tensor (a
    valid program does not read memory it never wrote; the fills cost ~3,000 tensor writes per demo DINO step):
    the bit-identical tests above run this way."""
    assert torch.utils.deterministic.fill_uninitialized_memory  # torch's default, put back after each test
    determinism.apply(_cfg(deterministic=True, threads=1), torch.device("cpu"))
    assert torch.are_deterministic_algorithms_enabled() and not torch.utils.deterministic.fill_uninitialized_memory
