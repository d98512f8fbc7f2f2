"""`vtrain export` of a DINO checkpoint (tools/export_detection.py): one export of a small DINO checkpoint, checked
by onnxruntime against PyTorch on batches of 1 and 4 at two sizes (one not a multiple of 32), then run at sizes the
export did not trace (one with fewer encoder tokens than queries), and by `vtrain predict --onnx` against the
PyTorch predict path; the comparison rules; the deformable-attention paths as ONNX graphs; a failed check leaves
nothing behind.

The checkpoint's model is debug-resnet's DINO (ResNet-10-T, 64-d, 2+2 layers, 100 queries) read at two levels
instead of four: the backbone's stride-32 stage and one extra stride-2 level (`PRESET`). The export's cost is
torch.export's symbolic shapes and onnxscript's optimizer over the graph, most of it per feature level: two levels
trace in about 0.6x the CPU time of four, while keeping every kind of level (a backbone one and an extra
convolution one, whose size is the ceiling of an odd half at 352 px wide and at 223 px high)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from vtrain.errors import VtrainError
from vtrain.models.dino.msda import auto_impl, ms_deform_attn
from vtrain.models.dino.msda_onnx import LOWERINGS
from vtrain.presets import DINO_PRESETS
from vtrain.tools import export_detection as det
from vtrain.tools.export import export_onnx
from vtrain.tools.onnx_detector import session

CATEGORIES = [{"id": 1, "name": "red"}, {"id": 3, "name": "blue"}, {"id": 7, "name": "dark green"}]


PRESET = "test-export-2level"  # registered for this module only (the `preset` fixture)
QUERIES = 100


def detections(height: int, width: int) -> int:
    """Detections per image of the exported graph at a padded batch of `height` x `width`: 3 classes x the queries
    it selects, at most one per encoder token (levels at strides 32 and 64 of the size padded to 32)."""
    h, w = -(-height // 32), -(-width // 32)
    return 3 * min(QUERIES, h * w + -(-h // 2) * -(-w // 2))


@pytest.fixture(scope="module")
def preset():
    """debug-resnet's DINO at two feature levels (the module docstring), as a preset name a checkpoint can carry."""
    two_levels = dataclasses.replace(DINO_PRESETS["debug-resnet"](), out_indices=(4,), levels=2, queries=QUERIES,
                                     description="debug-resnet at strides 32 and 64 (export tests)")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(DINO_PRESETS, PRESET, lambda: two_levels)
        yield PRESET


@pytest.fixture(scope="module")
def run(preset, tmp_path_factory) -> Path:
    """A run directory of the `preset` model (128 px test size, 3 classes) with seeded weights, written as
    `vtrain convert` writes one: a complete, verified checkpoint without a training run."""
    from vtrain.config import build_config
    from vtrain.tasks import build_model
    from vtrain.tools.convert import write

    out = tmp_path_factory.mktemp("export") / "run"
    cfg = build_config("dino", overrides={"model": {"preset": preset, "image_size": 128},
                                          "train": {"output_dir": str(out)}})
    torch.manual_seed(0)
    model = build_model("dino", cfg.model, len(CATEGORIES))
    assert model.levels == 2 and model.num_queries == QUERIES
    write(out, False, cfg, model.state_dict(), CATEGORIES, {"source": "test", "file": "-"})
    return out


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory):
    """The export (with its onnxruntime check), and PyTorch's graph of the same checkpoint."""
    from vtrain.tools.evaluate import load_model

    out = tmp_path_factory.mktemp("onnx") / "dino.onnx"
    report = export_onnx(run, out)
    model = load_model(run, "dino", torch.device("cpu")).model
    return report, out, det.DetectorGraph(model).eval()


def test_export_is_checked_on_batches_and_sizes_and_documents_itself(exported, run):
    import onnx

    report, out, _ = exported
    assert out.is_file() and report.task == "dino" and report.weights == "model"
    assert [(c.batch, c.height, c.width) for c in report.checks] == [(1, 256, 352), (4, 256, 352), (1, 223, 301),
                                                                       (4, 223, 301)]
    assert 223 % 32 and 301 % 32 and (256, 352) != det.TRACE[1:]  # one size not a multiple of 32, none traced
    for c in report.checks:
        assert c.detections == c.batch * detections(c.height, c.width)  # 223 x 301: 90 tokens, 90 queries
        assert c.score_diff <= det.SCORE_TOL and c.box_diff <= det.BOX_TOL_PX + det.BOX_TOL_REL * 352
    m = onnx.load(str(out))
    meta = {p.key: p.value for p in m.metadata_props}
    assert json.loads(meta["categories"]) == CATEGORIES
    assert meta["mean"] == "0.485,0.456,0.406" and meta["std"] == "0.229,0.224,0.225"
    assert meta["pad_multiple"] == "32" and meta["test_size"] == "128,213" and meta["output_convention"] == "topk"
    assert meta["vtrain.checkpoint"] == "run/step_0" and meta["vtrain.weights"] == "model"
    assert [i.name for i in m.graph.input] == ["images", "image_sizes"]
    assert [o.name for o in m.graph.output] == ["scores", "labels", "boxes"]
    dims = [[d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in m.graph.input]
    assert all(isinstance(d, str) for d in (dims[0][0], dims[0][2], dims[0][3], dims[1][0]))  # N, H, W symbolic
    assert dims[0][1] == 3 and dims[1][1] == 2


@pytest.mark.parametrize("batch,height,width", [(1, 64, 64), (3, 97, 130)])
def test_sizes_the_export_did_not_trace(exported, batch, height, width):
    """64 x 64 pads to 64 x 64: 2x2 + 1 = 5 encoder tokens, fewer than the 100 queries, so the graph selects 5
    queries and returns 5 x 3 detections; 97 x 130 pads to 128 x 160 inside the graph (levels of 4x5 and 2x3)."""
    _, out, graph = exported
    images, sizes, want, ties = det.reference(graph, batch, height, width)
    assert not ties
    got = session(out, "test").run(None, {"images": images.numpy(), "image_sizes": sizes.numpy()})
    det.compare_top(got, want, "test", batch, height, width)
    assert got[0].shape == (batch, detections(height, width)) == (batch, 15 if height == 64 else 78)  # 5, 26 tokens
    assert got[1].max() < 3 and got[2][..., 2:].max() <= 2 * width  # labels index the 3 categories; pixels


def test_predict_onnx_equals_predict_with_the_checkpoint(exported, run, tmp_path):
    """The same images, batches and drawing through both routes: the same COCO JSON within the check's
    tolerances (boxes in original pixels), and the same drawn images."""
    from vtrain.tools.predict import predict, predict_detection

    _, out, graph = exported
    rng = np.random.default_rng(0)
    for name, (h, w) in {"a.png": (96, 130), "b.png": (150, 101), "c.png": (77, 77)}.items():
        pixels = rng.integers(0, 255, (h, w, 3), dtype=np.uint8)
        pixels[h // 4: h // 2, w // 3: w // 2] = (220, 40, 40)  # a block to find
        Image.fromarray(pixels).save(tmp_path / name)
    images = [str(tmp_path / n) for n in ("a.png", "b.png", "c.png")]
    options = {"score_threshold": 0.0, "batch_size": 2, "num_workers": 0}
    torch_report = predict_detection(run, images, tmp_path / "torch", **options)
    onnx_report = predict(None, images, tmp_path / "onnx", onnx=out, **options)
    assert onnx_report.images == torch_report.images == 3 and onnx_report.test_size == torch_report.test_size
    want = json.loads((tmp_path / "torch" / "predictions.json").read_text())
    got = json.loads((tmp_path / "onnx" / "predictions.json").read_text())
    # per image, 3 x the queries its padded batch's tokens allow (a and b share one, c is alone)
    assert len(got) == len(want) == 2 * detections(190, 173) + detections(128, 128)
    for image_id in (1, 2, 3):
        w = [d for d in want if d["image_id"] == image_id]
        g = [d for d in got if d["image_id"] == image_id]
        as_arrays = [lambda ds: np.array([[d["score"] for d in ds]], dtype=np.float32),
                     lambda ds: np.array([[d["category_id"] for d in ds]]),
                     lambda ds: np.array([[d["bbox"] for d in ds]], dtype=np.float32)]
        # boxes as xywh in original pixels (at most 150 px here); the tolerance is the export check's
        det.compare_top([f(g) for f in as_arrays], [f(w) for f in as_arrays], f"image {image_id}", 1, 150, 150)
        assert {d["file_name"] for d in g} == {d["file_name"] for d in w}
    for name in ("a.jpg", "b.jpg", "c.jpg"):
        a = np.asarray(Image.open(tmp_path / "torch" / name))
        b = np.asarray(Image.open(tmp_path / "onnx" / name))
        assert a.shape == b.shape and (a != b).any(-1).mean() < 0.01


def test_comparison_rules():
    """compare_top: a swap inside a run of near-equal scores passes; a different box, label or score fails; at
    the top-k cut a near-equal detection may be missing from either side."""
    scores = np.array([[0.9, 0.5, 0.50005, 0.2, 0.1]], dtype=np.float32)
    labels = np.array([[0, 1, 2, 0, 1]])
    boxes = np.arange(20, dtype=np.float32).reshape(1, 5, 4) * 10
    want = [scores, labels, boxes]
    swapped = [x[:, [0, 2, 1, 3, 4]] for x in want]
    assert det.compare_top(swapped, want, "t", 1, 100, 100).box_diff == 0.0
    for i, change in enumerate((lambda g: g[2].__setitem__((0, 3, 0), 31.0),  # a box 1 px off
                                lambda g: g[1].__setitem__((0, 0), 2),  # another label
                                lambda g: g[0].__setitem__((0, 3), 0.2003))):  # a score 3e-4 off
        got = [x.copy() for x in want]
        change(got)
        with pytest.raises(VtrainError, match="not faithful"):
            det.compare_top(got, want, "t", 1, 100, 100)
    box = np.array([[[1, 1, 5, 5], [2, 2, 6, 6], [3, 3, 7, 7], [4, 4, 8, 8]]], dtype=np.float32)
    cut = [np.array([[0.9, 0.3, 0.10001, 0.1]], dtype=np.float32), np.array([[0, 1, 1, 2]]), box]
    # onnxruntime ranks PyTorch's last two the other way round and its own 5th (0.09999) above PyTorch's 3rd
    other = [np.array([[0.9, 0.3, 0.1, 0.09999]], dtype=np.float32), np.array([[0, 1, 2, 0]]),
             np.concatenate([box[:, :2], box[:, 3:], box[:, :1] + 50], 1)]
    det.compare_top(other, cut, "t", 1, 100, 100)
    with pytest.raises(VtrainError, match="rank 1"):  # away from the cut, a missing detection is an error
        det.compare_top([other[0], np.array([[0, 2, 2, 0]]), other[2]], cut, "t", 1, 100, 100)


class _Attention(nn.Module):
    """ms_deform_attn over two levels whose sizes come from the inputs' shapes (dynamic in the export)."""

    def forward(self, level0, level1, loc, attn):
        shapes = [tuple(level0.shape[1:3]), tuple(level1.shape[1:3])]
        value = torch.cat([level0.flatten(1, 2), level1.flatten(1, 2)], 1)  # (B, S, M, D)
        return ms_deform_attn(value, shapes, loc, attn)


@pytest.mark.parametrize("msda", ["grid-sample", "gather"])
def test_deformable_attention_paths_as_onnx_graphs(msda, tmp_path):
    """Each exportable path of deformable attention as a graph with dynamic level sizes, run by onnxruntime at
    sizes it did not trace (non-square, odd, locations outside [0, 1]) against the PyTorch reference; the gather
    graph has no GridSample."""
    import onnx

    gen = torch.Generator().manual_seed(0)

    def inputs(h0, w0, q):
        b, m, d = 2, 2, 8
        return (torch.randn(b, h0, w0, m, d, generator=gen), torch.randn(b, (h0 + 1) // 2, (w0 + 1) // 2, m, d,
                                                                         generator=gen),
                torch.rand(b, q, m, 2, 3, 2, generator=gen) * 1.4 - 0.2,
                torch.rand(b, q, m, 2, 3, generator=gen).softmax(-1))

    dyn = torch.export.Dim.DYNAMIC
    shapes = {"level0": {1: dyn, 2: dyn}, "level1": {1: dyn, 2: dyn}, "loc": {1: dyn}, "attn": {1: dyn}}
    with torch.no_grad(), auto_impl("export"):
        program = torch.onnx.export(_Attention().eval(), inputs(6, 10, 7), dynamo=True, dynamic_shapes=shapes,
                                    input_names=["level0", "level1", "loc", "attn"], verbose=False,
                                    custom_translation_table={torch.ops.vtrain.ms_deform_attn_export.default:
                                                              LOWERINGS[msda]})
    program.save(tmp_path / "msda.onnx")
    ops = {n.op_type for n in onnx.load(str(tmp_path / "msda.onnx")).graph.node}
    assert ("GridSample" in ops) == (msda == "grid-sample")
    sess = session(tmp_path / "msda.onnx", "test")
    for h0, w0, q in ((5, 9, 11), (13, 4, 3)):
        x = inputs(h0, w0, q)
        with torch.no_grad():
            want = _Attention()(*x).numpy()
        got = sess.run(None, {k: v.numpy() for k, v in zip(("level0", "level1", "loc", "attn"), x)})[0]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_failed_check_leaves_nothing_behind(run, tmp_path, monkeypatch):
    """A graph that fails the onnxruntime check: one error line, no file at OUT, no staging folder. (The trace is
    stood in for by a tiny graph: the staging and the check's verdict are what is tested.)"""
    tiny = torch.onnx.export(nn.Linear(3, 2).eval(), (torch.randn(1, 3),), dynamo=True, verbose=False)
    monkeypatch.setattr(det, "trace", lambda *a: tiny)

    def fails(path, graph):
        raise VtrainError(f"{path.name}: onnxruntime on a batch of 4 at 223 x 301: ... the export is not faithful")

    monkeypatch.setattr(det, "verify", fails)
    out = tmp_path / "m.onnx"
    with pytest.raises(VtrainError, match="not faithful"):
        export_onnx(run, out)
    assert list(tmp_path.iterdir()) == []
    for args, match in (({"msda": "cuda"}, "--msda: choose grid-sample or gather"), ({"top_k": 0}, "--top-k"),
                        ({"raw": True, "top_k": 5}, "--top-k: the raw outputs")):
        with pytest.raises(VtrainError, match=match):
            export_onnx(run, out, **args)
