"""`vtrain estimate-memory`: the fake-tensor trace against a real run measured by the CPU allocator, model
states against DeepSpeed's own estimators, and the command."""

from __future__ import annotations

import dataclasses
import json

import pytest

import torch

from tests.helpers.cli import ok, vtrain

from vtrain.memory.sizing import deepspeed_reference, estimate, max_batch_that_fits, model_facts, model_state_bytes
from vtrain.memory.setup import Setup
from vtrain.memory.trace import allocator_peak, profiled_peak, trace, trace_step
from vtrain.memory.tracker import LiveBytes


CASES = [("dino", "debug", (128, 160), 2), ("metric", "debug", (112, 112), 8)]


@pytest.mark.parametrize("task,preset,size,batch", CASES)
@pytest.mark.parametrize("precision", ["no", "bf16"])
@pytest.mark.parametrize("gc", [False, True])
def test_traced_activation_peak_matches_a_real_run(task, preset, size, batch, precision, gc):
    parts = (("backbone", "encoder") if task == "dino" else ("backbone",)) if gc else ()
    setup = Setup(task=task, preset=preset, image_size=size, batch_size=batch, precision=precision, grad_ckpt=parts,
                  num_classes=5 if task == "dino" else 50, num_targets=3, autocast_policy="cpu")
    traced = trace_step(setup)["Peak"]
    real = allocator_peak(setup)
    assert abs(traced - real) <= 0.10 * real, (traced, real)


def test_checkpointing_and_amp_move_the_traced_peak_the_right_way():
    base = Setup(task="dino", preset="debug", image_size=(128, 160), batch_size=2, precision="no", num_classes=5,
                 num_targets=3, autocast_policy="cpu")
    fp32 = trace_step(base)["Activation"]
    gc = trace_step(dataclasses.replace(base, grad_ckpt=("backbone", "encoder", "decoder")))["Activation"]
    assert gc < 0.8 * fp32
    double = trace_step(dataclasses.replace(base, batch_size=4))["Activation"]
    assert 1.6 * fp32 < double < 2.4 * fp32


def test_cuda_policy_keeps_norms_and_softmax_fp32_under_bf16():
    """CUDA autocast runs layer_norm/softmax in fp32 where CPU autocast stays bf16 (docs/memory_ckpt.md §1.3): the
    CUDA-policy trace holds more activation bytes than the CPU one (DINO: the fp32 outputs of the norms after
    deformable attention; the fp32 copies of 16-bit norm inputs are not kept since models/lean.py, which took
    this margin from 5% to about 3%). On a ResNet backbone with the same deformable-attention kernel on both sides:
    the CUDA policy also traces Swin's biased SDPA through the memory-efficient kernel, which keeps less than CPU's
    math kernel (swin_attention.py), a separate effect."""
    s = Setup(task="dino", preset="debug-resnet", image_size=(128, 160), batch_size=2, precision="bf16", num_classes=5,
              num_targets=3, msda_impl="triton")
    cuda = trace_step(s)["Activation"]
    cpu = trace_step(dataclasses.replace(s, autocast_policy="cpu"))["Activation"]
    assert cuda > 1.015 * cpu


def test_gpu_estimate_traces_the_fused_deformable_attention():
    """A GPU run calls the fused op, so the CUDA-policy trace does too (its fake kernel), not the grid_sample
    path that keeps every sampled value for backward."""
    s = Setup(task="dino", preset="debug", image_size=(128, 160), batch_size=2, precision="bf16", num_classes=5,
              num_targets=3)
    assert s.resolved_msda_impl() == "triton"
    t = trace(s)
    fused = t.activation
    assert trace_step(dataclasses.replace(s, msda_impl="pytorch"))["Activation"] > 1.2 * fused
    assert "fused Triton op" in estimate(s, t).notes[0]


def test_traced_deformable_attention_matches_what_it_allocates(interpret):
    """The fake-tensor trace of one deformable-attention forward + backward (bf16 value, fp32 locations and
    weights, as in DINO under autocast) against the CPU allocator during the real op. For the fused op the
    Triton interpreter runs the same launchers as a GPU (output, fp32 value-gradient accumulator, its cast);
    it must need far less than the grid_sample path."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vtrain.models.dino.msda import ms_deform_attn

    shapes = [(16, 24), (8, 12), (4, 6)]
    s = sum(h * w for h, w in shapes)
    g = torch.Generator().manual_seed(0)
    inputs = (torch.randn(2, s, 2, 16, generator=g).bfloat16(), torch.rand(2, s, 2, 3, 2, 2, generator=g),
              torch.rand(2, s, 2, 3, 2, generator=g))
    traced = {}
    for impl in ("pytorch", "triton"):
        def step(value, loc, attn):
            ms_deform_attn(value, shapes, loc, attn, impl=impl).float().sum().backward()

        real_inputs = [t.clone().requires_grad_() for t in inputs]
        real = profiled_peak(lambda: step(*real_inputs))
        with FakeTensorMode() as mode:
            fake_inputs = [mode.from_tensor(t).requires_grad_() for t in inputs]
            tracker = LiveBytes(fake_inputs)
            with tracker:
                step(*fake_inputs)
        traced[impl] = tracker.peak(set())
        assert abs(traced[impl] - real) <= 0.02 * real, (impl, traced[impl], real)
    assert traced["triton"] < 0.4 * traced["pytorch"], traced


@pytest.mark.parametrize("gpus", [1, 2, 8])
def test_model_states_match_deepspeeds_estimators(gpus):
    setup = Setup(task="dino", preset="swin-l", ds_16bit=True, gpus=gpus)
    facts = model_facts(setup)
    trainable, frozen, largest = facts.trainable, facts.frozen, facts.largest_layer
    assert frozen == 0
    total = trainable
    for zero, offload in [(2, "none"), (2, "optimizer"), (3, "none"), (3, "optimizer"), (3, "all")]:
        s = model_state_bytes(trainable, frozen, zero, False, offload, gpus, ds_16bit=True)
        ours = s["parameters"] + s["gradients"] + s["optimizer"] + (4 * largest if zero == 3 else 0)
        ref = deepspeed_reference(total, largest, zero, offload, gpus)
        assert ours == pytest.approx(ref, rel=1e-6, abs=16), (zero, offload, ours, ref)


def test_model_states_of_vtrain_engines():
    t, f = 1000, 200
    ddp = model_state_bytes(t, f, 0, False, "none", 4)
    assert (ddp["parameters"], ddp["gradients"], ddp["optimizer"]) == (4 * 1200, 4 * 1000, 8 * 1000)
    z1 = model_state_bytes(t, f, 1, False, "none", 4)
    assert (z1["parameters"], z1["gradients"], z1["optimizer"]) == (4800, 4000, 2000)
    fsdp = model_state_bytes(t, f, 0, True, "none", 4)
    assert (fsdp["parameters"], fsdp["gradients"], fsdp["optimizer"]) == (1200, 1000, 2000)
    off = model_state_bytes(t, f, 3, False, "all", 4)
    assert off["parameters"] == off["gradients"] == off["optimizer"] == 0 and off["cpu"] == 1200 + 1000 + 2000


def test_estimate_total_and_max_batch():
    s = Setup(task="dino", preset="debug", image_size=(128, 160), batch_size=2, num_classes=5, num_targets=3)
    est = estimate(s)
    assert est.total == sum((est.parameters, est.gradients, est.optimizer, est.activations, est.temporary,
                             est.overhead))
    per_sample = est.activations / 2
    assert max_batch_that_fits(est, est.total) == 2  # exactly the traced batch
    assert max_batch_that_fits(est, int(est.total + 10.5 * per_sample)) == 12  # room for 10 more samples
    assert max_batch_that_fits(est, est.overhead) == 0


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero2_offload", "zero3", "zero3_offload"])
def test_estimate_reads_a_ds_config_as_the_training_run_does(name, tmp_path):
    """One reading of a DeepSpeed JSON (config/ds_json.py): estimate-memory's Setup and the launch plan agree on the
    stage, the offloading and DeepSpeed's own 16-bit mode, for the shipped files and a full-bf16 variant."""
    from tests.helpers.paths import ROOT
    from vtrain.engine.engines.ds_config import fill_ds_config
    from vtrain.tools.estimate_memory import setup_from

    raw = json.loads((ROOT / "ds_configs" / f"{name}.json").read_text())
    for variant in (raw, {**raw, "bf16": {"enabled": True}}):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(variant))
        _, info = fill_ds_config(variant, name, batch_size=2, grad_accum=1, world_size=8, clip_grad=1.0,
                                 precision="bf16", precision_explicit=False)
        s = setup_from(ds_config=str(path), gpus=8)
        offload = "all" if info["offload_params"] else ("optimizer" if info["offload_optimizer"] else "none")
        assert (s.zero, s.offload, s.ds_16bit) == (info["stage"], offload, info["mode"] == "bf16")


@pytest.mark.integration
def test_estimate_memory_command(tmp_path):
    proc = ok(vtrain("estimate-memory", "--model", "debug", "--image-size", "128x160", "--batch-size", "2",
                     "--zero", "2", "--gpus", "4", "--json"))
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["setup"]["zero"] == 2 and report["params_total"] > 1e6
    est = report["estimate_gib"]
    assert est["total"] == pytest.approx(sum(est[k] for k in ("parameters", "gradients", "optimizer", "activations",
                                                              "temporary", "overhead")), abs=0.01)
    labels = [a["label"] for a in report["alternatives"]]
    assert any("GC backbone+encoder" in x for x in labels) and any(x.startswith("FSDP") for x in labels)
    # a run config is read as `vtrain train` would
    cfg = tmp_path / "run.yaml"
    cfg.write_text("task: dino\nmodel: {preset: debug, image_size: 128, grad_ckpt: [backbone]}\n"
                   "train: {batch_size: 1}\nparallel: {mixed_precision: 'no'}\n")
    proc = ok(vtrain("estimate-memory", "--config", str(cfg), "--ds-config", "ds_configs/zero3_offload.json",
                     "--no-compare-gc", "--json"))
    s = json.loads(proc.stdout.strip().splitlines()[-1])["setup"]
    assert (s["preset"], s["batch_size"], s["grad_ckpt"], s["zero"], s["offload"]) == \
        ("debug", 1, ["backbone"], 3, "all")
    proc = ok(vtrain("estimate-memory", "--model", "debug", "--image-size", "128x160", "--no-compare-gc"))
    assert "GiB per GPU" in proc.stdout and "max batch" in proc.stdout


@pytest.mark.integration
@pytest.mark.parametrize("args,message", [
    (["--zero", "5"], "--zero"),
    (["--zero", "2", "--offload", "all"], "--offload all"),
    (["--model", "nope"], "unknown dino preset"),
    (["--image-size", "big"], "--image-size"),
    (["--grad-ckpt", "head"], "unknown part 'head'"),
])
def test_estimate_memory_bad_flags(args, message):
    proc = vtrain("estimate-memory", *args)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
