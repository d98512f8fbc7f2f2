"""Five-point face alignment to the 112 x 112 ArcFace crop: the least-squares similarity transform from a face's
landmarks to the template, and the bilinear warp, computed as insightface's IJB evaluation computes them.

- The template is the one of insightface's `arcface_torch/eval_ijbc.py` (and `face_align.py`'s `arcface_dst`):
  eyes, nose tip and mouth corners in the 112 x 112 crop (docs/face.md §7).
- The transform is Umeyama's least-squares similarity (rotation, uniform scale, translation; no reflection):
  S. Umeyama, "Least-squares estimation of transformation parameters between two point patterns", IEEE TPAMI
  13(4), 1991, eqs. 34-43. eval_ijbc.py estimates it with scikit-image's `SimilarityTransform` on float32 points,
  so the arithmetic here is float32 too, with float64 only where the paper's sums would lose digits otherwise.
- The warp reproduces OpenCV's `warpAffine(img, M, (112, 112), borderValue=0)` with bilinear interpolation as
  OpenCV 5.0 computes it (docs/face.md §7): the matrix inverted in float64 and cast to float32, source coordinates
  as one fused multiply-add per pixel, interpolation first along x then y with fused multiply-adds, rounding to
  the nearest even level; source pixels outside the image are 0. Checked against OpenCV itself:
  tests/fixtures/ijb/README.md.
"""

from __future__ import annotations

import numpy as np

CROP = 112
_TEMPLATE_96 = np.array([[30.2946, 51.6963], [65.5318, 51.5014], [48.0252, 71.7366], [33.5493, 92.3655],
                         [62.7299, 92.2041]], np.float32)
ARCFACE_TEMPLATE = _TEMPLATE_96 + np.array([8.0, 0.0], np.float32)
"""Left eye, right eye, nose tip, left and right mouth corner in the 112 x 112 crop (x, y pixels): the 96 x 112
template moved 8 pixels right, added in float32 as eval_ijbc.py does (float32(30.2946) + 8 is not
float32(38.2946), and the transform is bit-equal to the script's only with the same points)."""


class AlignmentError(ValueError):
    """Landmarks from which no similarity transform can be estimated (all points equal, not finite)."""


def similarity_transform(src: np.ndarray, dst: np.ndarray = ARCFACE_TEMPLATE) -> np.ndarray:
    """The 2 x 3 matrix [sR | t] minimising sum ||s R src_i + t - dst_i||^2 over rotations R (det +1), scales s
    and translations t (Umeyama 1991). `src`, `dst`: N x 2 points. Raises AlignmentError when the points do not
    determine it (fewer than 2 distinct source points, or a non-finite result)."""
    src, dst = np.asarray(src, np.float32), np.asarray(dst, np.float32)
    if src.shape != dst.shape or src.ndim != 2 or src.shape[1] != 2:
        raise AlignmentError(f"landmarks of shape {src.shape}, expected {dst.shape}")
    if not np.isfinite(src).all():
        raise AlignmentError("landmarks are not finite")
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow shows as a non-finite value, refused
        return _umeyama(src, dst)


def _umeyama(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    # means, covariance and SVD in float32 (the precision of eval_ijbc.py's estimate), the composition in float64
    mu_src, mu_dst = src.mean(0), dst.mean(0)
    a, b = src - mu_src, dst - mu_dst
    var = a.var(0).sum()  # eq. 36: the source points' variance
    if not np.isfinite(var) or var <= 0:
        raise AlignmentError("the landmarks are all one point" if var == 0 else "the landmarks are too far apart")
    cov = b.T @ a / np.float32(len(src))  # eq. 38: Sigma_xy (target x source)
    u, sv, vt = np.linalg.svd(cov)
    # eq. 39-40 and 43: a reflection is replaced by the nearest rotation; with rank 1 (collinear points) the sign
    # comes from the singular vectors, since det(Sigma_xy) is then 0
    d = np.ones(2)
    rank = int((sv > sv.max() * 2 * np.finfo(np.float64).eps).sum())
    if rank == 0:
        raise AlignmentError("the landmarks are all one point")
    if (np.linalg.det(u) * np.linalg.det(vt) < 0) if rank == 1 else (np.linalg.det(cov) < 0):
        d[1] = -1
    rot = u @ np.diag(d) @ vt
    scale = (np.float32(1.0) / var) * (sv @ d)  # eq. 42
    m = np.empty((2, 3), np.float64)
    m[:, 2] = mu_dst - scale * (rot @ mu_src)  # eq. 41
    m[:, :2] = rot * scale
    if not np.isfinite(m).all() or not scale > 0:
        raise AlignmentError("no finite similarity transform maps these landmarks onto the template")
    return m


def warp_affine(image: np.ndarray, matrix: np.ndarray, size: int = CROP) -> np.ndarray:
    """`image` (H x W x C uint8) warped by the 2 x 3 forward `matrix` (source -> crop) to size x size x C uint8,
    bilinear, with 0 outside the source (OpenCV's warpAffine with INTER_LINEAR and BORDER_CONSTANT 0)."""
    sx, sy = _source_points(matrix, size)
    x0, y0 = np.floor(sx), np.floor(sy)
    # the fractions are exact (a float32 minus its floor); float64 makes each step below one fused multiply-add
    fx = (sx - x0).astype(np.float64)[:, None]
    fy = (sy - y0).astype(np.float64)[:, None]
    taps = _neighbours(image, x0.astype(np.int64), y0.astype(np.int64))
    # along x, both rows at once: p0 + fx (p1 - p0) with an exact difference and an exact product (24 x 9 bits),
    # one rounding to float32 (a fused multiply-add; up to a last-bit double rounding, which our tests never met)
    left, right = taps[0::2], taps[1::2]
    right -= left
    right *= fx
    right += left
    top, bottom = right.astype(np.float32)
    # along y: the difference of the rows rounded to float32, then fused as above
    value = (fy * (bottom - top) + top).astype(np.float32)
    return np.clip(np.rint(value), 0, 255).astype(np.uint8).reshape(size, size, image.shape[2])


def _source_points(matrix: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """The source point (x, y) of every crop pixel, row by row, in float32 as OpenCV computes them: the matrix
    inverted in float64 and cast to float32, each row's offset in float32, then one fused multiply-add per pixel."""
    m = np.asarray(matrix, np.float64)
    det = m[0, 0] * m[1, 1] - m[0, 1] * m[1, 0]
    if det == 0 or not np.isfinite(det):
        raise AlignmentError("the transform is singular")
    a11, a22, a12, a21 = m[1, 1] / det, m[0, 0] / det, -m[0, 1] / det, -m[1, 0] / det
    inv = np.array([[a11, a12, -a11 * m[0, 2] - a12 * m[1, 2]],
                    [a21, a22, -a21 * m[0, 2] - a22 * m[1, 2]]]).astype(np.float32)
    if not np.isfinite(inv).all():
        raise AlignmentError("the transform is not finite in float32")
    xs = np.arange(size, dtype=np.float64)[None, :]
    ys = np.arange(size, dtype=np.float32)[:, None]
    sx = (np.float64(inv[0, 0]) * xs + (ys * inv[0, 1] + inv[0, 2])).astype(np.float32).reshape(-1)
    sy = (np.float64(inv[1, 0]) * xs + (ys * inv[1, 1] + inv[1, 2])).astype(np.float32).reshape(-1)
    # beyond +-2^30 pixels every sample is outside: clip before the integer conversion
    return np.clip(sx, -2.0**30, 2.0**30, out=sx), np.clip(sy, -2.0**30, 2.0**30, out=sy)


def _neighbours(image: np.ndarray, x0: np.ndarray, y0: np.ndarray) -> np.ndarray:
    """The pixels (x0, y0), (x0 + 1, y0), (x0, y0 + 1), (x0 + 1, y0 + 1) of each sample as 4 x N x C float64,
    0 where one lies outside the image. One gather from the uint8 image with a zero pixel appended (outside points
    index it), so nothing of the size of the source image is made in floating point (IJB images are often
    several times the crop's size)."""
    h, w, c = image.shape
    xs, ys = np.stack([x0, x0 + 1]), np.stack([y0, y0 + 1])
    index = ys[:, None] * w + xs[None]  # 2 x 2 x N (row, column); |x0|, |y0| <= 2^30: no int64 overflow
    index[((ys < 0) | (ys >= h))[:, None] | ((xs < 0) | (xs >= w))[None]] = h * w
    flat = np.zeros((h * w + 1, c), np.uint8)
    flat[:-1].reshape(h, w, c)[...] = image
    return flat.take(index.reshape(-1), axis=0).reshape(4, -1, c).astype(np.float64)


def align_face(image: np.ndarray, landmarks: np.ndarray, size: int = CROP) -> np.ndarray:
    """The 112 x 112 ArcFace crop of `image` (H x W x C uint8) from its five landmarks (5 x 2, x then y)."""
    return warp_affine(image, similarity_transform(landmarks), size)
