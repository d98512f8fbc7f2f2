"""Regional torch.compile (`--compile`, engine/compile.py): compiled vs eager losses, checkpoints with the eager keys
that resume, recompiles per block group (not per model) when the image size changes, and the deformable-attention
custom op inside a compiled encoder layer.

Inductor on CPU generates and builds C++, minutes for a DINO model on a shared 2-core machine, so only the metric
run uses it (one block kind: two ViT blocks, one forward and one backward graph); the DINO and op tests trace with
`aot_eager` (dynamo + AOTAutograd, the graphs run as traced): what they check, the regions, guards and recompiles,
is decided before code generation.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch._dynamo.eval_frame import _get_total_cache_entry_count
from torch._dynamo.utils import counters

from tests.helpers.cli import launch, metrics, ok, run_info, vtrain
from vtrain.engine.checkpoint.format import complete_checkpoints
from vtrain.engine.compile import _run_region, apply_compile, compile_groups, compiled_regions
from vtrain.models.dino import DINO
from vtrain.tasks.dino import DinoTask

COMMON = ["--batch-size", "8", "--log-every", "1", "--num-workers", "0", "--embedding-dim", "32", "--head", "cosface",
          "--scale", "16", "--lr", "3e-3", "--mixed-precision", "no", "--save-every", "2", "--ema-decay", "0.9"]


@pytest.fixture
def fresh_dynamo():
    """Compiled graphs and counters of other tests in this process must not count here."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def test_metric_compiled_run_matches_eager_keeps_the_keys_and_resumes(faces, tmp_path):
    args = ["--data", str(faces), "--max-steps", "3", *COMMON]
    ok(vtrain("train", "--output-dir", str(tmp_path / "eager"), *args))
    run = tmp_path / "compiled"
    cache = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}  # cold, as in CI, and shared by the resume
    proc = ok(vtrain("train", "--output-dir", str(run), "--compile", *args, extra_env=cache))
    assert "--compile: 2 regions compiled separately with torch.compile(backend=inductor) in 1 groups" in proc.stdout
    assert "static shapes until a size changes" in proc.stdout  # fixed 112 x 112 crops
    assert run_info(run)["ranks"][0]["compiled_regions"] == ["backbone.blocks.0", "backbone.blocks.1"]
    assert run_info(tmp_path / "eager")["ranks"][0]["compiled_regions"] == []
    # fp32 on both sides: inductor fuses and reorders reductions (layer norm, softmax, the GEMM epilogues), so the
    # loss moves by float32 rounding, ~1e-6 relative after three AdamW steps at lr 3e-3 (measured 5e-7); 1e-4 is
    # far above that and far below a real difference (one step changes the loss by ~1e-1). The weights are not
    # compared: AdamW moves a weight with a near-zero gradient by +-lr whatever its size, so rounding can flip it.
    eager = [r["loss"] for r in metrics(tmp_path / "eager")]
    compiled = [r["loss"] for r in metrics(run)]
    assert compiled == pytest.approx(eager, rel=1e-4)
    # checkpoints hold the eager model's names (no `_orig_mod.`), so consolidate / eval / predict read them as ever
    for name in ("model.safetensors", "ema.safetensors"):
        a = load_file(str(complete_checkpoints(tmp_path / "eager")[-1] / name))
        b = load_file(str(complete_checkpoints(run)[-1] / name))
        assert sorted(a) == sorted(b) and not any("_orig_mod" in k for k in b), name
    # resume the compiled run (its compiled graphs come from inductor's on-disk cache) and go one step further
    proc = ok(vtrain("train", "--output-dir", str(run), "--compile", "--resume", "auto", *args[:2], "--max-steps", "4",
                     *COMMON, extra_env=cache))
    assert "resumed from" in proc.stdout and "step_3" in proc.stdout
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4]


def _detection_batch(h: int, w: int, boxes: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"images": torch.randn(1, 3, h, w, generator=g), "masks": torch.zeros(1, h, w, dtype=torch.bool),
            "labels": torch.randint(0, 3, (1, boxes), generator=g),
            "boxes": torch.rand(1, boxes, 4, generator=g) * 0.4 + 0.3, "num_targets": torch.tensor([boxes])}


def test_dino_new_image_sizes_compile_nothing_after_the_first_step_and_losses_match(fresh_dynamo):
    # multi-scale training: every step another H x W (and number of boxes, hence of denoising queries). The sizes
    # stay in one shape class of the debug Swin (window 7): no side a multiple of 7 windows' pixels, more than one
    # window row and column at every stage but the last; docs/compile.md §3 lists what makes another class.
    sizes = [(160, 192, 2), (192, 128, 3), (128, 160, 2), (192, 160, 4)]

    def train(compiled: bool) -> tuple[list[float], list[int]]:
        torch.manual_seed(0)
        model = DINO("debug", 3)
        if compiled:
            # the "eager" backend replays dynamo's graphs op by op: the regions, guards and recompiles are what
            # inductor would get, without minutes of C++ code generation (no checkpointing here: with it, torch
            # 2.14.1's eager backend reused a graph across shape classes, docs/compile.md §3)
            assert apply_compile(model, "eager", sizes_vary=DinoTask.input_sizes_vary) == compiled_regions(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses, graphs = [], []
        for step, (h, w, n) in enumerate(sizes):
            torch.manual_seed(100 + step)  # the denoising noise
            loss = model(**_detection_batch(h, w, n, seed=step))["loss"]
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            graphs.append(counters["stats"]["unique_graphs"])
        return losses, graphs

    eager, _ = train(False)
    compiled, graphs = train(True)
    # the same ops in the same order: a graph that baked in a size of an earlier step would give another loss
    assert compiled == pytest.approx(eager, rel=1e-6, abs=1e-7)
    # 8 regions (4 Swin blocks of 4 widths, 2 encoder and 2 decoder layers) in 6 groups: step 1 compiles one graph
    # per group with symbolic sizes; the three later sizes compile nothing
    assert graphs == [6, 6, 6, 6]
    # every compiled graph is a region's: the model's own forward (or anything between the blocks) never is
    assert _get_total_cache_entry_count(_run_region) == 6


def test_compile_backend_is_checked_with_the_key_to_change():
    from vtrain.config import TrainConfig
    from vtrain.errors import ConfigError

    with pytest.raises(ConfigError, match=r"train.compile_backend: choose one of \('inductor', 'aot_eager'\)"):
        TrainConfig(compile_backend="eager")


def test_regions_keep_the_module_tree_and_group_blocks_that_share_a_graph():
    model = DINO("debug", 3)
    keys = list(model.state_dict())
    names = apply_compile(model, "eager")
    assert names == ["backbone.body.layers.0.blocks.0", "backbone.body.layers.1.blocks.0",
                     "backbone.body.layers.2.blocks.0", "backbone.body.layers.3.blocks.0", "encoder.layers.0",
                     "encoder.layers.1", "decoder.layers.0", "decoder.layers.1"]
    assert list(model.state_dict()) == keys  # parameters and buffers untouched: no `_orig_mod.`
    assert compile_groups(model) == 6  # the two encoder layers share one compiled function, the decoder layers too


def test_encoder_layer_with_the_fused_op_compiles_whole_once_for_all_level_shapes(fresh_dynamo, monkeypatch):
    """The custom op `vtrain::ms_deform_attn` (Triton interpreter on CPU) inside a compiled encoder layer: dynamo
    traces its fake kernel (fullgraph: no graph break at the op), and new level shapes reach the op as SymInts."""
    import importlib

    from vtrain.models.dino.msda import auto_impl
    from vtrain.models.dino.transformer import Encoder

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if not importlib.import_module("vtrain.models.dino.msda_triton")._interpreting():
        pytest.skip("the Triton kernels were imported in this process without TRITON_INTERPRET=1")
    torch.manual_seed(0)
    enc = Encoder(layers=1, dim=16, ffn=32, levels=2, heads=2, points=2)
    eager = Encoder(layers=1, dim=16, ffn=32, levels=2, heads=2, points=2)
    eager.load_state_dict(enc.state_dict())
    apply_compile(enc, "aot_eager", sizes_vary=True, fullgraph=True)  # a graph break (at the op, say) would raise
    for shapes in ([(4, 5), (2, 3)], [(6, 4), (3, 2)], [(5, 7), (3, 4)]):
        s = sum(h * w for h, w in shapes)
        src, pos = torch.randn(1, s, 16), torch.randn(1, s, 16)
        mask = torch.zeros(1, s, dtype=torch.bool)
        outs = []
        for m in (enc, eager):
            x = src.clone().requires_grad_()
            with auto_impl("triton"):
                out = m(x, pos, shapes, torch.ones(1, 2, 2), mask)
                out.square().sum().backward()
            outs.append((out.detach(), x.grad))
        torch.testing.assert_close(outs[0][0], outs[1][0])
        torch.testing.assert_close(outs[0][1], outs[1][1], atol=1e-6, rtol=1e-5)
    # one graph for the three sets of level shapes: sizes are symbolic from the first compile (as for DINO training)
    # and the level shapes reach the op as SymInts, no guard on their values
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.slow
def test_two_process_fsdp2_with_checkpointing_compiles_each_block_inside_its_unit(faces, tmp_path):
    """FSDP2 over 2 gloo processes, every backbone block checkpointed: compile goes after checkpointing and before
    `fully_shard` (the FSDP unit's all-gather hooks run eagerly around the compiled forward). Traced with
    `aot_eager`, which runs the same aten ops as eager, so the losses are the eager run's to float32 rounding."""
    config = tmp_path / "aot.yaml"
    config.write_text("train:\n  compile_backend: aot_eager\n")
    args = ["train", "--data", str(faces), "--max-steps", "2", "--grad-ckpt", "backbone", *COMMON]
    ok(launch(2, *args, "--output-dir", str(tmp_path / "eager"), accelerate_config="fsdp.yaml"))
    ok(launch(2, *args, "--output-dir", str(tmp_path / "compiled"), "--compile", "--config", str(config),
              accelerate_config="fsdp.yaml"))
    ranks = run_info(tmp_path / "compiled")["ranks"]
    assert [r["compiled_regions"] for r in ranks] == [["backbone.blocks.0", "backbone.blocks.1"]] * 2
    assert all(r["all_params_dtensor"] and r["grad_ckpt"] == "backbone" for r in ranks)
    eager = [r["loss"] for r in metrics(tmp_path / "eager")]
    assert [r["loss"] for r in metrics(tmp_path / "compiled")] == pytest.approx(eager, rel=1e-6)
    a = load_file(str(complete_checkpoints(tmp_path / "eager")[-1] / "model.safetensors"))
    b = load_file(str(complete_checkpoints(tmp_path / "compiled")[-1] / "model.safetensors"))
    assert sorted(a) == sorted(b)
