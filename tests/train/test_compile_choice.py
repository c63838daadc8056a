"""train.compile = auto (train/compile_choice.py): the choice weighs the steps' saving against the compile, from
this machine's record when there is one; the run records its choice; a resume keeps it; the field reads
true/false/auto from TOML and the command line."""

from __future__ import annotations

import json

import pytest
import torch

from helpers.tiny import tiny_overrides
from scaletrain.config import ConfigError, load_config
from scaletrain.train import compile_choice
from scaletrain.train.trainer import Trainer

CPU = torch.device("cpu")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A private compile record and inductor cache folder (the suite's measured peak stays: no re-measuring)."""
    monkeypatch.setattr(compile_choice, "record_path", lambda: tmp_path / "cache" / "compile.json")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    return tmp_path


def test_the_field_reads_toml_bools_cli_words_and_auto(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text("[train]\ncompile = true\n")
    assert load_config(str(toml)).train.compile == "true"
    assert load_config(None, {"train.compile": "no"}).train.compile == "false"
    assert load_config(None, {"train.compile": "auto"}).train.compile == "auto"
    assert load_config(None).train.compile == "auto"
    with pytest.raises(ConfigError, match=r"train.compile must be one of auto, true, false \(got 'maybe'\)"):
        load_config(None, {"train.compile": "maybe"})


def test_without_a_record_the_estimate_decides_by_the_run_length(cache):
    cfg = load_config(None, tiny_overrides(cache / "run"))
    short, why = compile_choice.decide(cfg, CPU, 1, True, steps_to_go=40)
    assert not short and "estimated" in why and "cold compile of ~30 s" in why
    eager_ms = compile_choice.estimated_eager_ms(cfg, CPU, 1)
    # the step count at which 10% of the eager time repays 30 s
    breakeven = compile_choice.PRIOR_COLD_SECONDS / (eager_ms / 1000 * compile_choice.PRIOR_SAVING)
    assert compile_choice.decide(cfg, CPU, 1, True, steps_to_go=int(breakeven * 1.1))[0]
    assert not compile_choice.decide(cfg, CPU, 1, True, steps_to_go=int(breakeven * 0.9))[0]


def test_the_record_replaces_the_priors_and_a_warm_cache_is_cheaper(cache):
    cfg = load_config(None, tiny_overrides(cache / "run"))
    key = compile_choice.shape_key(cfg, CPU, True)
    # measured here: eager 50 ms, compiled 40 ms (20% saved), the first compile took 20 s
    compile_choice.write_record(key, {"eager_ms": 50.0, "compiled_ms": 40.0, "cold_seconds": 20.0})
    (cache / "inductor" / "fxgraph" / "ab").mkdir(parents=True)  # a graph compiled here
    # warm: ~0.25 x 20 s = 5 s, repaid by 500+ steps of 10 ms
    assert compile_choice.decide(cfg, CPU, 1, True, steps_to_go=600)[0]
    assert not compile_choice.decide(cfg, CPU, 1, True, steps_to_go=400)[0]
    _, why = compile_choice.decide(cfg, CPU, 1, True, steps_to_go=600)
    assert "measured here" in why and "warm compile of ~5 s" in why
    # inductor's cache folder gone: the measured cold compile (20 s) again
    (cache / "inductor" / "fxgraph" / "ab").rmdir()
    assert not compile_choice.decide(cfg, CPU, 1, True, steps_to_go=1500)[0]
    assert compile_choice.decide(cfg, CPU, 1, True, steps_to_go=2500)[0]
    # another shape (batch) has its own entry
    other = load_config(None, tiny_overrides(cache / "run", **{"train.batch_size": 8}))
    assert compile_choice.shape_key(other, CPU, True) != key


def test_qlora_and_gpus(cache):
    cfg = load_config(None, tiny_overrides(cache / "run", **{"finetune.method": "qlora"}))
    assert compile_choice.decide(cfg, CPU, 1, True, steps_to_go=10**6) == \
        (False, "train.compile=auto: eager (QLoRA's model runs eagerly; finetune.qlora_compile compiles the "
                "dequantization of its 4-bit base alone)")
    plain = load_config(None, tiny_overrides(cache / "run"))
    assert compile_choice.decide(plain, torch.device("cuda"), 1, True, steps_to_go=1)[0]


def test_an_auto_run_records_its_choice_and_its_steps_and_a_resume_keeps_the_choice(cache):
    run = cache / "run"
    cfg = load_config(None, tiny_overrides(run, **{"train.steps": 30}))
    trainer = Trainer(cfg, log=False)
    assert trainer.cfg.train.compile == "false"  # 30 tiny steps never repay a compile
    trainer.train()
    saved = (run / "config.toml").read_text()
    assert 'compile = "false"' in saved
    record = json.loads((cache / "cache" / "compile.json").read_text())
    (entry,) = record.values()
    assert entry["eager_ms"] > 0 and "compiled_ms" not in entry
    # a run folder that began compiled resumes compiled, whatever auto would decide now
    (run / "config.toml").write_text(saved.replace('compile = "false"', 'compile = "true"'))
    resumed = load_config(None, tiny_overrides(run, **{"train.steps": 30, "train.resume": "true"}))
    assert compile_choice.choose(resumed, CPU, 1, True, run)[0] == "true"
