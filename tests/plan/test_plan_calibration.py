"""The calibration cannot be poisoned: a busy machine's rounds are dropped, a calibration that contradicts itself is
never cached nor planned with, the plan models the precision the trainer picks, and MFU never reads over 100%."""

import argparse
import subprocess
import sys

import pytest
import torch

from scaletrain.commands.plan import add_plan_arguments, planned_precision, run_plan
from scaletrain.hardware.catalog import CATALOG, with_calibration
from scaletrain.hardware.peak import _thread_run_delays, device_fingerprint, load_calibration, save_calibration
from scaletrain.hardware.reference_cpu import REFERENCE_CPU_CALIBRATION
from scaletrain.plan import calibration
from scaletrain.plan.calibration import CalibrationError, calibration_problems
from scaletrain.plan.report import mfu_text
from scaletrain.plan.timing import BF16_KEYS, precision_rates
from scaletrain.train.precision import resolve_precision


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty calibration cache of its own."""
    monkeypatch.setenv("SCALETRAIN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def one_core(fp32: float, bf16: float) -> None:
    """Cache one core's peaks, as ``peak.peak_flops`` writes them (what ``train.precision = auto`` reads)."""
    data = load_calibration()
    data[device_fingerprint("cpu", threads=1)] = {"matmul_flops_fp32": fp32, "matmul_flops_bf16": bf16}
    save_calibration(data)


def matmul_round() -> dict:
    a = torch.randn(512, 512)
    start = torch.randn(1)
    for _ in range(60):
        start = start + (a @ a).sum() * 0
    return {"x": 1.0}


@pytest.mark.skipif(_thread_run_delays() is None, reason="this kernel does not report run-queue waits")
def test_rounds_taken_while_other_processes_hold_the_cores_are_dropped_and_nothing_is_cached(cache):
    """Three busy processes on a 2-core machine: every wall-clock round sees this process wait for a core, so the
    calibration refuses (one line, nothing cached); on the CPU clock with one thread the rounds still count."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(max(3, torch.get_num_threads()
                                                                                            + 1))]
    threads = torch.get_num_threads()
    try:
        seen: dict = {}
        with pytest.raises(CalibrationError, match="too busy to calibrate"):
            calibration._quiet_rounds(matmul_round, {"x": True}, 1, "wall", lambda s: None, "probe", seen)
        torch.set_num_threads(1)
        kept = calibration._quiet_rounds(matmul_round, {"x": True}, 1, "cpu", lambda s: None, "probe", seen)
        assert kept == {"x": 1.0} and seen["waited"] > calibration.QUIET_WAIT  # the load it saw is recorded
    finally:
        torch.set_num_threads(threads)
        for p in busy:
            p.kill()
            p.wait()
    assert not load_calibration()


def test_a_calibration_that_contradicts_itself_is_reported(monkeypatch):
    """2 threads slower than 1 (the poisoned cache of issue 23: bf16 4.8 GFLOP/s on 2 threads vs 206 on one), and a
    bf16/fp32 ratio that changes with the thread count by more than 3x."""
    one = {"matmul_flops_fp32": 100e9, "matmul_flops_bf16": 206e9}
    data = {device_fingerprint("cpu", threads=1): one}
    poisoned = {"threads": 2, "matmul_flops_fp32": 150e9, "matmul_flops_bf16": 4.8e9}
    sane = {"threads": 2, "matmul_flops_fp32": 180e9, "matmul_flops_bf16": 390e9}
    monkeypatch.setattr(calibration, "load_calibration", lambda: data)
    problems = calibration_problems(poisoned)
    assert any("slower than one thread" in p for p in problems)
    assert any("bf16 runs" in p for p in problems)
    assert calibration_problems(sane) == []


def plan_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    return parser.parse_args(list(argv))


def test_plan_refuses_a_poisoned_cached_calibration(cache, capsys):
    """A calibration cached by an older version while another job ran is never planned with: one line, exit 2."""
    one_core(100e9, 206e9)
    data = load_calibration()
    data[device_fingerprint("cpu")] = {**REFERENCE_CPU_CALIBRATION, "threads": torch.get_num_threads(),
                                       "matmul_flops_bf16": 4.8e9, "matmul_flops_fp32": 60e9}
    if torch.get_num_threads() == 1:  # the same key as one core's: make the one-core entry the poisoned one
        pytest.skip("needs more than one torch thread")
    save_calibration(data)
    assert run_plan(plan_args("--model.preset=nano", "--model.vocab_size=256", "--hardware", "auto")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "contradicts itself" in err[0] and "scaletrain doctor" in err[0]


@pytest.mark.parametrize("fp32,bf16,expected", [(100e9, 206e9, "bf16"), (100e9, 1e9, "fp32")])
def test_plan_precision_auto_is_what_the_trainer_picks_here(cache, fp32, bf16, expected):
    """--precision auto on this machine: the trainer's own rule over the same cached one-core measurement."""
    one_core(fp32, bf16)
    hw = with_calibration(CATALOG["cpu"], {})
    assert planned_precision("auto", hw, this_machine=True) == resolve_precision("auto", torch.device("cpu"))[0] \
        == expected
    assert planned_precision("fp32", hw, this_machine=True) == "fp32"
    # A catalog CPU: its calibrated matmul rates (the reference machine has fast bf16: 2x fp32)
    assert planned_precision("auto", CATALOG["cpu"], this_machine=False) == "bf16"
    assert planned_precision("auto", CATALOG["h100-sxm"], this_machine=False) == "bf16"


def test_bf16_steps_use_the_autocast_curves_or_the_matmul_ratio():
    """The CPU time model reads the curves measured under autocast for bf16; a calibration without them scales the
    fp32 GEMM and attention rates by the bf16/fp32 matmul ratio."""
    entry = {"gemm_curve": [[64.0, 10.0, 5.0]], "attention_curve": {"64": [[64.0, 4.0, 2.0]]},
             "matmul_flops_fp32": 1.0, "matmul_flops_bf16": 2.0}
    assert precision_rates(entry, "fp32") is entry
    scaled = precision_rates(entry, "bf16")
    assert scaled["gemm_curve"] == [[64.0, 20.0, 10.0]] and scaled["attention_curve"]["64"] == [[64.0, 8.0, 4.0]]
    full = {**entry, **{f"{k}_bf16": f"bf16 {k}" for k in BF16_KEYS}}
    assert all(precision_rates(full, "bf16")[k] == f"bf16 {k}" for k in BF16_KEYS)


def test_mfu_over_100_percent_is_never_printed():
    assert mfu_text(0.42) == "42%"
    assert "%" not in mfu_text(5.48) and "doctor" in mfu_text(5.48)


def test_a_small_calibration_measures_bf16_under_autocast_and_says_who_measured_it(cache, monkeypatch):
    """calibrate() on tiny shapes (CPU clock, one thread: robust on a shared machine) writes the bf16 curves the
    time model reads, the load it saw and what measured it; the plan's source line repeats it."""
    for name, value in {"GEMM_WIDTHS": (64, 128), "GEMM_ROWS": (128,), "ATTN_HEAD_DIMS": (16,),
                        "ATTN_SEQ_LENS": (64,), "CE_VOCABS": (256,), "OPT_SIZES": (1 << 12,),
                        "ELEMENTWISE_BATCHES": (1,)}.items():
        monkeypatch.setattr(calibration, name, value)
    monkeypatch.setattr(calibration, "REFERENCE_SHAPE", dict(dim=64, n_heads=4, ffn_hidden_dim=128, vocab_size=64,
                                                             max_seq_len=32))
    monkeypatch.setattr(calibration, "measure_memory_bandwidth", lambda: 1e10)
    for name, value in {"HEAD_CHUNK_VOCAB": 512, "HEAD_CHUNK_DIM": 64, "HEAD_CHUNK_ROWS": (16, 64)}.items():
        monkeypatch.setattr(calibration.timing, name, value)
    monkeypatch.setattr(calibration, "WEIGHT_CAST_ELEMENTS", 1 << 16)
    monkeypatch.setattr(calibration, "NF4_DEQUANT_SIDE", 256)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        peaks = calibration.measure_matmul_flops("cpu", "fp32", n=256, min_seconds=0.05)
        one_core(peaks, calibration.measure_matmul_flops("cpu", "bf16", n=256, min_seconds=0.05))
        entry = calibration.calibrate("cpu", log=lambda s: None, rounds=1, clock="cpu", by="the test")
    finally:
        torch.set_num_threads(threads)
    if entry["matmul_flops_bf16"] >= calibration.BF16_CURVES_MIN_RATIO * entry["matmul_flops_fp32"]:
        assert all(f"{key}_bf16" in entry for key in BF16_KEYS)
    assert [row[0] for row in entry["head_chunk_curve"]] == [16.0, 64.0] and entry["weight_cast_s_per_element"] > 0
    assert entry["measured_by"] == "the test" and "core_wait" in entry and entry["clock"] == "cpu"
    assert "by the test" in with_calibration(CATALOG["cpu"], entry).utilisation_source


def test_a_missing_calibration_says_which_thread_count_doctor_measured(cache):
    """`plan --hardware auto` after `doctor --clock cpu` said "no calibration for this machine yet" without
    saying that doctor's one-thread calibration is planned with under OMP_NUM_THREADS=1."""
    threads = torch.get_num_threads()
    entry = {"elementwise_s_per_element": 1e-9}
    try:
        torch.set_num_threads(2)
        line = calibration.missing_calibration_line({device_fingerprint("cpu", threads=1): entry})
        assert "at 2 threads" in line and "OMP_NUM_THREADS=1 scaletrain plan" in line
        assert "OMP_NUM_THREADS" not in calibration.missing_calibration_line({})
    finally:
        torch.set_num_threads(threads)
