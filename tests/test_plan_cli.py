"""`scaletrain plan` from the command line: exit codes, one-line errors, JSON, emitted config."""

import json
import subprocess
import sys

import pytest

from scaletrain.config import ConfigError, load_config
from scaletrain.plan.cli import main, parse_count


def run(*argv):
    return main(["plan", *argv])


def test_unknown_hardware_exits_2_and_lists_the_catalog(capsys):
    assert run("--model", "gpt2-124m", "--hardware", "v100:8") == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "unknown hardware" in err and "h100-sxm" in err and "rtx-4090" in err


def test_impossible_degree_exits_2_with_the_reason(capsys):
    assert run("--model", "gpt2-124m", "--hardware", "h100-sxm:8", "--tp", "8", "--dp-shard", "1") == 2
    err = capsys.readouterr().err
    assert "model.n_heads (12) must be divisible by parallel.tp (8)" in err  # the trainer's own words


def test_degrees_that_do_not_multiply_to_the_world(capsys):
    assert run("--model", "gpt2-124m", "--hardware", "h100-sxm:8", "--tp", "2", "--dp-shard", "2", "--pp", "1",
               "--cp", "1", "--dp-replicate", "1") == 2
    assert "the hardware has 8 devices" in capsys.readouterr().err


def test_plan_that_cannot_fit_says_by_how_much_and_what_would(capsys):
    assert run("--model", "llama-70b", "--hardware", "rtx-4090:1", "--seq-len", "2048", "--global-batch", "8") == 2
    err = capsys.readouterr().err
    assert "nothing fits" in err and "short by" in err and "devices" in err


def test_missing_vocab_is_a_clear_error(capsys):
    assert run("--model", "small", "--hardware", "h100-sxm:1") == 2
    assert "--vocab-size" in capsys.readouterr().err


def test_bad_token_count(capsys):
    assert run("--model", "gpt2-124m", "--hardware", "h100-sxm:1", "--tokens", "lots") == 2
    assert "--tokens must be a number" in capsys.readouterr().err


def test_json_and_emit(tmp_path):
    out, cfg = tmp_path / "plan.json", tmp_path / "job.toml"
    assert run("--model", "gpt2-124m", "--hardware", "a100-80gb:8x2", "--tokens", "10B", "--json", str(out),
               "--emit", str(cfg)) == 0
    doc = json.loads(out.read_text())
    w = doc["workload"]
    assert w["params_total"] == 123_587_328 and w["train_tokens"] == 1e10
    assert w["total_flops"] == pytest.approx(w["flops_per_token"] * w["steps"] * w["tokens_per_step"])
    best = doc["plans"][0]
    assert best["fits"] and best["time"]["tokens_per_second"] > 0
    assert best["cost"]["device_hours"] == pytest.approx(16 * best["total_seconds"] / 3600)
    memory = best["memory"]
    parts = ("params", "grads", "master", "optimizer", "activations", "transients", "comm_buffers")
    assert sum(memory[k] for k in parts) == pytest.approx(memory["tensor_total"])
    job = load_config(cfg)
    assert job.parallel.dp_replicate * job.parallel.dp_shard * job.parallel.tp * job.parallel.pp == 16


def test_chinchilla_is_20_tokens_per_parameter(tmp_path):
    out = tmp_path / "plan.json"
    assert run("--model", "gpt2-124m", "--hardware", "h100-sxm:8", "--json", str(out)) == 0
    w = json.loads(out.read_text())["workload"]
    assert w["train_tokens"] == 20 * w["params_total"] and "convention" in w["tokens_convention"]


def test_parse_count():
    assert parse_count("300B", "x") == 3e11 and parse_count("1.5e9", "x") == 1.5e9
    assert parse_count("2_000", "x") == 2000
    with pytest.raises(ConfigError):
        parse_count("-5", "x")


def test_module_entry_point_runs():
    proc = subprocess.run([sys.executable, "-m", "scaletrain.plan.cli", "plan", "--model", "gpt2-124m",
                           "--hardware", "bogus"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "catalog" in proc.stderr
