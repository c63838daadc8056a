"""The scaling-law planner: the fit on synthetic data from a known law, its refusals, `scale` end to end on a
micro grid (resumable), and `plan --data` with a stored fit."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from scaletrain.cli import main
from scaletrain.config import ConfigError
from scaletrain.data.prepare import prepare_text
from scaletrain.scaling import fit as fitmod
from scaletrain.scaling import grid
from scaletrain.scaling.fit import LawParams, ScalingFitError, check_target, fit_law
from scaletrain.scaling.store import FIT_FILE, data_fingerprint, load_fit, write_fit

FIXTURES = Path(__file__).parent / "fixtures" / "shakespeare"
TRUE = LawParams(E=1.1, A=40.0, alpha=0.4, B=300.0, beta=0.35)


def synthetic(noise: float = 0.003, seed: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """16 runs (4 sizes x 4 token counts) from TRUE with multiplicative log-normal noise."""
    n = np.repeat([1e5, 3e5, 1e6, 3e6], 4)
    d = np.tile([1e6, 4e6, 1.6e7, 6.4e7], 4)
    return n, d, TRUE.loss(n, d) * np.exp(np.random.default_rng(seed).normal(0, noise, n.size))


def test_fit_recovers_a_known_law():
    n, d, loss = synthetic()
    fit = fit_law(n, d, loss, bootstrap=40)
    p, iv = fit.params, fit.param_intervals()
    assert p.E == pytest.approx(TRUE.E, rel=0.05) and p.beta == pytest.approx(TRUE.beta, abs=0.03)
    assert p.alpha == pytest.approx(TRUE.alpha, abs=0.06)
    assert iv["E"][0] <= TRUE.E <= iv["E"][1] and iv["beta"][0] <= TRUE.beta <= iv["beta"][1]
    # extrapolation to 3x the largest N and D: within 1% and inside the interval
    mid, lo, hi = fit.predict(1e7, 2e8)
    assert mid == pytest.approx(float(TRUE.loss(1e7, 2e8)), rel=0.01) and lo <= TRUE.loss(1e7, 2e8) <= hi
    # noiseless data: the exact parameters
    exact = fit_law(n, d, TRUE.loss(n, d), bootstrap=0).params
    assert exact.E == pytest.approx(TRUE.E, rel=1e-3) and exact.alpha == pytest.approx(TRUE.alpha, rel=1e-3)


def test_compute_optimal_split_minimises_the_loss_at_fixed_compute():
    c = 1e15
    n_opt, d_opt = TRUE.compute_optimal(c)
    assert 6 * n_opt * d_opt == pytest.approx(c)
    for f in (0.5, 2.0):  # moving N either way at the same compute is worse
        assert TRUE.loss(n_opt * f, d_opt / f) > TRUE.loss(n_opt, d_opt)


def test_fit_refusals(monkeypatch):
    n, d, loss = synthetic()
    with pytest.raises(ScalingFitError, match="at least 5"):
        fit_law(n[:3], d[:3], loss[:3])
    with pytest.raises(ScalingFitError, match="two model sizes"):
        fit_law(np.full(6, 1e5), d[:6], loss[:6])
    monkeypatch.setattr(fitmod, "_GRAD_TOL", 0.0)  # no start can meet these: the non-convergence path
    monkeypatch.setattr(fitmod, "_STALL", -1.0)
    with pytest.raises(ScalingFitError, match="did not converge"):
        fit_law(n, d, loss, bootstrap=0)


def test_runs_that_barely_depend_on_size_fit_in_any_order_without_an_overflow():
    """A real character-level grid (Tiny Shakespeare, 12 runs of 91-574 steps: 55k-332k non-embedding parameters
    change val bpb by under 1% at a token count) leaves the N term unconstrained; starts and bootstrap replicas
    that run off to A = e^800 once raised OverflowError out of `scale`."""
    n = np.repeat([55536, 100672, 238640, 332448], 3)
    d = np.tile([93184, 234496, 587776], 4)
    loss = np.array([  # the values `scale` fitted, in its order (another order takes another L-BFGS path)
        3.442751439495852, 3.1012260728362904, 2.8586147735974348, 3.450810271343042,
        3.0953489956996814, 2.8452775792169516, 3.4240008246063534, 3.063541664335859,
        2.797398056371638, 3.417440959147554, 3.1153259500794226, 2.778300647065807,
    ])
    fit = fit_law(n, d, loss, bootstrap=200)
    assert all(np.isfinite([fit.params.E, fit.params.A, fit.params.B])) and fit.bootstrap
    shuffled = np.random.default_rng(0).permutation(n.size)  # the same runs listed in another order: the same fit
    assert fit_law(n[shuffled], d[shuffled], loss[shuffled], bootstrap=200).params == fit.params


def test_target_below_irreducible_loss_is_refused():
    n, d, loss = synthetic()
    fit = fit_law(n, d, loss, bootstrap=0)
    check_target(fit, fit.params.E + 0.1)
    with pytest.raises(ScalingFitError, match="irreducible"):
        check_target(fit, fit.params.E * 0.9)


@pytest.fixture
def data_dir(tmp_path) -> Path:
    """A prepared char-level folder of one play."""
    prepare_text(str(FIXTURES / "hamlet_gut.txt"), tmp_path / "data", tokenizer="char", val_fraction=0.1)
    return tmp_path / "data"


def test_fit_from_other_data_is_refused(tmp_path, data_dir, capsys):
    n, d, loss = synthetic()
    write_fit(data_dir, fit_law(n, d, loss, bootstrap=0), [], {})
    assert load_fit(data_dir)[0].params.E == pytest.approx(TRUE.E, rel=0.05)
    other = tmp_path / "other"
    prepare_text(str(FIXTURES / "macbeth_gut.txt"), other, tokenizer="char", val_fraction=0.1)
    assert data_fingerprint(other) != data_fingerprint(data_dir)
    shutil.copy(data_dir / FIT_FILE, other / FIT_FILE)
    with pytest.raises(ScalingFitError, match="other data"):
        load_fit(other)
    assert main(["plan", "--data", str(other), "--model", "nano", "--hardware", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "fitted on other data" in err


def test_plan_with_a_fit_predicts_bpb_and_answers_a_target(data_dir, capsys):
    n, d, loss = synthetic()
    write_fit(data_dir, fit_law(n, d, loss, bootstrap=20), [{"params": x} for x in (1e5, 3e6)], {})
    assert main(["plan", "--data", str(data_dir), "--model", "nano", "--vocab-size", "256", "--tokens", "20M",
                 "--hardware", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "predicted val bpb" in out and "tokens per parameter" in out
    # the fixture play has 27k training characters: at most 4 epochs, where TRUE's D term alone is 5.2 bpb
    assert main(["plan", "--data", str(data_dir), "--target-bpb", "7.0", "--hardware", "h100-sxm:8",
                 "--max-nodes", "1", "--global-batch", "8", "--seq-len", "64"]) == 0
    out = capsys.readouterr().out
    assert "reaches 7" in out and "$" in out and "scope" in out
    assert main(["plan", "--data", str(data_dir), "--target-bpb", "7.0", "--hardware", "h100-sxm:8",
                 "--max-nodes", "1", "--global-batch", "8", "--seq-len", "64", "--json", "-"]) == 0
    doc = json.loads(capsys.readouterr().out)  # sized to the target: its own prediction is the target
    assert doc["choice"]["val_bpb"] == pytest.approx(7.0, rel=1e-6)
    assert doc["choice"]["tokens"] <= doc["scope"]["max_tokens"]
    assert doc["choice"]["on_demand_usd"] == min(r["on_demand_usd"] for r in doc["candidates"])
    assert main(["plan", "--target-bpb", "1.3", "--model", "nano", "--hardware", "cpu"]) == 2
    assert "needs --data" in capsys.readouterr().err
    # the choice's own predicted bpb is at (or just under) the target it was sized for
    assert main(["plan", "--data", str(data_dir), "--budget", "50", "--hardware", "h100-sxm:8", "--max-nodes", "1",
                 "--global-batch", "8", "--seq-len", "64", "--json", "-"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["choice"]["on_demand_usd"] <= 50 * 1.0001
    assert doc["choice"]["val_bpb"] == min(r["val_bpb"] for r in doc["candidates"])
    assert main(["plan", "--data", str(data_dir), "--target-bpb", "1.0", "--hardware", "h100-sxm:8"]) == 2
    assert "irreducible" in capsys.readouterr().err
    # above E, but only with more data than the folder has (or a model far beyond the grid's)
    assert main(["plan", "--data", str(data_dir), "--target-bpb", "1.3", "--hardware", "h100-sxm:8"]) == 2
    assert "within the fit's scope" in capsys.readouterr().err


def test_plan_keeps_the_fits_tokens_a_step_and_warns_when_told_otherwise(data_dir, capsys):
    """On a GPU too the search plans the grid's seq x batch (a ~0.5M-token step would reach the tokens in a few
    optimizer steps, far from the law's recipe); another batch prints one caveat line."""
    n, d, loss = synthetic()
    write_fit(data_dir, fit_law(n, d, loss, bootstrap=0), [{"params": x} for x in (1e5, 3e6)],
              {"seq_len": 32, "batch": 4})
    assert main(["plan", "--data", str(data_dir), "--target-bpb", "7.0", "--hardware", "h100-sxm:8",
                 "--max-nodes", "1"]) == 0
    out = capsys.readouterr().out
    assert "seq 32, 4 sequences a step" in " ".join(out.split()) and "caveat" not in out
    assert main(["plan", "--data", str(data_dir), "--target-bpb", "7.0", "--hardware", "h100-sxm:8",
                 "--max-nodes", "1", "--seq-len", "64", "--global-batch", "64"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "caveat: 4,096 tokens a step, the fit's runs took 128" in out


def _micro_grid(monkeypatch) -> None:
    """2 sizes x 3 token counts of a few steps: 6 runs (the fit needs 5)."""
    monkeypatch.setattr(grid, "SIZES", 2)
    monkeypatch.setattr(grid, "MIN_STEPS", 4)
    monkeypatch.setattr(grid, "EVAL_BATCHES", 2)
    monkeypatch.setattr(grid, "MAX_EPOCHS", 1000)


@pytest.mark.slow
def test_scale_trains_a_grid_fits_it_and_resumes(tmp_path, data_dir, monkeypatch, capsys):
    _micro_grid(monkeypatch)
    args = ["scale", str(data_dir), "--out", str(tmp_path / "grid"), "--budget", "1s", "--hardware", "cpu",
            "--min-tokens-per-param", "0.01", "--bootstrap", "10"]
    # the grid is printed before anything trains
    assert main([*args, "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert "predicted" in printed and "6 runs" in printed and not (tmp_path / "grid").exists()
    assert main(args) == 0
    doc = json.loads((data_dir / FIT_FILE).read_text())
    assert len(doc["runs"]) == 6 and doc["data_fingerprint"] == data_fingerprint(data_dir)
    assert set(doc["intervals"]) == {"E", "A", "alpha", "B", "beta"}
    assert all((tmp_path / "grid" / r["name"] / "metrics.jsonl").is_file() for r in doc["runs"])
    # the report of a grid run places it against its data's frontier
    run = tmp_path / "grid" / doc["runs"][0]["name"]
    assert main(["report", str(run), "--out", str(tmp_path / "r.html")]) == 0
    assert "scaling frontier" in (tmp_path / "r.html").read_text() and "bpb vs predicted" in \
        (tmp_path / "r.html").read_text()
    # started again: every run is skipped (training one would fail here)
    monkeypatch.setattr(grid, "train_run", lambda *a, **k: pytest.fail("a finished run was trained again"))
    capsys.readouterr()
    assert main(args) == 0
    assert capsys.readouterr().out.count("skipped") == 6


def test_ctrl_c_during_scale_exits_130_and_frees_the_run_folder(tmp_path, data_dir, monkeypatch, capsys):
    """Before: "the run ended without a finite val_bpb (got None)", exit 2, the run folder's lock still held. Now a
    Ctrl-C (SIGINT, to the trainer's handler, at step 2 of the first run) is the interrupt every command has."""
    import os
    import signal

    from scaletrain.checkpoint.run_folder import RunLock
    from scaletrain.train.trainer import Trainer

    _micro_grid(monkeypatch)
    timed = Trainer._timed_step

    def ctrl_c_at_step_2(self, profiler):
        record = timed(self, profiler)
        if self.state.step == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return record

    monkeypatch.setattr(Trainer, "_timed_step", ctrl_c_at_step_2)
    grid_dir = tmp_path / "grid"
    assert main(["scale", str(data_dir), "--out", str(grid_dir), "--budget", "1s", "--hardware", "cpu",
                 "--min-tokens-per-param", "0.01"]) == 130
    err = capsys.readouterr().err
    assert "interrupted (Ctrl-C): the grid's finished runs are kept" in err and "val_bpb" not in err, err
    (run,) = [p for p in grid_dir.iterdir() if p.is_dir()]
    assert not (run / grid.RESULT).exists()
    lock = RunLock(run)
    lock.acquire()  # a lock still held by this process would refuse (flock: one holder per open file)
    lock.release()


def test_scale_on_a_full_disk_is_one_line(tmp_path, data_dir, monkeypatch, capsys):
    """Before: an OSError traceback from claim_run_folder writing run.json; now train's one StorageError line. The
    disk refuses run.json however it is written (a plain write, or the flush of a temporary beside it)."""
    import errno
    import os

    _micro_grid(monkeypatch)
    write_text, fsync = Path.write_text, os.fsync

    def refused(name: str) -> None:
        if name.endswith("run.json") or name.endswith(".tmp") and "run.json" in name:
            raise OSError(errno.ENOSPC, "No space left on device")

    def full_write_text(self, *args, **kwargs):
        refused(self.name)
        return write_text(self, *args, **kwargs)

    def full_fsync(fd):
        refused(os.readlink(f"/proc/self/fd/{fd}"))
        return fsync(fd)

    monkeypatch.setattr(Path, "write_text", full_write_text)
    monkeypatch.setattr(os, "fsync", full_fsync)
    assert main(["scale", str(data_dir), "--out", str(tmp_path / "grid"), "--budget", "1s", "--hardware", "cpu",
                 "--min-tokens-per-param", "0.01"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "run.json failed: No space left on device" in err, err


def test_scale_with_too_few_finished_runs_is_one_line(tmp_path, data_dir, capsys):
    assert main(["scale", str(data_dir), "--out", str(tmp_path / "empty"), "--fit-only"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "0 finished run(s)" in err
    assert main(["scale", str(tmp_path), "--out", str(tmp_path / "g"), "--fit-only"]) == 2  # not prepared data
    assert "manifest" in capsys.readouterr().err
    assert main(["scale", str(data_dir), "--out", str(tmp_path / "g"), "--budget", "soon"]) == 2
    assert "--budget" in capsys.readouterr().err


def test_the_model_for_a_size_stays_within_the_fits_scope():
    """`plan --budget` on a real fit chose a 65.7M model where the scope ended at 60.3M: the family member
    nearest a size may lie outside it; within [low, high] one is taken when one exists."""
    from scaletrain.plan.quality import model_for_params
    from scaletrain.scaling.fit import law_params

    nearest = law_params(model_for_params(60_300_800, 1024, 64))
    inside = law_params(model_for_params(60_300_800, 1024, 64, 10_067, 60_300_800))
    assert inside <= 60_300_800 and abs(math.log(inside / 60_300_800)) < 0.5
    assert nearest > 60_300_800  # the case that was wrong: the nearest member is above the scope


def test_a_budget_too_small_names_the_smallest_that_fits(tmp_path, data_dir, capsys, monkeypatch):
    """On a slower machine the benchmark's 30 s char grid was refused with only "raise --budget": the line now
    says by how much, and the budget it names does plan a grid."""
    with pytest.raises(ConfigError, match="training split is too small for any grid"):  # one play, read 4 times at most
        grid.plan_grid(data_dir, 1e9, "cpu")
    monkeypatch.setattr(grid, "MAX_EPOCHS", 1000)  # the play read many times over: the budget decides
    assert main(["scale", str(data_dir), "--out", str(tmp_path / "g"), "--budget", "1s", "--hardware", "cpu",
                 "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "too small" in err
    smallest = int(re.search(r"needs --budget (\d+)s on cpu", err).group(1))
    assert grid.plan_grid(data_dir, smallest, "cpu")  # the named budget fits (one second above the bound at most)
    with pytest.raises(grid.BudgetTooSmall, match="too small") as refused:  # what benchmarks/scaling_law.py reads
        grid.plan_grid(data_dir, smallest - 2, "cpu")
    assert math.ceil(refused.value.smallest) == smallest


def test_plan_repeats_the_fits_caveats_beside_its_prediction(data_dir, capsys):
    """A grid whose size term is flat (Tiny Shakespeare's char grids: alpha 0.02 or 2.4) predicted held-out runs
    3.8-6.3% pessimistic; `scale` printed the caveat, and now every `plan --data` prediction repeats it."""
    from dataclasses import replace

    n, d, loss = synthetic()
    fit = fit_law(n, d, loss, bootstrap=0)
    write_fit(data_dir, fit, [{"params": x} for x in (1e5, 3e6)], {})
    plan = ["plan", "--data", str(data_dir), "--model", "nano", "--vocab-size", "256", "--tokens", "20M",
            "--hardware", "cpu"]
    assert main(plan) == 0
    assert "caveat" not in capsys.readouterr().out
    write_fit(data_dir, replace(fit, params=replace(fit.params, alpha=2.42)), [{"params": x} for x in (1e5, 3e6)], {})
    assert main(plan) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "predicted val bpb" in out and "caveat (the fit): alpha = 2.42 is outside the usual 0.02-2" in out
