"""The config tree: TOML + dotted overrides, precedence, documentation, and one-line errors."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from scaletrain.cli import main
from scaletrain.config import ConfigError, JobConfig, load_config, to_toml


def write(tmp_path, text: str):
    p = tmp_path / "c.toml"
    p.write_text(text)
    return p


def test_defaults_are_the_nano_preset():
    from scaletrain.config import ModelConfig, build
    from scaletrain.model.presets import PRESETS

    nano = build(ModelConfig, {"preset": "nano"}, presets=PRESETS)
    default = JobConfig().model
    for key in ("dim", "n_layers", "n_heads", "ffn_hidden_dim"):
        assert getattr(nano, key) == getattr(default, key)


def test_precedence_cli_over_toml_over_preset(tmp_path):
    p = write(tmp_path, '[model]\npreset = "small"\nn_layers = 3\n[optim]\nlr = 0.002\n')
    cfg = load_config(p, {"optim.lr": "3e-4"})
    assert cfg.model.dim == 512  # from the preset
    assert cfg.model.n_layers == 3  # TOML beats preset
    assert cfg.optim.lr == 3e-4  # CLI beats TOML
    assert cfg.model.n_kv_heads == 4


def test_print_config_round_trips(tmp_path):
    cfg = load_config(None, {"train.steps": "7", "data.path": 'a "quoted"\npath', "model.tie_embeddings": "true"})
    text = to_toml(cfg)
    assert "# optimizer steps to train" in text
    again = load_config(write(tmp_path, text))
    assert again == cfg


@pytest.mark.parametrize("text,overrides,message", [
    ("[optim]\nlrr = 1\n", {}, "unknown key optim.lrr in"),
    ("[optimizer]\nlr = 1\n", {}, "unknown key optimizer"),
    ("[optim]\nlr = 'fast'\n", {}, "optim.lr must be float (got 'fast') in"),
    ("[optim]\nlr = -1.0\n", {}, "optim.lr must be > 0 (got -1.0) in"),
    ("[train]\nsteps = 1.5\n", {}, "train.steps must be int"),
    ("[train]\ncompile = 1\n", {}, "train.compile must be str"),
    ("[schedule]\nname = 'exp'\n", {}, "schedule.name must be one of cosine, wsd, linear, constant"),
    ("[model]\npreset = 'huge'\n", {}, "unknown preset 'huge'"),
    ("[model]\ndim = 100\nn_heads = 3\n", {}, "model.dim (100) must be divisible by model.n_heads (3)"),
    ("", {"optim.lr": "abc"}, "optim.lr must be float (got 'abc')"),
    ("", {"train.steps": "0"}, "train.steps must be >= 1 (got 0)"),
    ("", {"data.seq_len": "512"}, "data.seq_len (512) must be <= model.max_seq_len"),
    ("optim = [", {}, "invalid TOML"),
])
def test_bad_config_is_one_clear_error(tmp_path, text, overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text), overrides)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_missing_config_file():
    with pytest.raises(ConfigError, match="config file not found: nope.toml"):
        load_config("nope.toml")


def test_cli_error_exit_code_and_one_line(tmp_path, capsys):
    p = write(tmp_path, "[optim]\nlr = -1.0\n")
    assert main(["train", "--config", str(p)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ConfigError: optim.lr must be > 0") and "\n" not in err
    assert main(["train", "--config", str(tmp_path / "missing.toml")]) == 2
    assert "config file not found" in capsys.readouterr().err
    assert main(["train", "--optim.lr=nan"]) == 2
    assert "finite" in capsys.readouterr().err


def test_help_documents_every_field():
    out = subprocess.run([sys.executable, "-m", "scaletrain", "train", "--help"], capture_output=True, text=True).stdout
    from scaletrain.config import iter_fields

    for key, _, f in iter_fields(JobConfig):
        assert f"--{key}" in out, key
        assert f.metadata["help"], f"{key} has no documentation"
    assert "peak learning rate" in out


def test_print_config_cli(capsys):
    assert main(["train", "--print-config", "--optim.lr=3e-4", "--model.preset=micro"]) == 0
    out = capsys.readouterr().out
    assert "lr = 0.0003" in out and "dim = 256" in out


def test_default_context_and_rotary_length_agree():
    """The default run trains on data.seq_len tokens; its rotary tables (and so its model) end there too,
    in the code defaults and in configs/default.toml alike."""
    from pathlib import Path

    default = JobConfig()
    assert default.model.max_seq_len == default.data.seq_len == 128
    recipe = load_config(Path(__file__).resolve().parents[2] / "configs" / "default.toml")
    assert recipe.model.max_seq_len == recipe.data.seq_len == default.data.seq_len


def test_a_cli_preset_overrides_the_toml_fields_it_sets(tmp_path):
    """`--model.preset=micro` over a TOML that spells out the nano sizes (configs/default.toml does) gives the
    micro model, not nano's dim under micro's name; TOML fields the preset does not set, and CLI fields, stay."""
    from scaletrain.model.presets import PRESETS

    p = write(tmp_path, '[model]\npreset = "small"\ndim = 128\nn_layers = 4\nn_heads = 4\nrope_theta = 5000.0\n')
    cfg = load_config(p, {"model.preset": "micro"})
    assert cfg.model.preset == "micro"
    for key, value in PRESETS["micro"].items():
        assert getattr(cfg.model, key) == value, key
    assert cfg.model.rope_theta == 5000.0  # not a micro field: the TOML's stays
    assert cfg.model.n_kv_heads == 0  # the TOML's preset (small: 4) is replaced, not layered underneath
    assert load_config(p, {"model.preset": "micro", "model.dim": "384", "model.n_heads": "6"}).model.dim == 384
    assert load_config(p).model.dim == 128  # without a CLI preset the TOML's own fields win over its preset
    recipe = load_config(Path(__file__).resolve().parents[2] / "configs" / "default.toml", {"model.preset": "micro"})
    assert (recipe.model.dim, recipe.model.ffn_hidden_dim) == (256, 688)


def test_a_command_imports_only_its_own_package():
    """`scaletrain report`/`prepare`/--help must not pay for importing the planner and torch.distributed's
    checkpoint stack (seconds per command): plugins load on demand, errors are caught through UserError."""
    code = ("import sys; from scaletrain.cli import build_parser; build_parser(['report', 'x']); "
            "print(sorted(m for m in ('scaletrain.commands.plan', 'scaletrain.data.cli', 'scaletrain.train.trainer', "
            "'torch.distributed.checkpoint', 'scaletrain.report.cli') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['scaletrain.report.cli']"
    # a whole `scaletrain plan` (its entry check included) without the trainer, DCP, pipelining or DTensor
    code = ("import sys; from scaletrain.cli import main; main(['plan', '--model.preset=nano', "
            "'--model.vocab_size=65', '--hardware', 'cpu:1', '--tokens', '1M']); print(sorted(m for m in ("
            "'scaletrain.train.trainer', "
            "'torch.distributed.checkpoint', 'torch.distributed.pipelining', 'torch.distributed.tensor') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


def test_every_user_error_is_one_line_exit_2(tmp_path, capsys):
    from scaletrain.checkpoint import CheckpointError
    from scaletrain.core.files import StorageError
    from scaletrain.core.options import UserError
    from scaletrain.data.tokenizer import DataError
    from scaletrain.train.trainer import TrainingError

    assert all(issubclass(e, UserError) for e in (ConfigError, DataError, CheckpointError, TrainingError, StorageError))
    assert main(["eval", "--run", str(tmp_path / "none")]) == 2  # a command's own error, caught without importing
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.split(":")[0].endswith("Error")
    assert main(["prepare", "--config", str(tmp_path / "missing.toml")]) == 2  # a plugin's error
    assert "\n" not in capsys.readouterr().err.strip()


def test_the_bpe_recipe_and_its_nanogpt_reference_are_the_same_size(capsys, monkeypatch):
    """configs/gutenberg_bpe_small.toml and benchmarks/nanogpt_reference.py's `bpe` config race each other in
    benchmarks/time_to_loss.py: same width, depth, heads, context, batch, steps and schedule, and parameter
    counts within 1% (SwiGLU 344 against GELU 4 x 128); the recipe prints as a full config."""
    import importlib.util

    from scaletrain.model.presets import num_params

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("nanogpt_reference", root / "benchmarks" / "nanogpt_reference.py")
    reference = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, reference)  # its dataclass looks its module up there
    spec.loader.exec_module(reference)
    ref = reference.CONFIGS["bpe"]
    recipe = load_config(root / ref.recipe)
    assert recipe.data.tokenizer == "bpe" and recipe.model.tie_embeddings
    assert (recipe.model.dim, recipe.model.n_layers, recipe.model.n_heads) == (ref.n_embd, ref.n_layer, ref.n_head)
    assert (recipe.data.seq_len, recipe.train.batch_size, recipe.train.steps) == (ref.block_size, ref.batch_size,
                                                                                  ref.max_iters)
    assert (recipe.optim.lr, recipe.schedule.warmup_steps, recipe.schedule.min_lr, recipe.optim.beta2,
            recipe.optim.weight_decay) == (ref.learning_rate, ref.warmup_iters, ref.min_lr, ref.beta2,
                                           ref.weight_decay)
    assert (recipe.train.eval_interval, recipe.train.eval_batches) == (ref.eval_interval, ref.eval_iters)
    vocab = recipe.data.vocab_size
    ours = num_params(replace(recipe.model, vocab_size=vocab))
    theirs = sum(p.numel() for p in reference.GPT(ref, vocab).parameters())
    assert abs(ours / theirs - 1) < 0.01, (ours, theirs)
    assert main(["train", "--config", str(root / ref.recipe), "--print-config"]) == 0
    assert 'tokenizer = "bpe"' in capsys.readouterr().out


def test_min_lr_above_the_peak_is_refused_naming_both_fields():
    """Before: accepted, and the cosine decay climbed from optim.lr to schedule.min_lr without a word."""
    from scaletrain.train.schedule import lr_at

    with pytest.raises(ConfigError, match=r"schedule.min_lr \(0.01\) is above optim.lr \(0.001\)"):
        load_config(None, {"optim.lr": "1e-3", "schedule.min_lr": "1e-2"})
    # the field's default (-1) is a tenth of the peak: a fine-tune's low rate decays, it is not refused
    cfg = load_config(None, {"optim.lr": "5e-5"})
    assert lr_at(10**6, cfg.optim.lr, 100, cfg.schedule) == pytest.approx(5e-6)
    assert lr_at(50, cfg.optim.lr, 100, cfg.schedule) < cfg.optim.lr
    with pytest.raises(ConfigError, match=r"schedule.min_lr must be >= 0, or -1"):
        load_config(None, {"schedule.min_lr": "-0.5"})
    # constant ignores min_lr; equal is a flat decay, not a climb
    load_config(None, {"optim.lr": "1e-3", "schedule.min_lr": "1e-2", "schedule.name": "constant"})
    load_config(None, {"optim.lr": "1e-4"})
