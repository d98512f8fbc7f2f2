"""Metric learning (face recognition): identity folders or insightface RecordIO, an embedding model with a margin
head, verification on held-out identities, a pairs file and insightface `.bin` packs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from vtrain.config import RunConfig
from vtrain.console import tracked
from vtrain.data.demo import data_root
from vtrain.data.faces import FaceFolder, FaceSamples, decode_rgb, load_image, read_pairs, resolve_face_data, \
    to_model_input
from vtrain.data.pairs import sample_pairs
from vtrain.data.recordio import RecordFaces
from vtrain.data.hf import HfSplits, is_hf
from vtrain.data.sampler import eval_shard
from vtrain.data.verification_bin import MIN_PAIRS, check_pairs, read_bin
from vtrain.data.workers import worker_options
from vtrain.dist import gather_tensors, world_size
from vtrain.errors import VtrainError
from vtrain.eval.verification import pack_metrics, verification_metrics
from vtrain.models.backbones import check_match, load_backbone_weights, read_state_dict
from vtrain.models.metric import MetricModel
from vtrain.tasks.model import build_model

@dataclass
class EvalSet:
    """Images to embed and the pairs over them. name "" is the held-out identities / pairs file (unprefixed
    metric keys); a `.bin` pack is named by its file stem and its keys are prefixed `<name>/`."""
    name: str
    images: Dataset
    """Item i -> float CHW model input."""
    pairs: np.ndarray
    same: np.ndarray


class MetricTask:
    name = "metric"
    collate_fn = None  # default collation: fixed-size crops
    input_sizes_vary = False  # every micro-batch has the same shape (engine/compile.py reads this)

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.data = resolve_face_data(cfg.data, data_root(self.name, cfg.data.path))
        self.hf = HfSplits(cfg.data.path) if is_hf(cfg.data.path) else None  # --data hf:PATH (data/hf.py)
        self._train: FaceSamples | None = None
        self._packs: dict[str, tuple[list[bytes], np.ndarray]] = {}
        self.notes: list[str] = []

    # ---- data ---------------------------------------------------------------------------------------------
    def train_dataset(self) -> FaceSamples:
        """A Hugging Face dataset (`hf:PATH`), RecordIO (train.rec + train.idx) or identity folders, recognised by
        the files in --data."""
        limit = self.cfg.data.max_image_pixels
        if self._train is None and self.hf is not None:
            self._train = self.hf.faces("train", self.cfg.model.image_size, train=True, seed=self.cfg.train.seed,
                                        max_pixels=limit)
            _check_head_memory(self._train, self.cfg)
        if self._train is None:
            d, size, seed = self.data, self.cfg.model.image_size, self.cfg.train.seed
            if d.layout == "bin":
                raise VtrainError(f"--data {d.root}: a verification .bin holds pairs to evaluate on, not training "
                                  "data; train on a RecordIO dir (train.rec + train.idx) or identity folders")
            if d.layout == "recordio":
                self._train = RecordFaces(d.train_dir, size, train=True, seed=seed, max_pixels=limit)
                if self._train.note:  # the header's float32 range made exact from train.idx
                    self.notes.append(self._train.note)
            else:
                self._train = FaceFolder(d.train_dir, size, train=True, seed=seed,
                                         skip_bad=self.cfg.data.skip_bad_images, max_pixels=limit)
                if self._train.empty_files:
                    self.notes.append(f"--skip-bad-images: left out {len(self._train.empty_files)} empty files, "
                                      f"e.g. {self._train.empty_files[0]}")
            _check_head_memory(self._train, self.cfg)
        return self._train

    def check_eval_data(self) -> None:
        """Read and check every evaluation set now (at the start of training): pairs that cannot be scored, an
        unreadable pack or held-out folder are one error before any step, not after the final save."""
        self.eval_sets()

    @staticmethod
    def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"images": batch["images"], "labels": batch["labels"]}

    # ---- model --------------------------------------------------------------------------------------------
    def build_model(self, num_classes: int | None = None) -> MetricModel:
        n = num_classes if num_classes is not None else self.train_dataset().num_classes
        return build_model(self.name, self.cfg.model, n)

    def load_pretrained(self, model: MetricModel, weights: str | Path | None = None,
                        categories: list[dict[str, Any]] | None = None) -> str:
        """Load --pretrained (`weights`, default the flag's file): a full vtrain model file (keys backbone./neck./
        head.) or a timm backbone file. A model of another identity count keeps backbone and neck and starts a fresh
        margin head; any other tensor of another shape is an error (a file of another model). `categories`: unused
        (detection's class names)."""
        m = self.cfg.model
        path = str(weights or m.pretrained)
        sd = read_state_dict(path, "--pretrained")
        if any(k.startswith("backbone.") for k in sd):
            own = model.state_dict()
            note = ""
            if "head.weight" in own and "head.weight" not in sd:  # an embedding network (e.g. vtrain convert's)
                note = f"; head.weight initialised for {own['head.weight'].shape[0]} identities (the file has none)"
            elif "head.weight" in own and sd["head.weight"].shape != own["head.weight"].shape:
                old, new = sd["head.weight"].shape[0], own["head.weight"].shape[0]
                if sd["head.weight"].shape[1:] == own["head.weight"].shape[1:]:  # a different identity count
                    note = f"; head.weight re-initialised for {old} → {new} identities"
                    sd = {k: v for k, v in sd.items() if not k.startswith("head.")}
            misfit = [k for k, v in sd.items() if k in own and v.shape != own[k].shape]
            if misfit and not m.allow_partial_pretrained:
                shown = ", ".join(f"{k} {tuple(sd[k].shape)} vs {tuple(own[k].shape)}" for k in misfit[:3])
                raise VtrainError(f"--pretrained: {path} does not fit --model {m.preset}: {len(misfit)} tensors of "
                                  f"another shape ({shown}) (--allow-partial-pretrained loads the tensors that fit)")
            sd = {k: v for k, v in sd.items() if k not in misfit}
            res = model.load_state_dict(sd, strict=False)
            share = check_match(path, "model", len(own) - len(res.missing_keys), len(own),
                                m.pretrained_min_match, m.allow_partial_pretrained)
            return f"loaded {path}: {share}, unexpected {len(res.unexpected_keys)}{note}"
        missing, unexpected = load_backbone_weights(model.backbone, sd)
        total = len(model.backbone.state_dict())
        share = check_match(path, "backbone", total - len(missing), total, m.pretrained_min_match,
                            m.allow_partial_pretrained)
        return f"loaded backbone {path}: {share}, missing {len(missing)} {missing[:3]}, unused " \
               f"{len(unexpected)} {unexpected[:3]}"

    # ---- evaluation ---------------------------------------------------------------------------------------
    def eval_sets(self) -> list[EvalSet]:
        """The held-out identities or pairs file (if any), then every `.bin` pack of --val-targets."""
        size, limit, sets = self.cfg.model.image_size, self.cfg.data.max_image_pixels, []
        if self.data.pairs_file is not None:
            pairs = read_pairs(self.data.pairs_file)
            paths = sorted({p for a, b, _ in pairs for p in (a, b)})
            pos = {p: i for i, p in enumerate(paths)}
            idx = np.array([[pos[a], pos[b]] for a, b, _ in pairs])
            sets.append(EvalSet("", _Images(paths, load_image, size, limit), idx, np.array([s for *_, s in pairs])))
            where = f"--pairs {self.data.pairs_file}"
        elif self.hf is not None and self.hf.eval_split:  # held-out identities: the validation (or test) split
            val = self.hf.faces(self.hf.eval_split, size, train=False, max_pixels=limit)
            idx, same = self._sample_pairs(val.targets)
            sets.append(EvalSet("", _Images(list(val.samples.images), load_image, size, limit), idx, same))
            where = f"--data {self.hf.where(self.hf.eval_split)} (pairs sampled over its identities)"
        elif self.data.val_dir is not None:
            val = FaceFolder(self.data.val_dir, size, train=False, skip_bad=self.cfg.data.skip_bad_images,
                             max_pixels=limit)
            idx, same = self._sample_pairs(val.targets)
            sets.append(EvalSet("", _Images([p for p, _ in val.samples], load_image, size, limit), idx, same))
            where = f"--val-data {self.data.val_dir} (pairs sampled over its identities)"
        if sets:  # e.g. held-out identities with one image each give no genuine pair
            check_pairs(sets[0].same, where)
        for name, path in self.data.val_targets:
            if name not in self._packs:  # unpickled once per run, not at every evaluation
                images, same = read_bin(path)
                check_pairs(same, f"verification pack {path}", MIN_PAIRS)
                self._packs[name] = images, same
            images, same = self._packs[name]
            pairs = np.arange(len(images)).reshape(-1, 2)  # pair i = images 2i, 2i+1 (docs/face.md §1.5)
            sets.append(EvalSet(name, _Images(images, _PackImage(path), size, limit), pairs, same))
        return sets

    def _sample_pairs(self, labels) -> tuple[np.ndarray, np.ndarray]:
        d = self.cfg.data
        return sample_pairs(labels, d.max_impostor_pairs, seed=self.cfg.train.seed, max_genuine=d.max_genuine_pairs)

    @torch.no_grad()
    def evaluate(self, forward: Callable[..., dict[str, torch.Tensor]], device: torch.device,
                 rank: int = 0, world: int = 1, input_dtype: torch.dtype = torch.float32,
                 save_predictions: str | None = None) -> dict[str, Any] | None:
        """Verification over all ranks: for every set each rank embeds an equal-length shard (sharded engines
        need every rank in every forward), embeddings are gathered, rank 0 scores the pairs. Returns metrics
        on rank 0: the held-out set's keys as they are, a pack's prefixed with its name (`lfw/acc`, ...)."""
        sets = self.eval_sets()
        if not sets:
            return None
        out: dict[str, Any] = {"rows": []}
        for es in sets:
            emb = self._embed(es.images, forward, device, rank, world, input_dtype, es.name or "held-out")
            if rank != 0:
                continue
            if es.name:
                e1, e2 = emb[es.pairs[:, 0]].numpy(), emb[es.pairs[:, 1]].numpy()
                m = pack_metrics(e1, e2, es.same)
            else:
                m = verification_metrics(pair_scores(emb, es.pairs), es.same)
            out["rows"] += [{**r, "set": es.name} for r in m.pop("rows")]
            out.update({(f"{es.name}/{k}" if es.name else k): v for k, v in m.items()})
        return out if rank == 0 else None

    def _embed(self, images: Dataset, forward: Callable[..., dict[str, torch.Tensor]], device: torch.device,
               rank: int, world: int, input_dtype: torch.dtype, name: str) -> torch.Tensor:
        """L2-normalised flip-summed embeddings of all images, complete on rank 0 (which shows the progress)."""
        n = len(images)
        mine, _ = eval_shard(n, rank, world)  # padding duplicates are cut off after the gather ([:n])
        workers = min(self.cfg.data.num_workers, 2)
        loader = torch.utils.data.DataLoader(torch.utils.data.Subset(images, mine),
                                             batch_size=self.cfg.train.batch_size, num_workers=workers,
                                             **worker_options(workers))
        chunks = []
        for imgs in tracked(loader, len(loader), f"eval {name} ({len(images)} images)", rank == 0):
            chunks.append(flip_embeddings(forward, imgs.to(device, input_dtype)))
        local = torch.cat(gather_tensors(torch.cat(chunks)))  # every rank's, in rank order
        return local[:n].cpu()

    @staticmethod
    def metrics_table(metrics: dict[str, Any], title: str = "verification"):
        from rich.table import Table

        t = Table(title=title)
        for col in ("set", "metric", "value", "threshold", "note"):
            t.add_column(col)
        for name in dict.fromkeys(r["set"] for r in metrics.get("rows", [])):
            key = (lambda k: f"{name}/{k}") if name else (lambda k: k)  # noqa: E731
            label = name or "held-out"
            if name:
                t.add_row(label, "10-fold accuracy", f"{metrics[key('acc')]:.4f} ± {metrics[key('acc_std')]:.4f}",
                          f"{metrics[key('acc_threshold')]:.2f}", "squared L2; fold mean")
            for r in (r for r in metrics["rows"] if r["set"] == name):
                note = (f"FAR achieved {r['far_achieved']:.2e}" if r["resolvable"]
                        else f"unresolvable: < {1 / r['far_target']:.0f} impostor pairs")
                t.add_row(label, f"TAR@FAR={r['far_target']:g}", f"{r['tar']:.4f}", f"{r['threshold']:.4f}", note)
            t.add_row(label, "best balanced accuracy", f"{metrics[key('balanced_accuracy')]:.4f}",
                      f"{metrics[key('accuracy_threshold')]:.4f}", "")
            t.add_row(label, "pairs", f"{metrics[key('genuine_pairs')]} genuine / {metrics[key('impostor_pairs')]} "
                      "impostor", "", "")
        return t


def pair_scores(emb: torch.Tensor, pairs: np.ndarray, chunk: int = 65536) -> np.ndarray:
    """Cosine scores of index pairs of unit embeddings, a chunk of pairs at a time: gathering both sides of every
    pair at once holds 2 x pairs x dim floats (1.6 GB for 400,000 pairs of 512-d embeddings)."""
    out = np.empty(len(pairs), np.float32)
    for s in range(0, len(pairs), chunk):
        p = torch.from_numpy(pairs[s:s + chunk])
        out[s:s + chunk] = (emb[p[:, 0]] * emb[p[:, 1]]).sum(1).numpy()
    return out


def flip_embeddings(forward: Callable[..., dict[str, torch.Tensor]], images: torch.Tensor) -> torch.Tensor:
    """Evaluation embeddings (also `vtrain predict --task metric`): flip test-time augmentation, the sum of the
    embeddings of the image and its mirror (docs/face.md §1.5), L2-normalised in fp32."""
    emb = forward(images=images)["embedding"].float() + forward(images=images.flip(-1))["embedding"].float()
    return F.normalize(emb, dim=1)


class _Images(Dataset):
    """Model inputs of a list of image sources (paths or encoded bytes), none larger than `max_pixels`."""

    def __init__(self, sources: list, decode: Callable[[Any, int, int], torch.Tensor], size: int,
                 max_pixels: int) -> None:
        self.sources, self.decode, self.size, self.max_pixels = sources, decode, size, max_pixels

    def __len__(self) -> int:
        return len(self.sources)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.decode(self.sources[i], self.size, self.max_pixels)


class _PackImage:
    """Decoder of one pack's encoded images (picklable, for DataLoader workers); errors name the pack."""

    def __init__(self, path) -> None:
        self.path = path

    def __call__(self, data: bytes, size: int, max_pixels: int) -> torch.Tensor:
        return to_model_input(decode_rgb(data, f"in {self.path}", max_pixels), size)


def _check_head_memory(data: FaceSamples, cfg: RunConfig) -> None:
    """Refuse a class count whose head cannot be held, before any head is built: the count comes from a file
    (a RecordIO `property`, a header record) that says anything. The estimate is the fp32 weight, its gradient and
    AdamW's two moments of this process's rows (all classes, or 1/world of them with --head-parallel sharded),
    against what this machine has (available RAM, or the GPU's memory when it is larger)."""
    world = world_size()
    shards = world if cfg.model.head_parallel == "sharded" else 1
    rows = -(-data.num_classes // shards)
    need = 4 * rows * cfg.model.embedding_dim * 4
    have = psutil.virtual_memory().available
    if torch.cuda.is_available():
        have = max(have, torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    if need > have:
        source = f" ({data.num_classes_source})" if data.num_classes_source else ""
        raise VtrainError(f"{data.num_classes} classes{source} need a {need / 2**30:.1f} GiB head per process "
                          f"({rows} x {cfg.model.embedding_dim} fp32 weights, gradients and AdamW moments), more "
                          f"than this machine has ({have / 2**30:.1f} GiB); the class count is wrong, or use "
                          "--head-parallel sharded over more processes")
