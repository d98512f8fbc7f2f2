"""Loading a trained model from a checkpoint (config.yaml + its fp32 weights: the EMA weights when the run kept
them, else model.safetensors), for `vtrain eval` and `vtrain predict`, and `vtrain eval` itself (with its IJB-B/C
route, whose steps are in tools/ijb_eval.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn
from torchvision.datasets.folder import IMG_EXTENSIONS

from vtrain.io import guarded
from vtrain.config import DEFAULT_MAX_IMAGE_PIXELS, DataConfig, RunConfig, TrainConfig, load_run_config
from vtrain.config.fields import check_value
from vtrain.config.paths import check_data
from vtrain.data.ijb import find_ijb
from vtrain.engine.checkpoint import format as ckpt
from vtrain.engine.checkpoint import content
from vtrain.engine.ema import weights_file
from vtrain.errors import VtrainError
from vtrain.models.backbones import load_strict
from vtrain.tasks import build_model, build_task
from vtrain.tasks.dino import chosen_test_sizes
from vtrain.tools import ijb_eval
from vtrain.tools.ijb_eval import IjbReport


@dataclass
class LoadedModel:
    path: Path
    """The checkpoint directory (checkpoints/step_<N>)."""
    cfg: RunConfig
    """The run's config, as its config.yaml holds it."""
    saved_data: dict[str, Any]
    """Its `data` section's values that are set: what eval and predict default to."""
    model: nn.Module
    """In eval mode, fp32, on `device`."""
    device: torch.device
    categories: list[dict[str, Any]] | None
    """Detection: COCO categories (id, name) in label order, when the checkpoint has them."""
    weights: str = "model"
    """Which weights were loaded: ema (ema.safetensors) or model."""


def checkpoint_task(checkpoint: str | Path, flag: str = "--checkpoint") -> str:
    """The task a checkpoint was trained for (its config.yaml), without building or verifying anything (the
    loader verifies the checkpoint it loads)."""
    path = ckpt.find(checkpoint)
    if path is None:
        raise ckpt.CheckpointError(f"{flag}: {checkpoint} is neither a complete checkpoint nor a run "
                                   "directory with one")
    return load_run_config(path / ckpt.CONFIG).task


def load_model(checkpoint: str | Path, task_name: str | None = None, device: torch.device | None = None,
               flag: str = "--checkpoint", task_flag: str | None = None,
               weights_choice: str | None = None) -> LoadedModel:
    """The model of a checkpoint (or of a run directory's newest one that verifies), built from its config.yaml
    and loaded strictly from its model.safetensors; on CUDA when there is a GPU. Shared by `vtrain eval`, `predict`
    and `export`. The checkpoint is verified against its manifest first (a damaged one is an error naming the
    file), then its weights against the model (engine/checkpoint/content.py: names, shapes, dtypes, finite values). A
    `task_name` other than the checkpoint's is an error naming `task_flag` (default `--task NAME`).
    `weights_choice`: ema, model or None (the EMA weights when the checkpoint has them: they are what the run
    evaluated)."""
    path = ckpt.find_verified(checkpoint, flag)
    weights, used = weights_file(path, weights_choice)
    if not weights.is_file():
        raise VtrainError(f"{flag}: {path} has no {weights.name}")
    cfg = load_run_config(path / ckpt.CONFIG)
    if task_name is not None and task_name != cfg.task:
        raise VtrainError(f"{task_flag or f'--task {task_name}'}: {path} is a {cfg.task} checkpoint")
    saved = {k: v for k, v in asdict(cfg.data).items() if v is not None}
    # the model config.yaml records, with the class count the checkpoint records (checkpoint/content.py), and weights
    # checked against it (names, shapes, dtypes, finite values) before they are loaded
    classes = content.recorded_classes(path, cfg, flag)
    if classes is None:
        raise VtrainError(f"{flag}: {path} has no {ckpt.MODEL}")
    model = build_model(cfg.task, cfg.model, classes)
    content.expect_tensors(weights, content.spec_of(model.state_dict()), flag,
                           f"the model of its config.yaml ({content.text(content.describe(cfg, classes))})")
    load_strict(model, load_file(str(weights)), flag, "weights do not match the model in config.yaml")
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device).eval()
    return LoadedModel(path, cfg, saved, model, device, ckpt.read_categories(path), used)


def _reads(task: Any) -> list[guarded.Read]:
    """What a detection evaluation reads: its annotation file and the images of its image folder (a Hugging Face
    set: every file of its folder, or its parquet file)."""
    if getattr(task, "hf", None) is not None:
        p = Path(task.cfg.data.path[3:])
        return [guarded.Read("--data", p, folder=p.is_dir())]
    paths = getattr(task, "paths", None)
    if paths is None or paths.val_ann is None:
        return []
    return [guarded.Read("--val-ann", paths.val_ann),
            guarded.Read("--val-images", paths.val_images, folder=True, suffixes=tuple(IMG_EXTENSIONS))]


# `vtrain eval` data flags that only one task's evaluation reads (DataConfig field, flag)
TASK_FLAGS = {"metric": (("val_path", "--val-data"), ("pairs_file", "--pairs"), ("val_targets", "--val-targets")),
              "dino": (("val_ann", "--val-ann"), ("val_images", "--val-images"))}
# every `vtrain eval` flag that names the data to evaluate on (DataConfig field, flag)
DATA_FLAGS = (("path", "--data"), *TASK_FLAGS["metric"], *TASK_FLAGS["dino"])


def evaluate_checkpoint(checkpoint: Path, data: dict[str, Any], batch_size: int | None = None,
                        task_name: str | None = None, save_predictions: str | None = None,
                        weights_choice: str | None = None, overwrite: bool = False, image_size: int | None = None,
                        max_size: int | None = None, classwise: bool = False, ijb: Path | None = None,
                        ijb_target: str | None = None) -> tuple[Any, dict]:
    """Returns (task, metrics); metrics["weights"] says which weights were evaluated (ema | model). `data` holds
    DataConfig overrides (path, val_path, pairs_file, val_ann, ...); unset values fall back to the data the run was
    trained on. `weights_choice`: ema, model or None (EMA when present). `save_predictions` is refused when it
    exists (unless `overwrite`) or lies in a checkpoint, before anything is evaluated; it and the other data flags
    of one task are refused for the other task's checkpoint. `batch_size`: None is the run's micro-batch.
    `image_size` / `max_size`: detection's test resize instead of the run's (tasks/dino.py: chosen_test_sizes);
    metrics["test_size"] is the one used. `classwise`: AP per category, refused for a face checkpoint before
    anything is evaluated. `ijb` / `ijb_target`: IJB-B/C 1:1 verification instead (tools/ijb_eval.py), which takes
    none of the data flags but --max-image-pixels."""
    check_value(TrainConfig, "batch_size", batch_size)  # train's rule: 0 is refused, never taken for "not given"
    if ijb is not None or ijb_target is not None:
        others = [flag for key, flag in DATA_FLAGS if data.get(key) is not None]
        others += [flag for flag, v in (("--save-predictions", save_predictions), ("--image-size", image_size),
                                        ("--max-size", max_size), ("--classwise", classwise or None)) if v is not None]
        return evaluate_ijb(checkpoint, ijb, ijb_target, task_name, batch_size, weights_choice,
                            data.get("max_image_pixels"), others)
    if save_predictions:
        guarded.claim_output([Path(save_predictions)], overwrite, "--save-predictions", ckpt.inside_checkpoint)
    loaded = load_model(checkpoint, task_name, weights_choice=weights_choice)
    saved, cfg = loaded.saved_data, loaded.cfg
    given = {k: v for k, v in data.items() if v is not None}
    # a flag of the other task's evaluation would be accepted and then ignored: refused, naming the checkpoint's
    foreign = [flag for key, flag in TASK_FLAGS["metric" if cfg.task == "dino" else "dino"] if given.get(key)]
    if cfg.task != "dino":  # the metric evaluation writes no predictions; a face model's input size is its own
        foreign += [flag for flag, v in (("--save-predictions", save_predictions), ("--image-size", image_size),
                                         ("--max-size", max_size), ("--classwise", classwise or None)) if v is not None]
    if foreign:
        raise VtrainError(f"{foreign[0]}: only for {'face (metric)' if cfg.task == 'dino' else 'detection'} "
                          f"checkpoints; {loaded.path} is a {cfg.task} checkpoint")
    # no --data: the run's own data (and its explicit files); a new --data root: only what is given
    keep = () if "path" in given else ("path", "val_targets", "train_ann", "train_images", "val_ann", "val_images")
    # the run's own limits and pair counts hold for any data (they are not where the data is)
    own = ("max_image_pixels", "max_impostor_pairs", "max_genuine_pairs")
    merged = {**{k: saved[k] for k in keep if saved.get(k) is not None}, "max_size": saved.get("max_size"),
              **{k: saved[k] for k in own if saved.get(k)}, **given}
    data = DataConfig(**merged)
    check_data(data)  # the files it names, before they are opened (one error line each)
    cfg = replace(cfg, data=data,
                  train=replace(cfg.train, batch_size=cfg.train.batch_size if batch_size is None else batch_size))
    task = build_task(cfg)
    if save_predictions:  # now that the data it reads is known: never written over, even with --overwrite
        guarded.check_not_input([Path(save_predictions)], _reads(task), "--save-predictions")
    if cfg.task == "dino":
        task.set_test_sizes(*chosen_test_sizes(image_size, max_size, cfg.model.image_size, cfg.data.max_size))
        if loaded.categories is not None:
            task.check_eval_categories(loaded.categories, f"the checkpoint's ({loaded.path})")
    model = loaded.model
    metrics = task.evaluate(lambda **inputs: model(**inputs), loaded.device, save_predictions=save_predictions)
    if metrics is None:
        if cfg.data.path.startswith("hf:"):
            raise VtrainError(f"nothing to evaluate on: --data {cfg.data.path} has no validation or test split")
        hint = "--val-ann and --val-images (or --data with annotations/instances_val2017.json)" if cfg.task == "dino" \
            else "--val-data (held-out identities), --pairs or --val-targets / --data X.bin (verification packs)"
        raise VtrainError(f"nothing to evaluate on: give {hint}")
    metrics["weights"] = loaded.weights
    if cfg.task == "dino":
        metrics["test_size"] = [task.size, task.max_size]
    return task, metrics


def evaluate_ijb(checkpoint: Path, root: Path | None, target: str | None = None, task_name: str | None = None,
                 batch_size: int | None = None, weights_choice: str | None = None, max_pixels: int | None = None,
                 others: Sequence[str] = ()) -> tuple[IjbReport, dict]:
    """`vtrain eval --ijb` (tools/ijb_eval.py): (what prints the metrics, the metrics). Each flag is checked and
    the protocol read before the model is built. `target`: ijbb or ijbc (default: from the files); `others`: the
    other data flags given, which this evaluation would ignore (refused)."""
    if root is None:
        raise VtrainError("--ijb-target: only with --ijb")
    if task_name == "dino":
        raise VtrainError("--ijb: only for face (metric) checkpoints")
    if others:
        raise VtrainError(f"{others[0]}: not with --ijb")
    check_value(DataConfig, "max_image_pixels", max_pixels)
    files = find_ijb(root, target)
    found = checkpoint_task(checkpoint)  # a missing or foreign checkpoint before the protocol is read
    if found != "metric":
        raise VtrainError(f"--ijb: only for face (metric) checkpoints; {checkpoint} is a {found} checkpoint")
    protocol = ijb_eval.read_protocol(files)
    loaded = load_model(checkpoint, "metric", weights_choice=weights_choice, task_flag="--ijb")
    _, table = ijb_eval.verify(protocol, lambda x: loaded.model(images=x)["embedding"], loaded.device,
                               loaded.cfg.model.image_size,
                               loaded.cfg.train.batch_size if batch_size is None else batch_size,
                               max_pixels or loaded.saved_data.get("max_image_pixels") or DEFAULT_MAX_IMAGE_PIXELS)
    return (IjbReport(f"{files.name} 1:1 verification"),
            ijb_eval.flat_metrics(files.target, table, loaded.weights, str(loaded.path)))
