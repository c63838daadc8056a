"""How the suite is handed to pytest-xdist's workers (tests/helpers/schedule.py, installed by conftest.py): a file
is one unit (its module fixtures run once), each documented page is a unit of its own (so both workers share the
pages), and the units with slow or distributed tests go first."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from helpers.schedule import heavy_first, unit_of
from helpers.waits import CEILING_S

HERE = Path(__file__).resolve().parents[1]
PAGE_TEST = "tests/repo/test_docs.py::test_documented_commands_run"


class Item:
    """What heavy_first reads of a pytest item: its node id and its marks."""

    def __init__(self, nodeid: str, *marks: str):
        self.nodeid, self.marks = nodeid, marks

    def get_closest_marker(self, name: str):
        return name if name in self.marks else None


def test_a_page_is_a_unit_of_its_own_and_any_other_test_goes_with_its_file():
    assert unit_of(f"{PAGE_TEST}[README.md]") == f"{PAGE_TEST}[README.md]"
    assert unit_of("tests/repo/test_docs.py::test_number_matching") == "tests/repo/test_docs.py"
    dist = "tests/parallel/test_parallel_dist.py"
    assert unit_of(f"{dist}::test_parity_2_ranks[ddp]") == dist


def test_the_units_with_slow_or_distributed_tests_go_first_in_their_own_order():
    items = [Item("tests/test_a.py::one"), Item("tests/test_a.py::two"), Item("tests/test_a.py::three"),
             Item("tests/test_b.py::run", "distributed"), Item("tests/test_c.py::quick"),
             Item("tests/test_c.py::long", "slow"), Item("tests/test_c.py::longer", "slow"),
             Item(f"{PAGE_TEST}[a.md]", "slow"), Item(f"{PAGE_TEST}[b.md]", "slow")]
    heavy_first(items)
    assert [item.nodeid for item in items] == [
        "tests/test_c.py::quick", "tests/test_c.py::long", "tests/test_c.py::longer",  # two heavy tests: first,
        "tests/test_b.py::run", f"{PAGE_TEST}[a.md]", f"{PAGE_TEST}[b.md]",  # in its own order; then the units of one
        "tests/test_a.py::one", "tests/test_a.py::two", "tests/test_a.py::three"]  # the light file last


SUITE = {
    "pytest.ini": "[pytest]\naddopts = -p no:cacheprovider\nmarkers =\n    slow: s\n    distributed: d\n",
    "tests/conftest.py": f"import sys\nsys.path.insert(0, {str(HERE)!r})\n"
                         "from helpers.schedule import pytest_collection_modifyitems, pytest_xdist_make_scheduler\n"
                         "from helpers.schedule import pytest_terminal_summary\n",
    "tests/record.py": "import os\n\ndef record(request):\n    with open(os.environ['ORDER_LOG'], 'a') as f:\n"
                       "        f.write(os.environ['PYTEST_XDIST_WORKER'] + ' ' + request.node.nodeid + '\\n')\n",
    "tests/test_a.py": "from record import record\n\n" + "".join(
        f"def test_{k}(request):\n    record(request)\n\n\n" for k in range(4)),
    "tests/repo/test_docs.py": "import time\n\nimport pytest\nfrom record import record\n\n\n@pytest.mark.slow\n"
                          "@pytest.mark.parametrize('page', ['a.md', 'b.md', 'c.md', 'd.md'])\n"
                          "def test_documented_commands_run(page, request):\n    record(request)\n"
                          "    time.sleep(0.3)\n",
    "tests/test_z.py": "import pytest\nfrom record import record\n\n\n@pytest.mark.distributed\n"
                       "def test_ranks(request):\n    record(request)\n",
}


def test_two_workers_share_the_pages_and_start_with_the_heavy_units(tmp_path):
    """A small suite laid out like this one, run as pyproject.toml runs it (-n 2 --dist loadfile) with these hooks:
    the pages run on both workers, and on each worker every heavy unit runs before the light file."""
    for name, text in SUITE.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # not this run's worker
    env["ORDER_LOG"] = str(tmp_path / "order.log")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile", "tests"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=CEILING_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = [line.split() for line in (tmp_path / "order.log").read_text().splitlines()]
    assert len(runs) == 9
    assert len({worker for worker, nodeid in runs if "test_docs.py" in nodeid}) == 2  # the pages on both workers
    for worker in {worker for worker, _ in runs}:
        mine = [nodeid for w, nodeid in runs if w == worker]
        light = [k for k, nodeid in enumerate(mine) if "test_a.py" in nodeid]
        heavy = [k for k, nodeid in enumerate(mine) if "test_a.py" not in nodeid]
        assert not light or not heavy or max(heavy) < min(light), mine
    # The tiers' line: the default pass is test_a's four and the ranks test (distributed, not slow); the pages
    # (4 x 0.3 s asleep) are the slow tier.
    line = next(line for line in proc.stdout.splitlines() if line.startswith("suite time by tier"))
    assert "default pass 5 tests" in line and "on 2 worker(s)" in line and "slow tier 4 tests" in line, line
    assert float(line.split("slow tier 4 tests, ")[1].split(" s summed")[0]) >= 1, line  # 1.2 s asleep, rounded


def test_ci_runs_the_readme_test_command_then_the_slow_tier():
    """.ci/run's last two lines are the README's test command (the default pass, -m "not slow") and the slow tier:
    CI runs what a developer is told to run, and every test besides."""
    root = HERE.parent
    readme = (root / "README.md").read_text()
    after = readme.split("Run the tests", 1)[1]
    command = after.split("```bash\n", 1)[1].split("\n```", 1)[0].strip()
    assert command.endswith('pytest -q -m "not slow"'), command
    lines = [line for line in (root / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert lines[-2:] == [command, ".venv/bin/python -m pytest -q -m slow"], lines[-2:]
