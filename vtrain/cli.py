"""Command line (Typer only): builds a validated config and calls the core. User mistakes become one line on
stderr and exit code 2, never a traceback.

Start-up speed: this module imports nothing that imports torch (tests/core/test_layers.py checks it), so a flag or
config error is reported in about half a second. Each command imports the heavy modules it needs (engine,
tools, models) inside its function, after the checks that need none of them."""

from __future__ import annotations

import inspect
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from vtrain.cli_options import choice, command_of, parameter, shared
from vtrain.cli_rules import path, text, user_error
from vtrain.config import FLAG_SECTIONS, PRECISIONS, TASKS, config_from_flags, options  # noqa: F401
from vtrain.config import DataConfig
from vtrain.config.estimate import EstimateOptions
from vtrain.config.fields import check_value
from vtrain.config.paths import check_exists, check_demo_batch
from vtrain.console import console, end_log, header, log_to, plain, start_log
from vtrain.engine.engines.ds_config import check_ds_config
from vtrain.engine.interrupt import GracefulInterrupt, TrainingInterrupted
from vtrain.engine.run_files import check_new_run, eval_log
from vtrain.errors import VtrainError
from vtrain.exit import end as _exit
from vtrain.exit import groups_left as _groups_left
from vtrain.exit import leave_gloo_group as _leave_gloo_group
from vtrain.launch import check_launch
from vtrain.io.safeio import force_weights_only_env

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Train large vision models on small GPUs (Accelerate + DeepSpeed ZeRO / FSDP2).")


Task, Precision = choice("Task", TASKS), choice("Precision", PRECISIONS)
Dtype = choice("Dtype", ("fp32", "bf16", "fp16"))  # consolidate's output dtypes: Click refuses any other

# options more than one command takes, declared once (eval and predict: a run's checkpoint, tested at its test size)
RunBatch = shared("train.batch_size", "Batch size (default: the run's micro-batch)")
RunMaxPixels = shared("data.max_image_pixels", "Refuse images above this many pixels, read from their header "
                      "(default: the run's, else PIL's 89478485)")
TestSize = Annotated[Optional[int], typer.Option(
    help="Detection: test short side (default: the run's --image-size; the published DINO tests at 800)")]
TestMaxSize = Annotated[Optional[int], typer.Option(
    help="Detection: test longest-side cap (default: --image-size x 1333 / 800, or the run's)")]
Best = Annotated[bool, typer.Option("--best", help="The run's best checkpoint (checkpoints/best.json)")]
Weights = Annotated[Optional[str], typer.Option(
    parser=text, help="ema or model (default: ema when the checkpoint has EMA weights)")]


def _train_command(fn: Any) -> Any:
    """`fn(config, task, **section_flags)` with one parameter per config field that has a flag, plus --config."""
    config = inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[
        Optional[Path], typer.Option(
            parser=path, help="YAML config, keys as in docs/options.md (a run's config.yaml too); flags "
                                     "override its values")])
    params = [parameter(o) for o in options() if o.flag] + [config]
    fn.__signature__ = inspect.Signature(params, return_annotation=None)
    return fn


@app.command()
@_train_command
def train(**flags: Any) -> None:
    """Train a model; the same command runs on 1 CPU process, N CPU processes (gloo), GPUs and nodes."""
    # first: a SIGTERM/SIGINT that arrives while the model is being built must also lead to a checkpoint
    interrupt = GracefulInterrupt().install()
    if os.environ.get("RANK", "0") == "0":
        start_log()  # this console, kept for <output-dir>/train.log (written once the directory is claimed)
    check_launch()  # `accelerate launch --num_processes N` that started one process alone (launch.py)
    cfg = config_from_flags(flags)
    # what start-up would refuse after a minute of imports, refused now (each one line, no torch imported yet)
    check_new_run(cfg.train.output_dir, cfg.train.resume, cfg.train.overwrite_output_dir)
    check_ds_config(cfg)
    check_demo_batch(cfg.task, cfg.data, cfg.train)
    from vtrain.engine.trainer import Trainer

    Trainer(cfg, interrupt).fit()


@app.command("eval")
def evaluate(
    checkpoint: Annotated[Path, typer.Option(
        parser=path, help="Checkpoint dir (checkpoints/step_N) or a run dir (newest)")],
    task: Annotated[Optional[Task], typer.Option(help="Expected task (checked against the checkpoint)")] = None,
    # the data to evaluate on: train's data fields, each defaulting to the run's (tools/evaluate.py checks them as
    # a DataConfig)
    data: shared("data.path", "Data directory, a verification .bin pack, or `demo`; default: the run's data") = None,
    val_data: shared("data.val_path", "Metric: held-out identity tree") = None,
    pairs: shared("data.pairs_file", "Metric: verification pairs file") = None,
    val_targets: shared("data.val_targets", "Metric: verification .bin packs (NAME = <data>/NAME.bin, or paths)") = None,
    val_ann: shared("data.val_ann", "Detection: COCO annotation JSON to evaluate on") = None,
    val_images: shared("data.val_images", "Detection: its image folder") = None,
    batch_size: RunBatch = None,
    save_predictions: Annotated[Optional[str], typer.Option(
        parser=text, help="Detection: write COCO results JSON here")] = None,
    classwise: Annotated[bool, typer.Option(help="Detection: AP per category (a table, and in --json)")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print metrics as one JSON object on the last line")] = False,
    best: Best = False,
    weights: Weights = None,
    max_image_pixels: RunMaxPixels = None,
    overwrite: Annotated[bool, typer.Option(help="Replace --save-predictions when it exists (never a checkpoint's file)")] = False,
    image_size: TestSize = None,
    max_size: TestMaxSize = None,
    ijb: Annotated[Optional[Path], typer.Option(
        parser=path, help="Metric: IJB-B/C 1:1 verification on this folder")] = None,
    ijb_target: Annotated[Optional[str], typer.Option(
        parser=text, help="ijbb or ijbc (default: from --ijb's files)")] = None,
) -> None:
    """Evaluate a checkpoint: face verification (10-fold accuracy on .bin packs, TAR@FAR, best accuracy), IJB-B/C
    1:1 verification (--ijb) or COCO box AP. With --save-predictions the console also goes to eval.log beside the
    predictions."""
    check_exists(checkpoint, "--checkpoint")
    start_log()  # kept for eval.log, written once the predictions are (the evaluation's output place)
    from vtrain.tools.evaluate import evaluate_checkpoint

    if best:
        from vtrain.engine.checkpoint.best import best_checkpoint

        checkpoint = best_checkpoint(checkpoint, "--checkpoint")
        console.print(f"best checkpoint: {checkpoint}", soft_wrap=True)
    overrides = {"path": data, "val_path": val_data, "pairs_file": pairs, "val_targets": val_targets,
                 "val_ann": val_ann, "val_images": val_images, "max_image_pixels": max_image_pixels}
    run_task, metrics = evaluate_checkpoint(checkpoint, overrides, batch_size, task.value if task else None,
                                            save_predictions, weights, overwrite, image_size, max_size, classwise,
                                            ijb, ijb_target)
    log, why = eval_log(save_predictions) if save_predictions else (None, "")
    if log is not None:
        log_to(log, header("eval"))
    elif why:
        console.print(f"no eval.log: {why}", soft_wrap=True)
    size = f", test size {metrics['test_size'][0]}/{metrics['test_size'][1]}" if "test_size" in metrics else ""
    console.print(run_task.metrics_table(metrics, title=f"{run_task.name}: {checkpoint} ({metrics['weights']} "
                                                        f"weights{size})"))
    if classwise:
        console.print(run_task.classwise_table(metrics))
    if save_predictions:
        console.print(f"wrote {save_predictions}", soft_wrap=True)
    if as_json:  # per-category numbers only when asked for (eval.jsonl of a training run always keeps them)
        hidden = ("rows",) if classwise else ("rows", "per_class")
        plain(json.dumps({k: v for k, v in metrics.items() if k not in hidden}))


@app.command()
def predict(
    images: Annotated[list[str], typer.Option(parser=text,
        help="Image file, folder (searched at any depth) or quoted glob pattern; repeat for more")],
    out: Annotated[Path, typer.Option(
        parser=path, help="Detection: output folder; metric: the .safetensors file to write")],
    checkpoint: Annotated[Optional[Path], typer.Option(
        parser=path, help="Checkpoint dir (checkpoints/step_N) or a run dir (newest)")] = None,
    task: Annotated[Optional[Task], typer.Option(help="Expected task (default: the checkpoint's)")] = None,
    score_threshold: Annotated[Optional[float], typer.Option(
        help="Detection: draw and keep boxes scoring at least this (default 0.3)")] = None,
    nms_iou: Annotated[Optional[float], typer.Option(
        help="Detection: drop a box whose IoU with a higher-scoring box of any class exceeds this (default: no NMS, "
             "as DINO is trained and evaluated)")] = None,
    batch_size: RunBatch = None,
    ann: Annotated[Optional[str], typer.Option(parser=text,
        help="Detection: COCO annotation JSON whose file_names give the image ids (default: 1..N)")] = None,
    num_workers: Annotated[int, typer.Option(help="Image decoding workers")] = 2,
    max_image_pixels: RunMaxPixels = None,
    overwrite: Annotated[bool, typer.Option(help="Replace the files --out names when it exists (never a checkpoint's file)")] = False,
    image_size: TestSize = None,
    max_size: TestMaxSize = None,
    onnx: Annotated[Optional[Path], typer.Option(
        parser=path, help="Detection: run this ONNX file of `vtrain export` with onnxruntime instead of a checkpoint")] = None,
) -> None:
    """Run a checkpoint on images: drawn boxes + COCO results JSON (detection) or embeddings (metric)."""
    check_exists(checkpoint, "--checkpoint")
    from vtrain.tools.predict import predict as run_predict

    check_value(DataConfig, "num_workers", num_workers)  # train's rule (--batch-size: tools/predict.py, the same)
    report = run_predict(checkpoint, images, out, task.value if task else None, score_threshold=score_threshold,
                         nms_iou=nms_iou, batch_size=batch_size, ann=ann, num_workers=num_workers, max_pixels=max_image_pixels,
                         overwrite=overwrite, image_size=image_size, max_size=max_size, onnx=onnx)
    if report.task == "dino":
        console.print(f"{report.images} images on {report.device} at test size {report.test_size[0]}/"
                      f"{report.test_size[1]}: {report.detections} boxes with score >= {report.score_threshold}"
                      f"{'' if report.nms_iou is None else f' after NMS at IoU {report.nms_iou}'}; "
                      f"wrote the drawn images and predictions.json to {out}", soft_wrap=True)
    else:
        console.print(f"{report.images} images on {report.device}: wrote {out} (embeddings; file names in its "
                      "metadata)", soft_wrap=True)


@app.command("consolidate")
def consolidate_cmd(
    ckpt: Annotated[Path, typer.Argument(
        parser=path, help="vtrain run/checkpoint dir, DeepSpeed checkpoint, Accelerate state")],
    out: Annotated[Path, typer.Argument(parser=path, help="Output file: .safetensors or .pt")],
    dtype: Annotated[Dtype, typer.Option(help="Output dtype: fp32 (default), bf16 or fp16", show_default=False)] = Dtype.fp32,
    max_shard_size: Annotated[Optional[str], typer.Option(
        parser=text, help="Split into shards + index, e.g. 5GB")] = None,
    allow_nonfinite: Annotated[bool, typer.Option(help="Write even when tensors hold inf/NaN")] = False,
    check_model: Annotated[bool, typer.Option(help="Load the result strictly into the model of config.yaml")] = False,
    overwrite: Annotated[bool, typer.Option(help="Replace OUT when it exists (never a checkpoint's file)")] = False,
    backbone_only: Annotated[bool, typer.Option(
        help="Metric: leave the class head out (backbone + embedding neck, what inference needs)")] = False,
    verbose: Annotated[bool, typer.Option(help="Show notes and peak RSS")] = False,
    best: Best = False,
    weights: Annotated[Optional[str], typer.Option(parser=text,
        help="ema or model (default: ema when the vtrain checkpoint has EMA weights)")] = None,
) -> None:
    """Turn a (sharded) checkpoint into one verified state dict; every tensor, buffers included, is scanned."""
    check_exists(ckpt, "CKPT")
    import torch
    from rich.table import Table

    from vtrain.tools.consolidate import consolidate, parse_size

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    report = consolidate(ckpt, out, dtypes[dtype.value], parse_size(max_shard_size), allow_nonfinite, check_model,
                         overwrite, weights, best, backbone_only)
    console.print(f"found: {report.source.description}", soft_wrap=True)
    console.print(f"{report.tensors} tensors, {report.numel:,} elements", soft_wrap=True)
    if verbose:
        for note in report.source.notes:
            console.print(f"  note: {note}", soft_wrap=True)
        console.print(f"peak RSS {report.peak_rss_mb:.0f} MiB", soft_wrap=True)
    if report.offenders:
        # what is written, after the cast: "by the cast" counts values finite in the checkpoint beyond --dtype's range
        t = Table(title="non-finite values")
        for col in ("tensor", "dtype", "inf/NaN", "by the cast", "of", "buffer"):
            t.add_column(col)
        for o in report.offenders:
            t.add_row(o.name, o.dtype, str(o.nonfinite), str(o.overflow), str(o.numel), "yes" if o.is_buffer else "")
        console.print(t)
        cast = sum(o.overflow > 0 for o in report.offenders)
        why = (f" ({cast} of them only after the cast to {dtype.value}: values beyond its range; --dtype bf16 or fp32 "
               "keeps them)" if cast else "")
        if not allow_nonfinite:
            raise VtrainError(f"{len(report.offenders)} tensors hold inf/NaN as written{why}; {out} was not written "
                              "(--allow-nonfinite writes it anyway)")
    else:
        console.print("every tensor is finite as written")
    for f in report.files:
        console.print(f"wrote {f}", soft_wrap=True)


@app.command("export")
def export_cmd(
    checkpoint: Annotated[Path, typer.Argument(parser=path, help="Run dir (newest checkpoint) or checkpoints/step_N: a "
                                                    "metric or DINO checkpoint")],
    out: Annotated[Path, typer.Argument(parser=path, help="Output file, e.g. model.onnx")],
    opset: Annotated[int, typer.Option(help="ONNX opset (18 up to what the installed onnx/onnxscript write)")] = 18,
    verify: Annotated[bool, typer.Option(help="Compare onnxruntime with PyTorch on inputs the export did not trace")] = True,
    overwrite: Annotated[bool, typer.Option(help="Replace OUT (and OUT.data) when it exists (never a checkpoint's file)")] = False,
    weights: Weights = None,
    raw: Annotated[Optional[bool], typer.Option(
        "--raw", help="Detection: output the raw logits and boxes of every query instead of the top-k detections")] = None,
    msda: Annotated[Optional[str], typer.Option(
        parser=text, help="Detection: deformable attention as grid-sample (default; ONNX GridSample) or gather "
        "(no GridSample, for TensorRT-like runtimes)")] = None,
    top_k: Annotated[Optional[int], typer.Option(help="Detection: detections per image (default 300)")] = None,
) -> None:
    """Export a metric model's embedding network, or a DINO detector with a dynamic batch and image size, to ONNX."""
    check_exists(checkpoint, "CHECKPOINT")
    from vtrain.tools.export import MEAN, STD, export_onnx

    r = export_onnx(checkpoint, out, opset, verify, overwrite, weights, raw, msda, top_k)
    console.print(f"exported {r.checkpoint} ({r.params:,} parameters, {r.weights} weights) to {r.path}"
                  + (f" + {r.path.name}.data" if r.external_data else ""), soft_wrap=True)
    if r.task == "dino":
        m = r.meta
        console.print(f"inputs `images`: float32 N x 3 x H x W, RGB, (x / 255 - mean) / std (mean {m['mean']}, std "
                      f"{m['std']}), any H, W (padded inside to a multiple of {m['pad_multiple']}); `image_sizes`: "
                      "int64 N x 2 (height, width of each image; the rest is padding)", soft_wrap=True)
        if m["output_convention"] == "raw":
            console.print("outputs `logits` N x Q x C and `boxes` N x Q x 4 (cx, cy, w, h normalised to each image)",
                          soft_wrap=True)
        else:
            console.print(f"outputs the top {m['top_k']} detections per image: `scores` N x K, `labels` N x K (index "
                          f"into the {m['num_classes']} categories of the metadata), `boxes` N x K x 4 (x0, y0, x1, "
                          "y1 in input pixels)", soft_wrap=True)
        for c in r.checks or []:
            unit = "" if m["output_convention"] == "raw" else " px"
            console.print(f"onnxruntime vs PyTorch, batch {c.batch} at {c.height} x {c.width}: max diff "
                          f"{'logits' if unit == '' else 'scores'} {c.score_diff:.1e}, boxes {c.box_diff:.1e}{unit} "
                          f"({c.detections} compared)", soft_wrap=True)
        return
    console.print(f"input `input`: float32 N x 3 x {r.image_size} x {r.image_size}, RGB, x / {MEAN} - 1 "
                  f"(mean {MEAN}, std {STD}); output `embedding`: N x {r.embedding_dim}, not L2-normalised",
                  soft_wrap=True)
    if r.max_abs_diff is not None:
        console.print(f"onnxruntime vs PyTorch (batch 3): max abs diff {r.max_abs_diff:.2e}", soft_wrap=True)


@app.command("estimate-memory")
@command_of(EstimateOptions)
def estimate_memory_cmd(opts: EstimateOptions) -> None:
    """Predict per-GPU training memory from the real model, without a GPU (fake tensors, one traced step)."""
    opts.run_config()  # the run's values checked as `vtrain train` checks them, before the imports: an error at once
    tracing = ("estimate-memory: building the model on the meta device and tracing one training step with fake "
               "tensors (no memory is allocated; up to a minute for a large model, more with --memory-budget or the "
               "other checkpointing choices)")
    if opts.as_json:  # stdout is the JSON object alone
        print(tracing, file=sys.stderr)
    else:
        console.print(tracing, soft_wrap=True)
    from vtrain.tools.estimate_memory import estimate_report, setup_from

    rows = (15 if opts.breakdown_rows is None else opts.breakdown_rows) if opts.breakdown else 0
    report = estimate_report(setup_from(opts), opts.gpu_memory, opts.compare_gc, rows)
    if opts.as_json:
        plain(json.dumps(report))
        return
    from vtrain.tools.memory_table import render

    for item in render(report):
        console.print(item, soft_wrap=isinstance(item, str))


@app.command()
def presets() -> None:
    """List model presets with parameter counts (stored with the presets, checked against the built models by the
    tests: instant)."""
    from vtrain.tools.presets_table import preset_tables

    for table in preset_tables():
        console.print(table)


@app.command("convert")
def convert_cmd(
    src: Annotated[Path, typer.Argument(parser=path, help="A published checkpoint file (e.g. arcface_torch model.pt)")],
    out: Annotated[Path, typer.Argument(parser=path, help="New run directory to write (its checkpoints/step_0)")],
    source: Annotated[str, typer.Option("--from", parser=text, help="What wrote SRC: arcface-vit, idea-dino, "
                                        "detrex-dino or mmdet-dino (docs/convert.md)")],
    model: Annotated[Optional[str], typer.Option("--model", parser=text, help="Preset to fill (default: the one of "
                                                 "the file's sizes, else the source's)")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace OUT when it is an earlier `vtrain convert` output")] = False,
    categories: Annotated[Optional[Path], typer.Option(
        parser=path, help="Detection: JSON naming the classes, one per class row: a COCO `categories` list (id, name) or a list "
        "of names (ids 1..N); default: the file's own names, else COCO's for COCO's class count")] = None,
) -> None:
    """Convert a published checkpoint into a vtrain checkpoint that eval, predict, export, consolidate and
    --pretrained read."""
    from vtrain.tools.convert import convert

    r = convert(src, out, source, model, overwrite, categories)
    for note in r.notes:
        console.print(note, soft_wrap=True)
    left = "".join(f"; left out {k} ({why})" for k, why in r.unused.items())
    console.print(f"filled all {r.filled} tensors of --model {r.preset}{left}", soft_wrap=True)
    console.print(f"wrote {r.checkpoint}", soft_wrap=True)


def main() -> None:
    groups = _groups_left()  # the caller's own (a test calling main in its process): never ended here
    try:
        code = _run()
    except Exception:
        if _groups_left() == groups:
            raise  # the traceback reaches the log too: it ends at exit (console.start_log)
        traceback.print_exc()  # what the interpreter prints for an uncaught exception, then exit 1
        code = 1
    end_log()  # the command's log file (train.log, eval.log) holds its last line, the error line included
    _exit(code, groups)


def _run() -> int:
    """The command, and its exit code: every user error is one `error: ...` line and 2."""
    # Every user error is one `error: ...` line and exit 2: Click's usage errors (an unknown option, `--seed abc`)
    # as well as our own VtrainError from anywhere in the core. Click runs in non-standalone mode so that its
    # errors reach us instead of being drawn as a multi-line box. Typer vendors Click; from 0.28 its errors are
    # typer.TyperException (public), with Click's `exit_code`, `format_message()` and, for a usage error, `ctx`.
    force_weights_only_env()  # before any command reads a file a user handed us (io/safeio.py)
    if not console.is_terminal:  # --help by the one width rule (console.py): no option name or default cut
        import typer.rich_utils

        typer.rich_utils.MAX_WIDTH = console.width
    try:
        code = app(standalone_mode=False)  # the exit code of --help and the like, else the command's None
    except typer.TyperException as e:
        if type(e).__name__ == "NoArgsIsHelpError":  # `vtrain` alone: Typer's rich help is already printed
            if e.format_message().strip():
                e.show()  # type: ignore[attr-defined]
            return e.exit_code
        print(user_error(e), file=sys.stderr)
        return e.exit_code
    except typer.Abort:
        return 1
    except TrainingInterrupted as e:
        if os.environ.get("RANK", "0") == "0":
            print(str(e), file=sys.stderr)
        return e.code
    except Exception as e:
        line = user_error(e)
        if line is None:
            raise
        if not getattr(e, "quiet", False):  # an error rank 0 reports for all ranks
            print(line, file=sys.stderr)
        _leave_gloo_group()
        return 2
    return code if isinstance(code, int) else 0


if __name__ == "__main__":
    main()
