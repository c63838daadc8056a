"""`scaletrain plan` from the command line: exit codes, one-line errors, JSON, emitted config."""

import json
import subprocess
import sys

import pytest

from helpers.waits import CEILING_S
from scaletrain.commands.plan import main, parse_count
from scaletrain.config import ConfigError, load_config


def run(*argv):
    return main(["plan", *argv])


def test_unknown_hardware_exits_2_and_lists_the_catalog(capsys):
    assert run("--model.preset=gpt2-124m", "--hardware", "v100:8") == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "unknown hardware" in err and "h100-sxm" in err and "rtx-4090" in err


def test_impossible_degree_exits_2_with_the_reason(capsys):
    assert run("--model.preset=gpt2-124m", "--hardware", "h100-sxm:8", "--parallel.tp=8", "--parallel.dp_shard=1") == 2
    err = capsys.readouterr().err
    assert "model.n_heads (12) must be divisible by parallel.tp (8)" in err  # the trainer's own words


def test_degrees_that_do_not_multiply_to_the_world(capsys):
    assert run("--model.preset=gpt2-124m", "--hardware", "h100-sxm:8", "--parallel.tp=2", "--parallel.dp_shard=2",
               "--parallel.pp=1", "--parallel.cp=1", "--parallel.dp_replicate=1") == 2
    assert "the hardware has 8 devices" in capsys.readouterr().err


def test_plan_that_cannot_fit_says_by_how_much_and_what_would(capsys):
    assert run("--model.preset=llama-70b", "--hardware", "rtx-4090:1", "--data.seq_len=2048",
               "--global-batch", "8") == 2
    err = capsys.readouterr().err
    assert "nothing fits" in err and "short by" in err and "devices" in err


def test_missing_vocab_is_a_clear_error(capsys):
    assert run("--model.preset=small", "--hardware", "h100-sxm:1") == 2
    assert "--model.vocab_size" in capsys.readouterr().err


def test_bad_token_count(capsys):
    assert run("--model.preset=gpt2-124m", "--hardware", "h100-sxm:1", "--tokens", "lots") == 2
    assert "--tokens must be a number" in capsys.readouterr().err


def test_json_and_emit(tmp_path):
    out, cfg = tmp_path / "plan.json", tmp_path / "job.toml"
    assert run("--model.preset=gpt2-124m", "--hardware", "a100-80gb:8x2", "--tokens", "10B", "--json", str(out),
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
    assert run("--model.preset=gpt2-124m", "--hardware", "h100-sxm:8", "--json", str(out)) == 0
    w = json.loads(out.read_text())["workload"]
    assert w["train_tokens"] == 20 * w["params_total"] and "convention" in w["tokens_convention"]


def test_parse_count():
    assert parse_count("300B", "x") == 3e11 and parse_count("1.5e9", "x") == 1.5e9
    assert parse_count("2_000", "x") == 2000
    with pytest.raises(ConfigError):
        parse_count("-5", "x")


def test_module_entry_point_runs():
    proc = subprocess.run([sys.executable, "-m", "scaletrain.commands.plan", "plan", "--model.preset=gpt2-124m",
                           "--hardware", "bogus"], capture_output=True, text=True, timeout=CEILING_S)
    assert proc.returncode == 2 and "catalog" in proc.stderr


@pytest.mark.parametrize("exponent", range(0, 40))
def test_human_numbers_use_one_prefix_at_every_magnitude(exponent):
    """3 significant digits and one SI prefix from k to Q (never '9.3e+03E'); scientific beyond 999Q."""
    from scaletrain.plan.report import SI_PREFIXES, human

    for mantissa in (1.0, 9.3, 123.4, 999.4, 999.96):
        x = mantissa * 10.0**exponent
        text = human(x, "FLOP/s")
        number = text.removesuffix("FLOP/s")
        if float(f"{x:.3g}") >= 1e33:
            assert "e+" in number and float(number) == pytest.approx(x, rel=5e-3), text
            continue
        prefix = number[-1] if number[-1] in SI_PREFIXES else ""
        digits = number.removesuffix(prefix)
        assert "e" not in digits and 1 <= float(digits) < 1000, text
        scale = 1000.0 ** (SI_PREFIXES.index(prefix) + 1) if prefix else 1.0
        assert float(digits) * scale == pytest.approx(x, rel=5e-3), text
    assert (human(9.3e21), human(999_999), human(1e25), human(1.5e40), human(0)) == ("9.3Z", "1M", "10Y",
                                                                                    "1.5e+40", "0")


def test_the_vocabulary_comes_from_the_recipe_data(tmp_path):
    """model.vocab_size = 0 in a recipe: the BPE size it trains (configs/gpt2_124m.toml: data.vocab_size = 8192)."""
    from scaletrain.config import ModelConfig, build
    from scaletrain.model.presets import PRESETS, num_params

    out = tmp_path / "plan.json"
    assert run("--config", "configs/gpt2_124m.toml", "--hardware", "a100-80gb:8", "--json", str(out)) == 0
    w = json.loads(out.read_text())["workload"]
    model = build(ModelConfig, {"preset": "gpt2-124m", "vocab_size": 8192, "max_seq_len": 1024}, presets=PRESETS)
    assert w["vocab_size"] == 8192 and w["params_total"] == num_params(model)


def test_a_prepared_data_folder_gives_its_manifest_vocabulary(tmp_path, capsys):
    """A job reading a prepared folder plans with that folder's tokenizer (its manifest), which wins over
    data.tokenizer / data.vocab_size as in the trainer; a char tokenizer over raw text asks for --vocab-size."""
    from scaletrain.data.prepare import prepare_text

    (tmp_path / "text.txt").write_text("hello world, a tiny corpus of few letters.\n" * 200)
    manifest = prepare_text(str(tmp_path / "text.txt"), tmp_path / "prepared")
    job = tmp_path / "job.toml"
    job.write_text(f'[model]\npreset = "nano"\n[data]\npath = "{tmp_path / "prepared"}"\ntokenizer = "bpe"\n'
                   "vocab_size = 4096\nseq_len = 64\n")
    out = tmp_path / "plan.json"
    assert run("--config", str(job), "--hardware", "cpu:1", "--tokens", "1M", "--json", str(out)) == 0
    assert json.loads(out.read_text())["workload"]["vocab_size"] == manifest["vocab_size"] < 64
    job.write_text('[model]\npreset = "nano"\n[data]\npath = "raw.txt"\ntokenizer = "char"\n')
    capsys.readouterr()
    assert run("--config", str(job), "--hardware", "cpu:1") == 2
    err = capsys.readouterr().err
    assert "--model.vocab_size" in err and "char" in err and err.count("\n") == 1


@pytest.mark.parametrize("argv,message", [
    # 0 was taken for "not given" and the defaults planned
    (["--global-batch", "0"], "--global-batch must be a positive integer (got 0)"),
    # the job's fields: train's checks (load_config), train's one line
    (["--data.seq_len=0"], "data.seq_len must be >= 1 (got 0)"),
    (["--model.vocab_size=-1"], "model.vocab_size must be >= 0 (got -1)"),
    (["--count", "0"], "--count must be a positive integer (got 0)"),
    (["--nodes", "-2"], "--nodes must be a positive integer (got -2)"),
    (["--parallel.tp=0"], "parallel.tp must be >= 1 (got 0)"),
    (["--parallel.dp_shard=0"], "--parallel.dp_shard=0: a degree to plan must be >= 1 (or -1: the search chooses)"),
    (["--micro-batch", "0"], "--micro-batch must be a positive integer (got 0)"),
    (["--parallel.zero_stage=7"], "parallel.zero_stage must be <= 3 (got 7)"),
    (["--top", "0"], "--top must be a positive integer (got 0)"),
    (["--finetune.method=lora", "--finetune.lora_rank=0"], "finetune.lora_rank must be >= 1 (got 0)"),
    (["--deadline", "nan"], "--deadline must be a finite number > 0 hours (got nan)"),
    (["--budget", "inf"], "--budget must be a finite number > 0 USD (got inf)"),
    (["--max-nodes", "0"], "--max-nodes must be >= 1 (got 0)"),
    # "1 steps" of more tokens than the whole run
    (["--global-batch", "10000000"], "--global-batch 10,000,000 x 1,024 tokens = 10,240,000,000 tokens a step, "
                                     "more than the 2,471,746,560 tokens to train (Chinchilla: 20 per parameter)"),
])
def test_every_numeric_plan_flag_out_of_range_is_one_line(capsys, argv, message):
    assert run("--model.preset=gpt2-124m", "--hardware", "h100-sxm:8", *argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_micro_batches_of_a_huge_batch_are_found_without_listing_its_divisors():
    """They were found by testing every number up to the batch (plan --global-batch 1e9: over 2 minutes)."""
    from scaletrain.plan.search import _micro_batches

    for batch in range(1, 600):
        for dp in (1, 2, 3, 8):
            share = batch // dp if batch % dp == 0 else 0
            brute = [m for m in range(1, share + 1) if share % m == 0 and (m & (m - 1) == 0 or m == share)]
            assert _micro_batches(batch, dp) == (brute or [1]), (batch, dp)
    assert _micro_batches(8 * 10**9, 8) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 10**9]
