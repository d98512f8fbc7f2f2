"""The IJB protocol reader (vtrain/data/ijb.py): a valid protocol read exactly; every malformed file, id out of range,
missing image, bad landmark and oversized file refused in one line naming file and line; generated hostile variants
(hypothesis) either read or refused in one line, in bounded memory, with nothing written."""

from __future__ import annotations

import hashlib
import tempfile
import tracemalloc
from contextlib import contextmanager
from pathlib import Path

import numpy as np
# read_ijb imports pandas on first use; imported here, its ~40 MB are not counted in a traced read (a hostile
# example run first, alone, failed its memory bound on the import)
import pandas  # noqa: F401
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vtrain.data.ijb import find_ijb, read_ijb
from vtrain.errors import VtrainError

LMK = "38.3 51.7 73.5 51.5 56.0 71.7 41.5 92.4 70.7 92.2"
FACES = [("1.jpg", 11, 100), ("2.jpg", 11, 100), ("3.jpg", 11, 101), ("4.jpg", 12, 102), ("5.jpg", 13, 103),
         ("1.jpg", 13, 104)]  # 1.jpg in two templates (as IJB-C lists faces per template)
PAIRS = [(11, 12, 0), (11, 13, 1), (12, 13, 0)]


def write(root: Path, faces=FACES, pairs=PAIRS, target="ijbc", lmk=LMK, score="0.9", images=True) -> Path:
    (root / "meta").mkdir(parents=True, exist_ok=True)
    (root / "loose_crop").mkdir(exist_ok=True)
    (root / "meta" / f"{target}_face_tid_mid.txt").write_text("".join(f"{n} {t} {m}\n" for n, t, m in faces))
    (root / "meta" / f"{target}_name_5pts_score.txt").write_text("".join(f"{n} {lmk} {score}\n" for n, _, _ in faces))
    (root / "meta" / f"{target}_template_pair_label.txt").write_text("".join(f"{a} {b} {c}\n" for a, b, c in pairs))
    if images:
        for n, _, _ in faces:
            (root / "loose_crop" / n).write_bytes(b"x")
    return root


def read(root: Path, target=None, **kw):
    return read_ijb(find_ijb(root, target), **kw)


def tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


def test_valid_protocol_is_read_exactly(tmp_path):
    p = read(write(tmp_path))
    assert p.files.target == "ijbc" and p.files.name == "IJB-C"
    assert p.names == [n for n, _, _ in FACES]
    assert p.template_ids.tolist() == [11, 12, 13] and p.template.tolist() == [0, 0, 0, 1, 2, 2]
    assert p.media.tolist() == [100, 100, 101, 102, 103, 104]
    assert p.pairs.tolist() == [[0, 1], [0, 2], [1, 2]] and p.labels.tolist() == [False, True, False]
    assert p.landmarks.shape == (6, 5, 2) and p.landmarks.dtype == np.float32
    assert p.landmarks[0, 1].tolist() == [np.float32(73.5), np.float32(51.5)]
    assert p.scores.dtype == np.float32 and np.all(p.scores == np.float32(0.9))


def test_ijbb_is_found_by_its_files_and_tabs_crlf_are_whitespace(tmp_path):
    root = write(tmp_path, target="ijbb")
    f = root / "meta" / "ijbb_template_pair_label.txt"
    f.write_bytes(f.read_bytes().replace(b" ", b"\t").replace(b"\n", b"\r\n"))
    assert read(root).files.name == "IJB-B" and read(root).labels.tolist() == [False, True, False]


def _set(name: str, text: str | bytes):
    def change(root: Path) -> None:
        f = root / "meta" / f"ijbc_{name}.txt"
        f.write_bytes(text if isinstance(text, bytes) else text.encode())
    return change


def _line(name: str, k: int, text: str):
    def change(root: Path) -> None:
        f = root / "meta" / f"ijbc_{name}.txt"
        lines = f.read_text().splitlines(keepends=True)
        lines[k] = text
        f.write_text("".join(lines))
    return change


def _rm(rel: str):
    def change(root: Path) -> None:
        p = root / rel
        p.unlink() if p.is_file() else p.rmdir()
    return change


def _both(root: Path) -> None:
    write(root, target="ijbb")


TPL = "face_tid_mid"
PTS = "name_5pts_score"
PRS = "template_pair_label"
CASES = {
    "both protocols": (_both, "holds both IJB-B and IJB-C"),
    "pair file missing": (_rm(f"meta/ijbc_{PRS}.txt"), "file missing"),
    "no loose_crop": (lambda r: [p.unlink() for p in (r / "loose_crop").iterdir()] and (r / "loose_crop").rmdir(),
                      "image folder missing"),
    "face: 2 fields": (_line(TPL, 1, "2.jpg 11\n"), f"ijbc_{TPL}.txt:2: expected"),
    "face: id not an integer": (_line(TPL, 1, "2.jpg 1x 100\n"), f"ijbc_{TPL}.txt:2: expected"),
    "face: id beyond int64": (_line(TPL, 1, f"2.jpg {2**63} 100\n"), "within int64"),
    "face: not UTF-8": (_set(TPL, b"1.jpg 11 100\n\xff.jpg 11 100\n"), f"ijbc_{TPL}.txt:2: not UTF-8"),
    "face: 10 kB line": (_line(TPL, 2, "3.jpg " + "1" * 10000 + " 1\n"), "longer than 4096 bytes"),
    "face: path leaves loose_crop": (lambda r: [_line(TPL, 0, "../x.jpg 11 100\n")(r),
                                                _line(PTS, 0, f"../x.jpg {LMK} 0.9\n")(r)], "inside loose_crop"),
    "face: absolute path": (lambda r: [_line(TPL, 0, "/etc/passwd 11 100\n")(r),
                                       _line(PTS, 0, f"/etc/passwd {LMK} 0.9\n")(r)], "inside loose_crop"),
    "faces: empty": (lambda r: [_set(TPL, "")(r), _set(PTS, "")(r)], "no faces"),
    "landmarks: 11 fields": (_line(PTS, 2, "3.jpg 1 2 3 4 5 6 7 8 9 0.9\n"), f"ijbc_{PTS}.txt:3: expected"),
    "landmarks: a word": (_line(PTS, 2, f"3.jpg {LMK.replace('56.0', 'nose')} 0.9\n"), "12 fields, numbers"),
    "landmarks: nan": (_line(PTS, 2, f"3.jpg {LMK.replace('56.0', 'nan')} 0.9\n"), "finite"),
    "landmarks: beyond float32": (_line(PTS, 2, f"3.jpg {LMK.replace('56.0', '1e39')} 0.9\n"), "finite"),
    "landmarks: one point": (_line(PTS, 3, "4.jpg " + "5 5 " * 5 + "0.9\n"), f"ijbc_{PTS}.txt:4: the five "
                                                                              "landmarks are one point"),
    "landmarks: too far apart": (_line(PTS, 3, "4.jpg " + "3e38 -3e38 " * 5 + "0.9\n"), "too far apart"),
    "score: negative": (_line(PTS, 1, f"2.jpg {LMK} -0.1\n"), ">= 0"),
    "score: inf": (_line(PTS, 1, f"2.jpg {LMK} inf\n"), "finite"),
    "names differ": (_line(PTS, 4, f"9.jpg {LMK} 0.9\n"), f"ijbc_{PTS}.txt:5: image '9.jpg'"),
    "counts differ": (lambda r: (r / "meta" / f"ijbc_{PTS}.txt").write_text(f"1.jpg {LMK} 0.9\n"), "has 1 faces"),
    "pair: label 2": (_line(PRS, 1, "11 13 2\n"), f"ijbc_{PRS}.txt:2: label must be 0 or 1"),
    "pair: unknown template": (_line(PRS, 2, "12 99 0\n"), f"ijbc_{PRS}.txt:3: template 99 has no face"),
    "pair: 4 fields on line 1": (_line(PRS, 0, "11 12 0 7\n"), f"ijbc_{PRS}.txt:1: expected"),
    "pair: 2 fields": (_line(PRS, 1, "11 13\n"), f"ijbc_{PRS}.txt:2: expected"),
    "pair: blank line": (_line(PRS, 1, "\n"), f"ijbc_{PRS}.txt:2: empty line"),
    "pair: a fraction": (_line(PRS, 1, "11.5 13 1\n"), f"ijbc_{PRS}.txt:2: expected"),
    "pair: beyond int64": (_line(PRS, 1, f"{2**64} 13 1\n"), f"ijbc_{PRS}.txt:2: expected"),
    "pair: not UTF-8": (_set(PRS, b"11 12 0\n11 \xff 1\n"),
                        f"ijbc_{PRS}.txt:2: not UTF-8"),
    "pair: 1 MB line": (_set(PRS, "11 12 0\n" + "1" * 1_000_000), "longer than 4096 bytes"),
    "pairs: genuine only": (_set(PRS, "11 13 1\n"), "needs both genuine (1) and impostor (0)"),
    "pairs: none": (_set(PRS, ""), "no pairs"),
    "image missing": (_rm("loose_crop/3.jpg"), f"ijbc_{PTS}.txt:3: image not found"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_protocols_are_one_line_naming_the_problem(tmp_path, case):
    change, needle = CASES[case]
    root = write(tmp_path / "IJBC")
    change(root)
    before = tree(tmp_path)
    with pytest.raises(VtrainError) as e:
        read(root)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert tree(tmp_path) == before


def test_folder_errors(tmp_path):
    with pytest.raises(VtrainError, match="not a directory"):
        find_ijb(tmp_path / "none")
    write(tmp_path / "IJBC")
    with pytest.raises(VtrainError, match=r"not an IJB-B or IJB-C release folder \(did you mean .*IJBC\?\)"):
        find_ijb(tmp_path)
    with pytest.raises(VtrainError, match="--ijb-target: 'ijba'"):
        find_ijb(tmp_path / "IJBC", "ijba")
    with pytest.raises(VtrainError, match="IJB-B file missing"):
        find_ijb(tmp_path / "IJBC", "ijbb")


def test_a_file_too_big_for_memory_is_refused_before_it_is_parsed(tmp_path):
    """The line count is held against the memory available before any array is made: 200,000 pairs (~10 MB to
    read) against a 4 MB budget."""
    root = write(tmp_path)
    (root / "meta" / f"ijbc_{PRS}.txt").write_text("11 12 0\n11 13 1\n" * 100_000)
    tracemalloc.start()
    try:
        with pytest.raises(VtrainError, match=r"200000 lines need about .* GiB to read, more than the"):
            read(root, available=4 << 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 20 << 20  # blocks of 8 MB counted, nothing parsed
    assert len(read(root).labels) == 200_000


# ---- generated hostile variants -----------------------------------------------------------------------------------
FILES = [f"meta/ijbc_{k}.txt" for k in (TPL, PTS, PRS)]
TOKENS = ["", " ", "\t", "\n", "\r\n", "0", "1", "-1", "2", "11", "12", "13", "99", "1.5", "1e3", "nan", "inf", "-inf",
          "1e39", "x", "..", "/", "../a.jpg", "1.jpg", "9.jpg", str(2**63), str(2**64), "\x00", "é", "\ufeff", "0.0"]


@contextmanager
def example_dir():
    """A fresh folder per generated example, with a decoy file beside the protocol (`tree` of the folder checks the
    protocol and its neighbour), removed after it: the check hashes one example's files, not every earlier
    example's (which made the test quadratic in the example count)."""
    with tempfile.TemporaryDirectory(prefix="ijb-") as tmp:
        (Path(tmp) / "decoy.txt").write_text("not part of the protocol\n")
        yield Path(tmp)


@settings(deadline=None)
@given(st.sampled_from(FILES), st.integers(0, 6), st.integers(0, 12),
       st.lists(st.sampled_from(TOKENS), min_size=0, max_size=6), st.sampled_from(["replace", "insert", "cut"]),
       st.binary(max_size=8))
def test_generated_hostile_files_read_or_fail_in_one_line(file, line, field, tokens, how, junk):
    with example_dir() as tmp:
        hostile_variant_reads_or_fails(write(tmp / "IJBC"), file, line, field, tokens, how, junk)


def hostile_variant_reads_or_fails(root: Path, file, line, field, tokens, how, junk) -> None:
    path = root / file
    lines = path.read_bytes().split(b"\n")
    k = min(line, len(lines) - 1)
    parts = lines[k].split(b" ")
    new = " ".join(tokens).encode("utf-8", "surrogatepass") + junk
    if how == "replace":
        parts[min(field, len(parts) - 1)] = new
    elif how == "insert":
        parts.insert(min(field, len(parts)), new)
    else:
        parts = parts[: field % (len(parts) + 1)]
    lines[k] = b" ".join(parts)
    path.write_bytes(b"\n".join(lines))
    before = tree(root.parent)  # the protocol and the decoy beside it
    tracemalloc.start()
    try:
        try:
            p = read(root)
        except VtrainError as e:
            assert str(e) and "\n" not in str(e) and "Traceback" not in str(e), str(e)
        else:  # what was read is consistent
            assert len(p.names) == len(p.template) == len(p.scores) == len(p.landmarks)
            assert p.pairs.max() < len(p.template_ids) and np.isfinite(p.landmarks).all()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20, peak
    assert tree(root.parent) == before


@given(st.lists(st.tuples(st.integers(-2**63, 2**63 - 1), st.integers(0, 5)), min_size=1, max_size=30),
       st.lists(st.tuples(st.integers(0, 29), st.integers(0, 29), st.booleans()), min_size=1, max_size=40),
       st.floats(0, 1e6, width=32))
@settings(deadline=None)
def test_generated_valid_protocols_read_back_exactly(faces, pairs, score):
    with example_dir() as tmp:
        valid_protocol_reads_back(tmp / "IJBC", faces, pairs, score)


def valid_protocol_reads_back(root: Path, faces, pairs, score) -> None:
    rows = [(f"{i}.jpg", t, m) for i, (t, m) in enumerate(faces)]
    tids = [t for _, t, _ in rows]
    plist = [(tids[a % len(tids)], tids[b % len(tids)], int(s)) for a, b, s in pairs]
    plist += [(tids[0], tids[0], 1), (tids[0], tids[-1], 0)]  # both kinds
    write(root, rows, plist, score=repr(score))
    p = read(root)
    assert p.template_ids[p.template].tolist() == tids and p.media.tolist() == [m for _, _, m in rows]
    assert p.template_ids[p.pairs].tolist() == [[a, b] for a, b, _ in plist]
    assert p.labels.tolist() == [bool(c) for _, _, c in plist] and np.all(p.scores == np.float32(score))
