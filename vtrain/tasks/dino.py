"""DINO detection: COCO-format data (built-in demo shapes by default), the DINO model, COCO box AP."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.table import Table
from torch.utils.data import DataLoader, Subset

from vtrain.config import MIN_DETECTION_SIZE, RunConfig, check_resize
from vtrain.console import tracked
from vtrain.data.coco import CocoDetection, collate
from vtrain.data.demo import data_root
from vtrain.data.hf import HfSplits, is_hf
from vtrain.data.sampler import eval_shard
from vtrain.data.workers import worker_options
from vtrain.dist import gather_objects
from vtrain.errors import VtrainError
from vtrain.eval.coco_eval import coco_box_metrics, coco_detections
from vtrain.io.files import write_json_atomic
from vtrain.models.backbones import check_match, load_backbone_weights, read_state_dict
from vtrain.models.dino import DINO, postprocess
from vtrain.models.dino.class_rows import (carry_rows, class_count, class_keys, describe_keys, describe_plan,
                                           misfit_class_tensors, plan_rows)
from vtrain.tasks.model import build_model

@dataclass
class CocoPaths:
    train_ann: Path | None
    train_images: Path | None
    val_ann: Path | None
    val_images: Path | None


def resolve_coco_data(data, root: Path | None = None) -> CocoPaths:
    """--data DIR in COCO layout (annotations/instances_{train,val}2017.json, train2017/, val2017/); explicit
    --train-ann/--train-images/--val-ann/--val-images win over the layout. `root`: where --data points, `demo`
    already turned into its directory (data/demo.py); default: --data."""
    root = Path(data.path) if root is None else root

    def pick(explicit: str | None, default: Path) -> Path | None:
        if explicit:
            return Path(explicit)
        return default if default.exists() else None

    if not root.is_dir():
        raise VtrainError(f"--data: not a directory: {root}")
    train_ann = pick(data.train_ann, root / "annotations" / "instances_train2017.json")
    train_images = pick(data.train_images, root / "train2017")
    val_ann = pick(data.val_ann, root / "annotations" / "instances_val2017.json")
    val_images = pick(data.val_images, root / "val2017")
    if (val_ann is None) != (val_images is None):
        raise VtrainError("--val-ann and --val-images go together (one of them is missing)")
    return CocoPaths(train_ann, train_images, val_ann, val_images)


def test_sizes(image_size: int, max_size: int | None) -> tuple[int, int]:
    """Test-time resize (evaluation, `vtrain predict`, the size `estimate-memory` traces): short side image_size,
    long side at most max_size, by default image_size * 1333 / 800 (the recipe's 800/1333, docs/dino.md §1.1).
    The one place that rule is written."""
    return image_size, max_size or round(image_size * 1333 / 800)


def chosen_test_sizes(image_size: int | None, max_size: int | None, run_size: int,
                      run_max: int | None) -> tuple[int, int]:
    """The test resize of `vtrain eval` / `vtrain predict`: the run's (test_sizes of its --image-size and
    --max-size) unless --image-size / --max-size are given. --image-size alone takes the recipe's long side with
    it (image_size * 1333 / 800); --max-size alone keeps the run's short side. Only the evaluation transform
    changes: the model is the checkpoint's. Bad values are one-line errors naming the flag."""
    for flag, value, high in (("--image-size", image_size, 8192), ("--max-size", max_size, 16384)):
        if value is not None and not MIN_DETECTION_SIZE <= value <= high:
            raise VtrainError(f"{flag}: must be in {MIN_DETECTION_SIZE}..{high} pixels (the coarsest DINO feature "
                              f"stride is 64), got {value}")
    if image_size is None and max_size is None:
        return test_sizes(run_size, run_max)
    size = run_size if image_size is None else image_size
    longest = test_sizes(size, None)[1] if max_size is None else max_size
    check_resize(size, longest, "--image-size" if image_size is not None else "the run's --image-size", "--max-size")
    return size, longest


class DinoTask:
    name = "dino"
    collate_fn = staticmethod(collate)
    # multi-scale training resizes every image (short side 480-800 in steps of 32) and pads each batch to its own
    # largest image, and the number of denoising queries follows the number of boxes (engine/compile.py reads this)
    input_sizes_vary = True

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.hf = HfSplits(cfg.data.path) if is_hf(cfg.data.path) else None  # --data hf:PATH (data/hf.py)
        if self.hf is not None:
            given = [f for f, v in (("--train-ann", cfg.data.train_ann), ("--train-images", cfg.data.train_images),
                                    ("--val-ann", cfg.data.val_ann), ("--val-images", cfg.data.val_images)) if v]
            if given:
                raise VtrainError(f"{', '.join(given)}: not used with --data {cfg.data.path} (its splits are the data)")
        self.paths = None if self.hf is not None else resolve_coco_data(cfg.data, data_root(self.name, cfg.data.path))
        self.size, self.max_size = test_sizes(cfg.model.image_size, cfg.data.max_size)
        self._train: CocoDetection | None = None
        self._val: CocoDetection | None = None
        self.notes: list[str] = []

    # ---- data ---------------------------------------------------------------------------------------------
    def train_dataset(self) -> CocoDetection:
        limit = self.cfg.data.max_image_pixels
        if self._train is None and self.hf is not None:
            self._train = self.hf.detection("train", self.size, self.max_size, train=True, seed=self.cfg.train.seed,
                                            max_pixels=limit)
            self.notes.append(self._train.report.summary("train data"))
        if self._train is None:
            if self.paths.train_ann is None or self.paths.train_images is None:
                raise VtrainError(f"--data: {self.cfg.data.path} is not in COCO layout "
                                  "(annotations/instances_train2017.json and train2017/); give --train-ann and "
                                  "--train-images")
            self._train = CocoDetection(self.paths.train_ann, self.paths.train_images, self.size, self.max_size,
                                        train=True, seed=self.cfg.train.seed, max_pixels=limit)
            self.notes.append(self._train.report.summary("train data"))
        return self._train

    def val_dataset(self) -> CocoDetection | None:
        limit = self.cfg.data.max_image_pixels
        if self._val is None and self.hf is not None and self.hf.eval_split is not None:
            self._val = self.hf.detection(self.hf.eval_split, self.size, self.max_size, train=False,
                                          max_pixels=limit)
        if self._val is None and self.paths is not None and self.paths.val_ann is not None:
            self._val = CocoDetection(self.paths.val_ann, self.paths.val_images, self.size, self.max_size,
                                      train=False, max_pixels=limit)
        return self._val

    def set_test_sizes(self, size: int, max_size: int) -> None:
        """Evaluate at another test resize than the run's (`vtrain eval --image-size/--max-size`): before the
        evaluation data is first read."""
        if self._val is not None:
            raise RuntimeError("set_test_sizes after the evaluation data was read")
        self.size, self.max_size = size, max_size

    def check_eval_data(self) -> None:
        """Load and check the evaluation set now (at the start of training), not first at evaluation time: its
        categories must be the training set's."""
        if self.val_dataset() is not None:
            self.check_eval_categories(self.train_dataset().categories, "the training set's")

    def check_eval_categories(self, categories: list[dict[str, Any]], whose: str) -> None:
        """The evaluation set labels detections with the model's class order (label i = `categories[i]`), so its
        categories (COCO ids and names, in order) must be the model's: another class list would score labels under
        the wrong ids, or index past the list."""
        val = self.val_dataset()
        if val is None:
            return
        theirs = [(int(c["id"]), str(c["name"])) for c in categories]
        ours = [(int(c["id"]), str(c["name"])) for c in val.categories]
        if ours != theirs:
            diff = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            at = (f"first difference at label {diff}: {ours[diff] if diff < len(ours) else 'none'} vs "
                  f"{theirs[diff] if diff < len(theirs) else 'none'}")
            raise VtrainError(f"--val-ann: the evaluation set's {len(ours)} categories are not {whose} "
                              f"{len(theirs)} (COCO id, name) in order ({at}); give --val-ann/--val-images of the "
                              "same classes")

    @staticmethod
    def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: batch[k] for k in ("images", "masks", "labels", "boxes", "num_targets")}

    # ---- model --------------------------------------------------------------------------------------------
    def build_model(self, num_classes: int | None = None) -> DINO:
        n = num_classes if num_classes is not None else self.train_dataset().num_classes
        model = build_model(self.name, self.cfg.model, n)
        if model.describe() not in self.notes:  # the run's log: drop-path rate in force, queries, head layout
            self.notes.append(model.describe())
        return model

    def load_pretrained(self, model: DINO, weights: str | Path | None = None,
                        categories: list[dict[str, Any]] | None = None) -> str:
        """--pretrained: a full detector file (vtrain keys; `weights`, default the flag's file) or a backbone file in
        timm or original Swin/ResNet layout. A detector of other classes keeps every tensor but the class rows,
        which are carried over by name where `categories` (the checkpoint's, in label order) name the same class
        and keep the model's initialisation otherwise (models/dino/class_rows.py). Returns the one log line."""
        m = self.cfg.model
        path = str(weights or m.pretrained)
        sd = read_state_dict(path, "--pretrained")
        if any(k.startswith("backbone.body.") for k in sd):
            return self._load_detector(model, sd, path, categories)
        missing, unexpected = load_backbone_weights(model.backbone.body, sd)
        total = len(model.backbone.body.state_dict())
        share = check_match(path, "backbone", total - len(missing), total, m.pretrained_min_match,
                            m.allow_partial_pretrained)
        return (f"loaded backbone {path}: {share}, missing {len(missing)} {missing[:3]}, unused {len(unexpected)} "
                f"{unexpected[:3]}")

    def _load_detector(self, model: DINO, sd: dict[str, torch.Tensor], path: str,
                       categories: list[dict[str, Any]] | None) -> str:
        m = self.cfg.model
        own = model.state_dict()
        keys = class_keys(list(own))
        old, new = class_count(sd), model.num_classes
        if categories is not None and old is not None and len(categories) != old:
            raise VtrainError(f"--pretrained: {path}: its categories list {len(categories)} classes but its class "
                              f"heads have {old} rows")
        misfit = [k for k in sd if k in own and k not in keys and sd[k].shape != own[k].shape]
        misfit += misfit_class_tensors(sd, own, old if old is not None else new, new)
        missing = [k for k in own if k not in sd]
        unexpected = [k for k in sd if k not in own]
        if (misfit or missing or unexpected) and not m.allow_partial_pretrained:
            raise VtrainError(f"--pretrained: {path} is a detector of another architecture than --model {m.preset}: "
                              + "; ".join(_mismatch(misfit, missing, unexpected, sd, own))
                              + " (--allow-partial-pretrained loads the tensors that fit)")
        skip = set(misfit) | set(keys)
        keep = {k: v for k, v in sd.items() if k in own and k not in skip}
        if old is not None and not any(k in misfit for k in keys):
            plan = plan_rows(old, new, categories, self.train_dataset().categories)
            keep.update(carry_rows(sd, own, plan))
            classes = f"; {describe_plan(plan, self.train_dataset().categories, keys)}"
        else:
            classes = f"; class tensors ({describe_keys(keys)}) re-initialised ({new} classes)"
        res = model.load_state_dict(keep, strict=False)
        loaded = len(own) - len(res.missing_keys)
        share = check_match(path, "detector", loaded, len(own), m.pretrained_min_match, m.allow_partial_pretrained)
        rest = "; ".join(_mismatch(misfit, missing, unexpected, sd, own))
        return f"loaded detector {path}: {share}{classes}" + (f"; not loaded: {rest}" if rest else "")

    # ---- evaluation ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, forward: Callable[..., dict[str, torch.Tensor]], device: torch.device, rank: int = 0,
                 world: int = 1, input_dtype: torch.dtype = torch.float32,
                 save_predictions: str | Path | None = None) -> dict[str, Any] | None:
        """COCO box AP over all ranks: each rank runs an equal-length shard (sharded engines need every rank in
        every forward), detections are gathered, rank 0 scores them with COCOeval."""
        ds = self.val_dataset()
        if ds is None:
            return None
        n = len(ds)
        order, real = eval_shard(n, rank, world)  # the padding duplicates are not scored
        workers = min(self.cfg.data.num_workers, 2)
        loader = DataLoader(Subset(ds, order), batch_size=self.cfg.train.batch_size, collate_fn=collate,
                            num_workers=workers, **worker_options(workers))
        dets: list[dict[str, Any]] = []
        pos = 0
        for batch in tracked(loader, len(loader), f"eval ({n} images)", rank == 0):
            out = forward(images=batch["images"].to(device, input_dtype), masks=batch["masks"].to(device))
            results = postprocess(out["pred_logits"], out["pred_boxes"], batch["orig_size"].to(device),
                                  clip=self.cfg.model.clip_boxes)
            for image_id, r in zip(batch["image_id"].tolist(), results):
                if pos < real:
                    dets += coco_detections(image_id, r["boxes"].cpu().numpy(), r["scores"].cpu().numpy(),
                                            r["labels"].cpu().numpy(), ds.cat_ids)
                pos += 1
        dets = [d for part in gather_objects(dets) for d in part]  # every rank's, in rank order
        if rank != 0:
            return None
        if save_predictions:
            write_json_atomic(save_predictions, dets)
        return coco_box_metrics(ds.coco, dets)

    @staticmethod
    def metrics_table(metrics: dict[str, Any], title: str = "COCO box AP") -> Table:
        t = Table(title=title)
        cols = ("AP", "AP50", "AP75", "APs", "APm", "APl")
        for c in cols:
            t.add_column(c, justify="right")
        t.add_row(*(_ap(metrics.get(c)) for c in cols))
        t.caption = f"{metrics.get('images', 0)} images, {metrics.get('detections', 0)} detections"
        return t

    @staticmethod
    def classwise_table(metrics: dict[str, Any], title: str = "COCO box AP per category") -> Table:
        """One row per category (`per_class` of coco_box_metrics); `-` where a category has no ground truth."""
        t = Table(title=title)
        for c, justify in (("id", "right"), ("category", "left"), ("gt boxes", "right"), ("AP", "right"),
                           ("AP50", "right"), ("AP75", "right")):
            t.add_column(c, justify=justify)
        for r in metrics.get("per_class", []):
            t.add_row(str(r["id"]), r["name"], str(r["gt"]), _ap(r["AP"]), _ap(r["AP50"]), _ap(r["AP75"]))
        return t


def _mismatch(misfit: list[str], missing: list[str], unexpected: list[str], sd: dict[str, torch.Tensor],
              own: dict[str, torch.Tensor]) -> list[str]:
    """The differences between a detector file and the model, each with its count and first three names."""
    out = []
    if misfit:
        shown = ", ".join(f"{k} {tuple(sd[k].shape)} vs {tuple(own[k].shape)}" for k in misfit[:3])
        out.append(f"{len(misfit)} tensors of another shape ({shown}{', ...' if len(misfit) > 3 else ''})")
    for what, names in (("missing from the file", missing), ("not in the model", unexpected)):
        if names:
            out.append(f"{len(names)} {what} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})")
    return out


def _ap(v: float | None) -> str:
    """An AP as the tables print it: the fraction that --json, eval.jsonl and best.json hold (COCOeval's unit), to
    3 decimals."""
    return "-" if v is None else f"{v:.3f}"
