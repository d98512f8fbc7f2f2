"""DINO detection: COCO-format data (built-in demo shapes by default), the DINO model, COCO box AP."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.table import Table
from torch.utils.data import DataLoader, Subset

from vtrain.config import RunConfig
from vtrain.data.coco import CocoDetection, collate
from vtrain.data.demo import data_root
from vtrain.data.hf import HfSplits, is_hf
from vtrain.data.sampler import eval_shard
from vtrain.data.workers import worker_context
from vtrain.dist import gather_objects
from vtrain.errors import VtrainError
from vtrain.eval.coco_eval import coco_box_metrics, coco_detections
from vtrain.files import write_json_atomic
from vtrain.models.backbones import check_match, load_backbone_weights, read_state_dict
from vtrain.models.dino import DINO, postprocess
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

    def check_eval_data(self) -> None:
        """Load and check the evaluation set now (at the start of training), not first at evaluation time."""
        self.val_dataset()

    @staticmethod
    def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: batch[k] for k in ("images", "masks", "labels", "boxes", "num_targets")}

    # ---- model --------------------------------------------------------------------------------------------
    def build_model(self, num_classes: int | None = None) -> DINO:
        n = num_classes if num_classes is not None else self.train_dataset().num_classes
        return build_model(self.name, self.cfg.model, n)

    def load_pretrained(self, model: DINO) -> str:
        """--pretrained: a full detector file (vtrain keys) or a backbone file in timm or original Swin/ResNet
        layout. Class-specific tensors of another class count are left at their initialisation."""
        m = self.cfg.model
        path = m.pretrained
        sd = read_state_dict(path, "--pretrained")
        if any(k.startswith("backbone.body.") for k in sd):
            own = model.state_dict()
            unexpected = [k for k in sd if k not in own]
            reinit = [k for k in sd if k in own and sd[k].shape != own[k].shape]
            keep = {k: v for k, v in sd.items() if k in own and k not in reinit}
            res = model.load_state_dict(keep, strict=False)
            missing = [k for k in res.missing_keys if k not in reinit]
            share = check_match(path, "detector", len(own) - len(res.missing_keys), len(own) - len(reinit),
                                m.pretrained_min_match, m.allow_partial_pretrained)
            return (f"loaded detector {path}: {share}, missing {len(missing)} {missing[:3]}, unexpected "
                    f"{len(unexpected)} {unexpected[:3]}, re-initialised (other shape) {len(reinit)} {reinit[:3]}")
        missing, unexpected = load_backbone_weights(model.backbone.body, sd)
        total = len(model.backbone.body.state_dict())
        share = check_match(path, "backbone", total - len(missing), total, m.pretrained_min_match,
                            m.allow_partial_pretrained)
        return (f"loaded backbone {path}: {share}, missing {len(missing)} {missing[:3]}, unused {len(unexpected)} "
                f"{unexpected[:3]}")

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
                            num_workers=workers, multiprocessing_context=worker_context(workers))
        dets: list[dict[str, Any]] = []
        pos = 0
        for batch in loader:
            out = forward(images=batch["images"].to(device, input_dtype), masks=batch["masks"].to(device))
            results = postprocess(out["pred_logits"], out["pred_boxes"], batch["orig_size"].to(device))
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
        t.add_row(*(_pct(metrics.get(c)) for c in cols))
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
            t.add_row(str(r["id"]), r["name"], str(r["gt"]), _pct(r["AP"]), _pct(r["AP50"]), _pct(r["AP75"]))
        return t


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}"
