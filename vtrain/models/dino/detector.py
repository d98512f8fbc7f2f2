"""The DINO detector: timm backbone -> ChannelMapper neck -> deformable encoder -> two-stage mixed query
selection (+ contrastive denoising) -> refining decoder -> per-layer class/box heads.

Layout as MMD's `DINO` (docs/dino.md §1.1-1.2): separate heads for each decoder layer plus one for the encoder
proposals, learned content queries, anchors from the encoder's top-k proposals. `forward` returns the loss dict
when targets are given and predictions otherwise (inference also goes through `forward`, so sharded engines
gather parameters in their hooks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import timm
from timm.layers import DropPath
from timm.models.swin_transformer import SwinTransformer
import torch
import torch.nn.functional as F
from torch import nn
from torchvision.ops import box_convert

from vtrain.models.recompute_units import apply_spec, backbone_units
from vtrain.models.lean import autocast_input, lean_norm
from vtrain.models.dino.criterion import dino_loss
from vtrain.models.dino.denoising import build_denoising
from vtrain.models.dino.transformer import MLP, Decoder, Encoder, LevelPositions, inverse_sigmoid
from vtrain.models.swin_attention import use_shared_bias_attention
from vtrain.models.swin_lean import swin_features, use_lean_swin
from vtrain.presets import DINO_PRESETS, DinoPreset


class Backbone(nn.Module):
    """A plain timm model (standard keys, so timm and original checkpoints load) read through
    `forward_intermediates`; unused head and final norm are pruned."""

    def __init__(self, p: DinoPreset, drop_path: float | None = None) -> None:
        super().__init__()
        kwargs = dict(p.kwargs)
        # a stated rate is always passed, 0.0 too: timm's own default is not 0 for every model (Swin: 0.1)
        kwargs["drop_path_rate"] = p.drop_path if drop_path is None else drop_path
        if p.timm_name.startswith("swin"):
            # the detection Swin: every odd block of every stage shifts, also where one window covers the map
            # (docs/detection.md "The detection Swin"); timm's default turns the shift off there
            kwargs.setdefault("always_partition", True)
        self.body = timm.create_model(p.timm_name, pretrained=False, num_classes=0, **kwargs)
        # Swin: pad before the shift as the detection codebases do, and no per-image/window/head N x N tensors at
        # detection sizes (swin_attention.py)
        use_shared_bias_attention(self.body, detection=True)
        # Swin read out stage by stage, one kept copy of each taken stage output (swin_lean.py)
        self.swin = isinstance(self.body, SwinTransformer) and p.out_norm
        if self.swin:
            use_lean_swin(self.body)
        self.indices = list(p.out_indices)
        self.body.prune_intermediate_layers(self.indices, prune_norm=True, prune_head=True)
        self.channels = [self.body.feature_info[i]["num_chs"] for i in self.indices]
        self.strides = [self.body.feature_info[i]["reduction"] for i in self.indices]
        self.out_norms = nn.ModuleList(nn.LayerNorm(c) for c in self.channels) if p.out_norm else None
        if p.frozen_bn:
            # batch 2 per GPU: BatchNorm statistics are frozen and the stem + stage 1 are not trained
            self.body = timm.layers.freeze_batch_norm_2d(self.body)
            for name, param in self.body.named_parameters():
                if name.startswith(("conv1.", "bn1.", "layer1.")):
                    param.requires_grad_(False)

    @property
    def drop_path(self) -> float:
        """The stochastic-depth rate in force: the largest drop probability of the model's DropPath layers (timm
        raises it linearly to the configured rate over the blocks), 0.0 when it has none."""
        return max((float(m.drop_prob) for m in self.body.modules() if isinstance(m, DropPath)), default=0.0)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.swin:
            return swin_features(self.body, x, self.indices, self.out_norms)
        feats = self.body.forward_intermediates(x, indices=self.indices, intermediates_only=True)
        if self.out_norms is not None:
            feats = [lean_norm(n, f.permute(0, 2, 3, 1)).permute(0, 3, 1, 2) for n, f in zip(self.out_norms, feats)]
        return feats


@dataclass(frozen=True)
class DinoOptions:
    """Choices on which the published DINO codebases differ from each other and from vtrain's recipe; the defaults
    are vtrain's. ModelConfig's fields of the same names set them (their docstrings say which codebase does what;
    docs/detection.md "Model options")."""

    neck_bias: bool = False
    pos_temperature: float = 20.0
    pos_offset: float = 0.0
    pos_normalize: bool = True
    mask_invalid_proposals: bool = True
    refine_eps: float = 1e-3
    box_eps: float = 1e-3
    clip_boxes: bool = False
    shared_class_head: bool = False
    shared_box_head: bool = False


class ChannelMapper(nn.Module):
    """1x1 conv + GroupNorm(32) per backbone level to `dim`, plus 3x3 stride-2 conv + GN extra levels, the first
    on the last backbone map (MMD ChannelMapper, docs/dino.md §1.2)."""

    def __init__(self, in_channels: list[int], dim: int, levels: int, bias: bool = False) -> None:
        super().__init__()
        groups = min(32, dim)
        self.lateral = nn.ModuleList(nn.Sequential(nn.Conv2d(c, dim, 1, bias=bias), nn.GroupNorm(groups, dim))
                                     for c in in_channels)
        extra_in = [in_channels[-1]] + [dim] * (levels - len(in_channels) - 1)
        self.extra = nn.ModuleList(nn.Sequential(nn.Conv2d(c, dim, 3, 2, 1, bias=bias), nn.GroupNorm(groups, dim))
                                   for c in extra_in[: levels - len(in_channels)])
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.xavier_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, feats: list[torch.Tensor]) -> list[torch.Tensor]:
        # conv -> GroupNorm; the GN's fp32 copy of the 16-bit conv output is made again in backward (lean.py)
        outs = [lean_norm(lat[1], lat[0](f)) for lat, f in zip(self.lateral, feats)]
        x = feats[-1]
        for conv in self.extra:
            x = lean_norm(conv[1], conv[0](x))
            outs.append(x)
        return outs


class DINO(nn.Module):
    def __init__(self, preset: str | DinoPreset, num_classes: int, drop_path: float | None = None,
                 num_queries: int | None = None, dn_queries: int | None = None, ffn_recompute: bool = True,
                 ffn_chunk: int = 0, options: DinoOptions | None = None) -> None:
        super().__init__()
        p = DINO_PRESETS[preset]() if isinstance(preset, str) else preset
        self.preset = p
        self.options = o = options or DinoOptions()
        self.num_classes = num_classes
        self.num_queries = num_queries or p.queries
        self.dn_queries = p.dn_queries if dn_queries is None else dn_queries
        self.levels, d = p.levels, p.dim
        self.backbone = Backbone(p, drop_path)
        self.neck = ChannelMapper(self.backbone.channels, d, p.levels, bias=o.neck_bias)
        self.level_embed = nn.Parameter(torch.empty(p.levels, d))
        self.encoder = Encoder(p.enc_layers, d, p.ffn, p.levels, p.heads, p.points)
        for layer in self.encoder.layers:  # ModelConfig.ffn_recompute/ffn_chunk: the encoder FFN's hidden layer
            layer.ffn.recompute_hidden, layer.ffn.chunk = ffn_recompute, ffn_chunk
        self.decoder = Decoder(p.dec_layers, d, p.ffn, p.levels, p.heads, p.points)
        self.decoder.refine_eps = o.refine_eps
        # two-stage: proposals from the encoder memory
        self.memory_proj = nn.Linear(d, d)
        self.memory_norm = nn.LayerNorm(d)
        # learned content queries; anchors come from the top-k proposals (mixed query selection)
        self.query_embed = nn.Embedding(self.num_queries, d)
        # denoising label embedding; index num_classes marks padding slots and stays zero
        self.label_embed = nn.Embedding(num_classes + 1, d, padding_idx=num_classes)
        # heads 0..L-1 for the decoder layers and the last for the encoder proposals; a shared head (IDEA DINO's
        # dec_pred_class_embed_share / dec_pred_bbox_embed_share) is one module for every decoder layer, stored once
        # as head 0, so its index L is 1 (no tied tensors: every engine and checkpoint sees plain parameters)
        n_cls = 1 if o.shared_class_head else p.dec_layers
        n_box = 1 if o.shared_box_head else p.dec_layers
        self.cls_heads = nn.ModuleList(nn.Linear(d, num_classes) for _ in range(n_cls + 1))
        self.reg_heads = nn.ModuleList(MLP(d, d, 4, 3) for _ in range(n_box + 1))
        self._init_weights()

    def cls_head(self, layer: int) -> nn.Module:
        """The class head of decoder layer `layer` (the shared one when shared)."""
        return self.cls_heads[0 if self.options.shared_class_head else layer]

    def box_head(self, layer: int) -> nn.Module:
        """The box head of decoder layer `layer` (the shared one when shared); it also refines the layer's
        reference boxes."""
        return self.reg_heads[0 if self.options.shared_box_head else layer]

    def describe(self) -> str:
        """One log line: the settings of the built model that the preset and the options decide."""
        n = self.preset.dec_layers
        heads = ", ".join(f"{what} head shared by the {n} decoder layers" if shared else
                          f"a {what} head for each of the {n} decoder layers"
                          for what, shared in (("class", self.options.shared_class_head),
                                               ("box", self.options.shared_box_head)))
        return (f"model: backbone {self.preset.timm_name}, drop-path rate {self.backbone.drop_path:g}; "
                f"{self.num_queries} matching + {self.dn_queries} denoising queries; {heads}")

    def _init_weights(self) -> None:
        nn.init.normal_(self.level_embed)
        nn.init.normal_(self.query_embed.weight)
        bias = -math.log((1 - 0.01) / 0.01)  # prior probability 0.01 for focal loss
        for h in self.cls_heads:
            nn.init.constant_(h.bias, bias)
        for h in self.reg_heads:
            nn.init.zeros_(h.layers[-1].weight)
            nn.init.zeros_(h.layers[-1].bias)

    # ---- activation checkpointing --------------------------------------------------------------------------
    def recompute_units(self) -> dict[str, tuple[nn.Module, ...]]:
        """Recompute units in forward order: backbone stages (or blocks), then each encoder and decoder layer."""
        units = backbone_units(self.backbone.body)
        units.update({f"encoder.{i}": (layer,) for i, layer in enumerate(self.encoder.layers)})
        units.update({f"decoder.{i}": (layer,) for i, layer in enumerate(self.decoder.layers)})
        return units

    def set_grad_checkpointing(self, spec: str | list[str]) -> None:
        """Checkpoint the units a `--grad-ckpt` value names (e.g. ["backbone", "encoder:0-2", "sac:decoder"])."""
        apply_spec(self, spec)

    # ---- forward pieces ----------------------------------------------------------------------------------------
    def _flatten(self, feats: list[torch.Tensor], mask: torch.Tensor):
        srcs, masks, level_masks, shapes, ratios = [], [], [], [], []
        for f in feats:
            b, _, h, w = f.shape
            m = F.interpolate(mask[None].float(), size=(h, w))[0].bool()
            level_masks.append(m)
            shapes.append((h, w))
            valid_h = (~m[:, :, 0]).sum(1).float() / h
            valid_w = (~m[:, 0, :]).sum(1).float() / w
            ratios.append(torch.stack([valid_w, valid_h], -1))
            srcs.append(f.flatten(2).transpose(1, 2))
            masks.append(m.flatten(1))
        # positions are made by each encoder layer (transformer.LevelPositions), not kept
        o = self.options
        pos = LevelPositions(level_masks, self.level_embed, feats[0].dtype,
                             (o.pos_temperature, o.pos_offset, o.pos_normalize))
        return (torch.cat(srcs, 1), torch.cat(masks, 1), pos, shapes, torch.stack(ratios, 1).clamp(min=1e-3))

    @staticmethod
    def _proposals(memory: torch.Tensor, mask: torch.Tensor, shapes: list[tuple[int, int]]):
        """One anchor per encoder token: its centre, size 0.05 * 2^level (normalised to the valid region).
        Returns the anchors as logits (inf where padded/out of range) and a validity mask."""
        props = []
        start = 0
        b = memory.shape[0]  # every view spelt out: a -1 costs torch.export a division of symbolic sizes
        for lvl, (h, w) in enumerate(shapes):
            m = mask[:, start:start + h * w].view(b, h, w)
            valid_h = (~m[:, :, 0]).sum(1)
            valid_w = (~m[:, 0, :]).sum(1)
            ys, xs = torch.meshgrid(torch.arange(h, device=memory.device), torch.arange(w, device=memory.device),
                                    indexing="ij")
            scale = torch.stack([valid_w, valid_h], -1).float().view(b, 1, 1, 2)
            grid = (torch.stack([xs, ys], -1).float()[None] + 0.5) / scale
            wh = torch.full_like(grid, 0.05 * 2.0**lvl)
            props.append(torch.cat([grid, wh], -1).view(b, h * w, 4))
            start += h * w
        props = torch.cat(props, 1)
        valid = ((props > 0.01) & (props < 0.99)).all(-1) & ~mask
        logit = torch.log(props / (1 - props)).masked_fill(~valid[..., None], float("inf"))
        return logit, valid

    def _proposal_embed(self, memory: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        return lean_norm(self.memory_norm, self.memory_proj(memory.masked_fill(~valid[..., None], 0.0)))

    def _proposal_logits(self, memory: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        return self.cls_heads[-1](self._proposal_embed(memory, valid))

    @torch.no_grad()
    def _selection_scores(self, memory: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """(B, S) the score each encoder token is ranked by for the top-k query selection: its best class logit
        (-inf where invalid, with mask_invalid_proposals). The rank decides which learned content query a token
        is paired with (tools/export_detection.py checks exports on inputs without near-equal scores here)."""
        score = self._proposal_logits(memory, valid).float().max(-1)[0]
        if self.options.mask_invalid_proposals:
            score = score.masked_fill(~valid, float("-inf"))
        return score

    def forward(self, images: torch.Tensor, masks: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                boxes: torch.Tensor | None = None, num_targets: torch.Tensor | None = None) -> dict:
        """images (B, 3, H, W), masks (B, H, W) True on padding; targets padded: labels (B, M), boxes (B, M, 4)
        cxcywh normalised to each image's unpadded size, num_targets (B,)."""
        b = images.shape[0]
        if masks is None:
            masks = torch.zeros(b, *images.shape[-2:], dtype=torch.bool, device=images.device)
        feats = self.neck(self.backbone(images))
        src, mask, pos, shapes, ratios = self._flatten(feats, masks)
        del feats  # (the del's: the forward's peak is its end; what backward does not keep goes at once)
        memory = self.encoder(src, pos, shapes, ratios, mask)
        del src, pos

        # two-stage mixed query selection: top-k proposals give anchors, content queries are learned. Every token is
        # scored, but a loss reaches only the k chosen ones: the proposal heads run again, with gradients, on those
        # k rows alone, so backward keeps k rows instead of every token's (about 0.6 GiB at 800x1333, batch 2)
        anchors, valid = self._proposals(memory, mask, shapes)
        k = torch.sym_min(self.num_queries, memory.shape[1])  # symbolic under a dynamic export: min in the graph
        score = self._selection_scores(memory, valid)
        topk = score.topk(k, dim=1)[1]
        rows = topk[..., None]
        chosen = memory.gather(1, rows.expand(-1, -1, memory.shape[-1]))
        mem = self._proposal_embed(chosen, valid.gather(1, topk))
        enc_logits_k = self.cls_heads[-1](mem)
        enc_coord_k = self.reg_heads[-1](mem).float() + anchors.gather(1, rows.expand(-1, -1, 4))
        del mem, score
        memory = autocast_input(memory)  # the decoder's value projections share one 16-bit copy (lean.py)
        query = self.query_embed(torch.arange(k, device=images.device))[None].expand(b, -1, -1)
        reference = enc_coord_k.detach()

        training = labels is not None
        dn = None
        if training:
            dn = build_denoising(labels, boxes, num_targets, self.num_classes, k, self.dn_queries)
        if dn is not None:
            query = torch.cat([self.label_embed(dn.label_ids).to(query.dtype), query], 1)
            reference = torch.cat([dn.boxes_unact, reference], 1)
        attn_mask = dn.attn_mask if dn is not None else None
        layers = range(self.preset.dec_layers)
        hidden, refs = self.decoder(query, reference.sigmoid(), memory, shapes, ratios, mask, attn_mask,
                                    [self.box_head(i) for i in layers])
        logits, coords = [], []
        for i, (h, r) in enumerate(zip(hidden, refs)):
            logits.append(self.cls_head(i)(h).float())
            delta = self.box_head(i)(h).float()
            coords.append((delta + inverse_sigmoid(r.float(), self.options.box_eps)).sigmoid())
        n_dn = dn.num_queries if dn is not None else 0
        out = {"logits": [x[:, n_dn:] for x in logits], "boxes": [x[:, n_dn:] for x in coords],
               "enc_logits": enc_logits_k.float(), "enc_boxes": enc_coord_k.sigmoid()}
        if not training:
            return {"pred_logits": out["logits"][-1], "pred_boxes": out["boxes"][-1]}
        if dn is not None:
            out["dn_logits"] = [x[:, :n_dn] for x in logits]
            out["dn_boxes"] = [x[:, :n_dn] for x in coords]
        losses = dino_loss(out, labels, boxes, num_targets, dn)
        if dn is None:
            # no targets in this batch: touch the denoising embedding so every rank's gradients have the same
            # set of parameters (DDP/ZeRO reduce all of them)
            losses["loss"] = losses["loss"] + 0.0 * self.label_embed(num_targets[:1].long()).sum()
        return losses


@torch.no_grad()
def postprocess(pred_logits: torch.Tensor, pred_boxes: torch.Tensor, orig_sizes: torch.Tensor,
                top_k: int = 300, clip: bool = False) -> list[dict[str, torch.Tensor]]:
    """Top-k (query, class) pairs by sigmoid score per image (test_cfg.max_per_img=300, docs/dino.md §1.1); boxes
    as xyxy in original image pixels (orig_sizes: (B, 2) as (h, w)), clipped to the image if `clip`
    (DinoOptions.clip_boxes)."""
    scores, labels, boxes = top_detections(pred_logits, pred_boxes, orig_sizes, top_k, clip)
    return [{"scores": s, "labels": lab, "boxes": bx} for s, lab, bx in zip(scores, labels, boxes)]


def top_detections(pred_logits: torch.Tensor, pred_boxes: torch.Tensor, sizes: torch.Tensor, top_k: int = 300,
                   clip: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`postprocess` as batched tensors, (B, k) scores, (B, k) labels, (B, k, 4) xyxy boxes scaled by `sizes` (B, 2)
    as (h, w), with k = min(top_k, queries x classes): what an exported graph computes in place of the list."""
    b, q, c = pred_logits.shape
    prob = pred_logits.float().sigmoid().view(b, -1)
    k = torch.sym_min(top_k, q * c)  # symbolic under a dynamic export (few proposals on a small image)
    scores, idx = prob.topk(k, dim=1)
    labels = idx % c
    boxes = box_convert(pred_boxes.float(), "cxcywh", "xyxy").gather(1, (idx // c)[..., None].expand(-1, -1, 4))
    h, w = sizes.float().unbind(1)
    scale = torch.stack([w, h, w, h], 1)[:, None]
    boxes = boxes * scale
    if clip:
        boxes = torch.minimum(boxes.clamp(min=0), scale)
    return scores, labels, boxes


def count_parameters(model: nn.Module) -> dict[str, int]:
    parts = {"backbone": model.backbone, "neck": model.neck}
    out = {k: sum(p.numel() for p in m.parameters()) for k, m in parts.items()}
    out["total"] = sum(p.numel() for p in model.parameters())
    out["transformer_and_heads"] = out["total"] - out["backbone"] - out["neck"]
    return out
