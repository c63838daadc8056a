"""benchmarks/moe_balance.py on a data folder (``--data``, the Gutenberg table's option in docs/model.md): a folder
of .txt prepared by benchmarks/moe_vs_dense.py's ``prepare``, each method trained for the same steps, and per method
the expert load of each sparse layer, the dropped tokens and the val bpb in the JSON."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.waits import CEILING_S

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "moe_balance.py"
FOLDER = ROOT / "tests" / "fixtures" / "shakespeare"  # 8 plays, 240 kB: a tiny Gutenberg Shakespeare folder


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=CEILING_S,
                          cwd=ROOT)


@pytest.mark.slow  # not in the default pass (README): 34 s of training; its bad-input lines stay in it
def test_the_balancing_table_runs_on_a_data_folder_and_records_each_methods_load(tmp_path):
    out = tmp_path / "balance.json"
    proc = _run("--data", str(FOLDER), "--steps", "2", "--methods", "aux,bias", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["data"] == f"shakespeare ({sum(p.stat().st_size for p in FOLDER.glob('*.txt')):,} bytes)"
    assert doc["steps"] == 2 and list(doc["methods"]) == list(doc["results"]) == ["aux", "bias"]
    assert doc["cpu"]["model"]
    for name, r in doc["results"].items():
        assert math.isfinite(r["val_bpb"]) and 0 < r["val_bpb"] < 8, (name, r)
        loads, tokens = r["max_mean_load_by_layer"], r["tokens_per_expert_by_layer"]
        assert sorted(loads) == sorted(tokens) == sorted(r["dropped_by_layer"]) == ["0", "1", "2", "3"]  # nano-moe
        for layer, counts in tokens.items():
            # the last log window is the last step: 16 sequences x 128 positions, 2 experts each, over 8 experts
            assert len(counts) == 8 and sum(counts) == 16 * 128 * 2, (name, layer)
            assert loads[layer] == max(counts) / (sum(counts) / 8) >= 1
        assert r["max_mean_load_mean"] == sum(loads.values()) / 4 and r["max_mean_load_worst"] == max(loads.values())
        assert r["dropped"] == sum(r["dropped_by_layer"].values()) == 0  # no capacity factor: none dropped
    assert doc["results"]["aux"]["balance_loss"] > 0 and doc["results"]["bias"]["balance_loss"] is None
    assert "| aux |" in proc.stdout and "| bias |" in proc.stdout


def test_a_missing_folder_or_an_unknown_method_is_one_line_and_exit_2(tmp_path):
    missing = _run("--data", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x.json"))
    assert missing.returncode == 2 and missing.stderr.strip().splitlines() == [
        f"moe_balance: --data {tmp_path / 'nowhere'}: no such folder (give a folder of .txt files)"]
    unknown = _run("--methods", "aux,lossless", "--out", str(tmp_path / "x.json"))
    assert unknown.returncode == 2 and "--methods: unknown lossless" in unknown.stderr
    assert len(unknown.stderr.strip().splitlines()) == 1 and not (tmp_path / "x.json").exists()
