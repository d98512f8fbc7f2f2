"""Shared fixtures only (a private data cache, small synthetic identity trees, the Triton interpreter), the lane
of each test: everything under tests/integration/ is marked `integration` (docs/testing.md), and the hypothesis
profiles of the fuzz lane. Helpers that are not fixtures live in tests/helpers/."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

INTEGRATION = Path(__file__).resolve().parent / "integration"

# The fuzz lane (docs/testing.md): property tests marked `fuzz` generate hostile variants of each format vtrain
# reads. `make test` runs a bounded, seeded number of examples (the same ones on every run: derandomized, no example
# database), so the lane costs about a minute and never fails by chance; `make fuzz` (VTRAIN_FUZZ=1) draws many
# more, randomly, and keeps the failing ones in .hypothesis/ to replay first. VTRAIN_FUZZ_EXAMPLES sets the count.
_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example,
            HealthCheck.function_scoped_fixture]
settings.register_profile("default", max_examples=int(os.environ.get("VTRAIN_FUZZ_EXAMPLES", 12)),
                          derandomize=True, database=None, deadline=None, print_blob=True,
                          suppress_health_check=_SLOW_OK)
settings.register_profile("fuzz", max_examples=int(os.environ.get("VTRAIN_FUZZ_EXAMPLES", 400)), deadline=None,
                          print_blob=True, suppress_health_check=_SLOW_OK)
settings.load_profile("fuzz" if os.environ.get("VTRAIN_FUZZ") else "default")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if INTEGRATION in Path(item.fspath).parents:
            item.add_marker(pytest.mark.integration)
        # `make test` runs two pytest-xdist workers with `--dist loadgroup` (docs/testing.md "Two workers"): a
        # module's tests stay together (its module fixtures are built once), and every multi-process test (`slow`)
        # is in one group, so at most one 2-process run is active while the other worker runs single-process tests.
        group = "multi-process" if item.get_closest_marker("slow") else item.nodeid.split("::", 1)[0]
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(scope="session", autouse=True)
def _cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    os.environ["VTRAIN_CACHE"] = str(tmp_path_factory.mktemp("vtrain_cache"))
    os.environ.setdefault("OMP_NUM_THREADS", "1")


_SETTINGS = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled())
"""torch's process-wide settings as the test process starts (OMP_NUM_THREADS=1: one thread; nothing deterministic)."""
_FILL = torch.utils.deterministic.fill_uninitialized_memory


@pytest.fixture(autouse=True)
def _process_settings():
    """A run started in the test's own process (`cli_in_process`, a Trainer, also inside a module fixture) sets
    process-wide torch settings (`--threads`: torch.set_num_threads; `--deterministic`: use_deterministic_algorithms
    and fill_uninitialized_memory): put back to the process's starting values after each test, so that what a later
    test measures in the same process (an allocator peak depends on the thread count) does not depend on which tests
    ran before it there (two xdist workers run them in other orders)."""
    yield
    threads, deterministic, warn_only = _SETTINGS
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    if (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()) != (
            deterministic, warn_only):
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    torch.utils.deterministic.fill_uninitialized_memory = _FILL


@pytest.fixture(scope="session")
def faces(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """train/: 16 identities x 6 images, val/: 6 held-out identities x 4 images (real JPEG files)."""
    from vtrain.data.demo_faces import write_identity_tree

    root = tmp_path_factory.mktemp("faces")
    write_identity_tree(root / "train", 0, 16, 6, seed=3)
    write_identity_tree(root / "val", 100, 6, 4, seed=3)
    return root


@pytest.fixture
def interpret(monkeypatch):
    """The kernels under the Triton interpreter. TRITON_INTERPRET is read when the kernels are decorated (first
    import) and while they run, so it is set for the test only: CLI subprocesses of other tests must not
    inherit it."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernels = importlib.import_module("vtrain.models.dino.msda_triton")
    if not kernels._interpreting():
        # on a GPU machine another test may have compiled them for CUDA first; on a CPU-only one that is a bug
        if torch.cuda.is_available():
            pytest.skip("the Triton kernels were imported in this process without TRITON_INTERPRET=1")
        pytest.fail("the Triton kernels were imported without TRITON_INTERPRET=1 on a machine without CUDA")
    return kernels
