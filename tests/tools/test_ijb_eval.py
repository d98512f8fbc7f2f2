"""`vtrain eval --ijb`: on the synthetic IJB-C set of tests/fixtures/ijb/ (made by make_ijb_fixture.py), vtrain's
aligned crops, template-pair scores and TAR@FAR table equal those of insightface's own eval_ijbc.py run on the same
files with the same network; the command's route, its JSON and its refusals."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.cli import cli_in_process
from tests.helpers.paths import FIXTURES
from vtrain.data.face_align import align_face
from vtrain.data.ijb import find_ijb, read_ijb
from vtrain.data.images import decode_rgb
from vtrain.eval.ijb import tar_at_far_table, template_pair_scores
from vtrain.models.metric import MetricModel
from vtrain.tools.ijb_eval import embed_templates

FIXTURE = FIXTURES / "ijb"
PEER = json.loads((FIXTURE / "peer.json").read_text())
TOL = 1e-5  # the bound on pair scores; both sides run the same fp32 network on the same pixels


def fixture_model() -> MetricModel:
    cfg = json.loads((FIXTURE / "model_config.json").read_text())
    model = MetricModel(cfg["preset"], 0, cfg["image_size"], cfg["embedding_dim"])
    model.load_state_dict(load_file(str(FIXTURE / "model.safetensors")))
    return model.eval()


@pytest.fixture(scope="module")
def vtrain_run():
    protocol = read_ijb(find_ijb(FIXTURE / "IJBC"))
    model = fixture_model()
    sums = embed_templates(lambda x: model(images=x)["embedding"], torch.device("cpu"), protocol, 112, 64,
                           num_workers=0)
    return protocol, template_pair_scores(sums.normalized(), protocol.pairs)


def percent_row(table: dict) -> dict[str, float]:
    """A table as eval_ijbc.py prints it: '%.2f' of TAR x 100 under str(FAR)."""
    return {str(r["far_target"]): float(f"{100 * r['tar']:.2f}") for r in table["rows"]}


def test_crops_equal_opencv_and_scikit_image():
    """Every face's crop, byte for byte, equals eval_ijbc.py's (SimilarityTransform + cv2.warpAffine + BGR->RGB)."""
    protocol = read_ijb(find_ijb(FIXTURE / "IJBC"))
    want = json.loads((FIXTURE / "peer_crops.json").read_text())["sha256_rgb_112x112x3"]
    got = [hashlib.sha256(align_face(decode_rgb(protocol.files.images / n).permute(1, 2, 0).numpy(),
                                     protocol.landmarks[i]).tobytes()).hexdigest()
           for i, n in enumerate(protocol.names)]
    assert len(got) == len(want) == 379 and got == want


def test_pair_scores_equal_insightface(vtrain_run):
    protocol, scores = vtrain_run
    peer = np.load(FIXTURE / "peer_scores.npy")
    assert peer.shape == scores.shape == (12720,)
    assert np.abs(scores - peer).max() <= TOL
    zero = protocol.template[-1]  # the template whose faces all score 0: cosine 0 with everything, both sides
    assert np.all(peer[(protocol.pairs == zero).any(1)] == 0)


def test_tar_table_equals_insightface(vtrain_run):
    protocol, scores = vtrain_run
    assert PEER["tar_percent"] == percent_row(tar_at_far_table(protocol.labels, scores))
    # and vtrain's table of insightface's own scores
    assert PEER["tar_percent"] == percent_row(tar_at_far_table(protocol.labels, np.load(FIXTURE / "peer_scores.npy")))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A checkpoint of the fixture's network, written as `vtrain convert` writes one."""
    from vtrain.config import build_config
    from vtrain.tools.convert import write

    out = tmp_path_factory.mktemp("ijbrun") / "run"
    cfg = build_config("metric", overrides={"model": {"preset": "debug", "embedding_dim": 512},
                                            "train": {"output_dir": str(out), "batch_size": 32}})
    write(out, False, cfg, load_file(str(FIXTURE / "model.safetensors")), None, {"source": "test"})
    return out


def small_ijbb(root, vtrain_run):
    """The fixture's first 8 templates (IJB-B's file names), and vtrain's scores of their pairs from the whole run."""
    protocol, scores = vtrain_run
    meta = FIXTURE / "IJBC" / "meta"
    (root / "meta").mkdir(parents=True)
    (root / "loose_crop").mkdir()
    keep = protocol.template < 8
    for name in ("face_tid_mid", "name_5pts_score"):
        lines = (meta / f"ijbc_{name}.txt").read_text().splitlines(keepends=True)
        (root / "meta" / f"ijbb_{name}.txt").write_text("".join(x for x, k in zip(lines, keep) if k))
    pairs = (protocol.pairs < 8).all(1)
    lines = (meta / "ijbc_template_pair_label.txt").read_text().splitlines(keepends=True)
    (root / "meta" / "ijbb_template_pair_label.txt").write_text("".join(x for x, k in zip(lines, pairs) if k))
    for n in {n for n, k in zip(protocol.names, keep) if k}:
        (root / "loose_crop" / n).write_bytes((FIXTURE / "IJBC" / "loose_crop" / n).read_bytes())
    return protocol.labels[pairs], scores[pairs]


@pytest.mark.integration
def test_command_json_and_table(tmp_path, run_dir, vtrain_run, monkeypatch, capsys):
    labels, scores = small_ijbb(tmp_path / "IJBB", vtrain_run)
    code, out, err = cli_in_process(monkeypatch, capsys, "eval", "--task", "metric", "--checkpoint", str(run_dir),
                                    "--ijb", str(tmp_path / "IJBB"), "--json")
    assert code == 0, err
    m = json.loads(out.strip().splitlines()[-1])
    want = tar_at_far_table(labels, scores)
    assert m["benchmark"] == "ijbb" and m["ijbb/genuine_pairs"] == labels.sum() == want["genuine_pairs"]
    for r in want["rows"]:
        key = f"ijbb/TAR@FAR={r['far_target']:g}"
        assert m[key] == pytest.approx(r["tar"]) and m[f"{key}/at_or_below"] == pytest.approx(r["tar_at_or_below"])
        assert m[f"{key}/resolvable"] == r["resolvable"]
    assert f"IJB-B 1:1 verification: {run_dir}" in out and "TAR, FAR<=" in out and "< 1e+06 impostors" in out
    assert f"{len(labels)} template pairs" in out


@pytest.mark.parametrize("args,needle", [
    (["--pairs", "p.txt"], "--pairs: not with --ijb"),
    (["--task", "dino"], "--ijb: only for face (metric) checkpoints"),
    (["--classwise"], "--classwise: not with --ijb"),
    (["--ijb-target", "ijba"], "--ijb-target: 'ijba'"),
    (["--ijb-target", "ijbb"], "IJB-B file missing"),
])
def test_refusals_are_one_line(run_dir, monkeypatch, capsys, args, needle):
    code, out, err = cli_in_process(monkeypatch, capsys, "eval", "--checkpoint", str(run_dir), "--ijb",
                                    str(FIXTURE / "IJBC"), *args)
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert code == 2 and len(lines) == 1 and needle in lines[0] and "Traceback" not in err, err


def test_ijb_target_without_ijb_is_refused(run_dir, monkeypatch, capsys):
    code, _, err = cli_in_process(monkeypatch, capsys, "eval", "--checkpoint", str(run_dir), "--ijb-target", "ijbc")
    assert code == 2 and "error: --ijb-target: only with --ijb" in err


def test_classwise_for_a_face_checkpoint_is_refused_before_evaluating(run_dir, monkeypatch, capsys):
    """--classwise is detection's: refused with the other foreign flags, before the evaluation (it was refused after
    a whole face evaluation had run)."""
    code, out, err = cli_in_process(monkeypatch, capsys, "eval", "--checkpoint", str(run_dir), "--classwise",
                                    "--val-data", str(FIXTURE / "none"))
    assert code == 2 and "error: --classwise: only for detection checkpoints" in err and "Traceback" not in err, err
