"""``scaletrain plan --deadline`` / ``--budget`` (plan/deadline.py): the cheapest device count that finishes in
time, the fastest within a budget, spot and on-demand, and the one-line refusals."""

from __future__ import annotations

import json

import pytest

from scaletrain.cli import main

BASE = ["plan", "--model.preset=gpt2-124m", "--tokens", "2B", "--hardware", "a100-80gb", "--max-nodes", "2"]


def run(tmp_path, *extra: str) -> tuple[int, dict]:
    out = tmp_path / "plan.json"
    code = main([*BASE, *extra, "--json", str(out)])
    return code, json.loads(out.read_text()) if out.exists() else {}


def test_deadline_takes_the_cheapest_count_that_finishes_and_budget_the_fastest_affordable(tmp_path):
    code, doc = run(tmp_path, "--deadline", "1000")
    assert code == 0
    opts = doc["options"]
    assert [o["devices"] for o in opts] == [1, 2, 4, 8, 16]  # part of a node, then whole nodes
    # The deadline that only the two biggest counts meet: the cheaper of those two is chosen.
    deadline = sorted(o["hours"] for o in opts)[1] * 1.001
    code, doc = run(tmp_path, "--deadline", f"{deadline}")
    assert code == 0
    for pricing in ("on_demand", "spot"):
        pick = doc["choice"][pricing]
        meeting = [o for o in doc["options"] if o["hours"] <= deadline]
        assert len(meeting) == 2 and pick["hours"] <= deadline
        assert pick[f"{pricing}_usd"] == min(o[f"{pricing}_usd"] for o in meeting)
    # A budget: the fastest option at or under it; spot's lower prices can afford faster options.
    budget = sorted(o["on_demand_usd"] for o in opts)[2]
    code, doc = run(tmp_path, "--budget", f"{budget}")
    assert code == 0
    pick = doc["choice"]["on_demand"]
    affordable = [o for o in doc["options"] if o["on_demand_usd"] <= budget]
    assert pick["on_demand_usd"] <= budget and pick["hours"] == min(o["hours"] for o in affordable)
    assert doc["choice"]["spot"]["hours"] <= pick["hours"]


@pytest.mark.parametrize("extra, says", [
    (("--deadline", "0"), "--deadline must be a finite number > 0 hours"),
    (("--budget", "-5"), "--budget must be a finite number > 0 USD"),
    (("--deadline", "0.0001"), "nothing meets a 0.0001 h deadline"),
])
def test_bad_or_impossible_limits_exit_2_with_one_line(tmp_path, capsys, extra, says):
    code, _ = run(tmp_path, *extra)
    assert code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and says in err[0]
