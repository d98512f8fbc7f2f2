"""Multi-scale deformable attention as ONNX operators: the two lowerings of the op `vtrain::ms_deform_attn_export`
(msda.py) that `vtrain export` writes into a graph (tools/export_detection.py, torch.onnx's custom translation
table; ONNX Script, opset 18).

- `grid_sample`: per level one ONNX GridSample (bilinear, zeros padding, align_corners=0) on the level's
  (B*M, D, h, w) map, as the PyTorch reference computes it (msda.ms_deform_attn_pytorch, docs/dino.md §3);
  onnxruntime runs it from opset 16.
- `gather`: the same bilinear sampling from index arithmetic and GatherElements, no GridSample: the 4 neighbours of
  x = loc_x * w - 0.5, y = loc_y * h - 0.5, each weighted bilinearly and by the attention weight, a neighbour
  outside the map adding nothing (the CUDA op's convention, docs/msda_kernels.md §1.2). For runtimes whose ONNX
  parser lacks GridSample (TensorRT's, for one); vtrain checks it with onnxruntime only.

The level sizes arrive as the exporter passes a `SymInt[]`: a Python int where the size was static, a 0-d INT64
value computed in the graph where it was symbolic; heads, channels, levels and points are static.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from onnxscript import FLOAT, INT64
from onnxscript import opset18 as op


def _ints(*values: int) -> Any:
    return op.Constant(value_ints=list(values))


def _one(size: Any) -> Any:
    """A level size as a 1-d INT64 tensor of one element."""
    return _ints(size) if isinstance(size, int) else op.Reshape(size, _ints(1))


def _levels(value: Any, spatial_shapes: Sequence[Any]) -> list[tuple[Any, Any, Any]]:
    """(h, w, the level's rows of value (B, h*w, M, D)) per level; h and w 1-d INT64."""
    out, start = [], _ints(0)
    for h, w in zip(spatial_shapes[0::2], spatial_shapes[1::2]):
        h, w = _one(h), _one(w)
        end = op.Add(start, op.Mul(h, w))
        out.append((h, w, op.Slice(value, start, end, _ints(1))))
        start = end
    return out


def _per_head(x: Any, level: int, rows: Any, tail: Sequence[int], locations: bool) -> Any:
    """loc (B, Q, M, L, P, 2) (`locations`) or weights (B, Q, M, L, P) -> one level's (B*M, rows, *tail)."""
    x = op.Gather(x, op.Constant(value_int=level), axis=3)  # (B, Q, M, P[, 2])
    x = op.Transpose(x, perm=[0, 2, 1, 3, 4] if locations else [0, 2, 1, 3])  # (B, M, Q, P[, 2])
    return op.Reshape(x, op.Concat(_ints(-1), rows, _ints(*tail), axis=0))


def _finish(out: Any, value: Any, queries: Any, heads: int, dim: int) -> Any:
    """(B*M, D, Q) -> (B, Q, M*D)."""
    batch = op.Shape(value, start=0, end=1)
    return op.Transpose(op.Reshape(out, op.Concat(batch, _ints(heads * dim), queries, axis=0)), perm=[0, 2, 1])


def grid_sample(value: Any, spatial_shapes: Sequence[Any], loc: Any, attn: Any) -> Any:
    """value (B, S, M, D), loc (B, Q, M, L, P, 2), attn (B, Q, M, L, P) -> (B, Q, M*D): GridSample per level."""
    heads, dim, points = value.shape[2], value.shape[3], loc.shape[4]
    queries = op.Shape(loc, start=1, end=2)
    grids = op.Sub(op.Mul(loc, op.Constant(value_float=2.0)), op.Constant(value_float=1.0))  # [-1, 1]
    out = None
    for lvl, (h, w, rows) in enumerate(_levels(value, spatial_shapes)):
        v = op.Reshape(op.Transpose(rows, perm=[0, 2, 3, 1]), op.Concat(_ints(-1, dim), h, w, axis=0))  # BM,D,h,w
        g = _per_head(grids, lvl, queries, (points, 2), True)  # (B*M, Q, P, 2)
        sampled = op.GridSample(v, g, mode="bilinear", padding_mode="zeros", align_corners=0)  # (B*M, D, Q, P)
        a = op.Unsqueeze(_per_head(attn, lvl, queries, (points,), False), _ints(1))  # (B*M, 1, Q, P)
        part = op.ReduceSum(op.Mul(sampled, a), _ints(-1), keepdims=0)  # (B*M, D, Q)
        out = part if out is None else op.Add(out, part)
    return _finish(out, value, queries, heads, dim)


def gather(value: Any, spatial_shapes: Sequence[Any], loc: Any, attn: Any) -> Any:
    """As `grid_sample`, with the 4 neighbours of every sample gathered by index (GatherElements)."""
    heads, dim, points = value.shape[2], value.shape[3], loc.shape[4]
    queries = op.Shape(loc, start=1, end=2)
    samples = op.Mul(queries, _ints(points))
    zero, one, half = (op.Constant(value_float=x) for x in (0.0, 1.0, 0.5))
    out = None
    for lvl, (h, w, rows) in enumerate(_levels(value, spatial_shapes)):
        v = op.Reshape(op.Transpose(rows, perm=[0, 2, 1, 3]), op.Concat(_ints(-1), op.Mul(h, w), _ints(dim),
                                                                         axis=0))  # (B*M, h*w, D)
        xy = _per_head(loc, lvl, samples, (2,), True)  # (B*M, Q*P, 2)
        hf, wf = op.Cast(op.Squeeze(h), to=FLOAT.dtype), op.Cast(op.Squeeze(w), to=FLOAT.dtype)
        x = op.Sub(op.Mul(op.Gather(xy, op.Constant(value_int=0), axis=2), wf), half)
        y = op.Sub(op.Mul(op.Gather(xy, op.Constant(value_int=1), axis=2), hf), half)
        a = _per_head(attn, lvl, samples, (), False)  # (B*M, Q*P)
        x0, y0 = op.Floor(x), op.Floor(y)
        fx, fy = op.Sub(x, x0), op.Sub(y, y0)
        gx, gy = op.Sub(one, fx), op.Sub(one, fy)
        top, right = op.Sub(hf, one), op.Sub(wf, one)
        shape = op.Concat(op.Shape(a), _ints(dim), axis=0)
        for dy, dx, weight in ((0, 0, op.Mul(gy, gx)), (0, 1, op.Mul(gy, fx)), (1, 0, op.Mul(fy, gx)),
                               (1, 1, op.Mul(fy, fx))):
            xi = op.Add(x0, op.Constant(value_float=float(dx)))
            yi = op.Add(y0, op.Constant(value_float=float(dy)))
            inside = op.And(op.And(op.GreaterOrEqual(xi, zero), op.LessOrEqual(xi, right)),
                            op.And(op.GreaterOrEqual(yi, zero), op.LessOrEqual(yi, top)))
            index = op.Cast(op.Add(op.Mul(op.Clip(yi, zero, top), wf), op.Clip(xi, zero, right)), to=INT64.dtype)
            picked = op.GatherElements(v, op.Expand(op.Unsqueeze(index, _ints(-1)), shape), axis=1)  # BM,QP,D
            scale = op.Mul(op.Mul(weight, a), op.Cast(inside, to=FLOAT.dtype))
            part = op.Mul(picked, op.Unsqueeze(scale, _ints(-1)))
            out = part if out is None else op.Add(out, part)
    # (B*M, Q*P, D) -> the points of each query summed -> (B*M, D, Q)
    out = op.ReduceSum(op.Reshape(out, op.Concat(_ints(-1), queries, _ints(points, dim), axis=0)), _ints(2),
                       keepdims=0)
    return _finish(op.Transpose(out, perm=[0, 2, 1]), value, queries, heads, dim)


LOWERINGS: dict[str, Callable[..., Any]] = {"grid-sample": grid_sample, "gather": gather}
