"""The reference CPU's calibration, as measured by ``scaletrain doctor`` (the numbers the catalog's ``cpu``
entry plans with when this machine has not been calibrated; ``--hardware auto`` uses your own).

Machine: 2 vCPU AMD EPYC (the developer / CI kind), 24 GiB, torch 2.13.0+cpu. Measured with ONE torch
thread and process CPU time (``calibrate(clock="cpu")``), i.e. the rates of one core; the all-reduce,
collective latency and DTensor overhead come from ``torchrun --nproc-per-node 2 ... doctor`` (gloo).
Regenerate with benchmarks/planner_accuracy.py --recalibrate and copy the cache entry here.

The single-process rates are of 2026-11-25 (issue 10: the widened curves -- GEMMs at 128 and 1024 rows up
to width 4096, attention to sequence 2048 and head dim 16, cross-entropy to vocabulary 65536 -- measured at
a load average of ~5 from other jobs, with the CPU clock); the four 2-rank keys (all-reduce bandwidth, its
world size, collective latency, DTensor op overhead) are kept from the 2026-11-22 measurement.
``optimizer_curve`` was re-measured on 2026-11-25 (load ~2.5) with the fused AdamW kernel, the trainer's CPU
default since then (the foreach curve it replaces: 2.5e-9, 2.25e-9, 3.45e-9 s per parameter); the tracked
planner-accuracy results were measured with foreach.
"""

REFERENCE_CPU_CALIBRATION: dict = {'allreduce_busbw': 1088000000.0,
 'allreduce_world_size': 2,
 'attention_curve': {'128': [[64.0, 71680000000.0, 56020000000.0],
                             [256.0, 81000000000.0, 61470000000.0],
                             [1024.0, 116400000000.0, 89750000000.0],
                             [2048.0, 143400000000.0, 108900000000.0]],
                     '16': [[64.0, 33930000000.0, 31320000000.0],
                            [256.0, 50660000000.0, 43860000000.0],
                            [1024.0, 70690000000.0, 49960000000.0],
                            [2048.0, 86840000000.0, 61400000000.0]],
                     '32': [[64.0, 48490000000.0, 41950000000.0],
                            [256.0, 66270000000.0, 53990000000.0],
                            [1024.0, 92490000000.0, 67200000000.0],
                            [2048.0, 112500000000.0, 82720000000.0]],
                     '64': [[64.0, 61940000000.0, 50060000000.0],
                            [256.0, 75560000000.0, 56360000000.0],
                            [1024.0, 108300000000.0, 80660000000.0],
                            [2048.0, 132200000000.0, 97290000000.0]]},
 'block_ops': 176.0,
 'clock': 'cpu',
 'collective_latency_s': 0.0001753,
 'cores': 2,
 'cross_entropy_curve': [[256.0, 1.28e-09], [2048.0, 1.703e-09], [16380.0, 6.976e-09], [65540.0, 5.383e-09]],
 'dtensor_op_overhead_s': 6.914e-05,
 'elementwise_curve': [[1378000.0, 1.201e-09], [5511000.0, 9.13e-10], [22040000.0, 9.436e-10]],
 'elementwise_s_per_element': 9.13e-10,
 'gemm_curve': [[64.0, 86600000000.0, 71240000000.0],
                [128.0, 97960000000.0, 88970000000.0],
                [256.0, 103500000000.0, 90000000000.0],
                [512.0, 98060000000.0, 88540000000.0],
                [1024.0, 100400000000.0, 93750000000.0],
                [2048.0, 89430000000.0, 91000000000.0],
                [4096.0, 92820000000.0, 91010000000.0]],
 'gemm_curve_by_rows': {'1024': [[64.0, 86600000000.0, 71240000000.0],
                                 [128.0, 97960000000.0, 88970000000.0],
                                 [256.0, 103500000000.0, 90000000000.0],
                                 [512.0, 98060000000.0, 88540000000.0],
                                 [1024.0, 100400000000.0, 93750000000.0],
                                 [2048.0, 89430000000.0, 91000000000.0],
                                 [4096.0, 92820000000.0, 91010000000.0]],
                        '128': [[64.0, 58860000000.0, 34670000000.0],
                                [128.0, 84280000000.0, 62970000000.0],
                                [256.0, 95970000000.0, 82370000000.0],
                                [512.0, 100200000000.0, 84640000000.0],
                                [1024.0, 91160000000.0, 79880000000.0],
                                [2048.0, 88350000000.0, 84480000000.0],
                                [4096.0, 83170000000.0, 83400000000.0]]},
 'gemm_efficiency': 0.9463,
 'matmul_flops_bf16': 206100000000.0,
 'matmul_flops_fp32': 103500000000.0,
 'measured_at': '2026-11-25T12:05:49',
 'memory_bandwidth': 27040000000.0,
 'memory_bytes': 25280000000.0,
 'op_overhead_s': 1.114e-06,
 'optimizer_curve': [[262100.0, 1.2e-09], [2097000.0, 9.143e-10], [16780000.0, 1.032e-09]],
 'rounds': 4,
 'threads': 1}
