"""Verification `.bin` packs: the insightface layouts (py3 and py2 pickles, bytes or numpy images) are read,
anything else is refused before it can run."""

import io
import os
import pathlib
import pickle
import pickletools
import struct

import numpy as np
import pytest

from vtrain.data.verification_bin import read_bin, write_bin
from vtrain.errors import VtrainError

IMAGES = [bytes([0xFF, 0xD8, i]) + bytes(range(256)) * 2 for i in range(6)]  # not ASCII, like any JPEG
SAME = [True, False, True]


class Py2Pickler(pickle._Pickler):
    """What Python 2's pickle wrote at protocol 2: every `str` (the image bytes, numpy's dtype codes) as a py2
    byte string (SHORT_BINSTRING / BINSTRING), numpy under its old module name `numpy.core`."""
    dispatch = dict(pickle._Pickler.dispatch)

    def save_py2_str(self, obj):
        data = obj.encode("latin1") if isinstance(obj, str) else obj
        if len(data) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(data)]) + data)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", len(data)) + data)
        self.memoize(obj)

    dispatch[bytes] = save_py2_str
    dispatch[str] = save_py2_str


def py2_pickle(obj) -> bytes:
    f = io.BytesIO()
    Py2Pickler(f, protocol=2).dump(obj)
    return f.getvalue().replace(b"cnumpy._core.", b"cnumpy.core.")


@pytest.mark.parametrize("protocol", [2, 4, 5])
@pytest.mark.parametrize("layout", ["bytes", "numpy"])
def test_python3_packs(tmp_path, protocol, layout):
    if layout == "bytes":
        obj = (IMAGES, SAME)
    else:  # cv2.imencode-style uint8 arrays, flags as a numpy bool array and as numpy bool scalars
        obj = ([np.frombuffer(b, np.uint8) for b in IMAGES], np.array(SAME) if protocol != 4 else
               [np.bool_(s) for s in SAME])
    path = tmp_path / "lfw.bin"
    path.write_bytes(pickle.dumps(obj, protocol=protocol))
    images, same = read_bin(path)
    assert images == IMAGES and same.dtype == bool and same.tolist() == SAME


@pytest.mark.parametrize("layout", ["bytes", "numpy"])
def test_python2_packs(tmp_path, layout):
    obj = (IMAGES, SAME) if layout == "bytes" else ([np.frombuffer(b, np.uint8) for b in IMAGES], np.array(SAME))
    raw = py2_pickle(obj)
    ops = {op.name for op, _, _ in pickletools.genops(raw)}  # py2 byte strings only, no py3 str/bytes opcodes
    assert "BINSTRING" in ops and not ops & {"BINUNICODE", "SHORT_BINUNICODE", "BINBYTES", "SHORT_BINBYTES"}
    with pytest.raises(UnicodeDecodeError):  # why plain pickle.load cannot read them (insightface: encoding=bytes)
        pickle.loads(raw)
    path = tmp_path / "agedb_30.bin"
    path.write_bytes(raw)
    images, same = read_bin(path)
    assert images == IMAGES and same.tolist() == SAME


def test_writer_round_trip(tmp_path):
    images, same = read_bin(write_bin(tmp_path / "x.bin", IMAGES, SAME))
    assert images == IMAGES and same.tolist() == SAME


class Touch:
    """Unpickling runs Path.touch(target): the code must never run."""

    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        return pathlib.Path.touch, (self.target,)


class System:
    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        return os.system, (f"touch {self.target}",)


@pytest.mark.parametrize("evil,where,name", [
    (Touch, "top", "pathlib.Path.touch"),
    (System, "issame", "posix.system"),
    (Touch, "bins", "pathlib.Path.touch"),
])
def test_malicious_pack_is_refused_and_never_runs(tmp_path, evil, where, name):
    target = tmp_path / "pwned"
    payload = evil(target)
    obj = {"top": payload, "issame": (IMAGES, [True, payload, False]), "bins": ([payload] * 6, SAME)}[where]
    path = tmp_path / "evil.bin"
    path.write_bytes(pickle.dumps(obj, protocol=2 if where == "issame" else 4))
    with pytest.raises(VtrainError) as e:
        read_bin(path)
    assert str(e.value).startswith(f"refusing to unpickle {path}: it holds a `{name}` object")
    assert not target.exists()
    pickle.loads(path.read_bytes())  # the same file really would have run it
    assert target.exists()


class Call:
    """Pickles as a call of `fn(*args)`."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


@pytest.mark.parametrize("obj,message", [
    (([np.array([1, "x"], dtype=object)] * 6, SAME), "not a readable verification .bin .*dtype"),
    (([Call(np.ndarray, (4,), "O")] * 6, SAME), r"not a readable verification .bin .*direct numpy.ndarray\(...\) call"),
    ((IMAGES, SAME, 3), r"expected a pickled \(bins, issame\) pair"),
    ((IMAGES[:5], SAME), "5 images for 3 pairs"),
    ((IMAGES, [True, "yes", False]), "issame must be a list of booleans"),
    (([1, 2, 3, 4, 5, 6], SAME), r"bins\[0\] is a int"),
    ({"bins": IMAGES}, r"expected a pickled \(bins, issame\) pair, got dict"),
])
def test_malformed_packs(tmp_path, obj, message):
    path = tmp_path / "bad.bin"
    path.write_bytes(pickle.dumps(obj))
    with pytest.raises(VtrainError, match=message):
        read_bin(path)


def test_truncated_and_missing(tmp_path):
    path = tmp_path / "cut.bin"
    path.write_bytes(pickle.dumps((IMAGES, SAME))[:100])
    with pytest.raises(VtrainError, match="cut.bin is not a readable verification .bin"):
        read_bin(path)
    with pytest.raises(VtrainError, match="cannot read"):
        read_bin(tmp_path / "missing.bin")
