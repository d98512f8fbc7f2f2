"""Synthetic insightface RecordIO face sets of real sizes for benchmarks/data_scale.py (`faces`); its docstring says
how they are made."""

from __future__ import annotations

import io
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np


# ---- synthetic face sets ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FaceSize:
    images: int
    identities: int


FACE_SETS = {
    "tiny": FaceSize(1_000, 10),  # the start-up that does not depend on the data's size, for reference
    "ms1mv3": FaceSize(5_179_510, 93_431),
    "glint360k": FaceSize(17_091_657, 360_232),
    "webface42m": FaceSize(42_474_557, 2_059_906),
}
RECORD_BYTES = 3000  # average image record the offsets are spread for (a 112 x 112 JPEG)
IMAGE_POOL, IDENTITY_POOL = 64, 8
FACE_FORMAT = 1  # bump when the generated files change


def _jpeg(k: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(k)
    img = Image.fromarray(rng.integers(0, 255, (112, 112, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=60)
    return buf.getvalue()


def face_set(name: str, where: Path) -> Path:
    """The synthetic RecordIO dir of `name`, written once under `where` and reused."""
    from vtrain.data.recordio import IRHeader, frame, pack

    size = FACE_SETS[name]
    out = where / f"{name}_v{FACE_FORMAT}"
    if (out / "DONE").is_file():
        return out
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    first = size.images + 1
    end = first + size.identities
    span = max(size.images * RECORD_BYTES // IMAGE_POOL // 4 * 4, 4096)
    image_at = [4096 + k * span for k in range(IMAGE_POOL)]
    identity_at = [4096 + IMAGE_POOL * span + 64 * k for k in range(IDENTITY_POOL)]
    with open(out / "train.rec", "wb") as f:
        f.write(frame(pack(IRHeader(2, [first, end]), b"")))  # float32 labels, as insightface writes them
        for k, pos in enumerate(image_at):
            f.seek(pos)
            f.write(frame(pack(IRHeader(0, float(k * size.identities // IMAGE_POOL), k, 0), _jpeg(k))))
        for k, pos in enumerate(identity_at):
            f.seek(pos)
            f.write(frame(pack(IRHeader(2, [1 + k, 2 + k], first + k, 0), b"")))
        f.truncate(identity_at[-1] + 64 + size.identities * 40)  # sparse: the holes take no disk
    _write_idx(out / "train.idx", size, np.array(image_at, np.int64), np.array(identity_at, np.int64))
    (out / "property").write_text(f"{size.identities},112,112\n")
    (out / "DONE").write_text(json.dumps({"images": size.images, "identities": size.identities}))
    return out


def _write_idx(path: Path, size: FaceSize, image_at: np.ndarray, identity_at: np.ndarray) -> None:
    import pyarrow as pa
    import pyarrow.csv as pc

    schema = pa.schema([("key", pa.int64()), ("offset", pa.int64())])
    opts = pc.WriteOptions(include_header=False, delimiter="\t", quoting_style="none")
    lines = 1 + size.images + size.identities
    with pc.CSVWriter(str(path), schema, write_options=opts) as w:
        for a in range(0, lines, 1 << 22):
            keys = np.arange(a, min(lines, a + (1 << 22)), dtype=np.int64)
            offsets = np.zeros(len(keys), np.int64)  # key 0: the header at byte 0
            img = (keys >= 1) & (keys <= size.images)
            offsets[img] = image_at[(keys[img] - 1) * len(image_at) // size.images]
            ids = keys > size.images
            offsets[ids] = identity_at[(keys[ids] - size.images - 1) * len(identity_at) // size.identities]
            w.write_table(pa.table({"key": keys, "offset": offsets}, schema=schema))
