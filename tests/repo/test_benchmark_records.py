"""Every benchmark result names the CPU it was measured on (benchmarks/launch.py: write_result + machine_record):
a time belongs to one CPU, and bf16 speed to its flags (AVX512_BF16, AMX)."""

from __future__ import annotations

import json
import sys

from helpers.scripts import import_benchmark
from scaletrain.hardware.peak import SPEED_FLAGS, cpu_features


def test_the_flags_that_decide_speed_are_read_from_cpuinfo():
    avx2_only = "model name\t: AMD EPYC 7B13\nflags\t\t: fpu sse2 avx avx2 fma\n"
    record = cpu_features(avx2_only)
    assert record["model"]  # this machine's name: cpu_name reads the real /proc/cpuinfo
    assert record["flags"] == {"avx2": True, "avx512f": False, "avx512_bf16": False, "amx_bf16": False,
                               "amx_tile": False}
    sapphire = "flags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n"
    assert all(cpu_features(sapphire)["flags"].values())
    assert cpu_features("")["flags"] == {}  # no flags listed: nothing claimed
    assert record["cores"] >= 1


def test_every_written_result_carries_the_cpu(tmp_path):
    launch = import_benchmark("launch")
    path = launch.write_result(tmp_path / "x.json", {"rows": [1, 2]})
    doc = json.loads(path.read_text())
    assert doc["rows"] == [1, 2]
    cpu = doc["cpu"]
    assert cpu["model"] and cpu["cores"] >= 1 and cpu["torch"]
    if sys.platform.startswith("linux"):
        assert set(cpu["flags"]) == set(SPEED_FLAGS)
    # A result that already names its CPU keeps it.
    doc = json.loads(launch.write_result(tmp_path / "y.json", {"cpu": {"model": "given"}}).read_text())
    assert doc["cpu"] == {"model": "given"}

