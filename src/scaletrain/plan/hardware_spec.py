"""``--hardware`` specs -> a Cluster: a catalog name with counts, or ``auto`` (this machine, measured).

``parse_hardware("h100-sxm:8x2")`` is 8 devices per node x 2 nodes of the catalog's H100 SXM;
``parse_hardware("auto")`` is this machine with ``scaletrain doctor``'s calibration (measured if missing).
It sits above both the catalog (``hardware``) and the calibration, which therefore never import each other.
"""

from __future__ import annotations

import re
from dataclasses import replace

import torch

from scaletrain.core.options import ConfigError
from scaletrain.hardware import allocator
from scaletrain.hardware.catalog import CATALOG, Cluster, Hardware, catalog_listing, with_calibration
from scaletrain.hardware.peak import device_fingerprint, load_calibration
from scaletrain.hardware.reference_cpu import REFERENCE_CPU_CALIBRATION
from scaletrain.plan.calibration import calibration_entry


def catalog_key_for_gpu(name: str) -> str | None:
    """The catalog entry of a CUDA device name (``torch.cuda.get_device_name``), or None."""
    n = name.lower()
    rules = (("h200", "h200"), ("h100 pcie", "h100-pcie"), ("h100", "h100-sxm"), ("a100-sxm4-80", "a100-80gb"),
             ("a100 80", "a100-80gb"), ("a100-pcie-80", "a100-80gb"), ("a100", "a100-40gb"), ("l40s", "l40s"),
             ("4090", "rtx-4090"))
    return next((key for needle, key in rules if needle in n), None)


def hardware_from_calibration() -> Hardware:
    """The ``auto`` hardware: a GPU entry matched by name, or the generic CPU, with measured numbers."""
    if torch.cuda.is_available():
        key = catalog_key_for_gpu(torch.cuda.get_device_name(0))
        if key is None:
            raise ConfigError(f"--hardware auto: GPU {torch.cuda.get_device_name(0)!r} is not in the catalog; "
                              "pass a catalog name instead")
        match = CATALOG[key]
        return with_calibration(match, calibration_entry("cuda"), name=f"auto ({match.name})")
    hw = with_calibration(CATALOG["cpu"], calibration_entry("cpu"), name="auto (this cpu)")
    # one core's peaks (peak.peak_flops, cached by doctor beside the calibration): MFU's unit, as the trainer's
    one_core = load_calibration().get(device_fingerprint("cpu", threads=1), {})
    cores = {f"core_{key}": float(value) for key, value in one_core.items() if key.startswith("matmul_flops_")}
    return replace(hw, allocator=allocator.chosen_name(),  # what `scaletrain train` runs on here
                   calibration={**hw.calibration, **cores})


# What ``torchrun --nproc-per-node 2 -m scaletrain.cli doctor`` adds to this machine's calibration: gloo's
# all-reduce bandwidth and fixed cost per collective, DTensor's host overhead (TP), and the optimizer step as the
# ranks run it together (``optimizer_step``). Without them a plan of several CPU ranks would charge its
# collectives nothing but the catalog link's bandwidth: measured on 2 cores, that under-costs ZeRO-3 by 27% and
# TP by 45% (benchmarks/results/planner_two_rank_quiet.json).
COMMUNICATION_KEYS = ("allreduce_busbw", "collective_latency_s", "dtensor_op_overhead_s", "corun_slowdown",
                      "tp_overhead", "fsdp_overhead", "optimizer_step")
DOCTOR_RANKS = "torchrun --nproc-per-node 2 -m scaletrain.cli doctor"


def with_communication(hw: Hardware) -> Hardware:
    """``hw`` (this CPU) with the collectives' costs: this machine's from a ``doctor`` run under torchrun, else
    the reference CPU's (the catalog ``cpu``'s, also 2 cores and gloo), saying which in ``comm_source``."""
    calibration = dict(hw.calibration)
    if "allreduce_busbw" in calibration:
        calibration["comm_source"] = (f"measured on this machine (gloo, {calibration.get('allreduce_world_size', '?')}"
                                      f" ranks) by `{DOCTOR_RANKS}`")
    else:
        calibration.update({k: v for k, v in REFERENCE_CPU_CALIBRATION.items() if k in COMMUNICATION_KEYS})
        calibration["comm_source"] = (f"not measured here: the reference CPU's gloo numbers (run `{DOCTOR_RANKS}` "
                                      f"to measure this machine's)")
    return replace(hw, calibration=calibration)


_SPEC = re.compile(r"^(?P<name>[a-z0-9\-]+?)(?:[:@x*](?P<count>\d+))?(?:[x*](?P<nodes>\d+))?$")


def parse_hardware(spec: str, count: int | None = None, nodes: int | None = None) -> Cluster:
    """``h100-sxm``, ``h100-sxm:8`` (8 per node) or ``h100-sxm:8x4`` (8 per node, 4 nodes); ``auto`` = this machine.

    Raises ConfigError listing the catalog when the name is unknown.
    """
    text = spec.strip().lower()
    m = _SPEC.match(text)
    name = m.group("name") if m else text
    if name == "auto":
        hw = hardware_from_calibration()
    elif name in CATALOG:
        hw = CATALOG[name]
    else:
        raise ConfigError(f"unknown hardware {spec!r}; the catalog has: {catalog_listing()} "
                          f"(write NAME, NAME:COUNT or NAME:COUNTxNODES)")
    per_node = count if count is not None else int(m.group("count")) if m and m.group("count") else None
    n_nodes = nodes if nodes is not None else int(m.group("nodes")) if m and m.group("nodes") else 1
    if per_node is None:
        per_node = 1 if hw.kind == "cpu" else hw.devices_per_node
    if per_node < 1 or n_nodes < 1:
        raise ConfigError(f"hardware count and nodes must be >= 1 (got {per_node} x {n_nodes} nodes)")
    if hw.kind == "cpu" and hw.cores and per_node > hw.cores:
        raise ConfigError(f"{per_node} ranks per node but this CPU has {hw.cores} cores: ranks would share cores")
    if name == "auto" and hw.kind == "cpu" and per_node * n_nodes > 1:
        hw = replace(hw, allocator=allocator.torchrun_worker_name())  # torchrun's workers: not re-executed
        hw = with_communication(hw)
    return Cluster(hw, per_node, n_nodes)
