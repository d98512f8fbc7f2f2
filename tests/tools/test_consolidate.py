"""`vtrain consolidate` on one-process checkpoints (the 2-process engines are checked in test_distributed)."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers.cli import ok, reseal, vtrain
from vtrain.engine.checkpoint.format import complete_checkpoints


@pytest.fixture(scope="module")
def run(faces, tmp_path_factory):
    out = tmp_path_factory.mktemp("cons") / "run"
    ok(vtrain("train", "--data", str(faces), "--output-dir", str(out), "--max-steps", "2", "--batch-size", "4",
              "--num-workers", "0", "--embedding-dim", "32"))
    return out


def _error(proc, *needles):
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    for n in needles:
        assert n in proc.stderr, proc.stderr


@pytest.mark.integration
def test_consolidates_a_run_dir_to_safetensors_and_pt(run, tmp_path):
    live = load_file(str(complete_checkpoints(run)[-1] / "model.safetensors"))
    proc = ok(vtrain("consolidate", str(run), str(tmp_path / "m.safetensors"), "--check-model"))
    assert "every tensor is finite" in proc.stdout and "step_2" in proc.stdout
    got = load_file(str(tmp_path / "m.safetensors"))
    assert got.keys() == live.keys() and all(torch.equal(got[k], live[k]) for k in live)
    assert got["neck.norm.running_var"].dtype == torch.float32  # buffers included, fp32
    ok(vtrain("consolidate", str(run), str(tmp_path / "m.pt"), "--dtype", "bf16"))
    pt = torch.load(tmp_path / "m.pt", weights_only=True)
    assert pt["head.weight"].dtype == torch.bfloat16 and pt["neck.norm.num_batches_tracked"].dtype == torch.int64


@pytest.mark.integration
def test_sharded_output_has_an_index(run, tmp_path):
    ok(vtrain("consolidate", str(run), str(tmp_path / "m.safetensors"), "--max-shard-size", "100KB"))
    index = json.loads((tmp_path / "m.safetensors.index.json").read_text())
    shards = sorted({v for v in index["weight_map"].values()})
    assert len(shards) > 1 and all((tmp_path / s).is_file() for s in shards)
    merged = {}
    for s in shards:
        merged.update(load_file(str(tmp_path / s)))
    assert merged.keys() == set(index["weight_map"])


@pytest.mark.integration
def test_injected_inf_buffer_is_flagged_and_nothing_is_written(run, tmp_path):
    bad = tmp_path / "bad_ckpt"
    shutil.copytree(complete_checkpoints(run)[-1], bad)
    f = bad / "accelerate" / "model.safetensors"
    sd = load_file(str(f))
    sd["neck.norm.running_var"][3] = float("inf")  # the fp16 running_var overflow users hit
    sd["head.weight"][0, :2] = float("nan")
    for copy in (f, bad / "model.safetensors"):  # both copies of the weights, as a save of such a model writes them
        save_file(sd, str(copy))
    reseal(f.parents[1])
    out = tmp_path / "out.safetensors"
    proc = vtrain("consolidate", str(bad), str(out))
    _error(proc, "2 tensors hold inf/NaN", "not written")
    assert "neck.norm.running_var" in proc.stdout and "yes" in proc.stdout  # listed, marked as a buffer
    assert not out.exists()
    ok(vtrain("consolidate", str(bad), str(out), "--allow-nonfinite"))
    assert torch.isinf(load_file(str(out))["neck.norm.running_var"]).sum() == 1


@pytest.mark.integration
def test_bad_inputs_leave_out_untouched(run, tmp_path):
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"previous")
    (tmp_path / "empty").mkdir()
    _error(vtrain("consolidate", str(run), str(out)), "exists", "--overwrite")  # never replaced without asking
    _error(vtrain("consolidate", str(tmp_path / "empty"), str(out), "--overwrite"), "empty directory")
    _error(vtrain("consolidate", str(tmp_path / "nope"), str(out), "--overwrite"), "no such file")
    half = tmp_path / "checkpoints" / ".tmp-step_9"
    shutil.copytree(complete_checkpoints(run)[-1], half)
    (half / "COMPLETE").unlink()
    _error(vtrain("consolidate", str(half), str(out), "--overwrite"), "half-written")
    _error(vtrain("consolidate", str(run), str(tmp_path / "out.txt")), ".safetensors or .pt")
    ds = tmp_path / "ds"
    ds.mkdir()
    (ds / "latest").write_text("global_step7")
    _error(vtrain("consolidate", str(ds), str(out), "--overwrite"), "global_step7")
    assert out.read_bytes() == b"previous"


@pytest.mark.integration
def test_check_model_rejects_another_models_weights(run, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(complete_checkpoints(run)[-1], other)
    f = other / "accelerate" / "model.safetensors"
    sd = load_file(str(f))
    sd["neck.proj.weight"] = torch.zeros(16, sd["neck.proj.weight"].shape[1])
    save_file(sd, str(f))
    reseal(f.parents[1])
    _error(vtrain("consolidate", str(other), str(tmp_path / "o.safetensors"), "--check-model"),
           "--check-model", "do not fit")


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_plain_deepspeed_with_frozen_tied_and_batchnorm(stage, tmp_path):
    """The reference tool's known gaps (docs/memory_ckpt.md §4): ZeRO-1 drops frozen parameters, tied weights break
    safetensors output. Consolidation of a plain DeepSpeed checkpoint must equal the live model, all of it."""
    from tests.helpers.cli import launch
    from tests.helpers.paths import ROOT

    out = tmp_path / "ds"
    ok(launch(2, str(ROOT / "tests" / "helpers" / "ds_frozen_tied.py"), str(stage), str(out),
              accelerate_config="ddp.yaml", module=False))
    truth = load_file(str(out / "truth.safetensors"))
    proc = ok(vtrain("consolidate", str(out), str(tmp_path / "m.safetensors"), "--verbose"))
    assert f"ZeRO-{stage}, 2 ranks" in proc.stdout
    got = load_file(str(tmp_path / "m.safetensors"))
    assert got.keys() == truth.keys()  # frozen.weight/bias and the tied out.weight included
    for k in truth:
        assert torch.equal(got[k], truth[k]), k
    # a checkpoint that lost one rank's shard is refused, OUT untouched
    tag = out / (out / "latest").read_text().strip()
    next(tag.glob("*rank_1*optim_states.pt")).unlink()
    proc = vtrain("consolidate", str(out), str(tmp_path / "m.safetensors"), "--overwrite")
    _error(proc, "1 optimizer shards but the checkpoint was written by 2 ranks")
    assert torch.equal(load_file(str(tmp_path / "m.safetensors"))["emb.weight"], truth["emb.weight"])
    # running_var held values above the fp16 maximum (65504): kept finite and fp32
    assert got["bn.running_var"].dtype == torch.float32 and torch.isfinite(got["bn.running_var"]).all()
    assert got["bn.running_var"].max() > 65504


@pytest.mark.integration
def test_resume_weights_only_starts_a_new_run_from_a_consolidated_file(run, faces, tmp_path):
    cons = tmp_path / "m.safetensors"
    ok(vtrain("consolidate", str(run), str(cons)))
    new = tmp_path / "new"
    proc = ok(vtrain("train", "--data", str(faces), "--output-dir", str(new), "--max-steps", "1", "--batch-size", "4",
                     "--num-workers", "0", "--embedding-dim", "32", "--lr", "1e-12", "--resume-weights-only",
                     str(cons)))
    assert "weights loaded from" in proc.stdout
    want, got = load_file(str(cons)), load_file(str(complete_checkpoints(new)[-1] / "model.safetensors"))
    for k in want:
        if not k.startswith("neck.norm.running") and k != "neck.norm.num_batches_tracked":  # BN stats move
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-6, msg=k)
    proc = vtrain("train", "--data", str(faces), "--output-dir", str(tmp_path / "bad"), "--max-steps", "1",
                  "--embedding-dim", "64", "--resume-weights-only", str(cons))
    _error(proc, "--resume-weights-only", "does not fit this model")


@pytest.mark.integration
@pytest.mark.parametrize("layout", ["sharded", "full"])
def test_accelerate_fsdp_save_state_layouts(run, tmp_path, layout):
    """Accelerate's FSDP save_state: SHARDED_STATE_DICT writes a DCP dir `pytorch_model_fsdp_0` holding
    {"model": state_dict}; FULL_STATE_DICT writes `pytorch_model_fsdp.bin` (accelerate/utils/fsdp_utils.py).
    Written here the same way on one process (Accelerate never applies FSDP on CPU processes)."""
    import torch.distributed.checkpoint as dcp

    live = load_file(str(complete_checkpoints(run)[-1] / "model.safetensors"))
    state = tmp_path / "state"
    state.mkdir()
    if layout == "sharded":
        dcp.save({"model": dict(live)}, storage_writer=dcp.FileSystemWriter(str(state / "pytorch_model_fsdp_0")),
                 no_dist=True)
        (state / "optimizer_0").mkdir()
        expected = "Accelerate FSDP sharded state"
    else:
        torch.save(dict(live), state / "pytorch_model_fsdp.bin")
        expected = "pytorch_model_fsdp.bin"
    (state / "random_states_0.pkl").write_bytes(b"")
    out = tmp_path / "m.safetensors"
    proc = ok(vtrain("consolidate", str(state), str(out)))
    assert expected in proc.stdout
    got = load_file(str(out))
    assert got.keys() == live.keys() and all(torch.equal(got[k], live[k]) for k in live)
