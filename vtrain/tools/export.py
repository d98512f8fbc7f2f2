"""`vtrain export`: a checkpoint as one ONNX model, checked with onnxruntime against PyTorch before it is kept.

- metric: the embedding network (backbone + neck, no margin head). The graph takes `input`: float32 N x 3 x S x S,
  RGB, normalised as in training (x / 127.5 - 1, i.e. mean 127.5 and std 127.5 per channel on 0..255 pixels; S =
  the run's --image-size, 112 for faces) with a dynamic batch axis, and returns `embedding`: N x D, not
  L2-normalised (normalise before taking cosine similarities).
- dino: the detector with a dynamic batch and image size, post-processing inside the graph (or raw outputs), one
  of two exportable deformable-attention paths (tools/export_detection.py).
The facts a deployment needs (inputs, normalisation, outputs; for a detector the padding multiple, the test resize
and the categories) are written into the model's metadata_props, so it can read them instead of guessing.

Exporter: torch.onnx's default since torch 2.9, the torch.export-based ("dynamo") one. It needs the `onnxscript`
package (a pure-Python PyPI dependency, offline once installed). The TorchScript exporter (`dynamo=False`) also
works offline without it but is deprecated and warns on every call, so it is not used. Opset 18 is the lowest
this exporter writes (onnxruntime reads it from 1.14 on). The highest is read from the installed libraries
(`supported_opsets`): the exporter writes torchlib's opset and converts it with onnxscript's version converter,
whose range is narrower than onnx's own (onnxscript 0.7: 18..25, onnx 1.23: up to 28); beyond it the exporter falls
back to onnx's C converter, which leaves an invalid model (attention nodes at the old version).

The output (and its `.data` file) is refused when it exists, unless `--overwrite`, and never written into a
checkpoint (vtrain/io/guarded.py). It is written, checked and verified in a fresh hidden folder beside it, then renamed
into place: a failed check leaves nothing behind, and a link at the target is replaced, never written through.
"""

from __future__ import annotations

import os
import shutil
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vtrain.io import guarded
from vtrain.engine.checkpoint import format as ckpt
from vtrain.engine.logging import console
from vtrain.errors import VtrainError
from vtrain.models.dino.msda_onnx import LOWERINGS
from vtrain.tasks.dino import chosen_test_sizes
from vtrain.tools.evaluate import checkpoint_task, load_model
from vtrain.tools import export_detection as det
from vtrain.tools.export_detection import TOP_K
from vtrain.tools.onnx_detector import session

OPSET = 18
INPUT, OUTPUT = "input", "embedding"
# the normalisation of vtrain.data.faces.to_model_input, written into the model for its users
MEAN = STD = 127.5
PROTOBUF_LIMIT = 2 * 2**30  # one ONNX file holds < 2 GiB


class EmbeddingNet(nn.Module):
    """The inference path of MetricModel (`embed`): backbone -> neck."""

    def __init__(self, backbone: nn.Module, neck: nn.Module) -> None:
        super().__init__()
        self.backbone, self.neck = backbone, neck

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002  (the graph input's name)
        return self.neck(self.backbone(input))


@dataclass
class ExportReport:
    path: Path
    checkpoint: Path
    params: int
    external_data: bool
    task: str = "metric"
    weights: str = "model"
    """Which weights were exported: ema (ema.safetensors) or model."""
    image_size: int | None = None
    """metric: the input's side."""
    embedding_dim: int | None = None
    max_abs_diff: float | None = None
    """metric: onnxruntime vs PyTorch on a random batch of 3, one the export did not trace (None when not
    verified)."""
    checks: list[Any] | None = None
    """dino: the verification runs (export_detection.Check), None when not verified."""
    meta: dict[str, str] | None = None
    """The metadata written into the model."""


DETECTION_ONLY = (("raw", "--raw"), ("msda", "--msda"), ("top_k", "--top-k"))


def export_onnx(checkpoint: str | Path, out: str | Path, opset: int = OPSET, verify: bool = True,
                overwrite: bool = False, weights: str | None = None, raw: bool | None = None,
                msda: str | None = None, top_k: int | None = None) -> ExportReport:
    """Export the checkpoint's model by its task. `weights`: ema, model or None (EMA when the checkpoint has it).
    Detection only: `raw` (logits and boxes instead of the top-k detections), `msda` (grid-sample or gather),
    `top_k` (detections per image, default 300)."""
    out = Path(out)
    if out.suffix != ".onnx":
        raise VtrainError(f"output {out}: the file name must end in .onnx")
    if msda is not None and msda not in LOWERINGS:
        raise VtrainError(f"--msda: choose {' or '.join(LOWERINGS)}, got {msda!r}")
    if top_k is not None and not 1 <= top_k <= 100_000:
        raise VtrainError(f"--top-k: must be in 1..100000, got {top_k}")
    if raw and top_k is not None:
        raise VtrainError("--top-k: the raw outputs (--raw) keep every query; give one of the two")
    data = out.with_name(out.name + ".data")  # the weights of a model of >= 2 GiB (protobuf's limit)
    low, high = supported_opsets()
    if not low <= opset <= high:
        raise VtrainError(f"--opset {opset}: the installed exporter writes opsets {low} to {high} (torch's "
                          "torch.export-based exporter, onnx and onnxscript's version converter)")
    guarded.claim_output([out, data], overwrite, "OUT", ckpt.inside_checkpoint)
    task = checkpoint_task(checkpoint, "CHECKPOINT")
    if task != "dino":
        given = {"raw": raw, "msda": msda, "top_k": top_k}
        for key, flag in DETECTION_ONLY:
            if given[key] is not None:
                raise VtrainError(f"{flag}: only for detection (DINO) checkpoints; {checkpoint} is a {task} one")
        return _export_embedding(checkpoint, out, data, opset, verify, weights)
    return _export_detector(checkpoint, out, data, opset, verify, weights, bool(raw), msda or "grid-sample",
                            TOP_K if top_k is None else top_k)


def _export_embedding(checkpoint, out: Path, data: Path, opset: int, verify: bool,
                      weights: str | None) -> ExportReport:
    loaded = load_model(checkpoint, "metric", torch.device("cpu"), flag="CHECKPOINT", weights_choice=weights)
    path, cfg, model = loaded.path, loaded.cfg, loaded.model
    net = EmbeddingNet(model.backbone, model.neck).eval()
    size, dim = cfg.model.image_size, cfg.model.embedding_dim
    params = sum(p.numel() for p in net.parameters())
    external = params * 4 >= PROTOBUF_LIMIT
    example = torch.randn(2, 3, size, size)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the exporter's own chatter (deprecations inside torch.export)
        try:
            program = torch.onnx.export(net, (example,), dynamo=True, input_names=[INPUT], output_names=[OUTPUT],
                                        dynamic_shapes={"input": {0: torch.export.Dim("batch")}},
                                        opset_version=opset, verbose=False)
        except Exception as e:
            raise VtrainError(f"ONNX export of {path} failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}") \
                from None
    meta = {"vtrain.checkpoint": f"{path.parent.parent.name}/{path.name}", "vtrain.preset": cfg.model.preset,
            "vtrain.task": "metric", "vtrain.weights": loaded.weights,
            "input_name": INPUT, "input_shape": f"N,3,{size},{size}", "input_color": "RGB",
            "input_normalization": f"x / {MEAN} - 1 on 0..255 pixels (mean {MEAN}, std {STD} per channel)",
            "mean": f"{MEAN},{MEAN},{MEAN}", "std": f"{STD},{STD},{STD}", "output_name": OUTPUT,
            "embedding_dim": str(dim), "embedding_normalized": "false (L2-normalise before cosine similarity)"}
    program.model.metadata_props.update(meta)
    diff = _stage(program, out, data, external, path, opset, (lambda f: _verify(f, net, size)) if verify else None)
    return ExportReport(out, path, params, external, "metric", loaded.weights, size, dim, diff, meta=meta)


def _export_detector(checkpoint, out: Path, data: Path, opset: int, verify: bool, weights: str | None, raw: bool,
                     msda: str, top_k: int) -> ExportReport:
    loaded = load_model(checkpoint, "dino", torch.device("cpu"), flag="CHECKPOINT", weights_choice=weights)
    path, cfg, model = loaded.path, loaded.cfg, loaded.model
    categories = loaded.categories or [{"id": i, "name": f"class {i}"} for i in range(model.num_classes)]
    graph = det.DetectorGraph(model, raw, top_k, cfg.model.clip_boxes).eval()
    params = sum(p.numel() for p in model.parameters())
    external = params * 4 >= PROTOBUF_LIMIT
    console.print(f"tracing {path} ({params:,} parameters) with a dynamic batch and image size (the deformable "
                  f"attention's {msda} path); this takes minutes for a large model", soft_wrap=True)
    try:
        program = det.trace(graph, opset, msda)
    except Exception as e:
        raise VtrainError(f"ONNX export of {path} failed: {det.failure(e)}") from None
    meta = {"vtrain.checkpoint": f"{path.parent.parent.name}/{path.name}", "vtrain.preset": cfg.model.preset,
            "vtrain.weights": loaded.weights,
            **det.metadata(graph, categories, chosen_test_sizes(None, None, cfg.model.image_size,
                                                                loaded.saved_data.get("max_size")), msda)}
    program.model.metadata_props.update(meta)
    checks = _stage(program, out, data, external, path, opset, (lambda f: det.verify(f, graph)) if verify else None)
    return ExportReport(out, path, params, external, "dino", loaded.weights, checks=checks, meta=meta)


def _stage(program, out: Path, data: Path, external: bool, source: Path, opset: int,
           check: Callable[[Path], Any] | None) -> Any:
    """Write the model (and its .data file) under their final names in a fresh folder beside `out` (the model
    refers to its .data file by name), check it there (onnx's checker, then `check`), then rename it over the
    targets: a failed check leaves nothing behind. Returns what `check` returned."""
    work = out.parent / f".{out.name}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        with guarded.disk_op("write", out):
            work.mkdir(parents=True)
            program.save(work / out.name, external_data=external)
        import onnx

        try:
            onnx.checker.check_model(str(work / out.name))
        except onnx.checker.ValidationError as e:
            raise VtrainError(f"ONNX export of {source} at opset {opset} is not a valid model: "
                              f"{str(e).strip().splitlines()[0][:300]}") from None
        result = check(work / out.name) if check is not None else None
        with guarded.disk_op("write", out):
            if os.path.lexists(data) and not (work / data.name).exists():
                data.unlink()  # an earlier export's weights file: this model has none
            for f in (work / data.name, work / out.name):  # the weights first: the model never points to nothing
                if f.exists():
                    os.replace(f, out.parent / f.name)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return result


def supported_opsets() -> tuple[int, int]:
    """The ai.onnx opsets the installed exporter writes: from torch's exporter minimum to the lowest of onnx's newest
    opset and onnxscript's version converter maximum (read from the libraries, so an upgrade widens it)."""
    try:
        import onnx.defs
        import onnxscript  # noqa: F401  (the torch.export-based exporter's op library)
    except ImportError as e:
        raise VtrainError(f"vtrain export needs the `{e.name}` package: pip install onnx onnxscript onnxruntime") \
            from None
    low, high = OPSET, onnx.defs.onnx_opset_version()
    try:  # not re-exported by onnxscript: read where it is defined, and go without it if it moves
        from onnxscript.version_converter import _version_converter as converter

        low = max(low, int(converter.SUPPORTED_MIN_ONNX_OPSET))
        high = min(high, int(converter.SUPPORTED_MAX_ONNX_OPSET))
    except (ImportError, AttributeError, TypeError, ValueError):
        pass
    return low, high


def _verify(out: Path, net: nn.Module, size: int) -> float:
    """Run the file with onnxruntime on a batch the export did not see and compare with PyTorch."""
    x = torch.rand(3, 3, size, size, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.no_grad():
        ref = net(x).numpy()
    got = session(out, "export --verify").run([OUTPUT], {INPUT: x.numpy()})[0]
    diff = float(abs(got - ref).max())
    scale = float(abs(ref).max()) or 1.0
    if diff > 1e-3 * scale + 1e-4:
        raise VtrainError(f"{out}: onnxruntime output differs from PyTorch by {diff:.3g} (max |y| {scale:.3g}); "
                          "the export is not faithful")
    return diff
