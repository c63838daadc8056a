"""The reference CPU's calibration, as measured by ``scaletrain doctor`` (the numbers the catalog's ``cpu``
entry plans with when this machine has not been calibrated; ``--hardware auto`` uses your own).

Machine: 2 vCPU AMD EPYC (the developer / CI kind), 24 GiB, torch 2.13.0+cpu. Measured with ONE torch
thread and process CPU time (``calibrate(clock="cpu")``), i.e. the rates of one core; the all-reduce,
collective latency and DTensor overhead come from ``torchrun --nproc-per-node 2 ... doctor`` (gloo).
Regenerate with benchmarks/planner_accuracy.py --recalibrate and copy the cache entry here.
"""

REFERENCE_CPU_CALIBRATION: dict = {'allreduce_busbw': 1088000000.0,
 'allreduce_world_size': 2,
 'attention_curve': {'128': [[64.0, 70130000000.0, 42390000000.0],
                             [256.0, 73430000000.0, 59930000000.0],
                             [1024.0, 106700000000.0, 73800000000.0]],
                     '32': [[64.0, 44290000000.0, 44900000000.0],
                            [256.0, 61050000000.0, 44760000000.0],
                            [1024.0, 88720000000.0, 61280000000.0]],
                     '64': [[64.0, 59200000000.0, 45930000000.0],
                            [256.0, 67360000000.0, 52360000000.0],
                            [1024.0, 104000000000.0, 67750000000.0]]},
 'block_ops': 206.0,
 'clock': 'cpu',
 'collective_latency_s': 0.0001753,
 'cores': 2,
 'cross_entropy_curve': [[256.0, 1.609e-09], [2048.0, 2.13e-09], [16380.0, 7.367e-09]],
 'dtensor_op_overhead_s': 6.914e-05,
 'elementwise_curve': [[1525000.0, 3.528e-09], [6101000.0, 2.32e-09], [24400000.0, 3.481e-09]],
 'elementwise_s_per_element': 2.32e-09,
 'gemm_curve': [[64.0, 84390000000.0, 69790000000.0],
                [128.0, 96520000000.0, 83900000000.0],
                [256.0, 101700000000.0, 79900000000.0],
                [512.0, 86820000000.0, 80460000000.0],
                [1024.0, 81480000000.0, 88680000000.0],
                [2048.0, 86700000000.0, 86120000000.0]],
 'gemm_efficiency': 0.8534,
 'matmul_flops_bf16': 201500000000.0,
 'matmul_flops_fp32': 101700000000.0,
 'measured_at': '2026-11-22T04:07:51',
 'memory_bandwidth': 23970000000.0,
 'memory_bytes': 25280000000.0,
 'op_overhead_s': 1.107e-06,
 'optimizer_curve': [[262100.0, 2.721e-09], [2097000.0, 2.837e-09], [16780000.0, 3.842e-09]],
 'rounds': 2,
 'threads': 1}
