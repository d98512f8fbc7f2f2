"""Equality of `vtrain convert` at the full published structure: IDEA DINO (and detrex) Swin-L 5-scale.

Not run by the tests or CI: step `peer` needs the peer's source tree and its Python dependencies (the environment of
tests/fixtures/make_dino_fixtures.py); step `compare` runs in vtrain's environment. Nothing is downloaded.

    # 1. the peer's own full-size model (its config, 900 queries, 6 + 6 layers, Swin-L window 12), every parameter
    #    perturbed (seeded), saved in the peer's own format (~0.9 GB), run in eval mode on one fixed input
    PEER_PYTHON benchmarks/published_equality.py peer --peer idea --peer-path /src/DINO --work /tmp/fullsize
    # 2. `vtrain convert` on that file, the model loaded as `vtrain eval` loads it, the same input, the differences
    python benchmarks/published_equality.py compare --peer idea --work /tmp/fullsize \
        --results benchmarks/results/published_equality

The peers' compiled deformable attention is replaced by their own pure-PyTorch functions (as the fixture script
does). The input is 1x3x192x256: multiples of 32, so vtrain's batch padding adds nothing and no mask is needed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
HW = (192, 256)
SEED = 20261128
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
COCO_IDS = [i for i in range(1, 91) if i not in (12, 26, 29, 30, 45, 66, 68, 69, 71, 83)]
FILES = {"idea": "checkpoint.pth", "detrex": "model_final.pth"}
SOURCES = {"idea": "idea-dino", "detrex": "detrex-dino"}
COMMITS = {"idea": "faa8520fe9604c23ad65a48bc583550a44c0e3ab", "detrex": "e244e6c3da3e84566728c52c21fb061d23ce0e2f"}


def image() -> tuple[torch.Tensor, torch.Tensor]:
    """A seeded smooth RGB image (uint8 HWC) and its ImageNet-normalised NCHW float tensor."""
    g = torch.Generator().manual_seed(SEED)
    low = torch.nn.functional.interpolate(torch.rand(1, 3, 12, 16, generator=g), size=HW, mode="bilinear")
    img = (low * 0.8 + 0.2 * torch.rand(1, 3, *HW, generator=g)).clamp(0, 1)
    u8 = (img[0].permute(1, 2, 0) * 255).round().to(torch.uint8)
    x = (u8.permute(2, 0, 1).float()[None] / 255.0 - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(
        1, 3, 1, 1)
    return u8.contiguous(), x.contiguous()


def _peer_idea(peer: Path, work: Path) -> dict[str, torch.Tensor]:
    from fixture_common import Recorder, perturb
    from fixture_idea import build_idea

    model, _post, args, _over, _cfg, NestedTensor = build_idea(peer, full=True)
    perturb(model)
    model.eval()
    rec = Recorder()
    rec.add("swin", model.backbone[0])
    rec.add("encoder", model.transformer.encoder)
    rec.add("enc_cls", model.transformer.enc_out_class_embed)
    _u8, x = image()
    t0 = time.perf_counter()
    with torch.no_grad():
        res = model(NestedTensor(x, torch.zeros(1, *HW, dtype=torch.bool)))
    t = {"input": x, "forward_s": torch.tensor(time.perf_counter() - t0)}
    swin = rec.first("swin")
    for i, k in enumerate(sorted(swin)):
        t[f"backbone.{i}"] = swin[k].tensors
    t["memory"] = rec.first("encoder")[0]
    enc = rec.first("enc_cls")  # every token's 91 logits, before the top-k
    t["enc_max91"] = enc.max(-1)[0]
    t["enc_max80"] = enc[..., COCO_IDS].max(-1)[0]
    t["enc_topk"] = torch.topk(t["enc_max91"], args.num_queries, dim=1)[1]  # IDEA's own call on its own scores
    t["pred_logits"], t["pred_boxes"] = res["pred_logits"], res["pred_boxes"]
    torch.save({"model": model.state_dict(), "args": args}, work / FILES["idea"])
    return t


def _peer_detrex(peer: Path, work: Path) -> dict[str, torch.Tensor]:
    from fixture_common import Recorder, perturb
    from fixture_detrex import build_detrex

    model = build_detrex(peer, full=True)[0]
    perturb(model)
    model.eval()
    rec = Recorder()
    rec.add("backbone", model.backbone)
    rec.add("encoder", model.transformer.encoder)
    rec.add("enc_cls", model.class_embed[-1])
    inp, seen = {}, {}
    model.backbone.register_forward_pre_hook(lambda _m, a: inp.setdefault("x", a[0]))
    orig_aux = model._set_aux_loss

    def aux(outputs_class, outputs_coord):
        seen["cls"], seen["box"] = outputs_class, outputs_coord
        return orig_aux(outputs_class, outputs_coord)

    model._set_aux_loss = aux
    u8, _x = image()
    t0 = time.perf_counter()
    with torch.no_grad():
        model([{"image": u8.permute(2, 0, 1).float(), "height": HW[0], "width": HW[1]}])
    t = {"input": inp["x"], "forward_s": torch.tensor(time.perf_counter() - t0)}
    feats = rec.first("backbone")
    for i in range(4):
        t[f"backbone.{i}"] = feats[f"p{i}"]
    t["memory"] = rec.first("encoder")
    t["enc_max80"] = rec.calls["enc_cls"][0].max(-1)[0]
    t["enc_topk"] = torch.topk(t["enc_max80"], model.num_queries, dim=1)[1]
    t["pred_logits"], t["pred_boxes"] = seen["cls"][-1], seen["box"][-1]
    from detectron2.checkpoint import DetectionCheckpointer
    DetectionCheckpointer(model, save_dir=str(work)).save("model_final")
    (work / "last_checkpoint").unlink(missing_ok=True)
    return t


def step_peer(a) -> None:
    from safetensors.torch import save_file

    sys.path.insert(0, str(FIXTURES))
    torch.set_num_threads(a.threads)
    work = (a.work / a.peer).resolve()
    work.mkdir(parents=True, exist_ok=True)
    peer, here = a.peer_path.resolve(), os.getcwd()
    os.chdir(peer)  # some peers read files relative to their root
    try:
        t = {"idea": _peer_idea, "detrex": _peer_detrex}[a.peer](peer, work)
    finally:
        os.chdir(here)
    save_file({k: v.detach().contiguous() for k, v in t.items()}, str(work / "outputs.safetensors"))
    meta = dict(peer=a.peer, commit=a.commit or COMMITS[a.peer], torch=torch.__version__, image_hw=list(HW),
                seed=SEED, checkpoint_bytes=(work / FILES[a.peer]).stat().st_size,
                peer_forward_s=round(float(t["forward_s"]), 1),
                command=" ".join(["python", "benchmarks/published_equality.py"] + sys.argv[1:]))
    (work / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(json.dumps(meta))


class _PeerSelection:
    """Within the block, a top-k over every encoder token returns the peer's selection, in the peer's order. The
    order of near-tied proposals is set by fp32 rounding (the k-th and the next scores of a random model differ by
    ~1e-7); the order matters because the i-th proposal is paired with the i-th learned content query."""

    def __init__(self, indices: torch.Tensor) -> None:
        self.indices, self.used = indices, 0

    def __enter__(self):
        self.orig = torch.Tensor.topk
        orig, idx = self.orig, self.indices

        def topk(t, k, dim=-1, largest=True, sorted=True):
            if t.dim() == 2 and k == idx.shape[1] and dim == 1 and t.shape[1] > k:
                self.used += 1
                return torch.return_types.topk((t.gather(1, idx), idx))
            return orig(t, k, dim, largest, sorted)

        torch.Tensor.topk = topk
        return self

    def __exit__(self, *exc):
        torch.Tensor.topk = self.orig


def _vtrain_run(model, x: torch.Tensor, force: torch.Tensor | None = None) -> dict:
    """Backbone levels, encoder memory, encoder top-k scores (max logit per token), final logits and boxes;
    `force`: the top-k selection to use (the peer's) instead of vtrain's own."""
    seen = {}
    h = model.encoder.register_forward_hook(lambda _m, _i, out: seen.setdefault("memory", out))
    t0 = time.perf_counter()
    with torch.no_grad():
        if force is not None:
            with _PeerSelection(force) as sel:
                out = model(x)
            assert sel.used == 1, sel.used
            return out
        out = model(x)
        fwd = time.perf_counter() - t0
        feats = model.backbone(x)
        shapes = [tuple(f.shape[-2:]) for f in model.neck(feats)]
        mem = seen["memory"]
        _, valid = model._proposals(mem, torch.zeros(mem.shape[:2], dtype=torch.bool), shapes)
        enc_max = model._proposal_logits(mem, valid).max(-1)[0]
    h.remove()
    return {"backbone": feats, "memory": mem, "enc_max": enc_max, "forward_s": fwd, **out}


def _diff(a: torch.Tensor, b: torch.Tensor) -> dict:
    d = (a.float() - b.float()).abs().max().item()
    scale = b.float().abs().max().item()
    return {"max_abs": d, "max_ref": scale, "rel": d / max(scale, 1e-12)}


def _topk_equal(a: torch.Tensor, b: torch.Tensor, k: int) -> dict:
    ia, ib = a.topk(k, dim=1)[1][0], b.topk(k, dim=1)[1][0]
    common = len(set(ia.tolist()) & set(ib.tolist()))
    sb = torch.sort(b[0], descending=True).values[: k + 1]
    moved = (ia != ib).nonzero().flatten()
    return {"positions_in_other_order": len(moved),
            "max_score_diff_at_those": float((a[0, ia[moved]] - b[0, ib[moved]]).abs().max()) if len(moved) else 0.0,
            "k": k, "same_set": common == k, "same_order": bool(torch.equal(ia, ib)), "common": common,
            "min_gap_near_k": float((sb[:-1] - sb[1:]).min())}


def _load(out: Path):
    from vtrain.tools.evaluate import load_model
    return load_model(out, device=torch.device("cpu"))


def step_compare(a) -> dict:
    from safetensors.torch import load_file

    from vtrain.tools import convert as conv

    torch.set_num_threads(a.threads)
    work = (a.work / a.peer).resolve()
    o = load_file(str(work / "outputs.safetensors"))
    meta = json.loads((work / "meta.json").read_text())
    src = work / FILES[a.peer]
    rows = {}
    # the command as a user runs it (for IDEA: the 80 COCO classes, rows taken by id)
    cli = [sys.executable, "-m", "vtrain", "convert", str(src), str(work / "vtrain"), "--from", SOURCES[a.peer],
           "--overwrite"]
    t0 = time.perf_counter()
    subprocess.run(cli, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    convert_s = time.perf_counter() - t0
    runs = {"cli": work / "vtrain"}
    if a.peer == "idea":  # every class row (ids 0..90): IDEA's own 91-row ranking, the exact comparison
        import functools
        from vtrain.models.dino.adapters import idea
        spec = conv.SOURCES["idea-dino"]
        conv.SOURCES["idea-dino"] = conv.Source(functools.partial(idea.from_idea, categories="source"), spec.preset,
                                                spec.task)
        conv.convert(src, work / "vtrain91", "idea-dino", overwrite=True)
        conv.SOURCES["idea-dino"] = spec
        runs = {"all_rows": work / "vtrain91", **runs}
    for name, out in runs.items():
        loaded = _load(out)
        r = _vtrain_run(loaded.model, o["input"])
        nq = loaded.model.num_queries if hasattr(loaded.model, "num_queries") else r["pred_logits"].shape[1]
        classes = r["pred_logits"].shape[-1]
        row = {"classes": classes, "vtrain_forward_s": round(r["forward_s"], 1),
               "backbone": [_diff(f, o[f"backbone.{i}"]) for i, f in enumerate(r["backbone"])],
               "memory": _diff(r["memory"], o["memory"])}
        ref91 = o.get("enc_max91")
        if classes == 91:
            row["enc_topk"] = _topk_equal(r["enc_max"], ref91, nq)
            row["pred_logits"] = _diff(r["pred_logits"], o["pred_logits"])
            row["pred_boxes"] = _diff(r["pred_boxes"], o["pred_boxes"])
        if classes == 91 or a.peer != "idea":  # the exact rows: also with the peer's proposal order imposed
            sel = o["enc_topk"] if "enc_topk" in o else (ref91 if ref91 is not None else o["enc_max80"]).topk(nq, 1)[1]
            f = _vtrain_run(loaded.model, o["input"], force=sel)
            ref = o["pred_logits"]
            row["with_peer_order"] = {"pred_logits": _diff(f["pred_logits"], ref),
                                      "pred_boxes": _diff(f["pred_boxes"], o["pred_boxes"])}
        if classes != 91:
            peer_logits = o["pred_logits"][..., COCO_IDS] if a.peer == "idea" else o["pred_logits"]
            # against the peer's 80-row encoder ranking (what this model ranks), and against the peer's own ranking
            row["enc_topk"] = _topk_equal(r["enc_max"], o["enc_max80"], nq)
            if ref91 is not None:
                row["enc_topk_vs_91_rows"] = _topk_equal(r["enc_max"], ref91, nq)
            row["pred_logits"] = _diff(r["pred_logits"], peer_logits)
            row["pred_boxes"] = _diff(r["pred_boxes"], o["pred_boxes"])
        rows[name] = row
        del loaded
    res = dict(peer=a.peer, source=SOURCES[a.peer], peer_meta=meta, convert_cli=" ".join(
        ["vtrain", "convert", FILES[a.peer], "OUT", "--from", SOURCES[a.peer]]), convert_s=round(convert_s, 1),
        threads=a.threads, machine=f"{platform.machine()}, {os.cpu_count()} CPUs (shared with other jobs)",
        vtrain_torch=torch.__version__, rows=rows)
    print(json.dumps(res, indent=1))
    if a.results:
        path = a.results.with_suffix(".json")
        old = json.loads(path.read_text()) if path.is_file() else {}
        old[a.peer] = res
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(old, indent=1) + "\n")
        tmp.replace(path)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("step", choices=["peer", "compare"])
    ap.add_argument("--peer", choices=sorted(FILES), default="idea")
    ap.add_argument("--peer-path", type=Path, help="the peer's source tree (step peer)")
    ap.add_argument("--commit", default="", help="the peer's commit (default: the one the fixtures name)")
    ap.add_argument("--work", type=Path, required=True, help="a folder for the ~0.9 GB checkpoint and outputs")
    ap.add_argument("--results", type=Path, help="compare: write/merge RESULTS.json")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    if a.step == "peer":
        if a.peer_path is None:
            ap.error("step peer needs --peer-path")
        step_peer(a)
    else:
        step_compare(a)


if __name__ == "__main__":
    main()
