"""A process that builds (or waits for) one index, for the concurrent-builders test in test_data_index.py. Its own
module so that a spawned process imports only numpy and vtrain's data cache, not the test module's torch."""

from __future__ import annotations

import os
import time

import numpy as np

from vtrain.data.index import open_index


def build_or_wait(source: dict, log: str, barrier, results) -> None:
    def build(w) -> None:
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(0.5)  # the other process arrives while this one builds (the outcome does not depend on it)
        w.array("values", np.arange(1000, dtype=np.int64))

    barrier.wait()
    index = open_index("race", 1, source, build)
    results.put(f"{index.folder} {int(index.array('values').sum())}")


def build_coco(ann: str, images: str, log: str, barrier, results) -> None:
    """Open a COCO file's data set; each parse of the file is logged (the process that builds the index)."""
    import vtrain.data.coco as coco

    parse = coco.parse_coco

    def logged(path, where):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(0.5)  # the other process arrives while this one builds (the outcome does not depend on it)
        return parse(path, where)

    coco.parse_coco = logged
    barrier.wait()
    ds = coco.CocoDetection(ann, images, 64, 96, train=True)
    results.put(f"{ds.index.folder} {ds.report.boxes}")
