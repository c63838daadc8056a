"""The CPU time model's curves: GEMM rates by row count (issue 10: micro-batch-1 shapes ran slower than the
1024-row curve said) and the calibration's sample ranges covering held-out shapes."""

from scaletrain.plan import calibration
from scaletrain.plan.timing import gemm_rate, gemm_seconds

CURVE_128 = [[64.0, 2e10, 1e10], [1024.0, 6e10, 5e10]]
CURVE_1024 = [[64.0, 8e10, 7e10], [1024.0, 1e11, 9e10]]


def test_gemm_rate_interpolates_rows_and_holds_the_ends():
    entry = {"gemm_curve": CURVE_1024, "gemm_curve_by_rows": {"128": CURVE_128, "1024": CURVE_1024}}
    assert gemm_rate(entry, 1024, 1024) == 1e11 and gemm_rate(entry, 1024, 128) == 6e10
    assert gemm_rate(entry, 1024, 16) == 6e10 and gemm_rate(entry, 1024, 8192) == 1e11  # held beyond the curves
    mid = gemm_rate(entry, 1024, (128 * 1024) ** 0.5)  # halfway in log(rows), geometric in the rate
    assert abs(mid - (6e10 * 1e11) ** 0.5) < 1e3
    assert gemm_rate(entry, 1024, 128, backward=True) == 5e10
    # An older calibration (one curve at 1024 rows) reads as before.
    assert gemm_seconds(128, 1024, 1024, {"gemm_curve": CURVE_1024}) == 2.0 * 128 * 1024 * 1024 / 1e11


def test_calibration_covers_held_out_shapes():
    # benchmarks/planner_accuracy.py HELD_OUT: a 50k vocabulary (head 3.6k wide), micro-batch 1 x 128 tokens,
    # sequence 2048, head dim 16.
    assert max(calibration.CE_VOCABS) >= 50304 and max(calibration.GEMM_WIDTHS) >= 3589
    assert min(calibration.GEMM_ROWS) <= 128 and max(calibration.ATTN_SEQ_LENS) >= 2048
    assert min(calibration.ATTN_HEAD_DIMS) <= 16
