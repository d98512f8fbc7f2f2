"""`vtrain presets` prints the stored parameter counts (vtrain/preset_counts.py) without building a model or
importing torch; the stored counts are those of every preset as built."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers.cli import env
from tests.helpers.paths import ROOT


def test_presets_prints_the_stored_table_without_importing_torch():
    code = ("import json, sys\nsys.argv = ['vtrain', 'presets']\nfrom vtrain.cli import _run\ncode = _run()\n"
            "print(json.dumps([code, 'torch' in sys.modules, 'timm' in sys.modules]))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env(),
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    code, torch_loaded, timm_loaded = json.loads(proc.stdout.splitlines()[-1])
    assert (code, torch_loaded, timm_loaded) == (0, False, False)
    # piped: full width, nothing cut (the one width rule, vtrain/console.py)
    assert "swin_large_patch4_window12_384" in proc.stdout and "…" not in proc.stdout
    assert "218.33M" in proc.stdout  # Swin-L 5-scale DINO, the published 217-218M (docs/dino.md)
    # every preset has its one row, with the stored counts of its task in millions in their columns
    from vtrain.preset_counts import COUNTS

    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in proc.stdout.splitlines() if line.count("│") > 2]
    for task, counts in COUNTS.items():
        for name, (backbone, total) in counts.items():
            want = [f"{backbone / 1e6:.2f}M", f"{total / 1e6:.2f}M"]  # the two columns before the description
            assert sum(r[0] == name and r[-3:-1] == want for r in rows if len(r) > 3) == 1, (task, name, want)


def test_the_stored_counts_are_the_built_models():
    from vtrain.preset_counts import COUNTS
    from vtrain.tools.presets_count import measure

    assert measure() == COUNTS, "regenerate: python -m vtrain.tools.presets_count > vtrain/preset_counts.py"
