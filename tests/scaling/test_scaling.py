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

FIXTURES = Path(__file__).parents[1] / "fixtures" / "shakespeare"
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


def _flat_char_grid() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A real character-level grid (Tiny Shakespeare, 12 runs of 91-574 steps: 55k-332k non-embedding parameters
    change val bpb by under 1% at a token count): it leaves the N term unconstrained."""
    n = np.repeat([55536, 100672, 238640, 332448], 3)
    d = np.tile([93184, 234496, 587776], 4)
    loss = np.array([  # the values `scale` fitted, in its order (another order takes another L-BFGS path)
        3.442751439495852, 3.1012260728362904, 2.8586147735974348, 3.450810271343042,
        3.0953489956996814, 2.8452775792169516, 3.4240008246063534, 3.063541664335859,
        2.797398056371638, 3.417440959147554, 3.1153259500794226, 2.778300647065807,
    ])
    return n, d, loss


def test_runs_that_barely_depend_on_size_fit():
    n, d, loss = _flat_char_grid()
    fit = fit_law(n, d, loss, bootstrap=0)
    assert all(np.isfinite([fit.params.E, fit.params.A, fit.params.B]))


@pytest.mark.slow  # 200 bootstrap replicas and a second fit (~60 s); one fit: test_runs_that_barely_depend_on_size_fit
def test_runs_that_barely_depend_on_size_fit_in_any_order_without_an_overflow():
    """Starts and bootstrap replicas of the flat grid that ran off to A = e^800 once raised OverflowError out of
    `scale`; the same runs listed in another order give the same fit (fit_law sorts the runs first, so the
    bootstrap would be the same replicas again: the order is checked on the fit itself)."""
    n, d, loss = _flat_char_grid()
    fit = fit_law(n, d, loss, bootstrap=200)
    assert all(np.isfinite([fit.params.E, fit.params.A, fit.params.B])) and fit.bootstrap
    shuffled = np.random.default_rng(0).permutation(n.size)
    assert fit_law(n[shuffled], d[shuffled], loss[shuffled], bootstrap=0).params == fit.params


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
    assert main(["plan", "--data", str(other), "--model.preset=nano", "--hardware", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "fitted on other data" in err


def test_plan_with_a_fit_predicts_bpb_and_answers_a_target(data_dir, capsys):
    n, d, loss = synthetic()
    write_fit(data_dir, fit_law(n, d, loss, bootstrap=20), [{"params": x} for x in (1e5, 3e6)], {})
    assert main(["plan", "--data", str(data_dir), "--model.preset=nano", "--model.vocab_size=256", "--tokens", "20M",
                 "--hardware", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "predicted val bpb" in out and "tokens per parameter" in out
    # the fixture play has 27k training characters: at most 4 epochs, where TRUE's D term alone is 5.2 bpb
    assert main(["plan", "--data", str(data_dir), "--target-bpb", "7.0", "--hardware", "h100-sxm:8",
                 "--max-nodes", "1", "--global-batch", "8", "--data.seq_len=64"]) == 0
    out = capsys.readouterr().out
    assert "reaches 7" in out and "$" in out and "scope" in out
    assert main(["plan", "--data", str(data_dir), "--target-bpb", "7.0", "--hardware", "h100-sxm:8",
                 "--max-nodes", "1", "--global-batch", "8", "--data.seq_len=64", "--json", "-"]) == 0
    doc = json.loads(capsys.readouterr().out)  # sized to the target: its own prediction is the target
    assert doc["choice"]["val_bpb"] == pytest.approx(7.0, rel=1e-6)
    assert doc["choice"]["tokens"] <= doc["scope"]["max_tokens"]
    assert doc["choice"]["on_demand_usd"] == min(r["on_demand_usd"] for r in doc["candidates"])
    assert main(["plan", "--target-bpb", "1.3", "--model.preset=nano", "--hardware", "cpu"]) == 2
    assert "needs --data" in capsys.readouterr().err
    # the choice's own predicted bpb is at (or just under) the target it was sized for
    assert main(["plan", "--data", str(data_dir), "--budget", "50", "--hardware", "h100-sxm:8", "--max-nodes", "1",
                 "--global-batch", "8", "--data.seq_len=64", "--json", "-"]) == 0
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
    assert "seq 32, 4 sequences a step" in " ".join(out.split()) and "tokens a step, the fit's runs took" not in out
    assert main(["plan", "--data", str(data_dir), "--target-bpb", "7.0", "--hardware", "h100-sxm:8",
                 "--max-nodes", "1", "--data.seq_len=64", "--global-batch", "64"]) == 0
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

    from scaletrain.core.writer_lock import RunLock
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
    from scaletrain.scaling.fit import law_params
    from scaletrain.scaling.quality import model_for_params

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
    fit = fit_law(n, d, loss, bootstrap=3)
    write_fit(data_dir, fit, [{"params": x} for x in (1e5, 3e6)], {})
    plan = ["plan", "--data", str(data_dir), "--model.preset=nano", "--model.vocab_size=256", "--tokens", "60k",
            "--hardware", "cpu"]  # within the fit's scope (4 epochs of the play): no caveat of the scope either
    assert main(plan) == 0
    assert "caveat" not in capsys.readouterr().out
    write_fit(data_dir, replace(fit, params=replace(fit.params, alpha=2.42)), [{"params": x} for x in (1e5, 3e6)], {})
    assert main(plan) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "predicted val bpb" in out and "caveat (the fit): alpha = 2.42 is outside the usual 0.02-2" in out


# -- issue 49: bad grid records, edited fits, fits that mean nothing, and plan's bad numbers -------------------
def _grid_of_records(out: Path, data: Path, fingerprint: str | None = "auto") -> list[Path]:
    """Six finished-looking runs (2 sizes x 3 token counts, losses from TRUE) as `train_run` records them;
    ``fingerprint``: "auto" = ``data``'s, None = no field (a record from before runs recorded their data)."""
    paths = []
    for dim, layers in grid.FAMILY[:2]:
        for tokens in (20_480, 51_200, 128_000):
            run = grid.make_run(dim, layers, 256, tokens // (grid.BATCH * grid.SEQ_LEN), "cpu")
            record = {**grid.asdict(run), "flops": run.flops, "val_bpb": float(TRUE.loss(run.params, run.tokens)),
                      "val_loss": 1.0, "seconds": 1.0}
            if fingerprint is not None:
                record["data_fingerprint"] = data_fingerprint(data) if fingerprint == "auto" else fingerprint
            (out / run.name).mkdir(parents=True)
            (out / run.name / grid.RESULT).write_text(json.dumps(record))
            paths.append(out / run.name / grid.RESULT)
    return paths


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_fit_only_refuses_a_grid_trained_on_other_data(tmp_path, data_dir, capsys):
    """`scale OTHER --out GRID --fit-only` fitted GRID's runs (trained on DATA) and stamped the fit with OTHER's
    fingerprint, which `plan --data OTHER` then trusted: the runs name their data and are compared."""
    other = tmp_path / "other"
    prepare_text(str(FIXTURES / "macbeth_gut.txt"), other, tokenizer="char", val_fraction=0.1)
    _grid_of_records(tmp_path / "grid", data_dir)
    fit_only = ["scale", str(other), "--out", str(tmp_path / "grid"), "--fit-only", "--bootstrap", "0"]
    assert main(fit_only) == 2
    assert "was trained on other data" in _one_line(capsys) and not (other / FIT_FILE).exists()
    # a record from before runs named their data: its config.toml's data.path tells
    paths = _grid_of_records(tmp_path / "old", data_dir, fingerprint=None)
    for p in paths:
        (p.parent / "config.toml").write_text(f'[data]\npath = "{data_dir}"\n')
    assert main(["scale", str(other), "--out", str(tmp_path / "old"), "--fit-only", "--bootstrap", "0"]) == 2
    assert "was trained on other data" in _one_line(capsys)
    (paths[0].parent / "config.toml").unlink()  # nothing says: refused, not assumed
    assert main(["scale", str(data_dir), "--out", str(tmp_path / "old"), "--fit-only", "--bootstrap", "0"]) == 2
    assert "does not say which data" in _one_line(capsys)
    # its own data: fitted and written
    assert main(["scale", str(data_dir), "--out", str(tmp_path / "grid"), "--fit-only", "--bootstrap", "0"]) == 0
    assert json.loads((data_dir / FIT_FILE).read_text())["data_fingerprint"] == data_fingerprint(data_dir)


@pytest.mark.parametrize("damage", ["truncated", "abc", "nan", "negative", "missing"])
def test_a_damaged_run_record_is_one_line_naming_it(tmp_path, data_dir, capsys, damage):
    """A truncated scale_run.json was dropped without a word (the fit used 5 of 6 runs); val_bpb "abc" was a
    ValueError traceback in fit.py; NaN or a negative one was refused without naming the run."""
    paths = _grid_of_records(tmp_path / "grid", data_dir)
    bad = paths[2]
    record = json.loads(bad.read_text())
    if damage == "truncated":
        bad.write_text(bad.read_text()[:40])
    else:
        value = {"abc": "abc", "nan": float("nan"), "negative": -2.0}.get(damage)
        record = {k: v for k, v in record.items() if k != "val_bpb"} if damage == "missing" else \
            {**record, "val_bpb": value}
        bad.write_text(json.dumps(record))
    assert main(["scale", str(data_dir), "--out", str(tmp_path / "grid"), "--fit-only", "--bootstrap", "0"]) == 2
    err = _one_line(capsys)
    assert str(bad) in err and not (data_dir / FIT_FILE).exists()
    assert ("not a readable run record" in err) if damage == "truncated" else ("val_bpb must be" in err)


def _fit_doc(data_dir: Path, params: LawParams, runs: list[dict] | None = None, bootstrap: int = 0) -> Path:
    from scaletrain.scaling.fit import ScalingFit

    fit = ScalingFit(params, [params] * bootstrap, residual_std=0.01)
    return write_fit(data_dir, fit, runs if runs is not None else [{"params": x} for x in (1e5, 3e6)], {})


@pytest.mark.parametrize("field,value", [("E", -5.0), ("A", 0.0), ("beta", None), ("alpha", "x")])
def test_an_edited_fit_is_refused_on_load_naming_the_field(data_dir, capsys, field, value):
    """`scaling_fit.json` edited to E = -5 with an empty bootstrap was planned with: exit 0, a zero-width interval."""
    path = _fit_doc(data_dir, TRUE)
    doc = json.loads(path.read_text())
    doc["params"][field] = value
    doc["bootstrap"] = []
    path.write_text(json.dumps(doc))
    with pytest.raises(ScalingFitError, match=rf"{FIT_FILE}: params\.{field} must be a finite number"):
        load_fit(data_dir)
    assert main(["plan", "--data", str(data_dir), "--model.preset=nano", "--tokens", "60k", "--hardware", "cpu"]) == 2
    assert f"params.{field}" in _one_line(capsys)


def test_a_fit_without_replicates_keeps_the_runs_scatter_and_says_so(data_dir):
    from scaletrain.scaling.fit import ScalingFit

    fit = ScalingFit(TRUE, [], residual_std=0.02)
    mid, lo, hi = fit.predict(1e6, 1e7)
    assert lo < mid < hi and math.log(hi / mid) == pytest.approx(1.645 * 0.02)
    assert any("no bootstrap replicates" in c for c in fit.caveats())


def test_a_fit_whose_parameters_mean_nothing_says_so_and_the_searches_refuse(data_dir, capsys):
    """118 Gutenberg books: E = 0.0038 bpb and "compute-optimal tokens per parameter 535,190.8" were printed as
    an answer, with a caveat on alpha only, and `plan --target-bpb` / `--budget` searched with them."""
    from scaletrain.scaling.fit import E_FLOOR, TOKENS_PER_PARAM_RANGE, ScalingFit

    runs = [{"params": 1e5, "flops": 6e11}, {"params": 3e6, "flops": 1.2e15}]
    low_e = LawParams(E=0.0038, A=TRUE.A, alpha=TRUE.alpha, B=TRUE.B, beta=TRUE.beta)
    assert ScalingFit(low_e).implausible() and not ScalingFit(TRUE).implausible()
    # alpha well above beta: D/N grows with the compute; here ~1e4 tokens per parameter at the grid's largest
    skewed = LawParams(E=1.1, A=4e4, alpha=1.2, B=3.0, beta=0.1)
    assert ScalingFit(skewed).tokens_per_param(1.2e15) > TOKENS_PER_PARAM_RANGE[1]
    for params, said in ((low_e, f"below the plausible {E_FLOOR:g}"), (skewed, "outside the plausible 1-1000")):
        _fit_doc(data_dir, params, runs, bootstrap=3)
        for search in (["--target-bpb", "7.0"], ["--budget", "50"]):
            assert main(["plan", "--data", str(data_dir), *search, "--hardware", "h100-sxm:8", "--max-nodes", "1",
                         "--global-batch", "8", "--data.seq_len=64"]) == 2
            err = _one_line(capsys)
            assert "the fit cannot choose a model size" in err and said in err
        # one run is still predicted, with the caveat beside it
        assert main(["plan", "--data", str(data_dir), "--model.preset=nano", "--tokens", "60k", "--hardware",
                     "cpu"]) == 0
        out = " ".join(capsys.readouterr().out.split())
        assert "predicted val bpb" in out and "caveat (the fit): " in out and said in out
    # `scale` prints it with the fit, and stores it
    assert any("outside the plausible" in c for c in json.loads((data_dir / FIT_FILE).read_text())["caveats"])
    from scaletrain.scaling.cli import print_fit

    print_fit(ScalingFit(skewed, [skewed]), 1.2e15)
    assert "caveat: compute-optimal tokens per parameter" in capsys.readouterr().out


@pytest.mark.parametrize("target", ["inf", "nan", "-1", "0"])
def test_plan_refuses_a_target_that_is_no_number_of_bits(data_dir, capsys, target):
    """`plan --target-bpb inf` (and nan) printed "the cheapest way to reach inf bpb", exit 0."""
    _fit_doc(data_dir, TRUE)
    assert main(["plan", "--data", str(data_dir), "--target-bpb", target, "--hardware", "h100-sxm:8"]) == 2
    assert "--target-bpb must be a finite number of bits per byte > 0" in _one_line(capsys)


def test_plan_refuses_tokens_past_float_range(capsys):
    """`plan --tokens 1e400` was an OverflowError traceback."""
    assert main(["plan", "--model.preset=nano", "--model.vocab_size=256", "--tokens", "1e400", "--hardware",
                 "cpu"]) == 2
    assert "--tokens must be a finite number > 0" in _one_line(capsys)


def test_plan_says_when_a_prediction_is_outside_the_fits_scope(data_dir, capsys):
    """20M tokens of a 1.1M-token folder (18 epochs) was predicted with an interval and no word that the fit's
    scope ends at 4 epochs; here 20M of the play's ~27k training characters. The vocabulary comes from --data's
    manifest (docs/planning.md's command was refused "pass --vocab-size")."""
    _fit_doc(data_dir, TRUE, bootstrap=3)
    plan = ["plan", "--data", str(data_dir), "--model.preset=nano", "--hardware", "cpu", "--tokens"]
    assert main([*plan, "20M"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "predicted val bpb" in out and re.search(r"caveat: 20,000,000 tokens are [\d,.]+ epochs of this data's "
                                                    r"training split, and the fit's scope ends at 4", out)
    assert main([*plan, "60k"]) == 0  # within 4 epochs: no scope caveat
    assert "epochs" not in capsys.readouterr().out


def test_scale_says_when_the_data_caps_the_grid(tmp_path, data_dir, monkeypatch, capsys):
    """`scale --budget 99999h` on a small folder planned a 31.7-minute grid without saying the data (4 epochs)
    was the limit."""
    _micro_grid(monkeypatch)
    monkeypatch.setattr(grid, "MAX_EPOCHS", 4)
    args = ["scale", str(data_dir), "--out", str(tmp_path / "g"), "--hardware", "cpu", "--min-tokens-per-param",
            "0.01", "--dry-run", "--budget"]
    assert main([*args, "99999h"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "the data caps this grid, not the budget" in out and "no run reads it more than 4 times" in out
    largest = max(int(m) for m in re.findall(r"-t(\d+)", out))  # the grid's longest run: 4 epochs at most
    assert largest <= 4 * grid.vocabulary(data_dir)[1]
    monkeypatch.setattr(grid, "MAX_EPOCHS", 1000)  # the play read many times over: the budget binds, nothing said
    with pytest.raises(grid.BudgetTooSmall) as refused:
        grid.plan_grid(data_dir, 1e-3, "cpu")
    lines = []
    assert grid.plan_grid(data_dir, math.ceil(refused.value.smallest) + 1, "cpu", say=lines.append)
    assert lines == []
