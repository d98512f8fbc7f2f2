"""vtrain never takes over what it did not create, and reports nothing as written that was not.

Every row of CASES is one `vtrain` command through the fork server (helpers/cli_server.py) on a copy of a finished
face run (checkpoints step_1 and step_2, with vtrain's run marker), a briefly trained detector, and a decoy folder
outside both: an archive holding a copy of the run's own step_1 (the same lineage, so a pruning that went through a
mount would take it), a copy of its engine files, random bytes, and, where a row makes them, a FIFO and a character
device. Each asserts: a non-zero exit with exactly one `error:` line holding the needles and no traceback (or, for an
`ok` row, exit 0 with the needles in the output); the decoy folder byte-identical, every node in it of the same kind
(a FIFO still a FIFO) and its checkpoint still verifying; every checkpoint of the run that verified before still
verifying (or exactly the ones a pruning row names); the files a row protects byte-identical; no staging folder, temp
file or half-written output left behind.

The rules tested: a run directory is vtrain's when it carries the run marker, and a file at a name a run replaces
or deletes that is not vtrain's stops the run, also with --overwrite-output-dir (rundir.py); --output-dir never
inside a checkpoint; a checkpoint folder that is a mount point is left alone like a link (a real bind mount in the
command's own mount namespace as root; `test_mount_points_*` check the same logic without a mount); an output is
never written over a FIFO or a device; every JPEG `predict` writes is checked to hold every byte; `consolidate`
checks what it writes after the cast and compares a checkpoint's two copies of the weights; TensorBoard's failing
writer thread is one error line.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from tests.helpers.cli import reseal, tree_hash
from tests.helpers.paths import ROOT
from tests.helpers.scaffold import case_table, copied_run, served, shown, verdict
from tests.helpers.files import (
    face_run, FilesCli, leftovers as _leftovers, private_mounts_work as _private_mounts_work, ROOT_USER, TRAIN,
    verifying as _verifying)
from vtrain.io import guarded
from vtrain.engine.checkpoint import format as ckpt
from vtrain.engine import rundir


@dataclass
class Runs:
    cli: FilesCli
    faces: Path
    run: Path
    """A finished face run: checkpoints step_1 and step_2."""
    dino: Path
    """A detector trained 1 step (a checkpoint to draw with)."""
    images: list[Path]
    """The detector's two input images."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    from vtrain.data.demo_shapes import ensure_demo_shapes

    with served(tmp_path_factory, "owned", FilesCli) as (root, cli):
        faces, run = face_run(root, cli)
        demo = ensure_demo_shapes()
        coco = json.loads((demo / "annotations" / "instances_train2017.json").read_text())
        images = coco["images"][:2]
        ids = {im["id"] for im in images}
        ann = root / "two.json"
        ann.write_text(json.dumps({"images": images, "categories": coco["categories"],
                                   "annotations": [a for a in coco["annotations"] if a["image_id"] in ids]}))
        data = ["--train-ann", str(ann), "--train-images", str(demo / "train2017"), "--val-ann", str(ann),
                "--val-images", str(demo / "train2017")]
        rc, out, err = cli.run_with(["train", "--task", "dino", "--model", "debug-resnet", "--num-workers", "0",
                                     "--mixed-precision", "no", *data, "--output-dir", str(root / "dino"),
                                     "--image-size", "128", "--batch-size", "2", "--max-steps", "1"], {})
        assert rc == 0, out[-3000:] + err[-3000:]
        yield Runs(cli, faces, run, root / "dino", [demo / "train2017" / im["file_name"] for im in images])


@dataclass
class Ctx:
    runs: Runs
    run: Path
    """The case's run directory: a copy of the face run."""
    decoy: Path
    """Outside the run: archive/step_1 (a copy of the run's own step_1), accelerate/ (a copy of its engine files),
    bytes.bin; a row may add a FIFO or a device."""
    out: Path
    """A folder for outputs (and for directories a row hands over as --output-dir)."""
    options: dict = field(default_factory=dict)
    """For the CLI server: file_size_limit, bind; for the test: tmpfs (bytes: `out` on a tmpfs that small)."""
    kept: list[Path] = field(default_factory=list)
    """Files (outside the decoy) that must be byte-identical afterwards: what the row's command must not replace."""

    @property
    def ckpts(self) -> Path:
        return self.run / "checkpoints"

    def step(self, n: int) -> Path:
        return self.ckpts / f"step_{n}"

    def train(self, out: Path, *args: str) -> list[str]:
        return ["train", "--data", str(self.runs.faces), "--output-dir", str(out), *TRAIN, *args]

    def resume(self, *args: str) -> list[str]:
        return self.train(self.run, "--resume", "auto", "--max-steps", "3", *args)

    def users_folder(self, files: dict[str, str]) -> Path:
        """A folder of the user's holding `files` (name -> text) at names a run writes: kept byte-identical."""
        folder = self.out / "mine"
        for name, text in files.items():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text(text)
            self.kept.append(folder / name)
        return folder

    def bind(self, source: Path, target: Path) -> None:
        """`source` bind-mounted at `target` (an empty folder of the run) for the command alone."""
        if target.is_dir():
            shutil.rmtree(target)
        target.mkdir()
        self.options.setdefault("bind", []).append([str(source), str(target)])

    def doctor(self, files: list[Path], change: Callable[[dict], None]) -> None:
        """Change tensors of a checkpoint's safetensors `files` and reseal its manifest (what is tested is the
        content check, not the checksum)."""
        for f in files:
            sd = load_file(str(f))
            change(sd)
            save_file(sd, str(f))
        reseal(files[0].parent if files[0].parent.name.startswith("step_") else files[0].parents[1])

    def predict_dino(self, *args: str) -> list[str]:
        return ["predict", "--checkpoint", str(self.runs.dino), *(a for im in self.runs.images
                                                                  for a in ("--images", str(im))),
                "--out", str(self.out / "drawn"), "--num-workers", "0", *args]


@dataclass
class Case:
    build: Callable[[Ctx], list[str]]
    needles: tuple[str, ...]
    ok: bool = False
    pruned_to: tuple[str, ...] | None = None
    """An ok row that prunes: exactly these checkpoints of the run remain (each verifying)."""
    check: Callable[[Ctx], None] | None = None
    """More to assert afterwards."""


CASES, case = case_table(Case)


MOUNT_ROWS = ("bind",)  # options that need a private mount namespace (root with CAP_SYS_ADMIN)


# ---- --output-dir inside a checkpoint ------------------------------------------------------------------------------

@case("output-dir-is-a-checkpoint", "--output-dir", "is inside the checkpoint", "step_2")
def _(c):
    c.kept += [c.step(2) / "config.yaml"]
    return c.train(c.step(2), "--max-steps", "1")


@case("output-dir-is-a-new-folder-inside-a-checkpoint", "is inside the checkpoint", "step_1",
      check=lambda c: not (c.step(1) / "sub").exists() or pytest.fail("the folder was created"))
def _(c):
    return c.train(c.step(1) / "sub", "--max-steps", "1", "--overwrite-output-dir")


@case("output-dir-is-a-runs-checkpoints-folder", "is inside the checkpoint", "checkpoints")
def _(c):
    return c.train(c.ckpts, "--max-steps", "1", "--overwrite-output-dir")


@case("output-dir-is-in-a-runs-universal-folder", "is inside the checkpoint", "universal")
def _(c):
    (c.run / "universal").mkdir()
    return c.train(c.run / "universal" / "step_2", "--max-steps", "1")


@case("output-dir-links-to-a-checkpoint", "is inside the checkpoint", "step_2")
def _(c):
    (c.out / "link").symlink_to(c.step(2))
    c.kept += [c.step(2) / "config.yaml"]
    return c.train(c.out / "link", "--max-steps", "1", "--resume", "auto")


# ---- files vtrain did not write -------------------------------------------------------------------------------------

@case("users-own-config-yaml", "holds config.yaml", "which vtrain did not write", "--overwrite-output-dir")
def _(c):
    return c.train(c.users_folder({"config.yaml": "experiment: 7\nnotes: my own settings\n"}), "--max-steps", "1")


@case("users-own-vtrain-config-passed-with-config", "holds config.yaml", "which vtrain did not write")
def _(c):
    folder = c.users_folder({"config.yaml": "optim:\n  lr: 0.002\n"})  # replaced by the resolved config before
    return c.train(folder, "--max-steps", "1", "--config", str(folder / "config.yaml"))


@case("users-own-logs-with-overwrite-output-dir", "metrics.jsonl, eval.jsonl, run_info.json",
      "which vtrain did not write", "also with --overwrite-output-dir")
def _(c):
    folder = c.users_folder({"metrics.jsonl": '{"step": 1, "loss": 0.5}\n', "eval.jsonl": '{"step": 1, "acc": 1}\n',
                             "run_info.json": '{"host": "lab"}'})
    return c.train(folder, "--max-steps", "1", "--overwrite-output-dir")


@case("users-own-best-json-with-overwrite-output-dir", "checkpoints/best.json", "which vtrain did not write")
def _(c):
    return c.train(c.users_folder({"checkpoints/best.json": '{"winner": "me"}'}), "--max-steps", "1",
                   "--overwrite-output-dir")


@case("users-own-config-yaml-with-resume-auto", "holds config.yaml", "which vtrain did not write")
def _(c):
    folder = c.users_folder({"config.yaml": "a: 1\n"})
    shutil.copytree(c.ckpts, folder / "checkpoints")  # a checkpoint to resume does not make the folder vtrain's
    return c.train(folder, "--resume", "auto", "--max-steps", "3")


@case("a-marker-that-is-not-vtrains", ".vtrain-run.json", "which vtrain did not write")
def _(c):
    return c.train(c.users_folder({".vtrain-run.json": '{"format": "another tool"}'}), "--max-steps", "1")


@case("a-run-of-an-earlier-vtrain-without-marker-resumes", "resumed from", "step_2", ok=True,
      check=lambda c: rundir.foreign_files(c.run) == [] and (c.run / rundir.MARKER).is_file())
def _(c):
    (c.run / rundir.MARKER).unlink()  # as written before the marker existed: recognised by its files
    return c.resume()


@case("a-run-of-an-earlier-vtrain-without-marker-starts-over", "deleted 2 checkpoints", ok=True,
      pruned_to=("step_1",))
def _(c):
    (c.run / rundir.MARKER).unlink()
    return c.train(c.run, "--max-steps", "1", "--overwrite-output-dir")


@case("users-files-beside-run-names-stay", "saved", ok=True,
      check=lambda c: (c.out / "mine" / "notes.txt").read_text() == "keep")
def _(c):
    c.users_folder({"notes.txt": "keep"})  # not a name a run writes: a new run may use the folder
    return c.train(c.out / "mine", "--max-steps", "1")


# ---- mount points are left alone like links ------------------------------------------------------------------------

@case("bind-mounted-checkpoint-is-not-pruned", "step_0 is a mount point", "left alone", ok=True,
      pruned_to=("step_3",))
def _(c):
    c.bind(c.decoy / "archive" / "step_1", c.step(0))  # the same lineage, the oldest: --keep-last 1 would take it
    return c.resume("--save-every", "1", "--keep-last", "1")


@case("bind-mounted-checkpoint-overwrite-output-dir", "step_0 is a mount point", "left alone",
      "deleted 2 checkpoints", ok=True, pruned_to=("step_1",))
def _(c):
    c.bind(c.decoy / "archive" / "step_1", c.step(0))
    return c.train(c.run, "--max-steps", "1", "--overwrite-output-dir")


@case("bind-mounted-folder-inside-a-pruned-checkpoint", "accelerate is a mount point", "left alone", ok=True,
      pruned_to=("step_3",))
def _(c):
    c.bind(c.decoy / "accelerate", c.step(1) / "accelerate")  # the same files: step_1 still verifies
    return c.resume("--save-every", "1", "--keep-last", "1")


@case("bind-mounted-checkpoints-folder", "checkpoints is a mount point", "--output-dir")
def _(c):
    c.bind(c.decoy / "archive", c.ckpts)
    return c.train(c.run, "--max-steps", "1", "--overwrite-output-dir")


@case("bind-mounted-stale-staging-folder", ".tmp-step_3 is a mount point")
def _(c):
    c.bind(c.decoy / "archive" / "step_1", c.ckpts / ".tmp-step_3")  # the folder the next save clears
    return c.resume()


# ---- outputs over a FIFO or a device ---------------------------------------------------------------------------------

def _fifo(at: Path) -> Path:
    os.mkfifo(at)
    return at


@case("consolidate-overwrite-onto-a-fifo", "OUT", "is a FIFO, not a regular file", "even with --overwrite")
def _(c):
    return ["consolidate", str(c.run), str(_fifo(c.decoy / "pipe.safetensors")), "--overwrite"]


@case("predict-overwrite-onto-a-fifo", "--out", "is a FIFO")
def _(c):
    return ["predict", "--checkpoint", str(c.run), "--images", str(c.runs.faces / "val"), "--out",
            str(_fifo(c.decoy / "emb.safetensors")), "--num-workers", "0", "--overwrite"]


@case("predict-drawn-image-onto-a-fifo", "--out", "000000.jpg is a FIFO",
      check=lambda c: stat.S_ISFIFO(os.lstat(c.out / "drawn" / "000000.jpg").st_mode) or pytest.fail("replaced"))
def _(c):
    (c.out / "drawn").mkdir()
    os.mkfifo(c.out / "drawn" / "000000.jpg")
    return c.predict_dino("--overwrite")


@case("eval-save-predictions-links-to-a-fifo", "--save-predictions", "a symbolic link to a FIFO")
def _(c):
    (c.out / "preds.json").symlink_to(_fifo(c.decoy / "pipe"))
    return ["eval", "--checkpoint", str(c.runs.dino), "--save-predictions", str(c.out / "preds.json"),
            "--overwrite"]


@case("export-overwrite-onto-a-character-device", "OUT", "is a character device")
def _(c):
    os.mknod(c.decoy / "null.onnx", 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # the null device's numbers, in tmp
    return ["export", str(c.run), str(c.decoy / "null.onnx"), "--no-verify", "--overwrite"]


@case("run-config-yaml-is-a-fifo", "config.yaml is a FIFO, not a regular file", "--output-dir")
def _(c):
    (c.run / "config.yaml").unlink()
    os.mkfifo(c.run / "config.yaml")
    return c.resume()


# ---- nothing reported as written that was not ----------------------------------------------------------------------

def _nothing_drawn(c: Ctx) -> None:
    left = sorted(p.name for p in (c.out / "drawn").rglob("*")) if (c.out / "drawn").exists() else []
    assert not left, f"a failed predict left {left}"


@case("predict-jpegs-under-a-file-size-limit", "cannot write", "000000.jpg", "File too large",
      check=_nothing_drawn)
def _(c):
    c.options["file_size_limit"] = 5000  # every drawn JPEG is larger: write_jpeg would leave 5000 of its bytes
    return c.predict_dino()


@case("predict-jpegs-on-a-full-file-system", "cannot write", "000000.jpg", "No space left on device",
      check=_nothing_drawn)
def _(c):
    c.options["tmpfs"] = 8192  # tmpfs(5) rounds to pages: two, a JPEG needs more
    return c.predict_dino()


def _not_written(c: Ctx) -> None:
    assert not (c.out / "m.safetensors").exists(), "consolidate wrote its output after all"


def _head_value(value: float) -> Callable[[dict], None]:
    """Set one element of head.weight (a change to apply to both copies of the weights)."""
    return lambda sd: sd["head.weight"].__setitem__((0, 0), value)


@case("consolidate-fp16-of-a-value-beyond-its-range", "1 tensors hold inf/NaN as written",
      "only after the cast to fp16", "was not written", check=_not_written)
def _(c):
    c.doctor([c.step(2) / "model.safetensors", c.step(2) / "accelerate" / "model.safetensors"], _head_value(1e6))
    return ["consolidate", str(c.step(2)), str(c.out / "m.safetensors"), "--dtype", "fp16"]


@case("consolidate-bf16-keeps-a-value-beyond-fp16s-range", "every tensor is finite as written", ok=True)
def _(c):
    c.doctor([c.step(2) / "model.safetensors", c.step(2) / "accelerate" / "model.safetensors"], _head_value(1e6))
    return ["consolidate", str(c.step(2)), str(c.out / "m.safetensors"), "--dtype", "bf16"]


@case("consolidate-engine-copy-differs", "two copies of the weights differ", "tensor head.weight",
      "max abs difference 0.5", "nothing was written", check=_not_written)
def _(c):
    c.doctor([c.step(2) / "accelerate" / "model.safetensors"],
             lambda sd: sd["head.weight"].__setitem__((1, 2), sd["head.weight"][1, 2] + 0.5))
    return ["consolidate", str(c.run), str(c.out / "m.safetensors")]


@case("consolidate-top-level-copy-differs", "two copies of the weights differ", "neck.norm.weight",
      check=_not_written)
def _(c):
    c.doctor([c.step(2) / "model.safetensors"], lambda sd: sd["neck.norm.weight"].mul_(2))
    return ["consolidate", str(c.step(2)), str(c.out / "m.safetensors")]


@case("consolidate-top-level-copy-claims-more-than-it-holds", "model.safetensors is not a readable safetensors file",
      "do not fit the file", check=_not_written)
def _(c):
    f = c.step(2) / "model.safetensors"
    n = int.from_bytes(f.read_bytes()[:8], "little")
    header = json.loads(f.read_bytes()[8:8 + n])
    header["head.weight"]["shape"] = [2**40, 2**20]  # offsets no longer match: never allocated, never read
    raw = json.dumps(header).encode()
    f.write_bytes(len(raw).to_bytes(8, "little") + raw + f.read_bytes()[8 + n:])
    reseal(c.step(2))
    return ["consolidate", str(c.step(2)), str(c.out / "m.safetensors")]


@case("tensorboard-disk-full-at-start", "cannot start tensorboard", "File too large")
def _(c):
    c.options["file_size_limit"] = 2000  # config.yaml (1.4 kB) passes, TensorBoard's hparams event (4 kB) not
    return c.train(c.out / "new", "--max-steps", "1", "--report-to", "tensorboard")


@case("tensorboard-disk-full-while-logging", "cannot write tensorboard's events", "File too large")
def _(c):
    c.options["file_size_limit"] = 6000  # crossed by the writer thread's write after a few log lines
    return c.train(c.out / "new", "--max-steps", "40", "--log-every", "1", "--save-every", "100", "--report-to",
                   "tensorboard")


# ---- the table ----------------------------------------------------------------------------------------------------

def _kinds(root: Path) -> dict[str, int]:
    """Relative path -> file type (S_IFMT) of every node under `root`, links not followed."""
    return {str(Path(d, n).relative_to(root)): stat.S_IFMT(os.lstat(Path(d, n)).st_mode)
            for d, dirs, files in os.walk(root) for n in dirs + files}


def _hashes(paths: list[Path]) -> dict[str, str]:
    return {str(p): tree_hash(p) if p.is_dir() else p.read_bytes().hex() for p in paths}


@pytest.mark.parametrize("name", list(CASES))
def test_owned_outputs(name, runs, tmp_path):
    spec = CASES[name]
    c = Ctx(runs, *copied_run(runs.run, tmp_path))
    shutil.copytree(c.step(1) / "accelerate", c.decoy / "accelerate")
    try:
        argv = spec.build(c)
    except PermissionError as e:  # os.mknod of a device needs root (CAP_MKNOD)
        pytest.skip(f"cannot make the row's input here: {e}")
    if any(k in c.options for k in MOUNT_ROWS) and not _private_mounts_work():
        pytest.skip("no private mount namespace here (a bind mount needs root with CAP_SYS_ADMIN); the logic is "
                    "checked without a mount by test_mount_points_*")
    tmpfs = c.options.pop("tmpfs", None)
    if tmpfs is not None and not ROOT_USER:
        pytest.skip("a tmpfs needs root")
    before = _verifying(c.run)
    decoy_before, kinds_before, kept_before = tree_hash(c.decoy), _kinds(c.decoy), _hashes(c.kept)
    runs_before = (tree_hash(runs.run), tree_hash(runs.dino))
    mounted = False
    try:
        if tmpfs is not None:
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={tmpfs}", "tmpfs", str(c.out)], check=True)
            mounted = True
        rc, out, err = runs.cli.run_with(argv, c.options)
        after = _verifying(c.run)
        planted = {target for _, target in c.options.get("bind", [])}  # a mount point a row made stays, by design
        leftovers = [p for p in _leftovers(c.run, c.out) if p not in planted]
        if spec.check is not None:
            spec.check(c)
    finally:
        if mounted:
            subprocess.run(["umount", str(c.out)], check=True)
    show = shown(rc, out, err)
    assert "Exception in thread" not in out + err, show
    text = verdict(rc, out, err, spec.needles, spec.ok, show, tail=3000)
    for n in spec.needles:
        if "mount point" in n:  # what is left alone is named in one line, however many files lie below it
            assert sum(n in line for line in text.splitlines()) == 1, text[-3000:]
    assert tree_hash(c.decoy) == decoy_before and _kinds(c.decoy) == kinds_before, "a file outside the run changed"
    assert ckpt.verify(c.decoy / "archive" / "step_1") is None
    assert _hashes(c.kept) == kept_before, "a file the command does not own was replaced"
    assert (tree_hash(runs.run), tree_hash(runs.dino)) == runs_before
    if spec.pruned_to is not None:
        assert sorted(after) == sorted(spec.pruned_to), (sorted(after), show)
    else:
        assert {k: v for k, v in after.items() if k in before} == before, "a complete checkpoint was lost or changed"
    assert not leftovers, leftovers


def test_every_case_is_distinct():
    assert len(CASES) >= 30 and len({id(c.build) for c in CASES.values()}) == len(CASES)


# ---- the same rules without the CLI: mount points by a stand-in list, recognition of vtrain's files ---------------

@pytest.fixture
def mounted(monkeypatch):
    """Folders to treat as mount points: the kernel's list is replaced, so the logic runs without a real mount."""
    paths: set[str] = set()
    monkeypatch.setattr(guarded, "mount_points", lambda: frozenset(paths))
    return lambda p: paths.add(os.path.realpath(p))


def test_mount_points_are_never_pruned_or_deleted_through(runs, tmp_path, mounted):
    run = tmp_path / "run"
    shutil.copytree(runs.run, run)
    step1, step2 = run / "checkpoints" / "step_1", run / "checkpoints" / "step_2"
    before = tree_hash(step1)
    mounted(step1)
    assert guarded.crossing_in(run, step1 / "train_state.json") == step1
    assert "step_1 is a mount point" in guarded.describe_crossing(step1)
    assert [p.name for p in ckpt.complete_checkpoints(run)] == ["step_2"]  # not the run's: never resumed
    assert ckpt.linked_entries(run) == [f"{step1} is a mount point (another file system, or a bind mount of another "
                                        "folder): not this run's; left alone (never resumed, pruned or deleted)"]
    assert guarded.unlink(run, step1 / "train_state.json").endswith("left alone")
    with pytest.raises(guarded.Refused, match="step_1 is a mount point"):
        guarded.rmtree(run, step1)
    with pytest.raises(ckpt.CheckpointError, match="mount point"):
        ckpt.remove(step1)
    assert tree_hash(step1) == before
    # a mount inside a folder: deleting the folder whole, or its empty folders, never enters it
    mounted(step2 / "accelerate")
    with pytest.raises(guarded.Refused, match="accelerate is a mount point"):
        guarded.rmtree(run, step2)
    assert "accelerate is a mount point" in ckpt.verify(step2)
    (step2 / "accelerate" / "empty").mkdir()
    guarded.remove_empty_dirs(run, step2)
    assert (step2 / "accelerate" / "empty").is_dir()
    mounted(run / "checkpoints")
    with pytest.raises(Exception, match="checkpoints is a mount point"):
        rundir.check_links(run)


def test_mount_points_are_read_from_the_kernels_list(tmp_path):
    """A bind mount on the same file system has its parent's device id: only /proc/self/mountinfo names it."""
    if not os.path.exists("/proc/self/mountinfo"):
        pytest.skip("no /proc/self/mountinfo (not Linux)")
    assert "/" in guarded.mount_points() and guarded.is_mount("/")
    assert not guarded.is_mount(tmp_path)
    if not _private_mounts_work():
        pytest.skip("no private mount namespace here for a real bind mount")
    (tmp_path / "a b").mkdir()
    (tmp_path / "t").mkdir()
    code = ("import sys; from vtrain.io import guarded; p = sys.argv[1]; "
            "print(guarded.is_mount(p), guarded.is_mount(p + '/..'), p in guarded.mount_points())")
    proc = subprocess.run(["unshare", "-m", "sh", "-c", 'mount --make-rprivate / && mount --bind "$1" "$2" && '
                           'exec "$0" -c "$3" "$2"', sys.executable, str(tmp_path / "a b"), str(tmp_path / "t"),
                           code], capture_output=True, text=True, cwd=ROOT)
    assert proc.stdout.split() == ["True", "False", "True"], proc.stdout + proc.stderr


@pytest.mark.parametrize("name, text, ours", [
    ("config.yaml", None, True),  # the run's own
    ("config.yaml", "optim:\n  lr: 0.002\n", False),  # a partial --config of the user's
    ("config.yaml", "task: metric\nmodel: 3\n", False),
    ("config.yaml", "&a [*a]\n", False),  # not even loadable as vtrain's
    ("config.yaml", "- 1\n- 2\n", False),
    ("metrics.jsonl", None, True),
    ("metrics.jsonl", "long", True),  # a long run's log: its first line tells
    ("metrics.jsonl", '{"step": 1, "loss": 0.5}\n', False),  # another tool's log
    ("metrics.jsonl", "not json\n", False),
    ("eval.jsonl", '{"step": 2, "AP": 0.1}\n', True),
    ("eval.jsonl", '{"step": "2", "AP": 0.1}\n', False),
    ("run_info.json", None, True),
    ("run_info.json", '{"engine": "mine"}', False),
    ("checkpoints/best.json", '{"step": 2, "metric": "AP", "value": 0.5, "mode": "max", "run_id": "x"}', True),
    ("checkpoints/best.json", '{"step": 2}', False),
])
def test_files_of_a_folder_without_the_marker_are_recognised(runs, tmp_path, name, text, ours):
    folder = tmp_path / "f"
    (folder / name).parent.mkdir(parents=True, exist_ok=True)
    if text is None:
        shutil.copy(runs.run / name, folder / name)
    elif text == "long":
        line = (runs.run / name).read_text().splitlines()[0] + "\n"
        (folder / name).write_text(line * (3 * 2**20 // len(line)))
    else:
        (folder / name).write_text(text)
    assert rundir.foreign_files(folder) == ([] if ours else [name])
    (folder / rundir.MARKER).write_text(json.dumps({"format": rundir.MARKER_FORMAT, "version": 1, "created": 0}))
    assert rundir.foreign_files(folder) == []  # in a folder marked as a vtrain run's, the run names are the run's
