"""Hostile and careless files around a run (the files of a run, and --keep-best's superseded best):
nothing outside the run is read as its own, written or deleted; every malformed file and every environment error
is one line; a superseded best checkpoint does not outlive the run.

Every row of CASES is one `vtrain` command through the fork server (helpers/cli_server.py), on a copy of a finished
run (checkpoints step_1 and step_2) and a decoy folder outside it: an archive holding a copy of the run's own
step_1 (the same lineage, so a pruning that followed a link would take it), a copy of its weights and random bytes.
Each asserts: a non-zero exit with exactly one `error:` line holding the needles and no traceback (or, for an `ok`
row, exit 0 with the needles in the output); the decoy folder byte-identical and its checkpoint still verifying;
every checkpoint of the run that verified before still verifying (or, where a row prunes, exactly the ones it
names); no staging folder and no temp file left behind.

Environment errors are real ones: a full disk is RLIMIT_FSIZE with SIGXFSZ ignored (the crossing write fails with
EFBIG: `torch.save` then raises a RuntimeError without an errno, safetensors its own SafetensorError), and, where the
tests run as root, a small tmpfs (ENOSPC); a read-only folder is a read-only bind mount in the command's own mount
namespace as root, else a folder without write permission.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.helpers.cli import reseal, tree_hash
from tests.helpers.scaffold import case_table, copied_run, served, shown, verdict
from vtrain.engine.checkpoint import format as ckpt
from tests.helpers.files import (
    face_run, FilesCli, leftovers as _leftovers, private_mounts_work as _private_mounts_work, ROOT_USER, TRAIN,
    verifying as _verifying)


@dataclass
class Prior:
    cli: FilesCli
    faces: Path
    """train/: 2 identities x 2 images; val/: 2 held-out identities x 2 images."""
    run: Path
    """A finished run: checkpoints step_1 and step_2."""
    run_id: str


@pytest.fixture(scope="module")
def prior(tmp_path_factory) -> Prior:
    with served(tmp_path_factory, "hostile_files", FilesCli) as (root, cli):
        faces, run = face_run(root, cli)
        yield Prior(cli, faces, run, ckpt.read_manifest(run / "checkpoints" / "step_2").run_id)


@dataclass
class Ctx:
    prior: Prior
    run: Path
    """The case's run directory: a copy of the prior run."""
    decoy: Path
    """Outside the run: archive/step_1 (a copy of the run's own step_1), weights.safetensors, bytes.bin."""
    out: Path
    """An empty folder for outputs."""
    options: dict = field(default_factory=dict)
    """For the CLI server: file_size_limit, read_only; for the test: tmpfs (the run on a small file system)."""

    @property
    def ckpts(self) -> Path:
        return self.run / "checkpoints"

    def step(self, n: int) -> Path:
        return self.ckpts / f"step_{n}"

    def link(self, at: Path, target: Path) -> None:
        """Replace `at` (a file or folder of the run) by a link to `target`."""
        if at.is_dir() and not at.is_symlink():
            shutil.rmtree(at)
        elif os.path.lexists(at):
            at.unlink()
        at.symlink_to(target)

    def edit_json(self, path: Path, change: Callable[[dict], None], seal: bool = True) -> None:
        """Change a checkpoint's JSON file as a user editing it would, and reseal its manifest (so what is tested
        is the content check, not the checksum)."""
        data = json.loads(path.read_text())
        change(data)
        path.write_text(json.dumps(data))
        if seal:
            reseal(path.parent)

    def train(self, *args: str) -> list[str]:
        return ["train", "--data", str(self.prior.faces), "--output-dir", str(self.run), *TRAIN, *args]

    def resume(self, *args: str) -> list[str]:
        return self.train("--resume", "auto", "--max-steps", "3", *args)


@dataclass
class Case:
    build: Callable[[Ctx], list[str]]
    needles: tuple[str, ...]
    ok: bool = False
    kept: tuple[str, ...] | None = None
    """An ok row that prunes: exactly these checkpoints of the run remain (each verifying)."""


CASES, case = case_table(Case)


# ---- §1 nothing outside the run is read as the run's, written or deleted ------------------------------------------

@case("prune-leaves-a-symlinked-checkpoint-of-the-same-lineage", "step_0 is a symbolic link", "left alone",
      ok=True, kept=("step_3",))
def _(c):
    c.link(c.ckpts / "step_0", c.decoy / "archive" / "step_1")  # the oldest: --keep-last 1 would take it first
    return c.resume("--save-every", "1", "--keep-last", "1")


@case("overwrite-output-dir-leaves-a-symlinked-checkpoint", "step_0 is a symbolic link", "left alone",
      "deleted 2 checkpoints", ok=True, kept=("step_1",))
def _(c):
    c.link(c.ckpts / "step_0", c.decoy / "archive" / "step_1")
    return c.train("--max-steps", "1", "--overwrite-output-dir")


@case("symlinked-checkpoints-folder", "checkpoints is a symbolic link", "--output-dir")
def _(c):
    shutil.copytree(c.ckpts, c.decoy / "moved", symlinks=True)
    c.link(c.ckpts, c.decoy / "moved")
    return c.resume("--keep-last", "1")


@case("symlinked-checkpoints-folder-overwrite-output-dir", "checkpoints is a symbolic link")
def _(c):
    c.link(c.ckpts, c.decoy / "archive")
    return c.train("--max-steps", "1", "--overwrite-output-dir")


@case("stale-staging-folder-is-a-symlink", ".tmp-step_3 is a symbolic link")
def _(c):
    c.link(c.ckpts / ".tmp-step_3", c.decoy / "archive" / "step_1")  # the folder the next save clears
    return c.resume()


@case("run-config-yaml-is-a-symlink", "config.yaml is a symbolic link")
def _(c):
    c.link(c.run / "config.yaml", c.decoy / "bytes.bin")
    return c.resume()


@case("run-metrics-jsonl-is-a-symlink", "metrics.jsonl is a symbolic link")
def _(c):
    c.link(c.run / "metrics.jsonl", c.decoy / "bytes.bin")
    return c.resume()


@case("resume-skips-a-checkpoint-holding-a-linked-file", "skipped the damaged checkpoint step_2",
      "model.safetensors is a symbolic link", "resumed from", ok=True)
def _(c):
    shutil.copy(c.step(2) / "model.safetensors", c.decoy / "model-copy.safetensors")  # same bytes: hashes agree
    c.link(c.step(2) / "model.safetensors", c.decoy / "model-copy.safetensors")
    return c.resume()


@case("prune-leaves-a-linked-folder-inside-a-checkpoint", "accelerate is a symbolic link", "left alone",
      ok=True, kept=("step_3",))
def _(c):
    shutil.copytree(c.step(1) / "accelerate", c.decoy / "accelerate")
    c.link(c.step(1) / "accelerate", c.decoy / "accelerate")
    return c.resume("--save-every", "1", "--keep-last", "1")


@case("predict-out-exists", "--out", "emb.safetensors exists", "--overwrite")
def _(c):
    (c.out / "emb.safetensors").write_bytes(b"results of yesterday")
    return ["predict", "--checkpoint", str(c.run), "--images", str(c.prior.faces / "val"), "--out",
            str(c.out / "emb.safetensors"), "--num-workers", "0"]


@case("predict-out-is-a-checkpoints-own-file", "inside the checkpoint", "step_2", "never writes into a checkpoint")
def _(c):
    return ["predict", "--checkpoint", str(c.run), "--images", str(c.prior.faces / "val"), "--out",
            str(c.step(2) / "model.safetensors"), "--num-workers", "0", "--overwrite"]


@case("predict-out-links-to-a-checkpoints-file", "inside the checkpoint", "step_1")
def _(c):
    (c.out / "emb.safetensors").symlink_to(c.step(1) / "model.safetensors")
    return ["predict", "--checkpoint", str(c.run), "--images", str(c.prior.faces / "val"), "--out",
            str(c.out / "emb.safetensors"), "--num-workers", "0", "--overwrite"]


@case("predict-overwrite-replaces-a-link-not-its-target", "wrote", "emb.safetensors", ok=True)
def _(c):
    (c.out / "emb.safetensors").symlink_to(c.decoy / "bytes.bin")
    return ["predict", "--checkpoint", str(c.run), "--images", str(c.prior.faces / "val"), "--out",
            str(c.out / "emb.safetensors"), "--num-workers", "0", "--overwrite"]


@case("export-onnx-exists", "OUT", "model.onnx exists", "--overwrite")
def _(c):
    (c.out / "model.onnx").write_bytes(b"an earlier export")
    return ["export", str(c.run), str(c.out / "model.onnx"), "--no-verify"]


@case("export-into-a-checkpoint", "inside the checkpoint", "step_2")
def _(c):
    return ["export", str(c.run), str(c.step(2) / "model.onnx"), "--no-verify"]


@case("consolidate-over-a-checkpoints-file-with-overwrite", "inside the checkpoint", "step_2")
def _(c):
    return ["consolidate", str(c.run), str(c.step(2) / "model.safetensors"), "--overwrite"]


@case("eval-save-predictions-exists", "--save-predictions", "preds.json exists", "--overwrite")
def _(c):
    (c.out / "preds.json").write_text("[]")
    return ["eval", "--checkpoint", str(c.run), "--val-data", str(c.prior.faces / "val"), "--save-predictions",
            str(c.out / "preds.json")]


# ---- §4 one line for every malformed file -------------------------------------------------------------------------

@case("complete-step-is-a-list-resume-falls-back", "skipped the damaged checkpoint step_2", "`step` must be an integer",
      "resumed from", ok=True)
def _(c):
    c.edit_json(c.step(2) / "COMPLETE", lambda m: m.update(step=[2]), seal=False)
    return c.resume()


@case("complete-file-size-is-a-string", "--checkpoint", "`size` must be an integer", "no checkpoint")
def _(c):
    for n in (1, 2):
        c.edit_json(c.step(n) / "COMPLETE", lambda m: m["files"]["train_state.json"].update(size="471"), seal=False)
    return ["eval", "--checkpoint", str(c.run), "--val-data", str(c.prior.faces / "val")]


@case("complete-lists-a-path-outside-the-checkpoint", "--resume", "which is not a file inside the checkpoint")
def _(c):
    c.edit_json(c.step(2) / "COMPLETE", lambda m: m["files"].update({"../../../decoy/bytes.bin": m["files"][
        "train_state.json"]}), seal=False)
    return c.train("--resume", str(c.step(2)), "--max-steps", "3")


@case("train-state-step-is-a-string-resume-falls-back", "skipped the damaged checkpoint step_2",
      "`step` must be an integer", "resumed from", ok=True)
def _(c):
    c.edit_json(c.step(2) / "train_state.json", lambda s: s.update(step="two"))
    return c.resume()


@case("train-state-scheduler-sets-the-optimizer", "--resume", "`optimizer` is not a scheduler setting")
def _(c):
    c.edit_json(c.step(2) / "train_state.json", lambda s: s["scheduler"].update(optimizer={"lr": 1}))
    return c.train("--resume", str(c.step(2)), "--max-steps", "3")


@case("train-state-ema-updates-is-a-list", "--resume", "`updates` must be an integer")
def _(c):
    c.edit_json(c.step(2) / "train_state.json", lambda s: s.update(ema={"decay": 0.9, "warmup": 0, "updates": [1]}))
    return c.train("--resume", str(c.step(2)), "--max-steps", "3", "--ema-decay", "0.9")


@case("best-json-metric-is-a-number", "--keep-best: ignoring the earlier record", "`metric` must be", ok=True)
def _(c):
    best = {"step": 2, "metric": 5, "value": 0.5, "mode": "max", "run_id": c.prior.run_id, "checkpoint": "step_2"}
    (c.ckpts / "best.json").write_text(json.dumps(best))
    return c.resume("--keep-best", "acc", "--val-data", str(c.prior.faces / "val"))


@case("best-json-value-is-a-string-for-eval-best", "--best", "`value` must be a finite number")
def _(c):
    best = {"step": 2, "metric": "balanced_accuracy", "value": "high", "mode": "max", "run_id": c.prior.run_id}
    (c.ckpts / "best.json").write_text(json.dumps(best))
    return ["eval", "--checkpoint", str(c.run), "--best", "--val-data", str(c.prior.faces / "val")]


@case("stale-lock-with-a-negative-pid-is-taken-over", "saved", "step_3", ok=True)
def _(c):
    lock = c.run / ".vtrain.lock"
    lock.write_text(json.dumps({"host": os.uname().nodename, "pid": -5, "started": 1.0, "token": "x"}))
    os.utime(lock, (1e9, 1e9))  # written long ago: a lock that cannot be read is stale after 2 minutes
    return c.resume()


@case("yaml-value-of-the-wrong-type-under-a-flag", "--config train.max_steps", "expected an integer", "'many'")
def _(c):
    (c.out / "c.yaml").write_text("train: {max_steps: many}\n")
    return ["train", "--data", str(c.prior.faces), "--output-dir", str(c.out / "new"), *TRAIN, "--config",
            str(c.out / "c.yaml"), "--max-steps", "1"]


# ---- §4 the environment: paths that cannot be written or read back -----------------------------------------------

@case("tensorboard-path-is-a-file", "--report-to", "tensorboard is a file")
def _(c):
    (c.run / "tensorboard").write_text("not a folder")
    return c.resume("--report-to", "tensorboard")


@case("output-dir-not-utf8", "--output-dir", "is not valid UTF-8", "safetensors")
def _(c):
    return ["train", "--data", str(c.prior.faces), "--output-dir", os.fsdecode(bytes(c.out) + b"/run\xff"), *TRAIN,
            "--max-steps", "1"]


@case("predict-out-not-utf8", "--out", "is not valid UTF-8")
def _(c):
    return ["predict", "--checkpoint", str(c.run), "--images", str(c.prior.faces / "val"), "--out",
            os.fsdecode(bytes(c.out) + b"/emb\xff.safetensors"), "--num-workers", "0"]


@case("read-only-output-dir", "cannot create the lock", ".vtrain.lock")
def _(c):
    c.options["read_only"] = [str(c.run)]
    return c.resume()


@case("disk-full-at-torch-save-during-a-checkpoint", "saving checkpoint step_3", "cannot write",
      "File too large", "removed the unfinished .tmp-step_3", "newest: step_2")
def _(c):
    c.options["file_size_limit"] = 600_000  # the model's 486 kB pass, the optimizer's 994 kB (torch.save) do not
    return c.resume()


@case("disk-full-at-safetensors-during-a-checkpoint", "saving checkpoint step_3", "File too large",
      "removed the unfinished .tmp-step_3")
def _(c):
    c.options["file_size_limit"] = 300_000  # Accelerate's model.safetensors (486 kB) is the first to cross it
    return c.resume()


@case("disk-full-no-space-on-a-tmpfs-during-a-checkpoint", "saving checkpoint step_3", "No space left on device",
      "removed the unfinished .tmp-step_3")
def _(c):
    c.options["tmpfs"] = 600_000  # free bytes left once the run is on it
    return c.resume()


@case("disk-full-during-consolidate", "cannot write", "m.safetensors", "File too large")
def _(c):
    c.options["file_size_limit"] = 300_000
    return ["consolidate", str(c.run), str(c.out / "m.safetensors")]


# ---- Also: a superseded best checkpoint is pruned like any other -------------------------------------------------

@case("superseded-best-is-pruned-by-the-end-of-the-run", "--keep-best: new best", ok=True, kept=("step_3",))
def _(c):
    # the lineage's best is step_1 with a value any evaluation beats: step_3 (the last) supersedes it after its save
    best = {"step": 1, "metric": "balanced_accuracy", "spec": "acc", "value": -1.0, "mode": "max",
            "run_id": c.prior.run_id, "checkpoint": "step_1"}
    (c.ckpts / "best.json").write_text(json.dumps(best))
    return c.resume("--save-every", "1", "--keep-last", "1", "--keep-best", "acc", "--val-data",
                    str(c.prior.faces / "val"))


# ---- the table ----------------------------------------------------------------------------------------------------

def _on_tmpfs(c: Ctx, free: int) -> None:
    """Move the case's run onto a tmpfs with `free` bytes left over (root only; unmounted by the test)."""
    used = sum(f.stat().st_size + 4096 for f in c.run.rglob("*") if f.is_file())
    mount = c.run.with_name("tmpfs")
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={(used + free) // 1024}k", "tmpfs", str(mount)], check=True)
    shutil.copytree(c.run, mount / "run", symlinks=True)
    shutil.rmtree(c.run)
    c.run = mount / "run"


@pytest.mark.parametrize("name", list(CASES))
def test_hostile_files(name, prior, tmp_path):
    spec = CASES[name]
    c = Ctx(prior, *copied_run(prior.run, tmp_path))
    shutil.copy(c.step(2) / "model.safetensors", c.decoy / "weights.safetensors")
    argv = spec.build(c)
    if (c.options.get("read_only") or c.options.get("tmpfs")) and not ROOT_USER:
        if "tmpfs" in c.options:
            pytest.skip("a tmpfs needs root")
        c.run.chmod(0o555)  # without root, a folder without write permission
        c.options.pop("read_only")
    elif c.options.get("read_only") and not _private_mounts_work():
        pytest.skip("no private mount namespace here (root without CAP_SYS_ADMIN)")
    if c.options.get("tmpfs"):
        _on_tmpfs(c, c.options.pop("tmpfs"))
        argv = [str(c.run) if a == str(tmp_path / "run") else a for a in argv]
    before = _verifying(c.run)
    decoy_before, prior_before = tree_hash(c.decoy), tree_hash(prior.run)
    try:
        rc, out, err = prior.cli.run_with(argv, c.options)
        after = _verifying(c.run)
        leftovers = _leftovers(c.run, c.out)
    finally:
        c.run.chmod(0o755)
        if c.run.parent.name == "tmpfs":
            subprocess.run(["umount", str(c.run.parent)], check=True)
    show = shown(rc, out, err)
    text = verdict(rc, out, err, spec.needles, spec.ok, show, tail=3000)
    for n in spec.needles:
        if "symbolic link" in n:  # what is left alone is named in one line, however many files lie below a link
            assert sum(n in line for line in text.splitlines()) == 1, text[-3000:]
    assert tree_hash(c.decoy) == decoy_before, "a file outside the run changed"
    assert ckpt.verify(c.decoy / "archive" / "step_1") is None
    assert tree_hash(prior.run) == prior_before
    if spec.kept is not None:
        assert sorted(after) == sorted(spec.kept), (sorted(after), show)
    else:
        assert {k: v for k, v in after.items() if k in before} == before, "a complete checkpoint was lost or changed"
    assert not leftovers, leftovers


def test_every_case_is_distinct():
    assert len(CASES) >= 30 and len({id(c.build) for c in CASES.values()}) == len(CASES)
