"""Adaptive batch (train/adaptive.py, docs/tuning.md): the batch-size ramp and its exact resume, the gradient
noise scale, the load balancer's split, and the one-line refusals of inconsistent settings."""

from __future__ import annotations

import json
import math
import time

import pytest

from scaletrain.cli import main
from scaletrain.config import BatchConfig, ConfigError, load_config
from scaletrain.train.adaptive import BatchRamp, NoiseScale, split_counts, timed_micro_batches
from scaletrain.train.schedule import lr_at
from scaletrain.train.validate import check_runnable


def args(overrides: dict) -> list[str]:
    return ["train"] + [f"--{k}={v}" for k, v in overrides.items()]


def records(run_dir) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "loss" in r}


def test_ramp_follows_megatron_rule():
    # start 4, +4 every 64 / ((16 - 4) / 4) = 21.33 sequences consumed, up to 16.
    ramp = BatchRamp(BatchConfig(ramp_start=4, ramp_increment=4, ramp_samples=64, lr_scaling="sqrt"), full=16)
    batches = [ramp.batch_at(s) for s in range(12)]
    assert batches == [4, 4, 4, 4, 4, 4, 8, 8, 8, 12, 12, 16]
    assert ramp.samples_before(11) == sum(batches[:11])
    assert ramp.lr_factor(0) == pytest.approx(0.5) and ramp.lr_factor(11) == 1.0
    linear = BatchRamp(BatchConfig(ramp_start=4, ramp_increment=4, ramp_samples=64, lr_scaling="linear"), full=16)
    assert linear.lr_factor(0) == pytest.approx(0.25)
    assert BatchRamp(BatchConfig(), full=16).batch_at(5) == 16  # no ramp


def test_split_counts_follow_speed_and_keep_one_each():
    assert split_counts(8, [1.0, 1.0]) == [4, 4]
    assert split_counts(8, [1.0, 3.0]) == [6, 2]   # 3x slower rank: a quarter of the work beyond one each
    assert split_counts(4, [1.0, 100.0]) == [3, 1]  # never zero: the slow rank still synchronises
    assert sum(split_counts(7, [0.3, 0.5, 0.9])) == 7


def test_micro_batch_timing_measures_the_consumer_and_not_the_last_one():
    seconds: list[float] = []
    batches = timed_micro_batches(iter(range(4)), seconds)
    for _ in range(4):  # as training_step does: exactly as many requests as micro-batches
        next(batches)
        time.sleep(0.02)
    assert len(seconds) == 3 and all(s >= 0.02 for s in seconds)


def test_noise_scale_recovers_a_known_b_simple():
    # |G_B|^2 = |G|^2 + tr(Sigma) / B exactly: the estimator must give tr(Sigma) / |G|^2 = 50.
    g2, trace = 2.0, 100.0
    noise = NoiseScale()
    out = noise.update(4, g2 + trace / 4, 32, g2 + trace / 32)
    assert out["gns_b_simple"] == pytest.approx(50.0)
    assert noise.b_simple() == pytest.approx(50.0)


def test_ramp_resumes_exactly_and_logs_the_noise_scale(tmp_path, tiny):
    straight, split = tmp_path / "straight", tmp_path / "split"
    common = {"train.steps": 12, "train.grad_accum_steps": 4, "batch.ramp_start": 4, "batch.ramp_increment": 4,
              "batch.ramp_samples": 64, "batch.noise_scale_interval": 2, "logging.log_interval": 1,
              "checkpoint.interval": 7, "train.threads": 1,  # 2 threads on a loaded 2-core machine: 40x slower
              "data.cache_dir": str(tmp_path / "data")}  # one data preparation for both runs
    assert main(args(tiny(straight, **common))) == 0
    assert main(args(tiny(split, **common, **{"train.stop_at_step": 7}))) == 0  # mid-ramp (batch 8 of 16)
    assert main(args(tiny(split, **common)) + ["--resume"]) == 0
    a, b = records(straight), records(split)
    assert sorted(a) == sorted(b) == list(range(1, 13))
    assert [a[s]["global_batch"] for s in range(1, 13)] == [4, 4, 4, 4, 4, 4, 8, 8, 8, 12, 12, 16]
    assert all(a[s]["loss"] == b[s]["loss"] and a[s]["lr"] == b[s]["lr"] for s in a), "ramp resume differs"
    assert a[12]["gns_b_simple"] == b[12]["gns_b_simple"]
    assert math.isfinite(a[12]["gns_b_simple"]) and a[12]["critical_batch_tokens"] == a[12]["gns_b_simple"] * 32
    # The sqrt rule: at batch 4 of 16 the warmed-up LR is half the schedule's.
    cfg = load_config(None, tiny(straight, **common))
    assert a[6]["lr"] == pytest.approx(0.5 * lr_at(5, cfg.optim.lr, 12, cfg.schedule))
    assert a[12]["lr"] == pytest.approx(lr_at(11, cfg.optim.lr, 12, cfg.schedule))


@pytest.mark.parametrize("fields, says", [
    ({"batch.ramp_start": 4, "batch.ramp_increment": 5, "batch.ramp_samples": 64}, "batch.ramp_increment (5)"),
    ({"batch.ramp_start": 16, "batch.ramp_increment": 4, "batch.ramp_samples": 64}, "batch.ramp_start (16)"),
    ({"batch.ramp_start": 2, "batch.ramp_increment": 2, "batch.ramp_samples": 64}, "multiples of"),
    ({"batch.ramp_increment": 4}, "batch.ramp_start is 0"),
    ({"parallel.balance": "throughput", "parallel.dp_replicate": -1, "train.grad_accum_steps": 1},
     "grad_accum_steps >= 2"),
])
def test_inconsistent_settings_are_refused_in_one_line(tmp_path, tiny, fields, says):
    over = tiny(tmp_path / "run", **{"train.grad_accum_steps": 4}) | {k: str(v) for k, v in fields.items()}
    cfg = load_config(None, over)
    world = 2 if "parallel.balance" in fields else 1
    with pytest.raises(ConfigError) as err:
        check_runnable(cfg, world, "cpu", "fp32")
    assert says in str(err.value) and "\n" not in str(err.value)


def test_bad_ramp_exits_2_with_one_line(tmp_path, tiny, capsys):
    over = tiny(tmp_path / "run", **{"batch.ramp_start": 4, "batch.ramp_increment": 5, "batch.ramp_samples": 8,
                                     "train.grad_accum_steps": 4})
    assert main(args(over)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "batch.ramp_increment" in err[0]
