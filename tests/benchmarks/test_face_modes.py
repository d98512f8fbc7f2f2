"""benchmarks/face_modes.py without training: it runs what `make demo` runs, changing only each variant's flags."""

from __future__ import annotations

import sys

from tests.helpers.paths import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import face_modes  # noqa: E402


def test_the_recipe_is_make_demos_face_command_with_each_variants_flags():
    base = face_modes.makefile_face_flags()
    assert base[:2] == ["--task", "metric"] and "--output-dir" not in base and "--data" in base
    for compare, variants in face_modes.VARIANTS.items():
        for name, extra in variants.items():
            flags = face_modes.with_flags(base, extra)
            assert len(flags) == len(base) + len(extra) - 2 * sum(n in base for n in extra[::2]), (compare, name)
            for option, value in zip(extra[::2], extra[1::2]):
                assert flags.count(option) == 1 and flags[flags.index(option) + 1] == value
            untouched = [i for i in range(0, len(base), 2) if base[i] not in extra[::2]]
            assert all(flags[flags.index(base[i]) + 1] == base[i + 1] for i in untouched if base[i].startswith("--"))
