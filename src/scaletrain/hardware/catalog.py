"""The hardware catalog: peak dense FLOP/s per dtype, memory, bandwidth and interconnect, each with its source.

Values are *dense* (no 2:4 sparsity) datasheet figures. NVIDIA datasheets list tensor-core peaks "with
sparsity"; we halve those. Every entry names where its numbers come from so a reader can check them.

A ``Cluster`` is ``count`` devices per node x ``nodes``. ``parse_hardware("h100-sxm:8x2")`` builds one;
``auto`` reads this machine's calibration (``scaletrain doctor``) instead of a datasheet.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from scaletrain.core.options import ConfigError
from scaletrain.hardware.reference_cpu import REFERENCE_CPU_CALIBRATION

GB = 1e9
GiB = 2**30
TFLOPS = 1e12


@dataclass(frozen=True)
class Link:
    """One interconnect: unidirectional bandwidth per device (bytes/s) and what fraction collectives reach."""

    name: str
    bandwidth: float  # bytes/s per device, one direction
    efficiency: float  # achievable bus-bandwidth fraction for large collectives
    source: str
    # One port a node that its devices share (an Ethernet NIC), rather than one a device (InfiniBand rails): a
    # collective across nodes then gets one port's bandwidth, not one per device of the node in the group
    per_node: bool = False


LINKS: dict[str, Link] = {
    "nvlink4": Link("NVLink 4 (18 links)", 450 * GB, 0.80,
                    "NVIDIA H100 datasheet: 900 GB/s bidirectional per GPU; 0.80 = nccl-tests all-reduce busbw "
                    "~360 GB/s on 8x H100 SXM (NVIDIA DGX H100 user guide / nccl-tests README figures)"),
    "nvlink3": Link("NVLink 3 (12 links)", 300 * GB, 0.80,
                    "NVIDIA A100 datasheet: 600 GB/s bidirectional per GPU; 0.80 assumed as for NVLink 4"),
    "nvlink-bridge-h100pcie": Link("NVLink bridge (H100 PCIe pairs)", 300 * GB, 0.80,
                                   "NVIDIA H100 PCIe datasheet: 600 GB/s bidirectional NVLink bridge, pairs only"),
    "pcie5": Link("PCIe Gen5 x16", 64 * GB, 0.70,
                  "PCI-SIG Gen5: 32 GT/s x16 = 64 GB/s per direction; 0.70 assumed for NCCL over PCIe/host bridges"),
    "pcie4": Link("PCIe Gen4 x16", 32 * GB, 0.70,
                  "PCI-SIG Gen4: 16 GT/s x16 = 32 GB/s per direction; 0.70 assumed"),
    "ib-ndr": Link("InfiniBand NDR 400 Gb/s, one port per GPU", 50 * GB, 0.90,
                   "NVIDIA ConnectX-7 / DGX H100: 8x 400 Gb/s ports per 8-GPU node = 50 GB/s per GPU; 0.90 assumed"),
    "ib-hdr": Link("InfiniBand HDR 200 Gb/s, one port per GPU", 25 * GB, 0.90,
                   "NVIDIA DGX A100: 8x 200 Gb/s HDR ports per node = 25 GB/s per GPU; 0.90 assumed"),
    "eth-100g": Link("Ethernet 100 Gb/s per node", 12.5 * GB, 0.80, "100 Gb/s line rate; 0.80 assumed for TCP/RoCE",
                     per_node=True),
    "eth-10g": Link("Ethernet 10 Gb/s per node", 1.25 * GB, 0.80, "10 Gb/s line rate; 0.80 assumed for TCP (gloo)",
                    per_node=True),
    "nvme-gen4": Link("NVMe SSD, PCIe Gen4 x4 (DeepSpeed ZeRO-Infinity swap)", 7 * GB, 0.50,
                      "Samsung 990 PRO / WD SN850X datasheets: ~7 GB/s sequential read, ~6.5-6.9 GB/s write; 0.50 "
                      "assumed for DeepSpeed's async I/O of sub-group-sized blocks"),
    "shm": Link("shared memory (gloo, same host)", 2 * GB, 1.0,
                "placeholder; `scaletrain doctor` under torchrun measures the real all-reduce bus bandwidth"),
}


@dataclass(frozen=True)
class Hardware:
    """One accelerator (or one CPU host) as the planner sees it."""

    name: str
    kind: str  # "gpu" or "cpu"
    peak_flops: dict[str, float]  # dense matmul FLOP/s per dtype: fp32 (non-tensor), tf32, bf16, fp16, fp8
    memory_bytes: float
    memory_bandwidth: float  # bytes/s
    intra_node: str  # key of LINKS
    inter_node: str  # key of LINKS
    utilisation: float  # achievable MFU of a well-tuned step: the ceiling of wide GEMMs (see utilisation_at)
    utilisation_source: str
    source: str
    devices_per_node: int = 8
    cores: int = 0  # CPU only: physical cores the calibration used
    calibration: dict = field(default_factory=dict)  # CPU / auto: measured rates (see calibration.py)
    # GPU utilisation as a function of the model (fitted to published runs: benchmarks/gpu_utilisation.py):
    # the GEMMs reach ``utilisation * dim / (dim + utilisation_half_width)`` and attention's QK^T / AV
    # ``utilisation * attention_utilisation``. 0 and 1 (the defaults) make it one constant.
    utilisation_half_width: float = 0.0
    attention_utilisation: float = 1.0
    # CPU: the malloc a run uses (memory.CPU_ALLOCATOR_MARGIN): this machine's for ``auto``, else glibc (a fresh
    # machine has no jemalloc)
    allocator: str = "system"

    def utilisation_at(self, dim: int, attention_share: float) -> float:
        """Model-FLOPs utilisation of a step whose GEMMs have width ``dim`` and whose FLOPs are a fraction
        ``attention_share`` attention (QK^T, AV): the harmonic mix of the two parts' rates, because each part
        takes its FLOPs over its own rate. Small widths underuse the tensor cores (short GEMM tiles, and a
        kernel's fixed cost weighs more), so the GEMM rate saturates with width."""
        gemm = self.utilisation * dim / (dim + self.utilisation_half_width)
        attention = self.utilisation * self.attention_utilisation
        return 1.0 / ((1.0 - attention_share) / gemm + attention_share / attention)

    def flops(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            raise ConfigError(f"{self.name} has no {dtype} matmul peak in the catalog "
                              f"(has: {', '.join(self.peak_flops)})")
        return self.peak_flops[dtype]


# GPU utilisation (Hardware.utilisation_at), fitted by benchmarks/gpu_utilisation.py to published runs
# (benchmarks/results/gpu_utilisation.json has every row, its citation, and the held-out errors).
_FIT = ("fitted by benchmarks/gpu_utilisation.py to the one-node runs without activation checkpointing of "
        "llm-foundry's MPT benchmark tables (scripts/train/benchmarking/README.md, {table}: MPT {sizes}, "
        "sequence 512-65536); checked on runs not fitted (multi-node, activation checkpointing, A100 40GB, "
        "torchtitan Llama 3): {fit}")
_HOPPER_FIT = (0.534, 396.0, 0.560)  # ceiling, half width, attention fraction
_AMPERE_FIT = (0.729, 437.0, 0.736)
_H100_MFU = _FIT.format(table="'H100 80GB BF16'", sizes="760M-13B",
                        fit=f"GEMMs {_HOPPER_FIT[0]} x dim / (dim + {_HOPPER_FIT[1]:.0f}), "
                        f"attention {_HOPPER_FIT[0]} x {_HOPPER_FIT[2]}; H100 PCIe and H200 share it")
_HOPPER_SHAPE = dict(utilisation_half_width=_HOPPER_FIT[1], attention_utilisation=_HOPPER_FIT[2])
_AMPERE_SHAPE = dict(utilisation_half_width=_AMPERE_FIT[1], attention_utilisation=_AMPERE_FIT[2])
_A100_MFU = _FIT.format(table="'A100 80GB'", sizes="125M-13B",
                        fit=f"GEMMs {_AMPERE_FIT[0]} x dim / (dim + {_AMPERE_FIT[1]:.0f}), "
                        f"attention {_AMPERE_FIT[0]} x {_AMPERE_FIT[2]}; A100 40GB shares it")
_ADA_MFU = ("0.35: assumed (no published scaletrain-class MFU for Ada cards); lower than H100 because PCIe-only "
            "cards lose more to communication and GeForce bf16 runs at half rate with fp32 accumulate")

CATALOG: dict[str, Hardware] = {
    "h100-sxm": Hardware(
        "h100-sxm", "gpu",
        {"fp32": 66.9 * TFLOPS, "tf32": 494.7 * TFLOPS, "bf16": 989.4 * TFLOPS, "fp16": 989.4 * TFLOPS,
         "fp8": 1978.9 * TFLOPS},
        80 * GB, 3.35e12, "nvlink4", "ib-ndr", _HOPPER_FIT[0], _H100_MFU,
        "NVIDIA H100 Tensor Core GPU datasheet (SXM5 80GB), sparsity figures halved",
        **_HOPPER_SHAPE),
    "h100-pcie": Hardware(
        "h100-pcie", "gpu",
        {"fp32": 51.2 * TFLOPS, "tf32": 378.0 * TFLOPS, "bf16": 756.0 * TFLOPS, "fp16": 756.0 * TFLOPS,
         "fp8": 1513.0 * TFLOPS},
        80 * GB, 2.0e12, "pcie5", "ib-ndr", _HOPPER_FIT[0], _H100_MFU,
        "NVIDIA H100 datasheet (PCIe 80GB), sparsity figures halved; NVLink bridge pairs only, so pcie5 assumed",
        **_HOPPER_SHAPE),
    "h200": Hardware(
        "h200", "gpu",
        {"fp32": 66.9 * TFLOPS, "tf32": 494.7 * TFLOPS, "bf16": 989.4 * TFLOPS, "fp16": 989.4 * TFLOPS,
         "fp8": 1978.9 * TFLOPS},
        141 * GB, 4.8e12, "nvlink4", "ib-ndr", _HOPPER_FIT[0], _H100_MFU,
        "NVIDIA H200 datasheet (SXM 141GB HBM3e, 4.8 TB/s), same compute as H100 SXM; sparsity halved",
        **_HOPPER_SHAPE),
    "a100-40gb": Hardware(
        "a100-40gb", "gpu",
        {"fp32": 19.5 * TFLOPS, "tf32": 156.0 * TFLOPS, "bf16": 312.0 * TFLOPS, "fp16": 312.0 * TFLOPS},
        40 * GB, 1.555e12, "nvlink3", "ib-hdr", _AMPERE_FIT[0], _A100_MFU,
        "NVIDIA A100 datasheet (SXM4 40GB HBM2, 1,555 GB/s), dense tensor-core figures",
        **_AMPERE_SHAPE),
    "a100-80gb": Hardware(
        "a100-80gb", "gpu",
        {"fp32": 19.5 * TFLOPS, "tf32": 156.0 * TFLOPS, "bf16": 312.0 * TFLOPS, "fp16": 312.0 * TFLOPS},
        80 * GB, 2.039e12, "nvlink3", "ib-hdr", _AMPERE_FIT[0], _A100_MFU,
        "NVIDIA A100 datasheet (SXM4 80GB HBM2e, 2,039 GB/s), dense tensor-core figures",
        **_AMPERE_SHAPE),
    "l40s": Hardware(
        "l40s", "gpu",
        {"fp32": 91.6 * TFLOPS, "tf32": 183.0 * TFLOPS, "bf16": 362.05 * TFLOPS, "fp16": 362.05 * TFLOPS,
         "fp8": 733.0 * TFLOPS},
        48 * GB, 864e9, "pcie4", "eth-100g", 0.35, _ADA_MFU,
        "NVIDIA L40S datasheet (48GB GDDR6, 864 GB/s, PCIe Gen4, no NVLink), sparsity figures halved"),
    "rtx-4090": Hardware(
        "rtx-4090", "gpu",
        {"fp32": 82.6 * TFLOPS, "tf32": 82.6 * TFLOPS, "bf16": 165.2 * TFLOPS, "fp16": 165.2 * TFLOPS,
         "fp8": 330.3 * TFLOPS},
        24 * GB, 1008e9, "pcie4", "eth-10g", 0.35, _ADA_MFU,
        "NVIDIA Ada Lovelace architecture whitepaper (GeForce RTX 4090): bf16/fp16 with fp32 accumulate "
        "165.2 TFLOPS dense, 24GB GDDR6X 1,008 GB/s, PCIe Gen4, no NVLink", devices_per_node=4),
    "cpu": Hardware(
        "cpu", "cpu",
        {"fp32": REFERENCE_CPU_CALIBRATION["matmul_flops_fp32"],
         "bf16": REFERENCE_CPU_CALIBRATION["matmul_flops_bf16"]},
        24 * GiB, REFERENCE_CPU_CALIBRATION["memory_bandwidth"], "shm", "eth-10g",
        REFERENCE_CPU_CALIBRATION["gemm_efficiency"],
        "measured: nn.Linear throughput at transformer widths / 1024^3 matmul peak, one core of the reference "
        "machine (run `scaletrain doctor` and use --hardware auto for yours)",
        "generic CPU host = the reference machine (2 vCPU AMD EPYC, torch 2.13), measured by `scaletrain doctor` "
        "with one thread per rank (scaletrain/hardware/reference_cpu.py); one device = one rank on one core",
        devices_per_node=1, cores=2, calibration=REFERENCE_CPU_CALIBRATION),
}


@dataclass(frozen=True)
class Cluster:
    """``devices_per_node`` devices in each of ``nodes`` nodes (a CPU "device" is one rank's share of a host)."""

    hardware: Hardware
    devices_per_node: int
    nodes: int = 1

    @property
    def world_size(self) -> int:
        return self.devices_per_node * self.nodes

    def describe(self) -> str:
        nodes = f" x {self.nodes} nodes" if self.nodes > 1 else ""
        return f"{self.devices_per_node} x {self.hardware.name}{nodes}"


def catalog_listing() -> str:
    return ", ".join(sorted(CATALOG)) + ", auto"


def with_calibration(hw: Hardware, entry: dict, name: str | None = None) -> Hardware:
    """Replace datasheet numbers by measured ones (keys written by ``calibration.calibrate``)."""
    peak = dict(hw.peak_flops)
    for dtype in ("fp32", "tf32", "bf16", "fp16"):
        if f"matmul_flops_{dtype}" in entry:
            peak[dtype] = float(entry[f"matmul_flops_{dtype}"])
    changes = dict(peak_flops=peak, calibration=dict(entry), name=name or hw.name)
    if "memory_bandwidth" in entry:
        changes["memory_bandwidth"] = float(entry["memory_bandwidth"])
    if "memory_bytes" in entry:
        changes["memory_bytes"] = float(entry["memory_bytes"])
    if "cores" in entry:
        changes["cores"] = int(entry["cores"])
    if hw.kind == "cpu" and "gemm_efficiency" in entry:
        changes["utilisation"] = float(entry["gemm_efficiency"])
        changes["utilisation_source"] = (
            f"measured on this machine by {entry.get('measured_by', '`scaletrain doctor`')} at "
            f"{entry.get('measured_at', '?')} ({entry.get('clock', 'wall')} clock, {entry.get('threads', '?')} "
            f"thread(s), {entry.get('rounds', '?')} round(s); its threads waited {entry.get('core_wait', 0):.0%} "
            f"for a core): GEMM / matmul peak")
    return replace(hw, **changes)


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
