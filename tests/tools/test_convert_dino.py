"""`vtrain convert --from idea-dino|detrex-dino|mmdet-dino` (vtrain/tools/convert.py, models/dino/adapters/) against
checkpoints and outputs of the peers' own code (tests/fixtures/<peer>/, made by tests/fixtures/make_dino_fixtures.py;
tests/fixtures/README.md): the converted checkpoint, loaded as `vtrain eval`/`predict` load it, gives the peer's
outputs on the peer's input, and each fix is needed (without it the outputs differ by more than 1).

Tolerance 1e-5 of the largest value of each output (`_close`; the outputs reach 2-10): fp32 rounding of the same
operations in another order (SDPA against the peers' explicit softmax in the Swin, grid_sample deformable
attention in both); measured up to 1.1e-5 absolute on the encoder memory and 2.1e-5 on logits of magnitude ~7. The encoder top-k has no near-ties (smallest gap between the k-th and the next logit,
meta.json near_ties: 1.2e-4 to 8.2e-4), so its indices must be equal; the post-processed top-100 has score gaps
down to 2.1e-6, under what rounding can move, so detections are matched as sets of (label, box) with their scores."""

import functools
import json
import re

import pytest
import torch
from safetensors.torch import load_file
from timm.models.swin_transformer import SwinTransformerBlock

from tests.helpers.paths import FIXTURES
from tests.helpers.peers import COCO_IDS, TINY
from vtrain.errors import VtrainError
from vtrain.models.dino import DINO, DinoOptions, postprocess
from vtrain.models.dino.adapters import detrex, idea, mmdet
from vtrain.models.formats import unwrap
from vtrain.models.swin_attention import SharedBiasSwinBlock
from vtrain.presets import DINO_PRESETS
from vtrain.io.safeio import load_published
from vtrain.tools import convert as conv

FIX = FIXTURES
TOL = 1e-5
# peer -> (checkpoint file, --from, its adapter; IDEA's with every class row, so its 91-row top-k is the peer's)
PEERS = {
    "idea": ("checkpoint.pth", "idea-dino", functools.partial(idea.from_idea, categories="source")),
    "detrex": ("model_final.pth", "detrex-dino", detrex.from_detrex),
    "mmdet": ("model.pth", "mmdet-dino", mmdet.from_mmdet),
}


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setitem(DINO_PRESETS, "peer-tiny", lambda: TINY)
    return monkeypatch


def _outputs(peer):
    return load_file(str(FIX / peer / "outputs.safetensors"))


def _state(peer):
    whole = load_published(FIX / peer / PEERS[peer][0])
    return unwrap(whole)[0], whole


def _convert(monkeypatch, tmp_path, peer, adapter=None, name="out"):
    """`vtrain convert FILE OUT --from SOURCE --model peer-tiny`, loaded as `vtrain eval` loads it."""
    from vtrain.tools.evaluate import load_model

    file, source, default = PEERS[peer]
    spec = conv.SOURCES[source]
    monkeypatch.setitem(conv.SOURCES, source, conv.Source(adapter or default, spec.preset, spec.task))
    out = tmp_path / name
    conv.convert(FIX / peer / file, out, source, "peer-tiny")
    return out, load_model(out, device=torch.device("cpu"))


def _run(model, x):
    """Backbone levels, neck levels, encoder memory, last decoder layer's hidden states, final logits and boxes."""
    seen = {}

    def keep(key, index):
        def hook(m, i, out):  # returns None: the module's output stays as it is; the last call's is kept (a
            seen[key] = out if index is None else i[index]  # shared head runs for every layer, the last last)
        return hook

    hooks = [model.encoder.register_forward_hook(keep("memory", None)),
             model.cls_head(model.preset.dec_layers - 1).register_forward_hook(keep("hidden", 0))]
    with torch.no_grad():
        feats = model.backbone(x)
        neck = model.neck(feats)
        out = model(x)
    for h in hooks:
        h.remove()
    return {"backbone": feats, "neck": neck, "memory": seen["memory"], "hidden": seen["hidden"], **out}


def _topk(model, memory, shapes, k):
    _, valid = model._proposals(memory, torch.zeros(memory.shape[:2], dtype=torch.bool), shapes)
    with torch.no_grad():
        return model._proposal_logits(memory, valid).max(-1)[0].topk(k, dim=1)[1]


def _diff(a, b):
    return (a - b).abs().max().item()


def _close(a, b):
    """Equal to 1e-5 of the largest value of the peer's output `b` (at least 1)."""
    return _diff(a, b) <= TOL * max(1.0, b.abs().max().item())


def _same_detections(det, o, labels_to_ids):
    """The peer's post-processed detections (det_*) as a set of (label, box) with their scores."""
    keep = (det["boxes"][:, 2] > det["boxes"][:, 0]) & (det["boxes"][:, 3] > det["boxes"][:, 1])  # detrex drops
    labels = torch.tensor([labels_to_ids[i] for i in det["labels"][keep].tolist()])  # empty boxes
    boxes, scores = det["boxes"][keep], det["scores"][keep]
    assert len(scores) == len(o["det_scores"]) and torch.allclose(scores, o["det_scores"], atol=TOL)
    used = set()
    for lab, box, s in zip(o["det_labels"].tolist(), o["det_boxes"], o["det_scores"]):
        cand = [j for j in range(len(labels)) if j not in used and labels[j] == lab
                and _diff(boxes[j], box) <= 1e-3 and abs(scores[j] - s) <= TOL]
        assert cand, (lab, box.tolist(), s.item())
        used.add(cand[0])


@pytest.mark.parametrize("peer", list(PEERS))
def test_converted_checkpoint_gives_the_peers_outputs(peer, tiny, tmp_path):
    o = _outputs(peer)
    out, loaded = _convert(tiny, tmp_path, peer)
    model = loaded.model
    r = _run(model, o["input"])
    for i, f in enumerate(r["backbone"]):
        assert _close(f, o[f"backbone.{i}"]), (i, _diff(f, o[f"backbone.{i}"]))
    for i, f in enumerate(r["neck"]):
        assert _close(f, o[f"neck.{i}"]), (i, _diff(f, o[f"neck.{i}"]))
    assert _close(r["memory"], o["memory"]), _diff(r["memory"], o["memory"])
    shapes = [tuple(s) for s in o["spatial_shapes"].tolist()]
    assert torch.equal(_topk(model, r["memory"], shapes, 30), o["enc_topk_indices"])
    assert _close(r["pred_logits"], o["pred_logits"]) and _close(r["pred_boxes"], o["pred_boxes"])
    # post-processing as the peer does it (IDEA: no clipping; detrex, mmdet: clipped to the image)
    det = postprocess(r["pred_logits"], r["pred_boxes"], o["orig_size"][None], top_k=100,
                      clip=model.options.clip_boxes)[0]
    # labels: IDEA's rows are COCO ids (the converted categories list ids 0..90); detrex's and mmdet's are the
    # contiguous index over the 80 categories, which the checkpoint's categories.json maps to COCO ids
    ids = [c["id"] for c in loaded.categories]
    assert ids == (list(range(91)) if peer == "idea" else COCO_IDS)
    _same_detections(det, o, ids if peer == "idea" else list(range(80)))


def test_idea_coco_categories_select_the_class_rows_by_id(tiny, tmp_path):
    """--from idea-dino (default categories): 80 classes whose rows are the file's rows at the COCO ids; on the
    peer's final hidden states the head gives the peer's logits at those ids. Rows taken in order (0..79, no id
    selection) give other logits: the negative case."""
    o = _outputs("idea")
    sd, _ = _state("idea")
    out, loaded = _convert(tiny, tmp_path, "idea", idea.from_idea)
    cats = json.loads((out / "checkpoints" / "step_0" / "categories.json").read_text())
    assert [c["id"] for c in cats] == COCO_IDS and cats[0] == {"id": 1, "name": "person"}
    w = loaded.model.state_dict()
    # the file's class head is shared by its 2 decoder layers: head 0, then the encoder's (shared_class_head)
    assert loaded.model.options.shared_class_head and len(loaded.model.cls_heads) == 2
    assert torch.equal(w["cls_heads.0.weight"], sd["class_embed.1.weight"][COCO_IDS])
    assert torch.equal(w["cls_heads.1.bias"], sd["transformer.enc_out_class_embed.bias"][COCO_IDS])
    assert torch.equal(w["label_embed.weight"][:80], sd["label_enc.weight"][COCO_IDS])
    assert not w["label_embed.weight"][80].any()  # vtrain's padding label
    _, exact = _convert(tiny, tmp_path, "idea", name="exact")
    hidden = _run(exact.model, o["input"])["hidden"]
    with torch.no_grad():
        assert _close(loaded.model.cls_head(1)(hidden), o["pred_logits"][..., COCO_IDS])
        in_order = torch.nn.functional.linear(hidden, sd["class_embed.1.weight"][:80], sd["class_embed.1.bias"][:80])
    assert _diff(in_order, o["pred_logits"][..., COCO_IDS]) > 1.0


def _model_with(options: dict, weights: dict, classes: int, timm_swin: bool = False) -> DINO:
    model = DINO(TINY, classes, options=DinoOptions(**options)).eval()
    if timm_swin:  # timm's classification Swin: shift first, then pad; no shift where one window covers the map
        for b in model.backbone.body.modules():
            if isinstance(b, SwinTransformerBlock):
                b.__class__, b.always_partition = SharedBiasSwinBlock, False
                b.window_size, b.shift_size = b._calc_window_shift((7, 7))
    model.load_state_dict({k: v for k, v in weights.items() if k in model.state_dict()})
    return model


def _options(conv_):
    return {k: v for k, v in conv_.model.items() if k in DinoOptions.__dataclass_fields__}


@pytest.mark.parametrize("peer,fix,change", [
    ("idea", "detection Swin (pad before the shift, shift in every odd block)", {"timm_swin": True}),
    ("mmdet", "detection Swin (pad before the shift, shift in every odd block)", {"timm_swin": True}),
    ("idea", "neck-conv bias", {"options": {"neck_bias": False}}),
    ("detrex", "neck-conv bias", {"options": {"neck_bias": False}}),
    ("idea", "sine temperature 20, offset 0", {"options": {"pos_temperature": 10000.0, "pos_offset": -0.5}}),
    ("detrex", "sine temperature 10000, offset -0.5", {"options": {"pos_temperature": 20.0, "pos_offset": 0.0}}),
    ("mmdet", "PatchMerging channel order", {"adapter": {"unfold_order": False}}),
])
def test_without_each_fix_the_outputs_differ(peer, fix, change):
    o = _outputs(peer)
    sd, whole = _state(peer)
    adapter = PEERS[peer][2]
    good = adapter(sd, whole)
    bad = adapter(sd, whole, **change["adapter"]) if "adapter" in change else good
    model = _model_with({**_options(good), **change.get("options", {})}, bad.tensors, good.num_classes,
                        change.get("timm_swin", False))
    assert _diff(_run(model, o["input"])["pred_logits"], o["pred_logits"]) > 1.0, fix
    model = _model_with(_options(good), good.tensors, good.num_classes)  # and with it, equal
    assert _close(_run(model, o["input"])["pred_logits"], o["pred_logits"])


@pytest.mark.parametrize("peer,copy,original", [
    ("idea", "transformer.decoder.class_embed.1.weight", "class_embed.1.weight"),
    ("detrex", "transformer.decoder.bbox_embed.0.layers.2.bias", "bbox_embed.0.layers.2.bias"),
])
def test_tied_heads_must_be_tied(peer, copy, original):
    sd, whole = _state(peer)
    sd = {**sd, copy: sd[original] + 1}
    with pytest.raises(VtrainError, match=f"differs from {original}"):
        PEERS[peer][2](sd, whole)


# the full-size key lists (tests/fixtures/<peer>_swinl_keys.json): entries, and how many are left out (tied head
# copies, index buffers)
FULL = {"idea": (722, 48 + 24 + 40), "detrex": (730, 56 + 24), "mmdet": (669, 24)}
# vtrain's swin-l: 650 tensors with a class and a box head per decoder layer; IDEA's shared heads (equal in every
# layer of the zero-filled list, as in its published files) are one: 5 x (2 + 6) fewer
OWN = {"idea": 610, "detrex": 650, "mmdet": 645}


@pytest.mark.parametrize("peer", list(FULL))
def test_full_size_swin_l_fills_every_tensor(peer):
    """Each peer's Swin-L 5-scale DINO key list: every tensor of vtrain's swin-l (with the peer's options) named, with
    its shape, and every entry read or deliberately left out."""
    keys = json.loads((FIX / f"{peer}_swinl_keys.json").read_text())["state_dict"]
    sd = {k: torch.empty(v, device="meta") for k, v in keys.items()}  # names and shapes: no memory
    for k in sd:  # the decoder's copies of the heads are the heads themselves, as in the peers' files
        if k.startswith(("transformer.decoder.class_embed.", "transformer.decoder.bbox_embed.")):
            sd[k] = sd[k[len("transformer.decoder."):]]
    if peer == "idea":  # IDEA's shared heads: one module under every layer's name, so one tensor (torch.save ties)
        for k in sd:
            m = re.fullmatch(r"((?:transformer\.decoder\.)?(?:class|bbox)_embed)\.(\d+)\.(.+)", k)
            if m and m.group(2) != "0":
                sd[k] = sd[f"{m.group(1)}.0.{m.group(3)}"]
    c = {"idea": idea.from_idea, "detrex": detrex.from_detrex, "mmdet": mmdet.from_mmdet}[peer](sd, None)
    assert c.model["preset"] == "swin-l" and c.model["num_queries"] == 900
    with torch.device("meta"):
        own = DINO("swin-l", 80, num_queries=900, options=DinoOptions(**_options(c))).state_dict()
    conv.check_fill(own, c.tensors, "swin-l")
    assert len(c.tensors) == len(own) == OWN[peer]
    assert len(sd) == FULL[peer][0] and len(c.unused) == FULL[peer][1]
    assert c.read | set(c.unused) == set(sd)
    del c.tensors["level_embed"]
    with pytest.raises(VtrainError, match=f"leaves 1 of the model's {len(own)} tensors empty: level_embed"):
        conv.check_fill(own, c.tensors, "swin-l")


def test_wrong_preset_and_wrong_source_are_one_line(tmp_path):
    with pytest.raises(VtrainError, match="--model swin-l: the converted file leaves .* tensors empty"):
        conv.convert(FIX / "idea" / "checkpoint.pth", tmp_path / "x", "idea-dino", "swin-l")
    with pytest.raises(VtrainError, match="use --from mmdet-dino"):
        conv.convert(FIX / "mmdet" / "model.pth", tmp_path / "y", "detrex-dino", "swin-l")
    assert not any(tmp_path.iterdir())  # nothing half-written


def test_converted_weights_are_what_pretrained_reads(tiny, tmp_path):
    out, loaded = _convert(tiny, tmp_path, "detrex")
    from vtrain.models.backbones import read_state_dict

    sd = read_state_dict(out / "checkpoints" / "step_0" / "model.safetensors")
    assert set(sd) == set(loaded.model.state_dict())


@pytest.mark.slow  # an 800 x 800 image through a 256-d DINO on CPU, twice
def test_predict_on_a_converted_checkpoint_gives_coco_category_ids(tiny, tmp_path):
    """`vtrain predict` on a converted detrex checkpoint (80 contiguous class rows): its detections are those of the
    converted model (run here on the same input: an 800 x 800 image, which the test-time resize and the batch
    padding leave as it is), with each label written as its real COCO category id."""
    from torchcodec.encoders import PngEncoder

    from vtrain.data.coco import normalize
    from vtrain.tools.predict import predict

    out, loaded = _convert(tiny, tmp_path, "detrex")
    torch.manual_seed(0)
    image = torch.randint(0, 256, (3, 800, 800), dtype=torch.uint8)
    PngEncoder(image).to_file(tmp_path / "img.png")
    predict(out, [str(tmp_path / "img.png")], tmp_path / "pred", score_threshold=0.0, num_workers=0, batch_size=1)
    got = json.loads((tmp_path / "pred" / "predictions.json").read_text())
    with torch.no_grad():
        r = loaded.model(normalize(image.clone())[None])
    want = postprocess(r["pred_logits"], r["pred_boxes"], torch.tensor([[800, 800]]),
                       clip=loaded.model.options.clip_boxes)[0]
    assert len(got) == len(want["scores"]) == 300
    assert [d["category_id"] for d in got] == [COCO_IDS[i] for i in want["labels"].tolist()]
    assert torch.allclose(torch.tensor([d["score"] for d in got]), want["scores"], atol=1e-5)
    assert {d["category_id"] for d in got} <= set(COCO_IDS)


@pytest.mark.parametrize("peer", list(PEERS))
def test_each_peers_file_is_recognised_as_its_format(peer):
    from vtrain.models.formats import detect

    sd, _ = _state(peer)
    assert detect(sd) == PEERS[peer][1]
    keys = json.loads((FIX / f"{peer}_swinl_keys.json").read_text())["state_dict"]
    assert detect(keys) == PEERS[peer][1]  # the full-size Swin-L files too
