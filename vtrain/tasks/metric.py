"""Metric learning (face recognition): identity-folder data, embedding model with a margin head, verification."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import Dataset

from vtrain.config import RunConfig
from vtrain.data.faces import FaceFolder, load_image, read_pairs, resolve_face_data, sample_pairs
from vtrain.data.hf import HfSplits, is_hf
from vtrain.data.sampler import eval_shard
from vtrain.errors import VtrainError
from vtrain.eval.verification import verification_metrics
from vtrain.models.backbones import check_match, load_backbone_weights, read_state_dict
from vtrain.models.metric import MetricModel
from vtrain.tasks import build_model

GRAD_CKPT_PARTS = ("backbone",)


class MetricTask:
    name = "metric"
    collate_fn = None  # default collation: fixed-size crops

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.data = resolve_face_data(cfg.data)
        self.hf = HfSplits(cfg.data.path) if is_hf(cfg.data.path) else None  # --data hf:PATH (data/hf.py)
        self._train: FaceFolder | None = None
        self.notes: list[str] = []
        for part in cfg.model.grad_ckpt:
            if part not in GRAD_CKPT_PARTS:
                raise VtrainError(f"--grad-ckpt: unknown part {part!r} for --task metric; parts: "
                                  f"{', '.join(GRAD_CKPT_PARTS)}")

    # ---- data ---------------------------------------------------------------------------------------------
    def train_dataset(self) -> FaceFolder:
        if self._train is None and self.hf is not None:
            self._train = self.hf.faces("train", self.cfg.model.image_size, train=True, seed=self.cfg.train.seed)
        if self._train is None:
            self._train = FaceFolder(self.data.train_dir, self.cfg.model.image_size, train=True,
                                     seed=self.cfg.train.seed, skip_bad=self.cfg.data.skip_bad_images)
            if self._train.empty_files:
                self.notes.append(f"--skip-bad-images: left out {len(self._train.empty_files)} empty files, e.g. "
                                  f"{self._train.empty_files[0]}")
        return self._train

    @staticmethod
    def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"images": batch["images"], "labels": batch["labels"]}

    # ---- model --------------------------------------------------------------------------------------------
    def build_model(self, num_classes: int | None = None) -> MetricModel:
        n = num_classes if num_classes is not None else self.train_dataset().num_classes
        return build_model(self.name, self.cfg.model, n)

    def load_pretrained(self, model: MetricModel) -> str:
        """Load --pretrained: a full vtrain model file (keys backbone./neck./head.) or a timm backbone file."""
        m = self.cfg.model
        sd = read_state_dict(m.pretrained)
        if any(k.startswith("backbone.") for k in sd):
            own = model.state_dict()
            head_ok = "head.weight" in sd and sd["head.weight"].shape == own["head.weight"].shape
            if not head_ok:  # a different identity count: keep backbone and neck, fresh head
                sd = {k: v for k, v in sd.items() if not k.startswith("head.")}
            sd = {k: v for k, v in sd.items() if k not in own or v.shape == own[k].shape}
            res = model.load_state_dict(sd, strict=False)
            share = check_match(m.pretrained, "model", len(own) - len(res.missing_keys), len(own),
                                m.pretrained_min_match, m.allow_partial_pretrained)
            return (f"loaded {m.pretrained}: {share}, unexpected {len(res.unexpected_keys)}"
                    + ("" if head_ok else " (head re-initialised)"))
        missing, unexpected = load_backbone_weights(model.backbone, sd)
        total = len(model.backbone.state_dict())
        share = check_match(m.pretrained, "backbone", total - len(missing), total, m.pretrained_min_match,
                            m.allow_partial_pretrained)
        return f"loaded backbone {m.pretrained}: {share}, missing {len(missing)} {missing[:3]}, unused " \
               f"{len(unexpected)} {unexpected[:3]}"

    # ---- evaluation ---------------------------------------------------------------------------------------
    def eval_set(self) -> tuple[list[str], np.ndarray, np.ndarray] | None:
        """Image paths, (P, 2) pair indices and the `same` flags; None when there is nothing to verify on."""
        if self.data.pairs_file is not None:
            pairs = read_pairs(self.data.pairs_file)
            paths = sorted({p for a, b, _ in pairs for p in (a, b)})
            pos = {p: i for i, p in enumerate(paths)}
            idx = np.array([[pos[a], pos[b]] for a, b, _ in pairs])
            return paths, idx, np.array([s for *_, s in pairs])
        if self.hf is not None:  # held-out identities: the validation (or test) split
            val = self.hf.faces(self.hf.eval_split, self.cfg.model.image_size, train=False) \
                if self.hf.eval_split else None
        else:
            val = FaceFolder(self.data.val_dir, self.cfg.model.image_size, train=False,
                             skip_bad=self.cfg.data.skip_bad_images) if self.data.val_dir else None
        if val is None:
            return None
        idx, same = sample_pairs(val.targets, self.cfg.data.max_impostor_pairs, seed=self.cfg.train.seed)
        return [p for p, _ in val.samples], idx, same

    @torch.no_grad()
    def evaluate(self, forward: Callable[..., dict[str, torch.Tensor]], device: torch.device,
                 rank: int = 0, world: int = 1, input_dtype: torch.dtype = torch.float32,
                 save_predictions: str | None = None) -> dict[str, Any] | None:
        """Verification over all ranks: each embeds an equal-length shard (sharded engines need every rank in
        every forward), embeddings are gathered, rank 0 scores the pairs. Returns metrics on rank 0."""
        es = self.eval_set()
        if es is None:
            return None
        paths, pair_idx, same = es
        n, bs = len(paths), self.cfg.train.batch_size
        mine, _ = eval_shard(n, rank, world)  # padding duplicates are cut off after the gather ([:n])
        loader = torch.utils.data.DataLoader(_Images(paths, mine, self.cfg.model.image_size), batch_size=bs,
                                             num_workers=min(self.cfg.data.num_workers, 2))
        chunks = []
        for imgs in loader:
            chunks.append(flip_embeddings(forward, imgs.to(device, input_dtype)))
        local = torch.cat(chunks)
        if world > 1:
            gathered = [torch.empty_like(local) for _ in range(world)]
            dist.all_gather(gathered, local)
            local = torch.cat(gathered)
        if rank != 0:
            return None
        emb = local[:n].cpu()
        scores = (emb[pair_idx[:, 0]] * emb[pair_idx[:, 1]]).sum(1).numpy()
        return verification_metrics(scores, same)


    @staticmethod
    def metrics_table(metrics: dict[str, Any], title: str = "verification"):
        from vtrain.engine.logging import verification_table

        return verification_table(metrics, title)


def flip_embeddings(forward: Callable[..., dict[str, torch.Tensor]], images: torch.Tensor) -> torch.Tensor:
    """Evaluation embeddings (also `vtrain predict --task metric`): flip test-time augmentation, the sum of the
    embeddings of the image and its mirror (face.md §1.5), L2-normalised in fp32."""
    emb = forward(images=images)["embedding"].float() + forward(images=images.flip(-1))["embedding"].float()
    return F.normalize(emb, dim=1)


class _Images(Dataset):
    def __init__(self, paths: list[str], order: list[int], size: int) -> None:
        self.paths, self.order, self.size = paths, order, size

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, i: int) -> torch.Tensor:
        return load_image(self.paths[self.order[i]], self.size)

