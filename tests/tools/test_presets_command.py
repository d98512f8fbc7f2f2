"""`vtrain presets` builds every preset on the meta device; what it imports is torch, timm and the model code only:
no parallel engine, data or export library (their imports are most of a training run's start-up)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers.cli import env
from tests.helpers.paths import ROOT

NOT_NEEDED = ("deepspeed", "accelerate", "datasets", "onnx", "onnxruntime", "pycocotools", "tensorboard")


def test_presets_imports_no_engine_data_or_export_library():
    code = ("import json, sys\nfrom vtrain.cli import app\nfrom vtrain.tools.presets_table import preset_tables\n"
            "tables = preset_tables()\n"
            f"print(json.dumps([len(tables), sorted(m for m in {NOT_NEEDED!r} if m in sys.modules)]))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env(),
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    tables, loaded = json.loads(proc.stdout.splitlines()[-1])
    assert tables == 2
    assert loaded == [], f"`vtrain presets` imports {loaded}"
