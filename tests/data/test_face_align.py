"""Five-point alignment (vtrain/data/face_align.py): Umeyama's transform recovers a known similarity, never
reflects, refuses points that determine nothing; the warp is bilinear with zeros outside, within one level of the
exact float64 definition everywhere. Bit-equality with scikit-image + OpenCV on real crops: tests/tools/test_ijb_eval.py
(the fixture's crop digests)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vtrain.data.face_align import ARCFACE_TEMPLATE, AlignmentError, align_face, similarity_transform, warp_affine


def similarity(angle, scale, tx, ty):
    c, s = scale * np.cos(angle), scale * np.sin(angle)
    return np.array([[c, -s, tx], [s, c, ty]])


def test_template_is_eval_ijbcs():
    assert ARCFACE_TEMPLATE.dtype == np.float32
    assert ARCFACE_TEMPLATE[:, 0].tolist() == (np.float32([30.2946, 65.5318, 48.0252, 33.5493, 62.7299])
                                               + np.float32(8)).tolist()
    assert ARCFACE_TEMPLATE[:, 1].tolist() == np.float32([51.6963, 51.5014, 71.7366, 92.3655, 92.2041]).tolist()


@pytest.mark.parametrize("angle,scale,tx,ty", [(0, 1, 0, 0), (0.3, 0.5, -20, 13), (-2.5, 2.2, 80, -40)])
def test_a_known_similarity_is_recovered(angle, scale, tx, ty):
    m = similarity(angle, scale, tx, ty)  # face -> crop
    src = (np.linalg.inv(m[:, :2]) @ (ARCFACE_TEMPLATE.T - m[:, 2:])).T  # the face's landmarks
    np.testing.assert_allclose(similarity_transform(src), m, atol=2e-4 * max(1, abs(tx), abs(ty)))


def test_mirrored_landmarks_give_a_rotation_not_a_reflection():
    src = ARCFACE_TEMPLATE.copy()
    src[:, 0] = 112 - src[:, 0]  # left and right swapped
    m = similarity_transform(src)
    assert np.linalg.det(m[:, :2]) > 0
    collinear = np.array([[10, 10], [20, 20], [30, 30], [40, 40], [50, 50]], np.float32)
    assert np.linalg.det(similarity_transform(collinear)[:, :2]) > 0


@pytest.mark.parametrize("src,needle", [(np.full((5, 2), 7.0), "one point"), (np.full((5, 2), np.nan), "finite"),
                                        (np.zeros((4, 2)), "shape")])
def test_points_that_determine_nothing_are_refused(src, needle):
    with pytest.raises(AlignmentError, match=needle):
        similarity_transform(src)


def reference_warp(image, m, size=112):
    """Bilinear sampling in float64 from the definition: crop pixel p shows source point m^-1 p, zeros outside."""
    inv = np.linalg.inv(np.vstack([m, [0, 0, 1]]))[:2]
    ys, xs = np.mgrid[0:size, 0:size].astype(np.float64)
    sx, sy = inv[0, 0] * xs + inv[0, 1] * ys + inv[0, 2], inv[1, 0] * xs + inv[1, 1] * ys + inv[1, 2]
    h, w = image.shape[:2]
    pad = np.zeros((h + 2, w + 2, image.shape[2]))
    pad[1:-1, 1:-1] = image
    x0, y0 = np.floor(sx).astype(int), np.floor(sy).astype(int)
    fx, fy = (sx - x0)[..., None], (sy - y0)[..., None]

    def at(yy, xx):
        ok = (yy >= -1) & (yy <= h) & (xx >= -1) & (xx <= w)
        return np.where(ok[..., None], pad[np.clip(yy + 1, 0, h + 1), np.clip(xx + 1, 0, w + 1)], 0)

    v = (at(y0, x0) * (1 - fx) + at(y0, x0 + 1) * fx) * (1 - fy) + (at(y0 + 1, x0) * (1 - fx) + at(y0 + 1, x0 + 1) * fx) * fy
    return v


def test_identity_and_integer_shifts_are_exact():
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, (112, 112, 3), dtype=np.uint8)
    assert np.array_equal(warp_affine(img, similarity(0, 1, 0, 0)), img)
    shifted = warp_affine(img, similarity(0, 1, 5, -3))  # crop (x, y) shows source (x - 5, y + 3)
    assert np.array_equal(shifted[:109, 5:], img[3:, :107])
    assert not shifted[:, :5].any() and not shifted[109:].any()


@pytest.mark.parametrize("seed", range(3))
def test_warp_is_within_one_level_of_the_definition(seed):
    rng = np.random.default_rng(seed)
    img = rng.integers(0, 256, (150, 170, 3), dtype=np.uint8)
    m = similarity(rng.normal(0, 0.5), rng.uniform(0.5, 2), rng.uniform(-80, 20), rng.uniform(-80, 20))
    got = warp_affine(img, m).astype(float)
    assert np.abs(got - reference_warp(img, m)).max() <= 0.5 + 1e-3  # rounding, plus float32's 1e-4 of a level


@settings(deadline=None)
@given(st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=10, max_size=10),
       st.integers(1, 40), st.integers(1, 40))
def test_any_landmarks_give_a_crop_or_an_alignment_error(values, h, w):
    img = np.full((h, w, 3), 200, np.uint8)
    try:
        crop = align_face(img, np.array(values, np.float32).reshape(5, 2))
    except AlignmentError:
        return
    assert crop.shape == (112, 112, 3) and crop.dtype == np.uint8
