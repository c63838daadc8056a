"""``scaletrain doctor``: what this machine is, and how fast it really is (the planner's calibration).

Run plainly for the compute and memory rates; run under ``torchrun --nproc-per-node N`` to add the
all-reduce bus bandwidth between those N ranks (gloo on CPU, NCCL on GPU).
"""

from __future__ import annotations

import os
import platform
import shutil
import time

import torch

from scaletrain.hardware.peak import (
    CLOCKS,
    calibration_path,
    comm_fingerprint,
    cpu_name,
    load_calibration,
    save_calibration,
)
from scaletrain.plan import calibration


def system_info() -> dict:
    """CPU, RAM, disk, GPUs (name, memory, driver, NVLink via nvidia-ml-py when installed), versions."""
    info = {
        "cpu": cpu_name(), "cpu_cores": os.cpu_count(),
        "cpu_cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "ram_bytes": calibration.total_ram_bytes(), "disk_free_bytes": shutil.disk_usage(os.getcwd()).free,
        "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "torch_threads": torch.get_num_threads(), "gpus": [],
    }
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            info["gpus"].append({"name": props.name, "memory_bytes": props.total_memory,
                                 "capability": f"{props.major}.{props.minor}"})
        info.update(_nvml())
    return info


def _nvml() -> dict:
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return {"nvml": "nvidia-ml-py not installed (pip install nvidia-ml-py for driver and NVLink details)"}
    pynvml.nvmlInit()
    try:
        out = {"driver": pynvml.nvmlSystemGetDriverVersion(), "nvlink_links": []}
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            active = 0
            for link in range(18):  # NVML_NVLINK_MAX_LINKS on Hopper
                try:
                    active += pynvml.nvmlDeviceGetNvLinkState(handle, link) == 1
                except pynvml.NVMLError:
                    break
            out["nvlink_links"].append(active)
        return out
    finally:
        pynvml.nvmlShutdown()


def measure_allreduce_busbw(n_bytes: int = 1 << 25, reps: int = 5) -> float:
    """All-reduce bus bandwidth (bytes/s, nccl-tests' definition 2(n-1)/n * size / time) of the initialised
    default process group."""
    import torch.distributed as dist

    world = dist.get_world_size()
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    x = torch.ones(n_bytes // 4, device=device)
    dist.all_reduce(x)  # warm-up: connection setup
    best = float("inf")
    for _ in range(reps):
        dist.barrier()
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * (world - 1) / world * n_bytes / best


def measure_allreduce_latency(reps: int = 50) -> float:
    """Seconds of a 4-byte all-reduce (best of ``reps``): the fixed cost every collective pays."""
    import torch.distributed as dist

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    x = torch.ones(1, device=device)
    dist.all_reduce(x)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        dist.all_reduce(x)
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_dtensor_overhead(reps: int = 200) -> float:
    """Extra host seconds per op on a (replicated) DTensor over a plain tensor: tensor parallelism pays it
    on every op of a block (sharding propagation runs in Python)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    plain = torch.ones(8, device=device)
    dtensor = distribute_tensor(plain, mesh, [Replicate()])

    def per_op(x) -> float:
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(reps):
                x = x * 1.0
            best = min(best, (time.perf_counter() - t0) / reps)
        return best

    return max(0.0, per_op(dtensor) - per_op(plain))


# The reference model the tensor-parallel overhead is measured on (the elementwise calibration's reference
# block shape: dim 384, 6 heads, SwiGLU 1024, T=192; one sequence) -- not one of the accuracy benchmark's rows.
TP_PROBE_MODEL = calibration.REFERENCE_SHAPE
TP_PROBE_LAYERS = (1, 3)
# FSDP2's third reference model (1 block, this vocabulary): a root unit of 12.6M parameters (50 MB in fp32), beyond
# glibc's mmap threshold as a real model's root is, where the reference's 0.4M stays below it (measured: a d384
# ZeRO-3 step with a 16,384-row vocabulary ran 106 ms beyond its plan, with 512 rows 4 ms).
FSDP_PROBE_VOCAB = 16384
# Keys that hold a measured layout overhead: left out when measuring one (it is what remains beyond the rest).
OVERHEAD_KEYS = ("tp_overhead", "fsdp_overhead", "dtensor_op_overhead_s")


def measure_corun_slowdown(clock: str = "wall", reps: int = 7) -> float:
    """How much slower a training block runs when every rank of this host runs it at once than when each
    runs it alone (median over ``reps`` of each, side by side; the slowest rank's ratio, at least 1).

    Ranks on one host share its memory bandwidth and caches, which the single-process calibration cannot
    see: without this the planner under-predicted 2-rank steps on this machine by 10-23%. The block is the
    elementwise calibration's reference block (``calibration.reference_block_step``) at batch 4.
    """
    import statistics

    import torch.distributed as dist

    _, fwd_bwd = calibration.reference_block_step(4)
    timer = CLOCKS[clock]

    def timed() -> float:
        t0 = timer()
        fwd_bwd()
        return timer() - t0

    timed()  # warm-up
    rank, world = dist.get_rank(), dist.get_world_size()
    alone, together = [], []
    for _ in range(reps):
        for r in range(world):  # one rank at a time; the others block in the barrier (no spinning)
            dist.barrier()
            if rank == r:
                alone.append(timed())
        dist.barrier()
        together.append(timed())
    ratio = torch.tensor([statistics.median(together) / statistics.median(alone)], dtype=torch.float64)
    dist.all_reduce(ratio, op=dist.ReduceOp.MAX)
    return max(1.0, float(ratio))


def measure_tp_overhead(entry: dict, clock: str = "wall", reps: int = 7) -> dict:
    """Seconds tensor parallelism adds to one micro-batch's forward + backward beyond its sharded compute and
    its bytes, per block and per model (embedding, final norm, vocabulary-parallel head and loss), for ``tp`` =
    the world size, with and without sequence parallelism:
    ``{"sequence_parallel"|"replicated": {"per_block_s", "per_model_s"}}``.

    What remains is DTensor sharding propagation on every op, redistributions and the collectives' fixed
    cost; measured by ``layout_overhead``."""
    import torch.distributed as dist

    from scaletrain.config import ParallelConfig
    from scaletrain.plan.workload import Plan

    world = dist.get_world_size()
    return {("sequence_parallel" if sp else "replicated"): layout_overhead(
        entry, ParallelConfig(tp=world, sequence_parallel=sp), Plan(tp=world, micro_batch=1, sequence_parallel=sp),
        clock, reps) for sp in (True, False)}


def measure_fsdp_overhead(entry: dict, clock: str = "wall", reps: int = 7) -> dict:
    """Seconds FSDP2 (ZeRO-3, ``dp_shard`` = the world size) adds to one micro-batch's forward + backward
    beyond its compute, its all-gathers' and reduce-scatters' bytes and their fixed cost:
    ``{"per_block_s", "per_model_s", "per_param_s"}`` (per sharded unit: each block, and the embedding/head
    root; and per parameter of the units whose buffers glibc maps afresh at every collective).

    On a CPU this is the host's work around each collective -- the copy-in into and copy-out of the flat
    all-gather buffer, the pre/post hooks, DTensor's parameter swaps -- which runs on the same core as the
    compute and hides behind nothing. Without it the planner under-predicted a 2-rank ZeRO-3 step on this
    machine by 16% (benchmarks/results/planner_two_rank_quiet.json). A unit whose fp32 buffers pass glibc's mmap
    threshold (32 MiB: a 16,384-row vocabulary's root at d384) gets fresh pages from the kernel at every gather
    and reduce-scatter, page-faulted and zeroed: 312 MiB of minor faults a forward + backward of that d384 ZeRO-3
    model against 7 MiB with 512 rows, 106 ms of its step that the reference root (0.4M parameters, below the
    threshold) did not show; hence ``per_param_s``, measured on such a root."""
    import torch.distributed as dist

    from scaletrain.config import ParallelConfig
    from scaletrain.plan.workload import Plan

    world = dist.get_world_size()
    return layout_overhead(entry, ParallelConfig(dp_shard=world, zero_stage=3),
                           Plan(dp_shard=world, zero_stage=3, micro_batch=1), clock, reps, per_param=True)


def layout_overhead(entry: dict, pcfg, plan, clock: str = "wall", reps: int = 7, per_param: bool = False) -> dict:
    """The host seconds a parallel layout adds per block and per model: ``{"per_block_s", "per_model_s"}``, and
    with ``per_param`` per parameter of the FSDP units beyond glibc's mmap threshold (``"per_param_s"``).

    A reference Llama of 1 and of 3 blocks runs one micro-batch's forward + loss + backward through
    ``scaletrain.parallel.parallelize`` in the layout ``pcfg``; from each time (best of ``reps``, slowest rank)
    the CPU time model subtracts what it already charges ``plan`` -- the GEMMs, attention, elementwise work and
    dispatch from this machine's single-process calibration ``entry``, and the collectives' bytes over the
    measured all-reduce bandwidth plus their fixed cost (``timing.communication`` without a measured overhead).
    The rest split by the number of blocks: slope = per block, intercept = per model. The same method as the
    elementwise calibration (measured block minus what the curves predict). ``per_param``: a third reference model,
    of 1 block and a ``FSDP_PROBE_VOCAB``-row vocabulary, whose root unit is beyond glibc's mmap threshold: what it
    adds over the first, per parameter of such units (``timing.fresh_mapped_params``)."""
    import torch.distributed as dist

    from scaletrain.config import JobConfig, ModelConfig, TrainConfig
    from scaletrain.hardware.catalog import CATALOG, Cluster, with_calibration
    from scaletrain.parallel import ParallelDims
    from scaletrain.plan.timing import communication, cpu_micro_seconds, fresh_mapped_params
    from scaletrain.plan.workload import Workload
    from scaletrain.train.loss import forward_backward
    from scaletrain.train.step import build_parallel_training

    timer = CLOCKS[clock]
    world = dist.get_world_size()
    bare = {k: v for k, v in entry.items() if k not in OVERHEAD_KEYS}  # charge the collectives' bytes only
    cluster = Cluster(with_calibration(CATALOG["cpu"], bare), world, 1)
    seq = TP_PROBE_MODEL["max_seq_len"]

    def best(fn) -> float:
        return _slowest_rank_best(fn, timer, reps)

    shapes = [(layers, TP_PROBE_MODEL["vocab_size"]) for layers in TP_PROBE_LAYERS]
    shapes += [(TP_PROBE_LAYERS[0], FSDP_PROBE_VOCAB)] if per_param else []
    extra = []
    for layers, vocab in shapes:
        cfg = ModelConfig(n_layers=layers, **{**TP_PROBE_MODEL, "vocab_size": vocab})
        inputs = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(0))
        dims = ParallelDims.from_config(pcfg, world)
        pm, _ = build_parallel_training(JobConfig(model=cfg, parallel=pcfg, train=TrainConfig(seed=0)), dims,
                                        torch.device("cpu"))

        def step():  # one micro-batch's forward + backward: what the time model charges the overhead to
            forward_backward(pm, inputs, inputs, accum=1, sync=True)
            for p in pm.parameters():
                p.grad = None

        workload = Workload(cfg, seq, plan.dp, 1e6, "fp32")
        compute, _ = cpu_micro_seconds(workload, plan, cluster)
        comm, _ = communication(workload, plan, cluster, compute)
        extra.append(best(step) - compute - sum(comm.values()))
    lo, hi = TP_PROBE_LAYERS
    per_block = max(0.0, (extra[1] - extra[0]) / (hi - lo))
    out = {"per_block_s": per_block, "per_model_s": max(0.0, extra[0] - lo * per_block)}
    if per_param:  # the same blocks, a root unit beyond glibc's mmap threshold: what its fresh mappings cost
        big = fresh_mapped_params(ModelConfig(n_layers=lo, **{**TP_PROBE_MODEL, "vocab_size": FSDP_PROBE_VOCAB}), plan)
        small = fresh_mapped_params(ModelConfig(n_layers=lo, **TP_PROBE_MODEL), plan)
        out["per_param_s"] = max(0.0, (extra[2] - extra[0]) / (big - small))
    return out


# The optimizer-step probe's reference Llamas, (blocks, vocabulary) of the elementwise calibration's block shape:
# more blocks add parameter tensors and elements together, a bigger vocabulary adds elements alone (the embedding
# and the head), so the two costs separate. 8192 rows keep the root unit beyond the caches, as a real model's is.
OPTIMIZER_PROBE_SHAPES = ((1, 512), (4, 512), (1, 16384), (4, 16384))


def measure_optimizer_step(clock: str = "wall", reps: int = 7) -> dict:
    """Seconds of one optimizer step as the trainer runs it -- ``clip_grad_norm_`` then AdamW (fused) -- on every
    rank at once, per parameter tensor and per element a rank updates, in each layout: ``{"plain" | "fsdp" |
    "tp": {"per_tensor_s", "per_element_s"}}`` (DDP's plain tensors, FSDP2's shards over the world size, TP over
    the world size; ``timing.optimizer_layout`` says which a plan pays).

    The single-process calibration's AdamW curve misses two things here, measured on 2 cores for the d384
    two-rank rows (benchmarks/planner_two_rank.py): on DTensors every foreach op, and the clipping's norm, pays
    sharding propagation once per tensor (TP: 59 ms a step against the 17 ms charged); and ranks stepping at once
    share the memory bandwidth this memory-bound step lives on (DDP: 31 ms against 17). Each reference Llama of
    ``OPTIMIZER_PROBE_SHAPES`` takes one forward + backward for its gradients (their placements are the
    layout's), then its step is timed (best of ``reps``, slowest rank; the gradients are kept, as the calibration
    curve keeps them); a least-squares fit over the shapes gives the two costs (non-negative)."""
    import torch.distributed as dist

    from scaletrain.config import JobConfig, ModelConfig, ParallelConfig, TrainConfig
    from scaletrain.parallel import ParallelDims
    from scaletrain.train.loss import forward_backward
    from scaletrain.train.step import build_parallel_training

    timer = CLOCKS[clock]
    world = dist.get_world_size()
    layouts = {"plain": ParallelConfig(dp_replicate=world), "fsdp": ParallelConfig(dp_shard=world, zero_stage=3),
               "tp": ParallelConfig(tp=world)}
    seq = TP_PROBE_MODEL["max_seq_len"]
    out = {}
    for name, pcfg in layouts.items():
        rows, seconds = [], []
        for layers, vocab in OPTIMIZER_PROBE_SHAPES:
            cfg = ModelConfig(n_layers=layers, **{**TP_PROBE_MODEL, "vocab_size": vocab})
            pm, optimizer = build_parallel_training(JobConfig(model=cfg, parallel=pcfg, train=TrainConfig(seed=0)),
                                                    ParallelDims.from_config(pcfg, world), torch.device("cpu"))
            inputs = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(0))
            forward_backward(pm, inputs, inputs, accum=1, sync=True)  # the gradients, in the layout's placements
            rows.append(_parameter_counts(pm))
            seconds.append(_best_optimizer_step(pm, optimizer, timer, reps))
        fit = torch.linalg.lstsq(torch.tensor(rows, dtype=torch.float64),
                                 torch.tensor(seconds, dtype=torch.float64).unsqueeze(1)).solution.squeeze(1)
        per_tensor, per_element = (max(0.0, float(v)) for v in fit)
        out[name] = {"per_tensor_s": per_tensor, "per_element_s": per_element}
    return out


def _parameter_counts(pm) -> list[float]:
    """[parameter tensors, elements this rank holds] of a parallelized model."""
    params = list(pm.parameters())
    return [float(len(params)), float(sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in params))]


def _best_optimizer_step(pm, optimizer, timer, reps: int) -> float:
    """Best of ``reps`` (slowest rank each) of the trainer's clipping + optimizer step over ``pm``'s gradients."""

    from scaletrain.parallel.parallelize import clip_grad_norm_

    params = list(pm.parameters())

    def step():
        clip_grad_norm_(params, 1.0, pm.group("pp"), foreach=True)
        optimizer.step()

    return _slowest_rank_best(step, timer, reps)  # its warm-up: the optimizer's state, DTensor's caches


def _slowest_rank_best(fn, timer, reps: int) -> float:
    """Best of ``reps`` timings of ``fn`` on every rank at once, each the slowest rank's (a step waits for it),
    after one warm-up call (DTensor's sharding-propagation caches, gloo connections, optimizer states)."""
    import torch.distributed as dist

    fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = timer()
        fn()
        elapsed = torch.tensor([timer() - t0], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(float(elapsed))
    return min(times)


def measure_machine(log=print, rounds: int = 3, clock: str = "wall") -> dict:
    """System info plus calibration; under torchrun only the all-reduce (rank 0 saves it)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        import torch.distributed as dist

        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
        try:
            busbw = measure_allreduce_busbw()
            result = {"allreduce_busbw": busbw, "allreduce_world_size": dist.get_world_size(),
                      "collective_latency_s": measure_allreduce_latency(),
                      "dtensor_op_overhead_s": measure_dtensor_overhead()}
            if backend == "gloo":  # before the TP overhead, which is measured beyond it
                result["corun_slowdown"] = measure_corun_slowdown(clock)
                result["optimizer_step"] = measure_optimizer_step(clock)  # a whole step's: needs no other rate
            # The TP overhead is what remains after the single-process rates: it needs that calibration.
            entry = calibration.calibration_entry("cpu", measure_if_missing=False) if backend == "gloo" else {}
            if "elementwise_s_per_element" in entry:
                result["tp_overhead"] = measure_tp_overhead({**entry, **result}, clock)
                result["tp_overhead_world_size"] = dist.get_world_size()
                result["fsdp_overhead"] = measure_fsdp_overhead({**entry, **result}, clock)
            elif dist.get_rank() == 0 and backend == "gloo":
                log("no single-process calibration with this thread count: run `scaletrain doctor` (same --clock) "
                    "first to measure tensor parallelism's and FSDP2's overhead")
            if dist.get_rank() == 0:
                device = "cuda" if backend == "nccl" else "cpu"
                key = comm_fingerprint(device)
                data = load_calibration()
                data[key] = {**data.get(key, {}), **result}
                save_calibration(data)
                log(f"all-reduce over {dist.get_world_size()} ranks ({backend}): bus bandwidth {busbw / 1e9:.2f} GB/s, "
                    f"latency {result['collective_latency_s'] * 1e6:.0f} us; DTensor overhead "
                    f"{result['dtensor_op_overhead_s'] * 1e6:.0f} us/op; ranks running together are "
                    f"{result.get('corun_slowdown', 1.0):.2f}x slower than alone; tensor parallelism adds "
                    + ", ".join(f"{k} {v['per_block_s'] * 1e3:.1f} ms/block + {v['per_model_s'] * 1e3:.1f} ms/model"
                                for k, v in {**result.get("tp_overhead", {}),
                                             **({"FSDP2 ZeRO-3": result["fsdp_overhead"]}
                                                if "fsdp_overhead" in result else {})}.items())
                    + " per micro-batch; the optimizer step (clipping + AdamW) costs "
                    + ", ".join(f"{k} {v['per_tensor_s'] * 1e6:.0f} us/tensor + {v['per_element_s'] * 1e9:.2f} "
                                f"ns/element" for k, v in result.get("optimizer_step", {}).items())
                    + f" ({clock} clock) -> {calibration_path()}")
            dist.barrier()
        finally:
            dist.destroy_process_group()
        return result
    info = system_info()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtypes = ("fp32", "tf32", "bf16", "fp16") if device == "cuda" else ("fp32", "bf16")
    entry = calibration.calibrate(device, dtypes=tuple(d for d in dtypes if d != "tf32"), log=log, rounds=rounds,
                                  clock=clock if device == "cpu" else "wall")
    return {"system": info, "calibration": entry, "calibration_file": str(calibration_path())}
