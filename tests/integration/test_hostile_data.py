"""Hostile and careless data (docs/input_limits.md): memory bounded by what a file really holds,
labels checked the same way for every source and head, evaluation data that cannot be scored refused up front, and
no fork of a process that runs threads.

Every row of CASES is one `vtrain` command on inputs of our own design, run through the fork server
(helpers/cli_server.py, so torch is imported once). Each asserts: a non-zero exit with exactly one `error:` line
naming the problem, and no traceback (or, for an `ok` row, exit 0 with what was skipped named); the inputs, decoy
files beside them and a finished run are byte-identical afterwards; no failed run left a checkpoint; and the
command's peak resident memory stayed under PEAK_LIMIT. The command also runs under a data-segment limit of
DATA_LIMIT_MB above what it inherited, so the code before these fixes fails a case quickly (MemoryError) instead of
allocating the gigabytes the file declares on a shared machine.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import signal
import struct
import subprocess
import sys
import textwrap
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.cli import script_env, tree_hash
from tests.helpers.paths import ROOT
from tests.helpers.fork_server import Cli, PEAK_LIMIT_MB
from tests.helpers.scaffold import case_table, served, shown, verdict

TRAIN = ["--batch-size", "2", "--max-steps", "1", "--num-workers", "0", "--embedding-dim", "16",
         "--mixed-precision", "no", "--neck-norm", "ln"]


# ---- crafted inputs -----------------------------------------------------------------------------------------------

def png(width: int, height: int) -> bytes:
    """A valid greyscale PNG of zeros: it compresses ~1000:1, so a 20000 x 20000 one is 0.4 MB that decodes to 1.2 GB
    of RGB."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    z, rows = zlib.compressobj(9), b"\0" * (width + 1) * 100
    body = b"".join(z.compress(rows) for _ in range(height // 100)) + z.compress(b"\0" * (width + 1) * (height % 100))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", body + z.flush()) + chunk(b"IEND", b""))


def jpeg(shade: int, size: int = 112) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (size, size), (shade, 255 - shade, 90)).save(buf, "JPEG")
    return buf.getvalue()


FLAGS = [i % 2 == 0 for i in range(1500)]  # genuine and impostor pairs: a pack that can be scored


def _op_list(items: list[bytes]) -> bytes:
    """MARK item... LIST, then the flags list and the (bins, issame) tuple: the tail of every crafted pack."""
    flags = b"](" + b"".join(b"\x88" if f else b"\x89" for f in FLAGS) + b"e"
    return b"(" + b"".join(items) + b"l" + flags + b"\x86."


def pack_str_referenced(times: int, size: int) -> bytes:
    """One `size`-char str in the memo, `times` BINGETs of it as the images (what a py2 pack's str images look
    like to Python 3): a reader converting per reference makes `times` copies."""
    return b"\x80\x02X" + struct.pack("<I", size) + b"x" * size + b"q\x000" + _op_list([b"h\x00"] * times)


def pack_encode_calls(times: int, size: int) -> bytes:
    """`_codecs.encode(text, 'latin1')` called `times` times on one memoized text (not a memo of the result)."""
    head = (b"\x80\x02c_codecs\nencode\nq\x00X" + struct.pack("<I", size) + b"x" * size + b"q\x01X\x06\x00\x00\x00"
            b"latin1q\x020")
    return head + _op_list([b"h\x00h\x01h\x02\x86R"] * times)


def pack_frombuffer_calls(times: int, size: int) -> bytes:
    """Protocol 5's `_frombuffer(buffer, dtype, shape, order)` called `times` times on one memoized bytearray."""
    head = (b"\x80\x05cnumpy._core.numeric\n_frombuffer\nq\x00\x96" + struct.pack("<Q", size) + b"x" * size
            + b"q\x01cnumpy\ndtype\n(X\x02\x00\x00\x00u1\x89\x88tRq\x02J" + struct.pack("<i", size)
            + b"\x85q\x03X\x01\x00\x00\x00Cq\x040")
    return head + _op_list([b"h\x00(h\x01h\x02h\x03h\x04tR"] * times)


def pack_array_without_data(length: int) -> bytes:
    """issame = `_reconstruct(ndarray, (length,), dtype('u1'))` and no BUILD: a declared array, no data."""
    dtype = b"cnumpy\ndtype\nX\x02\x00\x00\x00u1\x85R"
    arr = (b"cnumpy._core.multiarray\n_reconstruct\ncnumpy\nndarray\nJ" + struct.pack("<i", length) + b"\x85"
           + dtype + b"\x87R")
    return b"\x80\x02]C\x01aaC\x01ba" + arr + b"\x86."


# ---- the per-case context ------------------------------------------------------------------------------------------

@dataclass
class Prior:
    cli: Cli
    faces: Path
    """train/: 2 identities x 2 small JPEGs."""
    run: Path
    """A finished metric run (eval and predict load its checkpoint)."""
    bomb: bytes
    """A 0.4 MB PNG declaring 20000 x 20000 pixels."""


@pytest.fixture(scope="module")
def prior(tmp_path_factory) -> Prior:
    with served(tmp_path_factory, "hostile") as (root, cli):
        faces = root / "faces" / "train"
        for i in range(2):
            (faces / f"id_{i}").mkdir(parents=True)
            for j in range(2):
                (faces / f"id_{i}" / f"{j}.jpg").write_bytes(jpeg(60 * i + 20 * j))
        rc, out, err, _ = cli.run(["train", "--data", str(root / "faces"), "--output-dir", str(root / "run"), *TRAIN])
        assert rc == 0, out[-3000:] + err[-3000:]
        yield Prior(cli, root / "faces", root / "run", png(20000, 20000))


@dataclass
class Ctx:
    prior: Prior
    inputs: Path
    out: Path

    def file(self, name: str, data: bytes) -> Path:
        p = self.inputs / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        return p

    def folders(self, images: dict[str, list[bytes]], name: str = "faces") -> Path:
        """root/train/<identity>/<i>.{jpg,png} from encoded images."""
        for ident, items in images.items():
            for i, data in enumerate(items):
                ext = "png" if data.startswith(b"\x89PNG") else "jpg"
                self.file(f"{name}/train/{ident}/{i}.{ext}", data)
        return self.inputs / name

    def rec(self, samples: list[tuple[bytes, float]], classes: int, header: bool = False) -> Path:
        from vtrain.data.recordio import write_face_rec

        return write_face_rec(self.inputs / "rec", samples, classes, header=header)

    def hf(self, images: list[bytes | None], labels: list, classlabel: int | None = 2) -> str:
        """A save_to_disk folder with `image` (Image) + `label` (ClassLabel of `classlabel` names, else inferred)."""
        from datasets import ClassLabel, Dataset, Features, Image, Value

        label = ClassLabel(names=[f"p{i}" for i in range(classlabel)]) if classlabel else Value(
            "float64" if any(isinstance(v, float) for v in labels) else "int64")
        ds = Dataset.from_dict({"image": [None if b is None else {"bytes": b, "path": None} for b in images],
                                "label": labels}, features=Features({"image": Image(), "label": label}))
        ds.save_to_disk(str(self.inputs / "hf"))
        return f"hf:{self.inputs / 'hf'}"

    def train(self, *args: str) -> list[str]:
        return ["train", "--output-dir", str(self.out), *TRAIN, *args]

    def eval(self, *args: str) -> list[str]:
        return ["eval", "--checkpoint", str(self.prior.run), *args]

    def pack(self, data: bytes) -> str:
        return str(self.file("x.bin", data))


@dataclass
class Case:
    build: Callable[[Ctx], list[str] | tuple[list[str], dict[str, str]]]
    needles: tuple[str, ...]
    absent: tuple[str, ...] = ()
    ok: bool = False
    """Exit 0 expected (a skipped image named in the log), not an error."""


CASES, case = case_table(Case)


def _two(c: Ctx, first: bytes) -> Path:
    """Two identities of one image each (a batch of 2 reads both): `first`, then a normal JPEG."""
    return c.folders({"id_a": [first], "id_b": [jpeg(200)]})


# ---- §2 memory bounded by what the file holds -----------------------------------------------------------------------

@case("rec-header-declares-134M-images", "header record 0 declares 134217727 images", "lists only 5 records")
def _(c):
    from vtrain.data.recordio import IRHeader, RecordWriter, pack

    (c.inputs / "rec").mkdir()
    with RecordWriter(c.inputs / "rec" / "train.rec", c.inputs / "rec" / "train.idx") as w:
        w.write(0, pack(IRHeader(2, [2**27, 2**27 + 2]), b""))  # images 1..2^27-1 (float32 holds 2^27 exactly)
        for key in range(1, 5):
            w.write(key, pack(IRHeader(0, float(key % 2), key, 0), jpeg(40 * key)))
    c.file("rec/property", b"2,112,112\n")
    return c.train("--data", str(c.inputs / "rec"))


@case("rec-property-1e12-classes", "1000000000000 classes", "property", "2^24")
def _(c):
    rec = c.rec([(jpeg(10), 0.0), (jpeg(90), 1.0)], 2)
    (rec / "property").write_text("1000000000000,112,112\n")
    return c.train("--data", str(rec))


@case("rec-property-head-beyond-memory", "16000000 classes (from", "property", "GiB head per process")
def _(c):
    rec = c.rec([(jpeg(10), 0.0), (jpeg(90), 1.0)], 2)
    (rec / "property").write_text("16000000,112,112\n")  # x 8192 dims x 4 B x 4 = 2 TB
    return [*c.train("--data", str(rec)), "--embedding-dim", "8192"]


@case("bin-array-declared-without-data", "x.bin: issame is a numpy array without data")
def _(c):
    return c.eval("--data", c.pack(pack_array_without_data(10**9)))


@case("bin-one-string-referenced-3000-times", "cannot decode image in", "x.bin", absent=("--skip-bad-images",))
def _(c):
    return c.eval("--data", c.pack(pack_str_referenced(3000, 4 << 20)))


@case("bin-encode-called-3000-times-on-one-text", "cannot decode image in", "x.bin", absent=("--skip-bad-images",))
def _(c):
    return c.eval("--data", c.pack(pack_encode_calls(3000, 4 << 20)))


@case("bin-frombuffer-3000-times-on-one-buffer", "x.bin: it decodes to more than", "a pickle that references")
def _(c):
    return c.eval("--data", c.pack(pack_frombuffer_calls(3000, 4 << 20)))


@case("png-bomb-in-image-folder", "refusing to decode image", "0.png: 20000x20000 = 400000000 pixels",
      "--max-image-pixels", "--skip-bad-images")
def _(c):
    return c.train("--data", str(_two(c, c.prior.bomb)))


@case("png-bomb-skipped", "skipped 1 unreadable images", "0.png: 20000x20000", ok=True)
def _(c):
    data = c.folders({"id_a": [c.prior.bomb, jpeg(30)], "id_b": [jpeg(200), jpeg(230)]})
    return [*c.train("--data", str(data), "--skip-bad-images"), "--max-steps", "2"]


@case("png-above-default-limit-allowed-by-flag", "step=1 ", "checkpoints/step_1", ok=True)
def _(c):
    return c.train("--data", str(_two(c, png(10000, 9000))), "--max-image-pixels", "100000000")


@case("max-image-pixels-zero", "--max-image-pixels (data.max_image_pixels)", "must be in 1..4294967296")
def _(c):
    return c.train("--data", str(c.prior.faces), "--max-image-pixels", "0")


@case("png-bomb-in-coco", "refusing to decode image", "bomb.png", "20000x20000")
def _(c):
    c.file("coco/img/ok.jpg", jpeg(50, 96))
    c.file("coco/img/bomb.png", c.prior.bomb)
    ann = {"images": [{"id": 1, "file_name": "ok.jpg", "width": 96, "height": 96},
                      {"id": 2, "file_name": "bomb.png", "width": 96, "height": 96}],
           "annotations": [{"id": i, "image_id": i, "category_id": 1, "bbox": [10, 10, 40, 40], "area": 1600,
                            "iscrowd": 0} for i in (1, 2)],
           "categories": [{"id": 1, "name": "a"}]}
    c.file("coco/ann.json", json.dumps(ann).encode())
    return ["train", "--task", "dino", "--output-dir", str(c.out), "--train-ann", str(c.inputs / "coco" / "ann.json"),
            "--train-images", str(c.inputs / "coco" / "img"), "--val-ann", str(c.inputs / "coco" / "ann.json"),
            "--val-images", str(c.inputs / "coco" / "img"), "--image-size", "128", "--batch-size", "2",
            "--max-steps", "1", "--num-workers", "0", "--dn-queries", "0", "--num-queries", "20",
            "--mixed-precision", "no"]


@case("png-bomb-in-recordio-record", "refusing to decode image", "train.rec: record 1", "20000x20000")
def _(c):
    return c.train("--data", str(c.rec([(jpeg(10), 0.0), (c.prior.bomb, 1.0)], 2)))


@case("png-bomb-in-bin-pack", "refusing to decode image in", "x.bin", "20000x20000", absent=("--skip-bad-images",))
def _(c):
    images = [c.prior.bomb] + [jpeg(10 * i) for i in range(1, 24)]
    return c.eval("--data", c.pack(pickle.dumps((images, FLAGS[:12]), protocol=4)))


@case("png-bomb-in-hf-row", "refusing to decode image", "[train] row 0", "20000x20000")
def _(c):
    return c.train("--data", c.hf([c.prior.bomb, jpeg(120)], [0, 1]))


@case("png-bomb-predict-input", "refusing to decode image", "bomb.png", "20000x20000", absent=("--skip-bad-images",))
def _(c):
    return ["predict", "--checkpoint", str(c.prior.run), "--images", str(c.file("bomb.png", c.prior.bomb)),
            "--out", str(c.out / "emb.safetensors"), "--num-workers", "0"]


# ---- §2 labels: one check for every source and both heads ------------------------------------------------------------

@case("hf-classlabel-minus-one", "[train]: column 'label': row 2: label -1 is not a class id", "[0, 2)")
def _(c):
    return c.train("--data", c.hf([jpeg(i * 40) for i in range(4)], [0, 1, -1, 1]))


@case("hf-classlabel-minus-one-sharded-head", "row 2: label -1 is not a class id", "[0, 2)")
def _(c):
    return c.train("--data", c.hf([jpeg(i * 40) for i in range(4)], [0, 1, -1, 1]), "--head-parallel", "sharded")


@case("hf-int-label-none", "row 1: label None is not a class id")
def _(c):
    return c.train("--data", c.hf([jpeg(i * 40) for i in range(4)], [3, None, 5, 3], classlabel=None))


@case("hf-float-label-fraction", "row 2: label 2.5 is not a class id")
def _(c):
    return c.train("--data", c.hf([jpeg(i * 40) for i in range(4)], [1.0, 2.0, 2.5, 1.0], classlabel=None))


@case("rec-label-minus-one", "train.rec: record 1: label -1 is not a class id", "[0, 2)")
def _(c):
    return c.train("--data", str(c.rec([(jpeg(10), 0.0), (jpeg(90), -1.0)], 2)))


@case("rec-index-damaged-in-the-cache", "error: data index", "offsets.npy", "is damaged", "delete that folder")
def _(c):
    from vtrain.data.recordio import RecordFaces

    rec = c.rec([(jpeg(10), 0.0), (jpeg(90), 1.0)], 2)
    index = RecordFaces(rec, 112).reader.index.folder  # built into the cache the command uses
    offsets = index / "offsets.npy"
    offsets.write_bytes(offsets.read_bytes()[:-8])  # a cut array: never used, named
    return c.train("--data", str(rec))


# ---- §4 data side: one line, at load or at the start of training ------------------------------------------------------

@case("bin-nine-pairs", "x.bin: 9 pairs", "needs at least 10")
def _(c):
    return c.eval("--data", c.pack(pickle.dumps(([jpeg(i) for i in range(18)], FLAGS[:9]), protocol=4)))


@case("bin-only-genuine-pairs", "x.bin: all 12 pairs are genuine", "both genuine and impostor")
def _(c):
    return c.eval("--data", c.pack(pickle.dumps(([jpeg(i) for i in range(24)], [True] * 12), protocol=4)))


@case("train-val-target-only-impostor-pairs", "x.bin: all 12 pairs are impostor")
def _(c):
    pack = c.pack(pickle.dumps(([jpeg(i) for i in range(24)], [False] * 12), protocol=4))
    return c.train("--data", str(c.prior.faces), "--val-targets", pack)


@case("train-val-data-without-genuine-pairs", "--val-data", "all 1 pairs are impostor")
def _(c):
    val = c.folders({"v1": [jpeg(1)], "v2": [jpeg(2)]}, "val")
    return c.train("--data", str(c.prior.faces), "--val-data", str(val / "train"))


@case("hf-image-none", "[train]: row 1 has no image", "--skip-bad-images")
def _(c):
    return c.train("--data", c.hf([jpeg(10), None], [0, 1]))


@case("hf-image-none-skipped", "skipped 1 unreadable images", "row 1 has no image", ok=True)
def _(c):
    return [*c.train("--data", c.hf([jpeg(10), None, jpeg(70), jpeg(130)], [0, 1, 0, 1]), "--skip-bad-images"),
            "--max-steps", "2"]


@case("cache-cannot-be-written", "VTRAIN_CACHE: cannot create a folder in", "demo_faces")
def _(c):
    if os.geteuid() == 0:  # root writes into a mode-555 folder: use a folder no one can create entries in
        cache = "/proc/self"
    else:
        cache = c.inputs / "cache"
        cache.mkdir(mode=0o555)
    return c.train("--data", "demo"), {"VTRAIN_CACHE": str(cache)}


@case("predict-undecodable-names-no-missing-flag", "cannot decode image", "junk.jpg", absent=("--skip-bad-images",))
def _(c):
    return ["predict", "--checkpoint", str(c.prior.run), "--images", str(c.file("junk.jpg", b"not an image")),
            "--out", str(c.out / "emb.safetensors"), "--num-workers", "0"]


# ---- the table -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(CASES))
def test_hostile_data(name, prior, tmp_path, record_property):
    from vtrain.engine.checkpoint.format import complete_checkpoints

    spec = CASES[name]
    c = Ctx(prior, tmp_path / "inputs", tmp_path / "out")
    c.inputs.mkdir()
    built = spec.build(c)
    argv, extra_env = built if isinstance(built, tuple) else (built, {})
    for d in (c.inputs, c.inputs.parent):  # decoys beside the inputs and beside the run
        (d / "decoy.bin").write_bytes(os.urandom(4096))
    before = tree_hash(c.inputs), tree_hash(prior.run), (c.inputs.parent / "decoy.bin").read_bytes()
    try:
        rc, out, err, peak_mb = prior.cli.run(argv, extra_env)
    finally:
        if (c.inputs / "cache").exists():
            (c.inputs / "cache").chmod(0o755)
    record_property("peak_rss_mb", round(peak_mb))
    show = shown(rc, out, err, peak_mb)
    text = verdict(rc, out, err, spec.needles, spec.ok, show)
    if not spec.ok:
        assert not complete_checkpoints(c.out), "a failed run left a checkpoint"
    for n in spec.absent:
        assert n not in text, f"{n!r} in {text!r}"
    after = tree_hash(c.inputs), tree_hash(prior.run), (c.inputs.parent / "decoy.bin").read_bytes()
    assert after == before, "a command changed files it was given, or files beside them"
    assert peak_mb < PEAK_LIMIT_MB, show


def test_every_case_is_distinct():
    assert len(CASES) >= 25 and len({id(c.build) for c in CASES.values()}) == len(CASES)


# ---- §5 no fork of a process that runs threads ------------------------------------------------------------------------

def _run_bounded(script: str, timeout: float, *args: str) -> subprocess.CompletedProcess:
    """Run `script` in its own process group; past `timeout` the whole group (forked children too) is killed and
    the result has returncode None."""
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script), *args], cwd=ROOT, env=script_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return subprocess.CompletedProcess(proc.args, None, out, err)


# A lock that the work needs is held by another thread when the work starts (`hold_while_starting()`, after every
# import), and released 3 s later: threads, or a fresh interpreter, wait for it or never see it; a forked child
# inherits it held, with no thread left to release it, and waits forever. This is the interleaving of docs/input_limits.md §5
# (a heartbeat thread, an inherited lock), forced.
HELD = """
    import sys, threading, time
    lock, held = threading.Lock(), threading.Event()

    def hold():
        with lock:
            held.set()
            time.sleep(3)

    def hold_while_starting():
        threading.Thread(target=hold, daemon=True).start()
        held.wait()

    def with_lock(fn):
        def wrapped(*a, **k):
            with lock:
                return fn(*a, **k)
        return wrapped
"""


def test_demo_generation_never_forks_while_a_thread_holds_a_lock(tmp_path):
    script = HELD + """
    from pathlib import Path
    from PIL import Image
    from vtrain.data.demo_faces import write_identity_tree

    Image.Image.save = with_lock(Image.Image.save)  # every image written needs the lock
    hold_while_starting()
    write_identity_tree(Path(sys.argv[1]), 0, 4, 2, seed=1)
    print("written")
    """
    proc = _run_bounded(script, 120, str(tmp_path / "ids"))
    assert proc.returncode == 0, f"hung or failed (rc {proc.returncode}): {proc.stderr[-3000:]}"
    assert sorted(p.relative_to(tmp_path / "ids").as_posix() for p in (tmp_path / "ids").rglob("*.jpg")) == \
        [f"id_{i:05d}/{j:03d}.jpg" for i in range(4) for j in range(2)]


def test_dataloader_workers_never_fork_while_a_thread_holds_a_lock():
    script = HELD + """
    import torch
    import locked_dataset
    from vtrain.data.workers import worker_context

    locked_dataset.LOCK = lock  # the parent's lock: every item needs it
    loader = torch.utils.data.DataLoader(locked_dataset.Squares(4), batch_size=2, num_workers=2,
                                         multiprocessing_context=worker_context(2))
    hold_while_starting()
    print(torch.cat(list(loader)).tolist())
    """
    proc = _run_bounded(script, 180)
    assert proc.returncode == 0, f"hung or failed (rc {proc.returncode}): {proc.stderr[-3000:]}"
    assert proc.stdout.split()[-4:] == ["[0,", "1,", "4,", "9]"]


def test_every_dataloader_with_workers_takes_its_context_from_data_workers():
    """The behavioural tests (above, and tests/data/test_workers.py) cover `worker_options`: the start method and
    the watch on the loader's process; this one that every DataLoader in vtrain takes them, and that nothing starts
    workers (or any process pool) some other way."""
    import ast

    for path in (ROOT / "vtrain").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                fn = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if fn == "DataLoader":
                    kw = {k.arg: k.value for k in node.keywords}
                    assert None in kw and ast.unparse(kw[None]).startswith("worker_options(") and not (
                        {"multiprocessing_context", "worker_init_fn"} & set(kw)), \
                        f"{path}:{node.lineno}: a DataLoader without **worker_options(...)"
                assert fn not in ("fork", "Pool", "ProcessPoolExecutor"), f"{path}:{node.lineno}: {fn}"
                if fn == "get_context":
                    assert ast.unparse(node.args[0]) != "'fork'", f"{path}:{node.lineno}: a fork context"

