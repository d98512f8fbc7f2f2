"""The per-face side of `vtrain eval --ijb`: how many faces per second one core decodes, aligns and embeds.

IJB-C has 469,375 faces, each decoded from its loose crop, aligned from five landmarks to the 112 x 112 crop
(data/face_align.py: Umeyama's transform and the bilinear warp) and turned into a model input in a DataLoader
worker, then embedded with its mirror image. This measures those steps one at a time, in CPU seconds of this
process (one thread: OMP_NUM_THREADS=1, a worker's setting), and `embed_templates` as a whole with the fixture's
`debug` network (batch 64, no workers), on two sets of the same 379 faces:

- `fixture`: tests/fixtures/ijb/IJBC as it is, loose crops of 140-169 px;
- `x4`: the same images enlarged 4 times (560-676 px, JPEG quality 90) with their landmarks scaled, written to a
  temporary folder first (not timed): a source image several times the crop's size.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/ijb_embed.py [--vtrain-root DIR] [--label after]

`--vtrain-root` measures another checkout's vtrain (the before figures: a worktree of an older commit). The rows
are added to benchmarks/results/ijb_embed.json under `--label`. CPU seconds are steadier than wall time on a shared
machine, but still slower than on an idle one: compare labels measured in one session.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "ijb"
RESULTS = ROOT / "benchmarks" / "results" / "ijb_embed.json"


def enlarged(src: Path, dst: Path, factor: int) -> Path:
    """A copy of the IJB folder `src` whose images are `factor` times larger and whose landmarks follow."""
    from PIL import Image

    (dst / "meta").mkdir(parents=True)
    (dst / "loose_crop").mkdir()
    for f in (src / "meta").iterdir():
        text = f.read_text()
        if "5pts" in f.name:
            text = "".join(" ".join([p[0], *(f"{float(v) * factor:.4f}" for v in p[1:11]), p[11]]) + "\n"
                           for p in (line.split() for line in text.splitlines()))
        (dst / "meta" / f.name).write_text(text)
    for f in (src / "loose_crop").iterdir():
        img = Image.open(f).convert("RGB")
        img.resize((img.width * factor, img.height * factor), Image.BILINEAR).save(dst / "loose_crop" / f.name,
                                                                                    quality=90)
    return dst


def measure(root: Path) -> dict:
    import numpy as np
    import torch
    from safetensors.torch import load_file

    from vtrain.data.face_align import align_face
    from vtrain.data.faces import to_model_input
    from vtrain.data.ijb import find_ijb, read_ijb
    from vtrain.data.images import decode_rgb
    from vtrain.models.metric import MetricModel
    from vtrain.tools.ijb_eval import embed_templates

    protocol = read_ijb(find_ijb(root))
    n = len(protocol.names)
    out: dict = {"faces": n}

    def cpu(name: str, fn):
        start, wall = time.process_time(), time.perf_counter()
        value = fn()
        seconds = time.process_time() - start
        out[name] = {"cpu_ms_per_face": round(1e3 * seconds / n, 3), "faces_per_cpu_s": round(n / seconds, 1),
                     "wall_s": round(time.perf_counter() - wall, 2)}
        return value

    images = cpu("decode", lambda: [decode_rgb(protocol.files.images / name).permute(1, 2, 0).numpy()
                                    for name in protocol.names])
    out["source_pixels"] = [int(min(i.shape[0] * i.shape[1] for i in images)),
                            int(max(i.shape[0] * i.shape[1] for i in images))]
    crops = cpu("align", lambda: [align_face(img, protocol.landmarks[i]) for i, img in enumerate(images)])
    cpu("model input", lambda: [to_model_input(torch.from_numpy(c).permute(2, 0, 1), 112) for c in crops])
    cfg = json.loads((FIXTURE / "model_config.json").read_text())
    model = MetricModel(cfg["preset"], 0, cfg["image_size"], cfg["embedding_dim"])
    model.load_state_dict(load_file(str(FIXTURE / "model.safetensors")))
    model.eval()
    sums = cpu("embed_templates (all of the above + the debug network on face and mirror)",
               lambda: embed_templates(lambda x: model(images=x)["embedding"], torch.device("cpu"), protocol, 112,
                                       64, num_workers=0))
    out["template_sum_checksum"] = float(np.abs(sums.sums).sum())
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vtrain-root", default=str(ROOT), help="the checkout whose vtrain is measured")
    ap.add_argument("--label", default="after")
    ap.add_argument("--factor", type=int, default=4)
    a = ap.parse_args()
    sys.path.insert(0, str(Path(a.vtrain_root).resolve()))
    import torch

    import vtrain

    torch.set_num_threads(1)
    result = {"label": a.label, "vtrain": str(Path(vtrain.__file__).parent), "threads": torch.get_num_threads(),
              "load_average_at_start": [round(x, 1) for x in os.getloadavg()],
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, python {sys.version.split()[0]}", "sets": {}}
    with tempfile.TemporaryDirectory() as tmp:
        sets = {"fixture": FIXTURE / "IJBC", f"x{a.factor}": enlarged(FIXTURE / "IJBC", Path(tmp) / "IJBC", a.factor)}
        for name, root in sets.items():
            result["sets"][name] = measure(root)
            print(name, json.dumps(result["sets"][name]), flush=True)
    runs = json.loads(RESULTS.read_text()) if RESULTS.exists() else []
    RESULTS.write_text(json.dumps([r for r in runs if r["label"] != a.label] + [result], indent=1) + "\n")


if __name__ == "__main__":
    main()
