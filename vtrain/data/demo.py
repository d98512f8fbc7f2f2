"""`--data demo`, for both tasks: the task's built-in synthetic data set, generated once into the data cache.

The one place that turns `demo` into a directory; the tasks call it before they look at the data's layout, so the
loading code after it is the code real data goes through."""

from __future__ import annotations

from pathlib import Path

from vtrain.config import DEMO_DATA
from vtrain.data.demo_faces import ensure_demo_faces_rec
from vtrain.data.demo_shapes import ensure_demo_shapes

# detection: a COCO-layout set of coloured shapes; metric: synthetic identities packed as an insightface RecordIO
# set, with a verification pack and the held-out identity folders
_DEMO_SETS = {"dino": ensure_demo_shapes, "metric": ensure_demo_faces_rec}


def data_root(task: str, path: str) -> Path:
    """Where --data `path` points: the built-in set of `task` (written on first use) for `demo`, else the path."""
    return _DEMO_SETS[task]() if path == DEMO_DATA else Path(path)
