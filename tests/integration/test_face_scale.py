"""The at-scale face path end to end through the real CLI: an insightface RecordIO dir with a `.bin` pack ->
`vtrain train` -> `vtrain eval --data X.bin --json` -> `vtrain export` checked with onnxruntime."""

import json
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from tests.helpers.checkpoints import relabelled_as_dino
from tests.helpers.cli import metrics, ok, reseal, vtrain
from vtrain.config import DataConfig
from vtrain.data.demo_faces import verification_pairs
from vtrain.data.faces import FaceFolder, resolve_face_data
from vtrain.data.recordio import write_face_rec
from vtrain.data.verification_bin import write_bin
from vtrain.errors import VtrainError

PACK_KEYS = ("lfw/acc", "lfw/acc_std", "lfw/acc_threshold", "lfw/TAR@FAR=0.1", "lfw/TAR@FAR=0.001",
             "lfw/TAR@FAR=0.001/resolvable", "lfw/genuine_pairs", "lfw/impostor_pairs")


def write_pack(val_root: Path, path: Path) -> None:
    """LFW-style pack over held-out identities: 10 folds of 2 genuine then 2 impostor pairs."""
    val = FaceFolder(val_root, 112, train=False)
    images, same = verification_pairs(val.samples, 10, 2, np.random.default_rng(0))
    write_bin(path, images, same, protocol=2)


@pytest.fixture(scope="module")
def rec_run(faces, tmp_path_factory):
    """A RecordIO dir (train.rec/.idx/property + lfw.bin) and a 4-step run trained from it."""
    root = tmp_path_factory.mktemp("rec")
    data = root / "ms1m"
    ff = FaceFolder(faces / "train", 112, train=False)
    write_face_rec(data, [(Path(p).read_bytes(), label) for p, label in ff.samples], ff.num_classes)
    write_pack(faces / "val", data / "lfw.bin")
    run = root / "run"
    proc = ok(vtrain("train", "--data", str(data), "--val-targets", "lfw", "--output-dir", str(run), "--max-steps",
                     "4", "--batch-size", "8", "--num-workers", "2", "--log-every", "1", "--embedding-dim", "32",
                     "--head", "cosface", "--scale", "16", "--mixed-precision", "no"))
    return data, run, proc


def test_trains_from_recordio_and_evaluates_packs(rec_run):
    data, run, proc = rec_run
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4]
    assert "10-fold accuracy" in proc.stdout and "lfw" in proc.stdout
    ev = json.loads((run / "eval.jsonl").read_text().splitlines()[-1])
    for key in PACK_KEYS:
        assert key in ev, key
    assert ev["lfw/genuine_pairs"] == 20 and ev["lfw/impostor_pairs"] == 20
    assert 0.0 <= ev["lfw/acc"] <= 1.0 and ev["lfw/TAR@FAR=0.001/resolvable"] is False
    assert yaml.safe_load((run / "config.yaml").read_text())["data"]["val_targets"] == ["lfw"]


def test_eval_bin_json_matches_training_and_refuses_malicious_pack(rec_run, tmp_path):
    data, run, _ = rec_run
    proc = ok(vtrain("eval", "--task", "metric", "--checkpoint", str(run), "--data", str(data / "lfw.bin"), "--json"))
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    ev = json.loads((run / "eval.jsonl").read_text().splitlines()[-1])
    for key in PACK_KEYS:
        assert got[key] == pytest.approx(ev[key], abs=1e-6), key
    # a pack whose unpickling would run code: refused with one line, the code never runs
    target = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return os.system, (f"touch {target}",)

    evil = tmp_path / "lfw.bin"
    evil.write_bytes(pickle.dumps(([b"x", b"y"], [Evil()])))
    proc = vtrain("eval", "--checkpoint", str(run), "--data", str(evil), "--json")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == (f"error: refusing to unpickle {evil}: it holds a `posix.system` object, which a "
                                   "verification .bin never needs (only image bytes and same/not-same flags are "
                                   "accepted)")
    assert not target.exists()


def test_export_onnx_matches_pytorch_on_dynamic_batches(rec_run, tmp_path):
    import onnx
    import onnxruntime as ort

    from vtrain.tools.evaluate import load_model
    from vtrain.tools.export import EmbeddingNet

    _, run, _ = rec_run
    out = tmp_path / "model.onnx"
    proc = ok(vtrain("export", str(run), str(out)))
    assert "x / 127.5 - 1" in proc.stdout and "onnxruntime vs PyTorch" in proc.stdout
    m = onnx.load(str(out))
    meta = {p.key: p.value for p in m.metadata_props}
    assert meta["mean"] == meta["std"] == "127.5,127.5,127.5" and meta["input_color"] == "RGB"
    assert meta["embedding_dim"] == "32" and meta["input_shape"] == "N,3,112,112"
    assert m.graph.input[0].type.tensor_type.shape.dim[0].dim_param  # symbolic batch axis
    model = load_model(run, device=torch.device("cpu")).model
    net = EmbeddingNet(model.backbone, model.neck).eval()
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    for batch in (3, 5):
        x = torch.rand(batch, 3, 112, 112, generator=torch.Generator().manual_seed(batch)) * 2 - 1
        with torch.no_grad():
            want = net(x).numpy()
        got = sess.run(["embedding"], {"input": x.numpy()})[0]
        assert got.shape == (batch, 32)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert abs(want).max() > 0.1  # not a degenerate all-zero comparison


def test_export_bad_input(rec_run, tmp_path):
    from vtrain.tools.export import export_onnx

    _, run, _ = rec_run
    with pytest.raises(VtrainError, match="must end in .onnx"):
        export_onnx(run, tmp_path / "model.pt")
    with pytest.raises(VtrainError, match="neither a complete checkpoint nor a run directory"):
        export_onnx(tmp_path / "missing", tmp_path / "m.onnx")
    dino = tmp_path / "dino"
    shutil.copytree(run, dino)
    for cfg_file in dino.rglob("config.yaml"):
        cfg = yaml.safe_load(cfg_file.read_text())
        cfg_file.write_text(yaml.safe_dump(relabelled_as_dino(cfg)))
    with pytest.raises(VtrainError, match="config.yaml: .* the manifest says"):  # verified before it is loaded
        export_onnx(dino, tmp_path / "m.onnx")
    for step in (dino / "checkpoints").glob("step_*"):
        reseal(step)
    # a face model's weights under a DINO config: export now takes DINO checkpoints (issue 35), and names what is missing
    with pytest.raises(VtrainError, match="lacks the dino classifier cls_heads.0.weight"):
        export_onnx(dino, tmp_path / "m.onnx")


def test_data_layout_and_val_target_resolution(rec_run, faces, tmp_path):
    data, _, _ = rec_run
    d = resolve_face_data(DataConfig(path=str(data)))  # RecordIO: every *.bin beside train.rec
    assert d.layout == "recordio" and d.val_targets == [("lfw", data / "lfw.bin")]
    d = resolve_face_data(DataConfig(path=str(data), val_targets="lfw.bin," + str(data / "lfw.bin")))
    assert d.val_targets == [("lfw", data / "lfw.bin")]
    assert resolve_face_data(DataConfig(path=str(data), val_targets="")).val_targets == []
    d = resolve_face_data(DataConfig(path=str(faces)))  # identity folders: packs only when named
    assert d.layout == "folders" and d.val_targets == [] and d.val_dir == faces / "val"
    d = resolve_face_data(DataConfig(path=str(data / "lfw.bin")))
    assert d.layout == "bin" and d.train_dir is None and d.val_targets == [("lfw", data / "lfw.bin")]
    with pytest.raises(VtrainError, match=r"--val-targets: agedb_30: no such verification pack .*agedb_30.bin"):
        resolve_face_data(DataConfig(path=str(data), val_targets="lfw,agedb_30"))
    (tmp_path / "train.rec").write_bytes(b"")  # a rec without its index: said so, not "no identity folders"
    from vtrain.tasks.metric import MetricTask
    from vtrain.config import build_config

    task = MetricTask(build_config("metric", overrides={"data": {"path": str(tmp_path)}}))
    with pytest.raises(VtrainError, match="train.idx not found"):
        task.train_dataset()
