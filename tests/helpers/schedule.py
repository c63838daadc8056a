"""How pytest-xdist hands the suite to its workers (pyproject.toml: -n auto --dist loadfile); tests/conftest.py
installs these two hooks.

A worker gets a unit of work at a time: a test file, so the file's module fixtures run once, except the tests named
in ONE_UNIT_PER_CASE, each case of which is a unit of its own because the cases are independent and long (a
documented page's commands, 10-150 s each): the workers share them, instead of one worker running all of them
(~500 s on one worker: the floor of the suite's wall). The units with the most slow or distributed tests go first,
so the longest work starts first and the run ends with short files on both workers: xdist's own order (the units
with the most tests first) left the one-test multi-process files for the end.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest

ONE_UNIT_PER_CASE = {"tests/repo/test_docs.py::test_documented_commands_run"}
HEAVY_MARKS = ("slow", "distributed")


def unit_of(nodeid: str) -> str:
    """The unit of work a test is handed out in: its file, or the test itself for one in ONE_UNIT_PER_CASE."""
    return nodeid if nodeid.partition("[")[0] in ONE_UNIT_PER_CASE else nodeid.split("::", 1)[0]


def heavy_first(items: list) -> None:
    """Sort ``items`` (in place, stably) by unit: the most slow or distributed tests first, then the most tests,
    then collection order; the order within a unit is kept."""
    weight, size, first = Counter(), Counter(), {}
    for k, item in enumerate(items):
        unit = unit_of(item.nodeid)
        size[unit] += 1
        weight[unit] += any(item.get_closest_marker(mark) for mark in HEAVY_MARKS)
        first.setdefault(unit, k)
    items.sort(key=lambda item: (-weight[unit_of(item.nodeid)], -size[unit_of(item.nodeid)],
                                 first[unit_of(item.nodeid)]))


def pytest_collection_modifyitems(config, items):
    """On a pytest-xdist worker, the units heaviest first (``heavy_first``); every worker sorts the same collection
    alike, as xdist requires. A serial run keeps the files' order."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        heavy_first(items)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's: unknown where it is not installed
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile over the units of ``unit_of``, handed out in the workers' order (above)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class UnitScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    config.option.loadscopereorder = False  # xdist's reordering (by test count) would undo heavy_first
    return UnitScheduling(config, log)


def tier_seconds(reports) -> dict[str, list[float]]:
    """Each test's seconds (setup + call + teardown, summed over its reports) by tier: "default" for a test not
    marked slow (the default pass, README.md's test command: the 2-rank runs marked distributed included), "slow"
    for the others (the slow tier, which .ci/run runs after it)."""
    tests: dict[str, tuple[float, bool]] = {}  # nodeid -> (seconds so far, marked slow)
    for report in reports:
        seconds, slow = tests.get(report.nodeid, (0.0, False))
        tests[report.nodeid] = (seconds + report.duration, slow or "slow" in report.keywords)
    tiers: dict[str, list[float]] = {"default": [], "slow": []}
    for seconds, slow in tests.values():
        tiers["slow" if slow else "default"].append(seconds)
    return tiers


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One line after the run: the seconds the default pass's tests and the slow tier's took, summed, and each
    tier's wall on this run's workers had it run alone (the sum over the workers: the workers stay busy to the end,
    helpers/schedule.py). So a full run (-m "") also times the default pass, on CI's CPU too."""
    reports = [r for key in ("passed", "failed", "error") for r in terminalreporter.stats.get(key, [])
               if hasattr(r, "duration") and getattr(r, "nodeid", "")]
    if not reports:
        return
    tiers = tier_seconds(reports)
    workers = max(1, int(getattr(config.option, "numprocesses", 0) or 0))
    default, slow = sum(tiers["default"]), sum(tiers["slow"])
    terminalreporter.write_line(
        f"suite time by tier: default pass {len(tiers['default'])} tests, {default:.0f} s summed "
        f"(~{default / workers / 60:.1f} min on {workers} worker(s)); slow tier {len(tiers['slow'])} tests, "
        f"{slow:.0f} s summed (~{slow / workers / 60:.1f} min)")
