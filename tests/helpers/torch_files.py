"""Hostile torch checkpoint files that `torch.save` cannot write, made byte by byte from the documented zip layout
(APPNOTE.TXT: local file header, central directory, end of central directory) and torch's own pickle of a tensor
(`torch._utils._rebuild_tensor_v2` of a persistent storage id), as a file of another tool or a hand-made one would be:

- `deflated_storage(path, nbytes)`: one uint8 tensor whose storage record is deflated zeros declaring `nbytes`
  (a zip bomb: 2.5 GB fit in about 2.4 MB), with a correct CRC, so torch inflates it whole and succeeds;
- `lying_sizes(path, declared)`: a real torch.save file whose central directory declares `declared` bytes for its
  storage record (the data stay 16 bytes).
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
import zlib
from pathlib import Path

import torch

_CHUNK = 1 << 24  # 16 MiB of zeros: its deflate stream, after a full flush, is the same bytes every time


class _Storage:
    def __init__(self, key: str, nbytes: int) -> None:
        self.key, self.nbytes = key, nbytes


class _Tensor:
    def __init__(self, storage: _Storage, size: tuple[int, ...], stride: tuple[int, ...]) -> None:
        self.args = (storage, 0, size, stride, False, collections.OrderedDict())

    def __reduce__(self):
        return torch._utils._rebuild_tensor_v2, self.args


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, _Storage):  # what torch.save writes for a storage (torch/serialization.py, _save)
            return "storage", torch.ByteStorage, obj.key, "cpu", obj.nbytes
        return None


def _crc32_zeros(n: int) -> int:
    """zlib's CRC-32 of n zero bytes without reading them: the CRC register advanced by repeated squaring of the
    linear map of one zero byte (the method of zlib's crc32_combine)."""
    def times(mat: list[int], vec: int) -> int:
        out, i = 0, 0
        while vec:
            if vec & 1:
                out ^= mat[i]
            vec >>= 1
            i += 1
        return out

    # the map of one zero bit on the reflected register (polynomial 0xEDB88320), then of 8 bits (one byte)
    one = [0xEDB88320] + [1 << i for i in range(31)]
    byte = one
    for _ in range(3):
        byte = [times(byte, byte[i]) for i in range(32)]
    crc, power = 0xFFFFFFFF, byte
    while n:
        if n & 1:
            crc = times(power, crc)
        power = [times(power, power[i]) for i in range(32)]
        n >>= 1
    return crc ^ 0xFFFFFFFF


def _zip(path: Path, entries: list[tuple[str, int, int, int, bytes]]) -> None:
    """entries: (name, method 0 stored / 8 deflated, crc, uncompressed size, the bytes stored)."""
    out, central = io.BytesIO(), io.BytesIO()
    for name, method, crc, size, data in entries:
        offset, raw = out.tell(), name.encode()
        out.write(struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, method, 0, 0x21, crc, len(data), size, len(raw), 0))
        out.write(raw + data)
        central.write(struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, method, 0, 0x21, crc, len(data), size,
                                  len(raw), 0, 0, 0, 0, 0, offset) + raw)
    start = out.tell()
    out.write(central.getvalue())
    out.write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(entries), len(entries), len(central.getvalue()), start,
                          0))
    Path(path).write_bytes(out.getvalue())


def _stored(name: str, data: bytes) -> tuple[str, int, int, int, bytes]:
    return name, 0, zlib.crc32(data), len(data), data


def deflated_storage(path: Path, nbytes: int, key: str = "w") -> None:
    """`{key: uint8 tensor of nbytes zeros}` whose storage record is deflated: a file of about nbytes / 1000."""
    assert nbytes % _CHUNK == 0
    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump({key: _Tensor(_Storage("0", nbytes), (nbytes,), (1,))})
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = c.compress(bytes(_CHUNK)) + c.flush(zlib.Z_FULL_FLUSH)
    stream = block * (nbytes // _CHUNK) + c.flush(zlib.Z_FINISH)
    _zip(path, [_stored("archive/data.pkl", buf.getvalue()), _stored("archive/byteorder", b"little"),
                ("archive/data/0", 8, _crc32_zeros(nbytes), nbytes, stream), _stored("archive/version", b"3\n")])


def lying_sizes(path: Path, declared: int) -> None:
    """A torch.save file of one 16-byte tensor whose central directory says its storage record holds `declared`
    bytes once inflated (the record is stored, 16 bytes)."""
    buf = io.BytesIO()
    torch.save({"w": torch.zeros(4)}, buf)
    raw = bytearray(buf.getvalue())
    i = raw.index(b"PK\x01\x02")
    while i >= 0:  # every central directory entry; the storage record's uncompressed size is replaced
        n, m, k = struct.unpack_from("<HHH", raw, i + 28)
        if raw[i + 46:i + 46 + n].endswith(b"/data/0"):
            struct.pack_into("<HI", raw, i + 10, 8, 0)  # method: deflated
            struct.pack_into("<I", raw, i + 24, declared if declared < 2**32 else 0xFFFFFFFF)
        i = raw.find(b"PK\x01\x02", i + 46 + n + m + k)
    Path(path).write_bytes(bytes(raw))
