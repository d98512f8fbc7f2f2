"""Bad input: one clear line naming the option, a non-zero exit, no traceback, nothing saved damaged."""

import pytest

from tests.helpers.cli import ok, vtrain


def _one_line_error(proc, *needles):
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, proc.stderr
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.mark.parametrize("args,needles", [
    (["--grad-accum", "0"], ["--grad-accum"]),
    (["--model", "vit-huge"], ["--model", "unknown metric preset"]),
    (["--data", "/no/such/dir"], ["--data", "not a directory"]),
    (["--task", "dino", "--model", "vit-b"], ["--model", "unknown dino preset"]),
    (["--config", "/no/such.yaml"], ["--config", "not found"]),
    (["--resume", "/no/such/ckpt"], ["--resume"]),
    (["--ds-config", "/no/such.json"], ["--ds-config"]),
    (["--grad-ckpt", "encoder"], ["--grad-ckpt", "encoder"]),
    (["--grad-ckpt", "backbone:7"], ["--grad-ckpt", "stageN or blockN", "forms: PART"]),
    (["--ds-config", "ds_configs/zero2.json", "--fsdp"], ["--fsdp"]),
])
def test_bad_flags(args, needles, tmp_path):
    _one_line_error(vtrain("train", "--output-dir", str(tmp_path / "r"), *args), *needles)


def test_bad_yaml_and_json_files(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("train: {batch_size: [1, 2\n")
    _one_line_error(vtrain("train", "--config", str(y)), "--config", "not valid YAML")
    j = tmp_path / "ds.json"
    j.write_text('{"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 4}')
    _one_line_error(vtrain("train", "--ds-config", str(j), "--grad-accum", "2", "--output-dir", str(tmp_path / "r")),
                    "gradient_accumulation_steps=4 contradicts --grad-accum")
    j.write_text("{oops")
    _one_line_error(vtrain("train", "--ds-config", str(j)), "--ds-config", "not valid JSON")


def test_data_without_identity_folders(tmp_path):
    (tmp_path / "empty").mkdir()
    _one_line_error(vtrain("train", "--data", str(tmp_path / "empty"), "--output-dir", str(tmp_path / "r")), "--data")


def test_eval_bad_checkpoint_and_unknown_option(tmp_path):
    _one_line_error(vtrain("eval", "--checkpoint", str(tmp_path)), "--checkpoint")
    proc = vtrain("train", "--no-such-flag")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "No such option" in proc.stderr


def test_presets_command_lists_every_preset():
    out = ok(vtrain("presets")).stdout
    for name in ("debug", "vit-t", "vit-s", "vit-b", "vit-l", "swin-t", "swin-b", "swin-l", "resnet50"):
        assert name in out
