"""Shared fixtures: a tiny job config that trains in a second on bundled data."""

from __future__ import annotations

import os

# pytest-xdist runs the suite in worker processes (pyproject.toml's addopts), one test at a time each. A worker
# gets one intra-op thread, inherited by the processes its tests start: two workers of two threads on two cores
# oversubscribe them, and OpenMP's spinning threads then make small ops many times slower.
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if WORKER:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
# Keep the measured-peak cache out of the user's home during tests; one per worker, so no test sees another
# test's measurement appear half-way through.
os.environ.setdefault("SCALETRAIN_CACHE", os.path.join(os.path.dirname(__file__), ".cache", WORKER))

# No test reaches the Hugging Face Hub (CI has no network): datasets / lm-eval read only local files and caches,
# and the hub probe (data/sources.hub_reachable) answers at once. A test of the probe itself sets these to 0.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import subprocess  # noqa: E402

import pytest  # noqa: E402  (after the environment above: OpenMP reads it when torch loads)

# The units pytest-xdist hands to its workers and their order (helpers/schedule.py: the docs pages one by one).
from helpers.schedule import (  # noqa: E402, F401
    pytest_collection_modifyitems,
    pytest_terminal_summary,
    pytest_xdist_make_scheduler,
)
from helpers.tiny import tiny_overrides  # noqa: E402
from helpers.waits import timed_out_output  # noqa: E402


@pytest.fixture
def tiny():
    return tiny_overrides


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A process that hit a wait's ceiling (``subprocess.run(..., timeout=CEILING_S)``) fails its test with what
    it had written, not only "timed out" (helpers/waits.py)."""
    outcome = yield
    error = call.excinfo.value if call.excinfo is not None else None
    if isinstance(error, subprocess.TimeoutExpired):
        outcome.get_result().sections.append(("output of the process still running", timed_out_output(error)[-5000:]))
