"""`vtrain convert` of hostile and careless published checkpoints (docs/convert.md, docs/input_limits.md §10): every
case is a variant of a peer's own fixture (tests/fixtures/<peer>/, tests/fixtures/arcface/), saved as that peer saves
it (or made byte by byte: tests/helpers/torch_files.py), and run as `vtrain convert` through the fork server with
the fixtures' DINO preset registered (helpers/convert_server.py).

The contract of each row: exit 2 with exactly one `error:` line holding the needles and no traceback (or, for an `ok`
row, exit 0 and a checkpoint that the readers accept: `tools.evaluate.load_model`, which eval, predict and export
use); peak resident memory within 100 MB of a plain conversion of the same fixture (every failing row is refused
before anything of the size it declares exists: a zero-stride view of 10^10 values, a 2.6 MB zip bomb of 2.5 GB, a
directory that lies); nothing changed outside OUT and, after an error, no OUT and no staging folder.

`test_every_command_accepts_a_converted_run` runs the other commands on a converted run of each source (and on a
20-class detrex conversion named by --categories): consolidate, predict, train --pretrained, eval (export: the face
model, in tests/tools/test_convert_arcface.py; DINO has no ONNX export yet). The fuzz test draws as many examples as
the loaded hypothesis profile says (tests/conftest.py)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from tests.helpers.cli import tree_hash
from tests.helpers.fork_server import Cli, PEAK_LIMIT_MB
from tests.helpers.paths import FIXTURES
from tests.helpers.peers import TINY
from tests.helpers.torch_files import deflated_storage, lying_sizes
from vtrain.io.safeio import load_published

# peer -> (fixture file, --from, the container of its state dict)
PEERS = {"idea": ("idea/checkpoint.pth", "idea-dino", "model"),
         "detrex": ("detrex/model_final.pth", "detrex-dino", "model"),
         "mmdet": ("mmdet/model.pth", "mmdet-dino", "state_dict"),
         "arcface": ("arcface/model.pt", "arcface-vit", None)}
MEMORY_MARGIN_MB = 100


@dataclass
class Server:
    cli: Cli
    root: Path
    peak_mb: dict[str, float] = field(default_factory=dict)
    """A plain conversion of each peer's fixture: its peak RSS."""


def argv(peer: str, src: Path, out: Path, *extra: str) -> list[str]:
    model = [] if peer == "arcface" else ["--model", "peer-tiny"]
    return ["convert", str(src), str(out), "--from", PEERS[peer][1], *model, *extra]


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Server:
    root = tmp_path_factory.mktemp("hostile_convert")
    (root / "logs").mkdir()
    s = Server(Cli(root / "logs", "convert_server.py"), root)
    for peer, (file, _, _) in PEERS.items():
        rc, out, err, peak = s.cli.run(argv(peer, FIXTURES / file, root / f"plain-{peer}"))
        assert rc == 0, err
        s.peak_mb[peer] = peak
    yield s
    s.cli.close()


def variant(peer: str, change: Callable) -> Callable[[Path], None]:
    """A writer of the peer's fixture after `change(state_dict, whole)` (which may return a new whole object)."""
    def write(path: Path) -> None:
        whole = load_published(FIXTURES / PEERS[peer][0])
        key = PEERS[peer][2]
        sd = whole[key] if key else whole
        new = change(sd, whole)
        torch.save(whole if new is None else new, path)
    return write


def put(key, value):
    def change(sd, whole):
        sd[key] = value(sd) if callable(value) else value
    return change


def drop(key):
    def change(sd, whole):
        del sd[key]
    return change


def args(**fields):
    def change(sd, whole):
        whole["args"] = argparse.Namespace(**{**vars(whole["args"]), **fields})
    return change


def nan_at(key):
    def change(sd, whole):
        t = sd[key].clone()
        t.view(-1)[3] = float("nan")
        sd[key] = t
    return change


def tied(key, to):
    def change(sd, whole):
        sd[key] = sd[to]
    return change


def sliced(a, b):
    """`a` and `b` two halves of one storage (a model saving views of one buffer)."""
    def change(sd, whole):
        both = torch.cat([sd[a].reshape(-1), sd[b].reshape(-1)])
        sd[a], sd[b] = both[:sd[a].numel()].view(sd[a].shape), both[sd[a].numel():].view(sd[b].shape)
    return change


def rows(n, *prefixes, meta=None):
    """The class head cut to n rows (every tensor of those names with 80, 91 or 92 rows); `meta`: mmdetection's
    `dataset_meta.classes`."""
    def change(sd, whole):
        for k in list(sd):
            if k.startswith(prefixes) and sd[k].ndim and sd[k].shape[0] in (80, 91, 92):
                sd[k] = sd[k][:n].clone()
        if meta is not None:
            whole["meta"] = {**whole.get("meta", {}), "dataset_meta": {"classes": meta}}
    return change


def odd_reduction(key):
    def change(sd, whole):
        sd[key] = sd[key][:, :-1].clone()
    return change


def many_names(sd, whole):
    """20,000 more names for one 80 x 256 tensor: 1.6 GB once each is copied, in a file of 12 MB."""
    for i in range(20000):
        sd[f"class_embed.{i + 10}.weight"] = sd["class_embed.0.weight"]


IDEA_HEADS = ("class_embed.", "transformer.decoder.class_embed.", "transformer.enc_out_class_embed.", "label_enc.")
DETREX_HEADS = ("class_embed.", "transformer.decoder.class_embed.", "label_enc.")
MMDET_HEADS = ("bbox_head.cls_branches.", "dn_query_generator.label_embedding.")
NAMES_20 = [f"thing {i}" for i in range(20)]
SWIN = "backbone.0.layers.0.blocks.0.mlp.fc1.weight"

# id -> (peer, writer of SRC, needles of the error line (None: it converts), extra flags, files written beside SRC)
CASES: dict[str, tuple] = {
    # memory: declared sizes checked before anything of that size exists
    "zero-stride view of 10^10 values": ("idea", variant("idea", put(SWIN, torch.zeros(1).expand(100000, 100000))),
                                         [SWIN, "elements overlap", "10,000,000,000"]),
    "zero-stride view of the model's shape": ("detrex", variant("detrex", put(
        "transformer.tgt_embed.weight", torch.zeros(1).expand(30, 256))), ["transformer.tgt_embed.weight", "overlap"]),
    "zip bomb: 2.5 GB deflated into 2.6 MB": ("mmdet", lambda p: deflated_storage(p, 2560 * 2**20),
                                            ["zip records declare", "archive/data/0", "2,684,354,560"]),
    "zip directory that lies about a record": ("idea", lambda p: lying_sizes(p, 2**32 - 1),
                                               ["zip records declare", "4,294,967,295"]),
    "20,000 names for one storage": ("idea", variant("idea", many_names), ["tensors hold", "share its storage"]),
    "truncated file": ("mmdet", lambda p: p.write_bytes((FIXTURES / PEERS["mmdet"][0]).read_bytes()[:5_000_000]),
                       ["cannot read"]),
    # tensors a real file can hold
    "tied weights (one storage, two names)": ("arcface", variant("arcface", tied("blocks.1.norm1.weight",
                                                                                "blocks.0.norm1.weight")), None),
    "two names, two views of one storage": ("arcface", variant("arcface", sliced("norm.weight", "norm.bias")), None),
    "a float counter of whole numbers": ("arcface", variant("arcface", put("feature.1.num_batches_tracked",
                                                                           torch.tensor(7.0))), None),
    "sparse": ("arcface", variant("arcface", put("norm.weight", lambda sd: sd["norm.weight"].to_sparse())),
               ["norm.weight", "sparse_coo"]),
    "meta": ("arcface", variant("arcface", put("norm.weight", torch.empty(24, device="meta"))), ["norm.weight", "meta"]),
    "quantized": ("arcface", variant("arcface", put("norm.weight", lambda sd: torch.quantize_per_tensor(
        sd["norm.weight"], 0.1, 0, torch.qint8))), ["norm.weight", "quantized"]),
    "complex": ("arcface", variant("arcface", put("norm.weight", torch.ones(24, dtype=torch.complex64))),
                ["norm.weight", "complex64"]),
    "bool": ("arcface", variant("arcface", put("norm.weight", torch.ones(24, dtype=torch.bool))), ["norm.weight", "bool"]),
    "integer weight": ("arcface", variant("arcface", put("norm.weight", torch.ones(24, dtype=torch.int64))),
                       ["norm.weight", "int64 values"]),
    "fractional counter": ("arcface", variant("arcface", put("feature.1.num_batches_tracked", torch.tensor(7.5))),
                           ["feature.1.num_batches_tracked", "not whole numbers"]),
    "a list for a tensor": ("arcface", variant("arcface", put("norm.weight", [1.0, 2.0])), ["'norm.weight'", "list"]),
    "a key that is no name": ("idea", variant("idea", put(3, torch.ones(2))), ["key 3"]),
    "a layer index of 5,000 digits": ("mmdet", variant("mmdet", put(f"backbone.stages.{'9' * 5000}.downsample.x",
                                                                     torch.ones(2))), ["name of 5,029 characters", "at most 1000"]),
    "0-d where 2-d": ("idea", variant("idea", put("transformer.tgt_embed.weight", torch.tensor(1.0))),
                      ["transformer.tgt_embed.weight", "found shape ()"]),
    "1-d class head": ("idea", variant("idea", put("class_embed.0.weight", torch.ones(91))),
                       ["class_embed.0.weight", "found shape (91,)"]),
    "1-d label embedding": ("detrex", variant("detrex", put("label_enc.weight", torch.ones(80))),
                            ["label_enc.weight", "(80,)"]),
    "1-d position embedding": ("arcface", variant("arcface", put("pos_embed", torch.ones(24))), ["pos_embed", "(24,)"]),
    "no tgt_embed": ("detrex", variant("detrex", drop("transformer.tgt_embed.weight")),
                     ["lacks transformer.tgt_embed.weight"]),
    "no query_embedding": ("mmdet", variant("mmdet", drop("query_embedding.weight")), ["lacks query_embedding.weight"]),
    "a norm bias without its weight": ("idea", variant("idea", drop("backbone.0.norm3.weight")),
                                       ["backbone.0.norm3.bias", "without its weight"]),
    "an mmdet norm bias without its weight": ("mmdet", variant("mmdet", drop("backbone.norm2.weight")),
                                              ["backbone.norm2.bias", "without its weight"]),
    "args.dn_number NaN": ("idea", variant("idea", args(dn_number=float("nan"))), ["args.dn_number", "nan"]),
    "args.dn_number a string": ("idea", variant("idea", args(dn_number="100")), ["args.dn_number", "'100'"]),
    "args.dn_number a list": ("idea", variant("idea", args(dn_number=[100])), ["args.dn_number", "[100]"]),
    "args.dn_number 10^30": ("idea", variant("idea", args(dn_number=10**30)), ["args.dn_number", "0..2000"]),
    "mmdet Swin reduction of an odd width": ("mmdet", variant("mmdet", odd_reduction(
        "backbone.stages.0.downsample.reduction.weight")), ["backbone.stages.0.downsample.reduction.weight",
                                                            "multiple of 4", "(16, 31)"]),
    "IDEA Swin reduction of an odd width": ("idea", variant("idea", odd_reduction(
        "backbone.0.layers.0.downsample.reduction.weight")), ["backbone.0.layers.0.downsample.reduction.weight",
                                                              "(16, 31) in the file"]),
    "NaN": ("detrex", variant("detrex", nan_at("neck.convs.0.conv.weight")), ["neck.convs.0.conv.weight", "inf/NaN"]),
    "float64 beyond float32": ("arcface", variant("arcface", put("norm.weight", torch.full((24,), 1e300,
                                                                                           dtype=torch.float64))),
                               ["norm.weight", "beyond its range"]),
    "tied copies that differ": ("detrex", variant("detrex", put("transformer.decoder.class_embed.1.bias",
                                                                lambda sd: sd["class_embed.1.bias"] + 1)),
                                ["differs from class_embed.1.bias"]),
    # class names: the file's own, --categories, never COCO's for another head
    "mmdet: 20 classes named by its meta": ("mmdet", variant("mmdet", rows(20, *MMDET_HEADS, meta=tuple(NAMES_20))),
                                            None),
    "mmdet: meta names 80 for 20 rows": ("mmdet", variant("mmdet", rows(20, *MMDET_HEADS)),
                                         ["meta.dataset_meta.classes lists 80 classes", "20 rows"]),
    "mmdet: meta classes of numbers": ("mmdet", variant("mmdet", rows(20, *MMDET_HEADS, meta=list(range(20)))),
                                       ["meta.dataset_meta.classes", "expected class names"]),
    "detrex: 20 rows, no names": ("detrex", variant("detrex", rows(20, *DETREX_HEADS)),
                                  ["20 rows, not COCO's 80", "--categories FILE"]),
    "detrex: 20 rows named by --categories": ("detrex", variant("detrex", rows(20, *DETREX_HEADS)), None,
                                              ["--categories", "names.json"], {"names.json": NAMES_20}),
    "detrex: --categories of another count": ("detrex", variant("detrex", rows(20, *DETREX_HEADS)),
                                              ["--categories lists 21", "20 rows"], ["--categories", "names.json"],
                                              {"names.json": NAMES_20 + ["one more"]}),
    "IDEA: 21 rows, no names": ("idea", variant("idea", rows(21, *IDEA_HEADS)), ["21 rows", "--categories FILE"]),
    "IDEA: 21 rows named by --categories": ("idea", variant("idea", rows(21, *IDEA_HEADS)), None,
                                            ["--categories", "names.json"], {"names.json": NAMES_20}),
    "--categories that is no categories list": ("detrex", variant("detrex", rows(20, *DETREX_HEADS)),
                                                ["--categories", "names.json"], ["--categories", "names.json"],
                                                {"names.json": {"id": 3}}),
    "--categories for a face model": ("arcface", variant("arcface", lambda sd, whole: None),
                                      ["--categories", "face model"], ["--categories", "names.json"],
                                      {"names.json": NAMES_20}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_published_file(case, server, tmp_path, record_property, monkeypatch):
    peer, write, needles, *more = CASES[case]
    flags, files = more[0] if more else [], more[1] if len(more) > 1 else {}
    src = tmp_path / "src.pth"
    write(src)
    for name, content in files.items():
        (tmp_path / name).write_text(json.dumps(content))
    flags = [str(tmp_path / f) if f in files else f for f in flags]
    out = tmp_path / "out"
    before = tree_hash(tmp_path)
    rc, stdout, stderr, peak_mb = server.cli.run(argv(peer, src, out, *flags))
    record_property("peak_rss_mb", round(peak_mb))
    shown = f"exit {rc}, peak {peak_mb:.0f} MB\nSTDOUT:\n{stdout[-3000:]}\nSTDERR:\n{stderr[-5000:]}"
    assert "Traceback" not in stdout + stderr, shown
    assert peak_mb < min(PEAK_LIMIT_MB, server.peak_mb[peer] + MEMORY_MARGIN_MB), shown
    if needles is None:
        assert rc == 0, shown
        _readers_accept(out, peer, monkeypatch)
        shutil.rmtree(out)
    else:
        lines = stderr.strip().splitlines()
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), shown
        for n in needles:
            assert n in lines[0], shown
        assert not out.exists()
    assert tree_hash(tmp_path) == before  # SRC, the flags' files: as they were; no staging folder left
    assert sorted(os.listdir(tmp_path)) == sorted(["src.pth", *files])


def _readers_accept(out: Path, peer: str, monkeypatch) -> None:
    """What eval, predict and export load from a checkpoint (the model of its config.yaml with the class count it
    records, categories.json agreeing, every tensor checked), in this process, with the fixtures' preset."""
    from vtrain.presets import DINO_PRESETS
    from vtrain.tools.evaluate import load_model

    monkeypatch.setitem(DINO_PRESETS, "peer-tiny", lambda: TINY)
    loaded = load_model(out, device=torch.device("cpu"))
    if peer != "arcface":
        assert len(loaded.categories) == loaded.model.num_classes


def _coco_set(root: Path, categories: list[dict]) -> tuple[Path, Path]:
    """Two images (the predict fixture, 64 x 96) with a box each, under the converted model's categories."""
    images = root / "images"
    images.mkdir()
    for name in ("a.png", "b.png"):
        shutil.copy(FIXTURES / "predict_image.png", images / name)
    ann = {"images": [{"id": i + 1, "file_name": n, "width": 96, "height": 64} for i, n in enumerate(["a.png", "b.png"])],
           "annotations": [{"id": i + 1, "image_id": i + 1, "category_id": categories[i]["id"], "bbox": [10, 8, 30, 20],
                            "area": 600, "iscrowd": 0} for i in range(2)],
           "categories": categories}
    (root / "ann.json").write_text(json.dumps(ann))
    return root / "ann.json", images


def _ok(server: Server, *args: str) -> str:
    rc, out, err, peak = server.cli.run(list(args))
    assert rc == 0 and "Traceback" not in out + err, f"{' '.join(args)}\nexit {rc}\n{out[-3000:]}\n{err[-3000:]}"
    return out


@pytest.mark.parametrize("peer", ["idea", "detrex", "mmdet", "detrex-20", "arcface"])
def test_every_command_accepts_a_converted_run(peer, server, tmp_path):
    """consolidate and predict on a converted run of each source, train --pretrained on IDEA's, mmdetection's and a
    20-class detrex file named by --categories, eval on that one (the face model's eval, predict, export and
    --pretrained: tests/tools/test_convert_arcface.py)."""
    if peer == "detrex-20":
        src, flags = tmp_path / "src.pth", ["--categories", str(tmp_path / "names.json")]
        variant("detrex", rows(20, *DETREX_HEADS))(src)
        (tmp_path / "names.json").write_text(json.dumps(NAMES_20))
        run = tmp_path / "converted"
        _ok(server, *argv("detrex", src, run, *flags))
    else:
        run = server.root / f"plain-{peer}"
    out = _ok(server, "consolidate", str(run), str(tmp_path / "weights.safetensors"))
    assert "no engine state: a converted checkpoint" in out and "every tensor is finite" in out
    if peer == "arcface":
        return
    categories = json.loads((run / "checkpoints" / "step_0" / "categories.json").read_text())
    assert len(categories) == (20 if peer == "detrex-20" else 80)
    ann, images = _coco_set(tmp_path, categories)
    size = ["--image-size", "64", "--max-size", "96"]
    if peer == "detrex-20":  # eval loads the checkpoint as predict does, then checks its set's categories against
        # the checkpoint's (and starts 2 loader workers: ~10 s): on the list that is not COCO's, named by --categories
        metrics = json.loads(_ok(server, "eval", "--checkpoint", str(run), "--val-ann", str(ann), "--val-images",
                                 str(images), "--batch-size", "1", *size, "--json").strip().splitlines()[-1])
        assert "AP" in metrics, metrics
    _ok(server, "predict", "--checkpoint", str(run), "--images", str(images), "--out", str(tmp_path / "pred"),
        "--num-workers", "0", "--score-threshold", "0", *size)
    predicted = json.loads((tmp_path / "pred" / "predictions.json").read_text())
    assert predicted and {d["category_id"] for d in predicted} <= {c["id"] for c in categories}
    if peer == "detrex":  # the path of detrex-20 but for the class count
        return
    _ok(server, "train", "--task", "dino", "--model", "peer-tiny", "--pretrained", str(run), "--train-ann", str(ann),
        "--train-images", str(images), "--val-ann", str(ann), "--val-images", str(images), "--output-dir",
        str(tmp_path / "ft"), "--max-steps", "1", "--batch-size", "1", "--num-workers", "0", "--mixed-precision",
        "no", *size)
    assert (tmp_path / "ft" / "checkpoints" / "step_1" / "model.safetensors").is_file()


# ---- generated variants (hypothesis; the number of examples is the loaded profile's) ---------------------------------

KINDS = ("int", "str", "none", "list", "dict", "0d", "1d", "transpose", "unsqueeze", "float64", "float16", "int64",
         "bool", "complex", "expand", "nan", "inf", "huge64", "sparse", "meta", "empty", "narrow")


def _hostile_value(t: torch.Tensor, kind: str):
    """`t` (a source tensor) made into a value of `kind`."""
    if kind in ("int", "str", "none", "list", "dict"):
        return {"int": 3, "str": "w", "none": None, "list": [1.0, 2.0], "dict": {"w": t}}[kind]
    flat = t.reshape(-1)
    return {
        "0d": lambda: flat[:1].reshape(()).clone(), "1d": lambda: flat.clone(),
        "transpose": lambda: t.t().clone() if t.ndim == 2 else t.unsqueeze(0), "unsqueeze": lambda: t.unsqueeze(0),
        "float64": lambda: t.double(), "float16": lambda: t.half(), "int64": lambda: t.long(), "bool": lambda: t != 0,
        "complex": lambda: t.to(torch.complex64) if t.is_floating_point() else t.float().to(torch.complex64),
        "expand": lambda: flat[:1].expand(*t.shape) if t.ndim else flat[:1].expand(4),
        "nan": lambda: torch.where(torch.arange(t.numel()).reshape(t.shape) == 0, float("nan"), t.float()),
        "inf": lambda: torch.full_like(t.float(), float("inf")), "huge64": lambda: t.double() * 1e300,
        "sparse": lambda: t.float().to_sparse(), "meta": lambda: torch.empty(t.shape, device="meta"),
        "empty": lambda: torch.empty(0, *t.shape[1:]), "narrow": lambda: flat[: max(1, t.numel() // 2)].clone(),
    }[kind]()


def _mutations(peer: str):
    from hypothesis import strategies as st

    index = st.integers(0, 10**6)
    ops = [st.tuples(st.just("drop"), index),
           st.tuples(st.just("rename"), index, st.sampled_from([".x", "s", ".0", "_copy"])),
           st.tuples(st.just("extra"), st.sampled_from(["extra.weight", "class_embed.9.weight", "blocks.7.norm1.weight",
                                                        "backbone.norm7.bias", "label_enc.weight.x"]),
                     st.integers(0, 3)),
           st.tuples(st.just("value"), index, st.sampled_from(KINDS)),
           st.tuples(st.just("tie"), index, index),
           st.tuples(st.just("nest"), st.sampled_from(["model", "state_dict", "module", "list", "deep"]))]
    scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                        st.text(max_size=4), st.lists(st.integers(0, 5), max_size=3))
    if peer == "idea":
        ops += [st.tuples(st.just("args"), st.sampled_from(["dn_number", "num_classes", "num_queries"]), scalars),
                st.tuples(st.just("args_object"), scalars)]
    if peer == "mmdet":
        ops += [st.tuples(st.just("meta"), st.one_of(
            scalars, st.lists(st.text(max_size=3), max_size=90), st.lists(scalars, max_size=4)))]
    return st.lists(st.one_of(ops), min_size=1, max_size=3)


def _apply(ops: list[tuple], sd: dict, whole):
    for op in ops:
        keys = sorted(sd, key=str)
        pick = (lambda i: keys[i % len(keys)]) if keys else None
        if op[0] == "drop" and keys:
            del sd[pick(op[1])]
        elif op[0] == "rename" and keys:
            k = pick(op[1])
            sd[f"{k}{op[2]}"] = sd.pop(k)
        elif op[0] == "extra":
            sd[op[1]] = torch.randn([4] * op[2])
        elif op[0] == "value" and keys:
            k = pick(op[1])
            if isinstance(sd[k], torch.Tensor) and sd[k].layout == torch.strided and sd[k].device.type == "cpu":
                sd[k] = _hostile_value(sd[k], op[2])
        elif op[0] == "tie" and keys:
            sd[pick(op[1])] = sd[pick(op[2])]
        elif op[0] == "args" and isinstance(whole, dict):
            whole["args"] = argparse.Namespace(**{**vars(whole.get("args", argparse.Namespace())), op[1]: op[2]})
        elif op[0] == "args_object" and isinstance(whole, dict):
            whole["args"] = op[1]
        elif op[0] == "meta" and isinstance(whole, dict):
            whole["meta"] = {"dataset_meta": {"classes": op[1]}}
        elif op[0] == "nest":
            whole = {"list": [whole], "deep": {"model": {"model": {"model": {"model": {"model": whole}}}}}}.get(
                op[1], {op[1]: whole})
    return whole


_FIXTURE_CACHE: dict[str, object] = {}


def _fresh(peer: str):
    """The peer's fixture as loaded, with its own dicts (tensors are never changed in place)."""
    if peer not in _FIXTURE_CACHE:
        _FIXTURE_CACHE[peer] = load_published(FIXTURES / PEERS[peer][0])
    whole = dict(_FIXTURE_CACHE[peer])
    key = PEERS[peer][2]
    if key:
        whole[key] = dict(whole[key])
        return whole[key], whole
    return whole, whole


def _damage(path: Path, how: tuple) -> None:
    """The saved file itself: cut, a byte changed, or a zip record's declared size (central directory) changed."""
    import struct

    raw = bytearray(path.read_bytes())
    if how[0] == "cut":
        raw = raw[: int(len(raw) * how[1])]
    elif how[0] == "flip":
        raw[int((len(raw) - 1) * how[1])] ^= how[2]
    elif how[0] == "size":
        entries = [i for i in range(len(raw) - 4) if raw[i:i + 4] == b"PK\x01\x02"]
        if entries:
            struct.pack_into("<I", raw, entries[int(how[1] * (len(entries) - 1))] + 24, how[2])
    path.write_bytes(bytes(raw))


@pytest.mark.fuzz
@pytest.mark.parametrize("peer", list(PEERS))
def test_fuzz_published_checkpoint(peer, server, tmp_path_factory, monkeypatch):
    """Generated variants of each source's published dict (renamed, missing and extra keys, values of other shapes,
    dtypes, strides and types, ties, nested containers, hostile `args` and `meta` fields) and of its file (cut, a
    byte flipped, a record's declared size changed): success with a checkpoint the readers accept, or exit 2 with one
    `error:` line; no traceback; peak memory within 100 MB of a plain conversion; nothing outside OUT changed."""
    from hypothesis import HealthCheck, given, settings, strategies as st

    damage = st.one_of(st.just(("none",)), st.tuples(st.just("cut"), st.floats(0, 0.999)),
                       st.tuples(st.just("flip"), st.floats(0, 1), st.integers(1, 255)),
                       st.tuples(st.just("size"), st.floats(0, 1), st.integers(0, 2**32 - 1)))

    @settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(ops=_mutations(peer), how=damage)
    def one(ops, how):
        root = tmp_path_factory.mktemp("fuzz")
        sd, whole = _fresh(peer)
        torch.save(_apply(ops, sd, whole), root / "src.pth")
        _damage(root / "src.pth", how)
        before, out = tree_hash(root), root / "out"
        rc, stdout, stderr, peak_mb = server.cli.run(argv(peer, root / "src.pth", out))
        shown = f"{ops} {how}: exit {rc}, peak {peak_mb:.0f} MB\nSTDOUT:\n{stdout[-2000:]}\nSTDERR:\n{stderr[-4000:]}"
        assert "Traceback" not in stdout + stderr, shown
        assert peak_mb < min(PEAK_LIMIT_MB, server.peak_mb[peer] + MEMORY_MARGIN_MB), shown
        if rc == 0:
            _readers_accept(out, peer, monkeypatch)
            shutil.rmtree(out)
        else:
            lines = stderr.strip().splitlines()
            assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), shown
            assert not out.exists(), shown
        assert tree_hash(root) == before and os.listdir(root) == ["src.pth"], shown
        shutil.rmtree(root)

    one()
