"""Training end to end on tiny models: the loss falls, resume is bitwise exact, commands run."""

from __future__ import annotations

import json
import math

import pytest
import torch

from scaletrain.cli import main
from scaletrain.config import ScheduleConfig, load_config
from scaletrain.infer.load import load_run
from scaletrain.train.schedule import lr_at
from scaletrain.train.trainer import Trainer


def args(overrides: dict) -> list[str]:
    return ["train"] + [f"--{k}={v}" for k, v in overrides.items()]


def losses(run_dir) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def final_weights(run_dir) -> dict[str, torch.Tensor]:
    _, model, _, path = load_run(run_dir)
    assert path == sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    return model.state_dict()


def test_loss_falls(tmp_path, tiny):
    cfg = load_config(None, tiny(tmp_path / "run", **{"train.steps": 60, "train.eval_interval": 30}))
    trainer = Trainer(cfg, log=False)
    first = trainer.evaluate().loss
    summary = trainer.train()
    assert first == pytest.approx(math.log(65), rel=0.05)  # an untrained model is ~uniform
    assert summary["final_val_loss"] < first - 0.7
    assert [e["step"] for e in summary["evals"]] == [0, 30, 60]


def test_summary_counts_eval_sample_and_checkpoint_stalls(tmp_path, tiny, capsys):
    """The seconds spent evaluating, sampling and checkpointing, and their share of the loop's wall time, are in
    the summary and on the done line."""
    overrides = tiny(tmp_path / "run", **{"train.steps": 20, "train.eval_interval": 10, "train.sample_tokens": 20,
                                          "checkpoint.interval": 10})
    assert main(args(overrides)) == 0
    done = [line for line in capsys.readouterr().out.splitlines() if line.startswith("done:")][0]
    assert "eval/sample/checkpoint " in done and "% of " in done and "eval " in done, done
    summary = Trainer(load_config(None, {**overrides, "train.run_dir": str(tmp_path / "again")}), log=False).train()
    stalls = summary["stall_seconds"]
    assert set(stalls) == {"eval", "sample", "checkpoint"} and all(v > 0 for v in stalls.values())
    assert summary["stall_share"] == pytest.approx(sum(stalls.values()) / summary["loop_seconds"])
    assert 0 < summary["stall_share"] < 1


def test_resume_is_bitwise_exact(tmp_path, tiny):
    straight = tmp_path / "straight"
    split = tmp_path / "split"
    common = {"logging.log_interval": 1, "train.eval_interval": 10, "checkpoint.interval": 15}
    assert main(args(tiny(straight, **common))) == 0
    assert main(args(tiny(split, **common, **{"train.stop_at_step": 20}))) == 0
    assert max(losses(split)) == 20
    assert main(args(tiny(split, **common)) + ["--resume"]) == 0
    a, b = losses(straight), losses(split)
    assert sorted(a) == sorted(b) == list(range(1, 41))
    assert all(a[s] == b[s] for s in a), "per-step losses differ after resume"
    wa, wb = final_weights(straight), final_weights(split)
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa), "final parameters differ after resume"


def test_resume_uses_saved_config_and_skips_corrupt_checkpoint(tmp_path, tiny, capsys):
    run = tmp_path / "run"
    over = tiny(run, **{"checkpoint.interval": 10, "checkpoint.keep_last": 3, "train.stop_at_step": 30})
    assert main(args(over)) == 0
    ckpts = sorted((run / "checkpoints").glob("step-*"))
    assert [c.name for c in ckpts] == ["step-00000010", "step-00000020", "step-00000030"]
    # Flip a byte in the newest checkpoint: resume must report it and fall back to step 20.
    f = ckpts[-1] / "__0_0.distcp"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["train", "--resume", f"--train.run_dir={run}", "--train.stop_at_step=25"]) == 0
    out = capsys.readouterr().out
    assert "checksum mismatch" in out and "resumed from" in out and "(step 20)" in out


def test_gradient_accumulation_matches_one_big_batch(tmp_path, tiny):
    big = Trainer(load_config(None, tiny(tmp_path / "a", **{"train.batch_size": 8})), log=False)
    acc = Trainer(load_config(None, tiny(tmp_path / "b", **{"train.batch_size": 4, "train.grad_accum_steps": 2})),
                  log=False)
    for _ in range(3):
        la, lb = big.step()["loss"], acc.step()["loss"]
        assert la == pytest.approx(lb, rel=1e-5)
    for (n, p), (_, q) in zip(big.model.named_parameters(), acc.model.named_parameters()):
        assert torch.allclose(p, q, rtol=1e-4, atol=1e-6), n


def test_schedules_are_pure_functions_of_the_step():
    cos = ScheduleConfig(name="cosine", warmup_steps=100, min_lr=1e-4)
    assert lr_at(0, 1e-3, 2000, cos) == pytest.approx(1e-5)
    assert lr_at(99, 1e-3, 2000, cos) == pytest.approx(1e-3)
    assert lr_at(1050, 1e-3, 2000, cos) == pytest.approx(5.5e-4)
    assert lr_at(2000, 1e-3, 2000, cos) == pytest.approx(1e-4)
    wsd = ScheduleConfig(name="wsd", warmup_steps=10, min_lr=0.0, wsd_decay_fraction=0.2)
    assert lr_at(500, 1.0, 1000, wsd) == 1.0 and lr_at(799, 1.0, 1000, wsd) == 1.0
    assert lr_at(900, 1.0, 1000, wsd) == pytest.approx(0.5)
    assert lr_at(1000, 1.0, 1000, wsd) == pytest.approx(0.0)


def test_eval_and_generate_commands(tmp_path, tiny, capsys):
    run = tmp_path / "run"
    assert main(args(tiny(run))) == 0
    capsys.readouterr()
    assert main(["eval", "--run", str(run)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("val loss ") and "perplexity" in out and "evenly spread over the val split" in out
    text = tmp_path / "t.txt"
    text.write_text("ROMEO:\nWhat light through yonder window breaks?\n" * 20)
    assert main(["eval", "--run", str(run), "--text", str(text)]) == 0
    assert f"{text}: token perplexity" in capsys.readouterr().out
    assert main(["generate", "--run", str(run), "--prompt", "ROMEO:", "--max-tokens", "30", "--top-p", "0.9"]) == 0
    sample = capsys.readouterr().out
    assert sample.startswith("ROMEO:") and len(sample) > 30
    greedy = [main(["generate", "--run", str(run), "--prompt", "A", "--temperature", "0", "--max-tokens", "10"])
              for _ in range(2)]
    outs = capsys.readouterr().out.splitlines()
    assert greedy == [0, 0] and outs[0] == outs[-1]


@pytest.mark.parametrize("argv,message", [
    (["eval", "--run", "nowhere"], "not a run folder"),
    (["generate", "--run", "nowhere"], "not a run folder"),
    (["train", "--data.path=missing.txt"], "data path not found: missing.txt"),
])
def test_bad_input_exits_2_with_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_eval_text_errors(tmp_path, tiny, capsys):
    run = tmp_path / "run"
    assert main(args(tiny(run, **{"train.steps": 2}))) == 0
    assert main(["eval", "--run", str(run), "--text", str(tmp_path / "none.txt")]) == 2
    assert "none.txt: file not found" in capsys.readouterr().err
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9 ".encode("latin-1") * 50)
    assert main(["eval", "--run", str(run), "--text", str(bad)]) == 2
    assert "not UTF-8" in capsys.readouterr().err


def test_eval_text_skips_characters_outside_a_char_vocabulary(tmp_path, tiny, capsys):
    """A Gutenberg text scored by a Tiny Shakespeare (char) model: the curly quotes it never saw are left out,
    counted in one line, and the rest is scored; a text it fully knows reports nothing skipped."""
    run = tmp_path / "run"
    assert main(args(tiny(run, **{"train.steps": 2}))) == 0
    capsys.readouterr()
    text = tmp_path / "book.txt"
    text.write_text("\u2018Curiouser and curiouser!\u2019 cried Alice; \u201cO Romeo\u201d.\n" * 10)
    assert main(["eval", "--run", str(run), "--text", str(text)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("skipped 40 characters not in the tokenizer's vocabulary "
                        "(e.g. '\u2018' x10, '\u2019' x10, '\u201c' x10, ...); the rest is scored")
    plain_count = len("Curiouser and curiouser! cried Alice; O Romeo.\n" * 10) - 1
    assert lines[1].startswith(f"{text}: token perplexity") and f"over {plain_count:,} tokens" in lines[1]
    text.write_text("ROMEO:\nWhat light through yonder window breaks?\n" * 20)
    assert main(["eval", "--run", str(run), "--text", str(text)]) == 0
    assert "skipped" not in capsys.readouterr().out


def test_default_recipe_smoke(tmp_path, capsys):
    """The README's default command, shortened: progress, a sample and the final val loss appear."""
    run = tmp_path / "default"
    assert main(["train", f"--train.run_dir={run}", "--train.steps=12", "--train.eval_interval=6",
                 "--logging.log_interval=3", "--train.sample_tokens=40", "--schedule.warmup_steps=2",
                 "--train.eval_batches=2"]) == 0
    out = capsys.readouterr().out
    assert "step      3 | loss" in out and "--- sample ---" in out and "final val loss" in out
    assert (run / "metrics.jsonl").is_file() and (run / "config.toml").is_file()
    assert (run / "tensorboard").is_dir()


@pytest.mark.parametrize("argv,message", [
    (["train", "--optim.lrr=1"], "unrecognized arguments: --optim.lrr=1"),
    (["generate", "--run", "x", "--max-tokens", "many"], "argument --max-tokens: invalid int value: 'many'"),
    (["generate", "--run", "x", "--top-p", "2"], "--top-p must be a finite number in (0, 1]"),
    (["train", "--optim.lr=-1"], "optim.lr must be > 0 (got -1.0)"),
])
def test_bad_flags_exit_2_with_one_line(argv, message, capsys):
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err, err


def _documents(folder, n=300):
    """n short text files (40 characters): each becomes one document, so 32-token windows straddle
    document ends."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "src/scaletrain/assets/tinyshakespeare/input.txt").read_text()
    folder.mkdir()
    for i in range(n):
        (folder / f"doc{i:03d}.txt").write_text(text[i * 100:i * 100 + 40])
    return folder


def test_document_attention_trains_with_the_block_causal_mask(tmp_path, tiny):
    """data.document_attention: the step's loss is the loss under the loader's block-causal mask, not the
    plain causal one; evaluation uses the mask too; pipeline/context parallelism is refused in one line."""
    import torch.nn.functional as F

    from scaletrain.config import ConfigError
    from scaletrain.data.loader import block_causal_mask

    overrides = tiny(tmp_path / "run", **{"data.path": str(_documents(tmp_path / "docs")),
                                           "data.document_attention": "true", "optim.grad_clip": "0"})
    trainer = Trainer(load_config(None, overrides), log=False)
    state = trainer.train_loader.state_dict()
    x, y, doc = next(trainer.train_loader)
    assert int(doc.max()) >= 1  # the batch crosses a document boundary
    trainer.train_loader.load_state_dict(state)
    with torch.no_grad():
        masked = float(F.cross_entropy(trainer.model(x, attn_mask=block_causal_mask(doc)).flatten(0, 1), y.flatten()))
        plain = float(F.cross_entropy(trainer.model(x).flatten(0, 1), y.flatten()))
    assert abs(masked - plain) > 1e-4
    assert trainer.step()["loss"] == pytest.approx(masked, rel=1e-6)
    assert math.isfinite(trainer.evaluate().loss)

    with pytest.raises(ConfigError, match="data.document_attention"):
        Trainer(load_config(None, {**overrides, "parallel.pp": "2"}), log=False)


def test_compile_without_a_cxx_compiler_trains_eagerly(tmp_path, tiny, monkeypatch, capsys):
    """A recipe with train.compile=true on a machine without g++: one warning line, then eager training
    (inductor would otherwise fail at the first step)."""
    import scaletrain.parallel.compile as compile_mod

    monkeypatch.setattr(compile_mod.shutil, "which", lambda name: None)
    monkeypatch.delenv("CXX", raising=False)
    trainer = Trainer(load_config(None, tiny(tmp_path / "run", **{"train.compile": "true"})))
    assert "no C++ compiler" in capsys.readouterr().out
    assert trainer.cfg.train.compile == "false"
    assert math.isfinite(trainer.step()["loss"])


def test_compiled_training_matches_eager(tmp_path, tiny):
    """train.compile=true (the whole model as one graph here): really compiled, the same losses as eager
    to rounding, and evaluation and sampling work on the compiled model."""
    from torch._dynamo.utils import counters

    losses_by_mode = {}
    for compiled in (False, True):
        counters.clear()
        cfg = load_config(None, tiny(tmp_path / f"run{compiled}", **{"train.compile": str(compiled).lower()}))
        trainer = Trainer(cfg, log=False)
        losses_by_mode[compiled] = [trainer.step()["loss"] for _ in range(4)]
        assert (counters["stats"]["unique_graphs"] > 0) == compiled
        assert math.isfinite(trainer.evaluate().loss)
        assert len(trainer.sample(12)[0]) > 1
    assert losses_by_mode[True] == pytest.approx(losses_by_mode[False], rel=1e-4)


def test_peak_measurement_says_where_it_is_cached(tmp_path, monkeypatch):
    """A training run that measures the peak matmul rate for MFU says so and where it wrote it."""
    from scaletrain.hardware.peak import calibration_path, peak_flops

    monkeypatch.setenv("SCALETRAIN_CACHE", str(tmp_path / "cache"))
    said = []
    first = peak_flops("cpu", "fp32", log=said.append)
    assert first > 0 and calibration_path().is_file()
    assert len(said) == 1 and str(calibration_path()) in said[0] and "SCALETRAIN_CACHE" in said[0]
    assert peak_flops("cpu", "fp32", log=said.append) == first and len(said) == 1  # cached: measured once


@pytest.fixture
def keep_threads():
    """Tests that set torch's thread count get the caller's back afterwards."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_only_rank_zero_speaks_and_errors_are_every_ranks(tmp_path, tiny, capsys, monkeypatch):
    """Every line of `scaletrain train` for people (elastic restart, model, step lines, done) comes from rank 0
    alone (`parallel/distributed.py: say`); a rank's error is printed by that rank."""
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # the elastic-restart line and its resume
    run = {"train.steps": 2, "logging.progress": "plain", "logging.log_interval": 1, "train.precision": "auto"}
    monkeypatch.setattr("scaletrain.train.precision.cpu_bf16_speedup", lambda log=None: 0.01)
    monkeypatch.setenv("RANK", "1")
    assert main(args(tiny(tmp_path / "rank1", **run))) == 0
    assert capsys.readouterr().out == ""
    assert main(["train", "--optim.lr=-1"]) == 2
    assert "ConfigError: optim.lr must be > 0" in capsys.readouterr().err
    monkeypatch.setenv("RANK", "0")
    assert main(args(tiny(tmp_path / "rank0", **run))) == 0
    lines = capsys.readouterr().out.splitlines()
    heads = [line.split(" ")[0].rstrip(":") for line in lines]
    assert heads.count("elastic") == heads.count("model") == heads.count("done") == 1, lines
    assert sum(" | loss " in line for line in lines) == 2, lines  # the step lines, one a step
    model_line = next(line for line in lines if line.startswith("model:"))
    assert "fp32 (precision auto -> fp32: bf16 matmul measured 0.01x fp32 on this CPU" in model_line


def test_precision_auto_follows_the_measured_bf16_speed(monkeypatch):
    """On a CPU, auto is bf16 only where bf16 matmuls measured clearly faster than fp32, and says why; an
    explicit precision measures nothing; a GPU with bf16 gets it."""
    from scaletrain.train.precision import BF16_MIN_SPEEDUP, resolve_precision

    cpu = torch.device("cpu")
    monkeypatch.setattr("scaletrain.train.precision.cpu_bf16_speedup", lambda log=None: 0.01)
    assert resolve_precision("auto", cpu) == ("fp32", "precision auto -> fp32: bf16 matmul measured 0.01x fp32 "
                                                      f"on this CPU (bf16 from {BF16_MIN_SPEEDUP}x)")
    monkeypatch.setattr("scaletrain.train.precision.cpu_bf16_speedup", lambda log=None: 2.3)
    precision, why = resolve_precision("auto", cpu)
    assert precision == "bf16" and "measured 2.3x fp32" in why

    def no_measuring(log=None):
        raise AssertionError("an explicit precision must not measure")

    monkeypatch.setattr("scaletrain.train.precision.cpu_bf16_speedup", no_measuring)
    assert resolve_precision("fp32", cpu) == ("fp32", "") and resolve_precision("bf16", cpu) == ("bf16", "")
    assert resolve_precision("auto", cpu, measure=False) == ("fp32", "")  # a rank > 0: rank 0's decision follows
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_precision("auto", torch.device("cuda"))[0] == "bf16"


def test_bf16_speedup_is_measured_once_on_one_core_and_cached(tmp_path, monkeypatch, keep_threads):
    """The ratio auto decides on: one core's bf16 and fp32 matmul rates, measured once (single-threaded, on
    the process-CPU-time clock), cached where the log line says, then read back without measuring."""
    from scaletrain.hardware import peak
    monkeypatch.setenv("SCALETRAIN_CACHE", str(tmp_path / "cache"))
    calls = []

    def fake(device, dtype, n, min_seconds, timer):
        calls.append((dtype, torch.get_num_threads(), timer))
        return {"fp32": 80e9, "bf16": 0.8e9}[dtype]

    monkeypatch.setattr(peak, "measure_matmul_flops", fake)
    torch.set_num_threads(2)
    said = []
    assert peak.cpu_bf16_speedup(said.append) == pytest.approx(0.01)
    assert [(d, t) for d, t, _ in calls] == [("bf16", 1), ("fp32", 1)] and calls[0][2] is peak.CLOCKS["cpu"]
    assert torch.get_num_threads() == 2  # the caller's threads are back
    assert len(said) == 2 and all(str(peak.calibration_path()) in line for line in said)
    assert peak.cpu_bf16_speedup(said.append) == pytest.approx(0.01) and len(calls) == 2  # cached


# What torchrun sets in a rank (torch 2.13, 1 node): --standalone and an explicit c10d rendezvous differ in
# the run id and the port only. One process per launch here (WORLD_SIZE=1): the trainer builds alone.
LAUNCHES = {
    "plain": {},
    "standalone": {"TORCHELASTIC_RUN_ID": "5e784894-7169-46ff-9207-e7b591a4985b", "MASTER_PORT": "37867"},
    "c10d": {"TORCHELASTIC_RUN_ID": "none", "MASTER_PORT": "33167"},
}
TORCHRUN_ENV = {"RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1", "TORCHELASTIC_RESTART_COUNT": "0",
                "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_USE_AGENT_STORE": "True"}


def test_mfu_does_not_depend_on_the_launcher(tmp_path, tiny, monkeypatch, keep_threads):
    """One definition, one peak: MFU = model FLOPs/s over one device's measured peak (one CPU core) times the
    devices used (every rank's threads). The same step time gives the same MFU under any launcher's
    environment; the peak is measured once, single-threaded, whatever the run's thread count."""
    from scaletrain.hardware import peak
    monkeypatch.setenv("SCALETRAIN_CACHE", str(tmp_path / "cache"))
    measured_with = []

    def fake(device, dtype, n, min_seconds, timer):
        measured_with.append(torch.get_num_threads())
        return 50e9

    monkeypatch.setattr(peak, "measure_matmul_flops", fake)
    mfus, peaks = {}, {}
    for launch, env in LAUNCHES.items():
        with monkeypatch.context() as m:
            for key, value in ({**TORCHRUN_ENV, **env} if env else {}).items():
                m.setenv(key, value)
            trainer = Trainer(load_config(None, tiny(tmp_path / "run", **{"train.threads": 1})), log=False)
            trainer.throughput.step_times = [0.05]
            peaks[launch] = trainer.throughput.peak_flops
            mfus[launch] = trainer._step_record({})["mfu"]
    assert peaks == dict.fromkeys(LAUNCHES, 50e9) and len(set(mfus.values())) == 1, (peaks, mfus)
    assert mfus["plain"] == pytest.approx(trainer.flops_per_token * trainer.tokens_per_step / 0.05 / 50e9)
    two = Trainer(load_config(None, tiny(tmp_path / "run", **{"train.threads": 2})), log=False)
    assert two.throughput.peak_flops == 2 * 50e9  # two cores' worth, from the same one-core measurement
    assert measured_with == [1]  # measured once (fp32), on one thread, then read from the cache
