"""Plan search, time model and cost: only fitting plans, ranked by throughput, runnable when emitted."""

import dataclasses
import importlib.util

import pytest

from scaletrain.config import ConfigError, ModelConfig, build, load_config
from scaletrain.hardware.catalog import CATALOG, LINKS, Cluster
from scaletrain.model.presets import PRESETS
from scaletrain.plan.cost import PRICES, load_prices, training_cost
from scaletrain.plan.emit import write_config
from scaletrain.plan.hardware_spec import parse_hardware
from scaletrain.plan.memory import memory_breakdown
from scaletrain.plan.search import enumerate_plans, search, what_would_fit
from scaletrain.plan.timing import (
    Unit,
    communication,
    gpu_utilisation,
    group_link,
    overlap_exposed,
    recomputed_share,
    step_time,
)
from scaletrain.plan.workload import Plan, Workload, check_plan, job_config, plan_run_dir
from scaletrain.train.validate import check_runnable

# A made-up but self-consistent CPU calibration, so these tests neither measure nor depend on the machine.
CALIBRATION = {
    "matmul_flops_fp32": 1e11, "gemm_curve": [[64, 5e10, 4e10], [2048, 1e11, 9e10]], "op_overhead_s": 2e-6,
    "attention_curve": {"64": [[64, 4e10, 4e10], [1024, 6e10, 6e10]]}, "cross_entropy_curve": [[256, 1e-9]],
    "optimizer_curve": [[1e5, 2e-9], [1e7, 4e-9]], "elementwise_s_per_element": 1e-9, "block_ops": 200,
    "allreduce_busbw": 1e9,
}
CPU = dataclasses.replace(CATALOG["cpu"], calibration=CALIBRATION, memory_bytes=8 * 2**30)


def gpt2(batch=512, tokens=2.5e9, precision="bf16"):
    return Workload(build(ModelConfig, {"preset": "gpt2-124m"}, presets=PRESETS), 1024, batch, tokens, precision)


def test_search_returns_only_fitting_plans_fastest_first():
    cluster = parse_hardware("a100-40gb:8")
    # some large micro-batches do not fit in 40 GB (at batch 512 the chunked loss lets all of them fit)
    result = search(gpt2(batch=2048), cluster)
    assert result.ranked and result.rejected
    for c in result.ranked:
        assert c.fits and c.memory.total <= cluster.hardware.memory_bytes
    for c in result.rejected:
        assert c.memory.total > cluster.hardware.memory_bytes and "short by" in c.reason
    speeds = [c.time.tokens_per_second for c in result.ranked]
    # fastest first, to the search's 1% tie resolution
    assert all(b <= a / 0.99 for a, b in zip(speeds, speeds[1:]))
    assert speeds[0] >= max(speeds) * 0.99


def _preset_workload(name: str) -> Workload:
    model = build(ModelConfig, {"preset": name, "vocab_size": PRESETS[name].get("vocab_size") or 50304},
                  presets=PRESETS)
    return Workload(model, min(1024, model.max_seq_len), 64, 1e9, "bf16")


# The mixture-of-experts presets are refused by the search (tests/model/test_moe.py) until the planner models them.
@pytest.mark.parametrize("preset", sorted(p for p in PRESETS if not PRESETS[p].get("moe_experts")))
def test_every_plan_the_search_returns_passes_the_trainers_checks(tmp_path, preset):
    # The search's candidates (fitting and too big alike) as the job `plan --emit` writes, judged by the
    # trainer's own entry check: none may be a job the trainer refuses. Every 8th (and the top) also makes
    # the round trip through the TOML file the user gets.
    w = _preset_workload(preset)
    for spec in ("cpu:1", "cpu:2", "h100-sxm:1", "h100-sxm:8", "h100-sxm:8x2"):
        cluster = parse_hardware(spec)
        result = search(w, cluster)
        candidates = result.ranked + result.rejected
        assert candidates, (preset, spec)
        kind = cluster.hardware.kind
        for i, c in enumerate(candidates):
            job = job_config(w, c.plan, kind)
            if i % 8 == 0:
                job = load_config(write_config(tmp_path / f"{spec.replace(':', '_')}-{i}.toml", w, c.plan, kind))
            check_runnable(job, cluster.world_size, job.train.device, job.train.precision)
            assert job.train.batch_size * job.train.grad_accum_steps * c.plan.dp == w.global_batch


def test_search_respects_the_trainers_refusals():
    # The rules the planner once re-stated and let drift: tp with tied embeddings (gpt2-124m), DDP with
    # tp/cp, pipeline stages that do not divide n_layers. Each refused plan names the trainer's reason.
    plans = enumerate_plans(gpt2(), parse_hardware("h100-sxm:8x2"))
    assert plans and {p.tp for p in plans} == {1} and {p.pp for p in plans} == {1}  # tied embeddings
    with pytest.raises(ConfigError, match="tie_embeddings is not supported with parallel.tp"):
        check_plan(gpt2(), Plan(tp=2, dp_shard=8, zero_stage=3), 16, "gpu")
    llama = _preset_workload("llama-8b")
    plans = enumerate_plans(llama, parse_hardware("h100-sxm:8x2"))
    assert {p.tp for p in plans} >= {1, 2, 4, 8} and {p.pp for p in plans} >= {1, 2, 4}
    assert not any(p.dp_replicate > 1 and p.dp_shard == 1 and (p.tp > 1 or p.cp > 1) for p in plans)
    assert all(32 % p.pp == 0 for p in plans)
    with pytest.raises(ConfigError, match="DDP .* cannot wrap tensor"):
        check_plan(llama, Plan(dp_replicate=8, tp=2), 16, "gpu")
    with pytest.raises(ConfigError, match=r"n_layers \(32\) must be divisible by the pipeline stages"):
        check_plan(llama, Plan(pp=3, pp_microbatches=4), 3, "gpu")


def test_pinned_impossible_degree_is_rejected_with_the_reason():
    with pytest.raises(ConfigError, match=r"model.n_heads \(12\) must be divisible by parallel.tp \(5\)"):
        search(gpt2(), parse_hardware("h100-sxm:5"), {"tp": 5})
    with pytest.raises(ConfigError, match="not supported on this device"):
        check_plan(gpt2(), Plan(cp=2, dp_shard=1), 2, "cpu")
    with pytest.raises(ConfigError, match="must be divisible by the pipeline stages"):
        check_plan(gpt2(), Plan(pp=16), 16, "gpu")


def test_what_would_fit_names_a_knob():
    cluster = parse_hardware("rtx-4090:1")
    w = gpt2(batch=64)
    plan = Plan(micro_batch=64)
    assert memory_breakdown(w, plan).total > cluster.hardware.memory_bytes
    advice = what_would_fit(w, plan, cluster)
    assert "would fit" in advice


def test_emitted_config_loads_and_runs_the_plan(tmp_path):
    w = gpt2()
    best = search(w, parse_hardware("h100-sxm:8")).ranked[0]
    path = write_config(tmp_path / "job.toml", w, best.plan, "gpu", header="test")
    job = load_config(path)
    assert job.parallel.dp_shard == best.plan.dp_shard and job.parallel.tp == best.plan.tp
    assert job.parallel.zero_stage == best.plan.zero_stage
    assert job.train.batch_size * job.train.grad_accum_steps * best.plan.dp == w.global_batch
    assert job.model.dim == 768 and job.model.vocab_size == 50304 and job.data.seq_len == 1024
    # its own run folder, named after the plan: running it never writes into runs/default
    assert job.train.run_dir == plan_run_dir(best.plan) == "runs/plan-" + best.plan.label().replace(" ", "-")


def test_gpu_compute_bound_step_runs_at_the_stated_utilisation():
    cluster = parse_hardware("h100-sxm:1")
    w = dataclasses.replace(gpt2(batch=64), loss_chunk_rows=0)  # the whole logits at once
    t = step_time(w, Plan(micro_batch=16), cluster)
    assert t.comm_total == 0
    stated = gpu_utilisation(cluster.hardware, w.model, w.seq_len)
    assert t.mfu == pytest.approx(stated, rel=0.02)  # the optimizer is the 2% left
    # the chunked loss (the default) recomputes the head's forward GEMM in its backward: FLOPs the model-FLOPs
    # convention does not count, so the same step shows a lower MFU by that share
    chunked = step_time(dataclasses.replace(w, loss_chunk_rows=-1), Plan(micro_batch=16), cluster)
    recompute = 2.0 * w.model.vocab_size * w.model.dim / w.flops_per_token
    assert chunked.mfu == pytest.approx(t.mfu / (1 + recompute), rel=0.01)


def test_gpu_utilisation_grows_with_width_and_falls_with_attention_share():
    """The fitted utilisation (benchmarks/gpu_utilisation.py): the GEMMs approach the ceiling as the model
    widens; attention runs at its own fraction of it, so longer sequences move the mix towards that."""
    for name in ("h100-sxm", "a100-80gb"):
        hw = CATALOG[name]
        widths = [hw.utilisation_at(d, 0.0) for d in (256, 768, 2048, 8192)]
        assert widths == sorted(widths) and widths[-1] < hw.utilisation
        assert hw.utilisation_at(10**9, 0.0) == pytest.approx(hw.utilisation, rel=1e-6)
        assert hw.utilisation_at(4096, 1.0) == pytest.approx(hw.utilisation * hw.attention_utilisation)
        short, long = (gpu_utilisation(hw, gpt2().model, t) for t in (512, 32768))
        assert (long < short) == (hw.attention_utilisation < hw.utilisation_at(768, 0.0) / hw.utilisation)
    # a kind without published runs keeps one constant
    assert CATALOG["l40s"].utilisation_at(256, 0.5) == CATALOG["l40s"].utilisation


def test_catalog_utilisation_is_the_published_fit():
    """The catalog carries the fit that benchmarks/results/gpu_utilisation.json reports, and the fit beats the
    old constant on the runs it was not fitted to."""
    import json
    from pathlib import Path

    result = json.loads((Path(__file__).parents[2] / "benchmarks/results/gpu_utilisation.json").read_text())
    for family, fit in result["fitted"].items():
        hw = CATALOG[fit["fitted_on"][0]]
        assert hw.utilisation == pytest.approx(fit["ceiling"], rel=0.01)
        assert hw.utilisation_half_width == pytest.approx(fit["half_width"], rel=0.01)
        assert hw.attention_utilisation == pytest.approx(fit["attention"], rel=0.01)
    for group, errors in result["errors"].items():
        assert errors["after"]["median_abs_error"] < errors["before"]["median_abs_error"], group


def test_recomputation_costs_what_checkpoint_recomputes_of_the_forward():
    cluster = parse_hardware("h100-sxm:1")
    w = dataclasses.replace(gpt2(batch=16), loss_chunk_rows=0)
    none = step_time(w, Plan(micro_batch=16), cluster).compute
    full = step_time(w, Plan(micro_batch=16, activation_checkpointing="full"), cluster).compute
    blocks = 1 - 6.0 * w.model.vocab_size * w.model.dim / w.flops_per_token  # the head is not recomputed
    assert full / none == pytest.approx(1 + blocks / 3 * recomputed_share(w.model, w.seq_len), rel=1e-3)
    assert 1.15 < full / none < 1 + blocks / 3  # not the blocks' whole forward again


def test_recompute_charges_what_checkpoint_recomputes():
    """torch.utils.checkpoint (non-reentrant, early stop) on scaletrain's block recomputes its forward's GEMMs
    but the last (w2: nothing the backward saved comes after it) and its attention: counted with a dispatch
    mode, the recomputed FLOPs over the forward's are the planner's ``recomputed_share``."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.checkpoint import checkpoint

    from scaletrain.model.decoder import TransformerBlock, rope_tables

    class Flops(TorchDispatchMode):
        total = 0.0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket is torch.ops.aten.mm:
                (m, k), (_, n) = args[0].shape, args[1].shape
                self.total += 2.0 * m * n * k
            elif "scaled_dot_product" in str(func) and "backward" not in str(func):
                b, h, t, hd = args[0].shape
                self.total += 4.0 * b * h * t * t * hd  # QK^T and AV, causal not halved (flops_per_token)
            return func(*args, **(kwargs or {}))

    cfg = ModelConfig(dim=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn_hidden_dim=96, vocab_size=16, max_seq_len=8)
    block, (cos, sin) = TransformerBlock(cfg), rope_tables(16, 8, 10000.0)
    x = torch.randn(2, 8, 64, requires_grad=True)

    def flops(run) -> float:
        with Flops() as mode:
            run()
        return mode.total

    forward = flops(lambda: block(x, cos, sin))
    plain, checkpointed = block(x, cos, sin), checkpoint(block, x, cos, sin, use_reentrant=False)
    recomputed = flops(lambda: checkpointed.sum().backward()) - flops(lambda: plain.sum().backward())
    assert recomputed / forward == pytest.approx(recomputed_share(cfg, 8), rel=1e-9)
    assert recomputed < forward


def test_overlap_exposes_only_the_ends_when_compute_covers_each_gather():
    """FSDP2's prefetch: each unit's all-gather runs during the previous unit's compute. Compute longer than the
    gathers exposes the first gather (nothing to hide it) and the last reduce (issued as the last compute ends)."""
    units = [Unit(gather=0.1, compute=1.0, reduce=0.2) for _ in range(4)]
    assert overlap_exposed(units) == pytest.approx(0.1 + 0.2)
    # a gather longer than the compute before it exposes the difference, unit after unit
    slow = [Unit(gather=1.5, compute=1.0) for _ in range(4)]
    assert overlap_exposed(slow) == pytest.approx(1.5 + 3 * 0.5)
    # reduces share the link with the gathers; HSDP's all-reduce across replicas has its own, after the reduce
    hsdp = [Unit(gather=0.0, compute=1.0, reduce=0.2, replicate=0.3)]
    assert overlap_exposed(hsdp) == pytest.approx(0.5)


def test_multi_node_groups_use_one_nic_per_rank_on_each_node():
    """NCCL puts one ring on each InfiniBand rail: an FSDP group over whole nodes moves its cross-node share over
    all 8 ports of a node (no faster than NVLink); HSDP's replicas (one rank a node) over one port; a node's shared
    Ethernet port counts once."""
    cluster = parse_hardware("h100-sxm:8x4")
    ib, nvlink = LINKS["ib-ndr"], LINKS["nvlink4"]
    assert group_link(cluster, 32, 1)[0] == pytest.approx(min(8 * ib.bandwidth * ib.efficiency,
                                                              nvlink.bandwidth * nvlink.efficiency))
    assert group_link(cluster, 4, 8)[0] == pytest.approx(ib.bandwidth * ib.efficiency)
    assert group_link(cluster, 16, 2)[0] == pytest.approx(4 * ib.bandwidth * ib.efficiency)
    eth = LINKS["eth-100g"]
    assert group_link(parse_hardware("l40s:8x2"), 16, 1)[0] == pytest.approx(eth.bandwidth * eth.efficiency)


def test_gpu_fsdp_hides_its_collectives_behind_compute_but_the_ends():
    """MPT-13B-like on 4 H100 nodes, the shape of llm-foundry's multi-node rows: the per-unit gathers and
    reduce-scatters run under compute, so the step is within a few percent of one node's, not the whole
    volume over one InfiniBand port (what the planner used to charge: 3x the step)."""
    cfg = ModelConfig(dim=5120, n_layers=40, n_heads=40, ffn_hidden_dim=13653, vocab_size=50368, max_seq_len=2048)
    one = step_time(Workload(cfg, 2048, 16, 1e9, "bf16"), Plan(dp_shard=8, zero_stage=3, micro_batch=2),
                    parse_hardware("h100-sxm:8"))
    four = step_time(Workload(cfg, 2048, 64, 1e9, "bf16"), Plan(dp_shard=32, zero_stage=3, micro_batch=2),
                     parse_hardware("h100-sxm:8x4"))
    assert four.comm_total > 5 * four.comm_exposed  # most of it hidden
    assert 0 < four.comm_exposed < 0.05 * four.step
    assert four.step == pytest.approx(one.step, rel=0.05)
    # DDP on a GPU: the buckets all-reduce during the backward; what is left is the last bucket
    ddp = step_time(gpt2(batch=64), Plan(dp_replicate=8, micro_batch=8), parse_hardware("h100-sxm:8"))
    assert 0 < ddp.comm_exposed < 0.5 * ddp.comm_total  # the tied embedding's bucket, ready last, stays exposed


def test_ddp_allreduce_volume_is_the_ring_formula():
    w = gpt2(batch=64, precision="fp32")
    cluster = Cluster(CPU, 2, 1)
    comm, exposed = communication(w, Plan(dp_replicate=2, micro_batch=32), cluster, compute=1.0)
    grads_bytes = w.params * 4
    assert comm["dp"] == pytest.approx(2 * (2 - 1) / 2 * grads_bytes / CALIBRATION["allreduce_busbw"])
    assert exposed == comm["dp"]  # gloo on shared CPU cores: nothing overlaps


def test_cpu_tensor_parallel_pays_the_measured_overhead_per_block_and_per_model():
    # doctor's tiny-TP-model measurement replaces the per-op guess: per micro-batch, each block pays its
    # bytes over the link plus the measured per-block cost, and the model (head, loss) its own once.
    cfg = ModelConfig(dim=256, n_layers=4, n_heads=4, ffn_hidden_dim=688, vocab_size=2048, max_seq_len=512)
    w = Workload(cfg, 128, 8, 1e6, "fp32")
    tp_cost = {"sequence_parallel": {"per_block_s": 0.02, "per_model_s": 0.005},
               "replicated": {"per_block_s": 0.01, "per_model_s": 0.003}}
    cluster = Cluster(dataclasses.replace(CPU, calibration={**CALIBRATION, "tp_overhead": tp_cost}), 2, 1)
    act_bytes = 4 * 128 * 256 * 4  # micro-batch 4 x 128 tokens x dim, fp32
    for sp, key in ((True, "sequence_parallel"), (False, "replicated")):
        comm, exposed = communication(w, Plan(tp=2, micro_batch=4, sequence_parallel=sp), cluster, compute=1.0)
        per_block = 4 * 2 * (2 - 1) / 2 * act_bytes / CALIBRATION["allreduce_busbw"] + tp_cost[key]["per_block_s"]
        assert comm["tp"] == pytest.approx(2 * (4 * per_block + tp_cost[key]["per_model_s"]))  # 2 micro-batches
        assert exposed == comm["tp"]


def test_cpu_time_grows_with_tokens_and_recompute():
    cfg = ModelConfig(dim=128, n_layers=4, n_heads=2, ffn_hidden_dim=344, vocab_size=256, max_seq_len=256)
    cluster = Cluster(CPU, 1, 1)
    w = Workload(cfg, 128, 8, 1e6)
    small = step_time(w, Plan(micro_batch=4), cluster).step
    large = step_time(Workload(cfg, 128, 16, 1e6), Plan(micro_batch=16), cluster).step
    ac = step_time(w, Plan(micro_batch=4, activation_checkpointing="full"), cluster).step
    assert large > small and ac > small


def test_cost_is_device_hours_times_price():
    prices, as_of = load_prices()
    cost = training_cost("h100-sxm", 8, 3600.0, prices, as_of)
    assert cost.device_hours == 8
    assert cost.on_demand_usd == pytest.approx(8 * PRICES["h100-sxm"]["on_demand"])
    assert cost.spot_usd < cost.on_demand_usd and as_of


def test_price_table_override(tmp_path):
    path = tmp_path / "prices.toml"
    path.write_text('as_of = "2030-01"\n[h100-sxm]\non_demand = 1.0\nspot = 0.5\n')
    prices, as_of = load_prices(str(path))
    assert as_of == "2030-01" and prices["h100-sxm"]["on_demand"] == 1.0
    path.write_text("[h100-sxm]\nspot = 0.5\n")
    with pytest.raises(ConfigError, match="on_demand"):
        load_prices(str(path))


def test_unknown_hardware_lists_the_catalog():
    with pytest.raises(ConfigError) as err:
        parse_hardware("tpu-v5")
    for name in ("h100-sxm", "h100-pcie", "h200", "a100-40gb", "a100-80gb", "l40s", "rtx-4090", "cpu"):
        assert name in str(err.value)


def test_hardware_spec_forms():
    assert parse_hardware("h100-sxm").world_size == 8
    assert parse_hardware("h100-sxm:4").world_size == 4
    c = parse_hardware("a100-80gb:8x4")
    assert (c.devices_per_node, c.nodes, c.world_size) == (8, 4, 32)


def test_every_catalog_value_has_a_source():
    for hw in CATALOG.values():
        assert hw.source and hw.utilisation_source and hw.peak_flops["bf16"] > 0
        assert hw.memory_bytes > 0 and hw.memory_bandwidth > 0


def test_ties_within_one_percent_go_to_the_simpler_plan():
    """Two plans predicted within 1% of each other rank by simplicity: DDP before ZeRO-1 (which adds a
    broadcast of every parameter tensor after the step for a tiny predicted gain)."""
    from scaletrain.plan.search import rank

    class T:
        def __init__(self, tps):
            self.tokens_per_second = tps

    class M:
        total = 1.0

    class C:
        def __init__(self, tps, zero_stage):
            self.time, self.memory = T(tps), M()
            self.plan = Plan(dp_replicate=2, zero_stage=zero_stage)

    ddp, zero1 = C(4330.0, 0), C(4339.0, 1)  # ZeRO-1 predicted 0.2% faster
    assert rank([zero1, ddp])[0] is ddp
    assert rank([C(4500.0, 1), ddp])[0].plan.zero_stage == 1  # 4% faster wins
    assert [c.time.tokens_per_second for c in rank([C(100.0, 0), C(200.0, 0), C(150.0, 0)])] == [200, 150, 100]


def test_ranks_sharing_a_host_pay_the_measured_contention():
    """doctor's ``corun_slowdown`` (ranks running together vs alone on one host) scales every rank's compute
    and optimizer time when more than one rank shares the host; one rank per host never pays it."""
    from scaletrain.plan.timing import cpu_micro_seconds

    w = Workload(build(ModelConfig, {"preset": "micro", "vocab_size": 2048}, presets=PRESETS), 128, 8, 1e6, "fp32")
    contended = dataclasses.replace(CPU, calibration={**CALIBRATION, "corun_slowdown": 1.25, "threads": 1}, cores=2)
    quiet = dataclasses.replace(contended, calibration={**contended.calibration, "corun_slowdown": 1.0})
    plan = Plan(dp_replicate=2, micro_batch=4)
    (a, opt_a), (b, opt_b) = (cpu_micro_seconds(w, plan, Cluster(hw, 2, 1)) for hw in (contended, quiet))
    assert opt_a == pytest.approx(1.25 * opt_b)
    assert b < a < 1.25 * b  # dispatch overhead is not scaled
    one = Plan(micro_batch=4)
    assert cpu_micro_seconds(w, one, Cluster(contended, 1, 1)) == cpu_micro_seconds(w, one, Cluster(quiet, 1, 1))


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed")
def test_deepspeed_engine_plans_ranked_with_native_ones_and_emitted_runnable(tmp_path):
    """--engine all: an 8B full training on one 24 GB card fits only on the DeepSpeed engine with ZeRO-3 and the
    optimizer state and parameters offloaded (CPU memory fastest, NVMe slower by its bandwidth); its emitted job
    passes the trainer's check. Where native plans fit too, both engines are ranked in one list."""
    llama8b = Workload(build(ModelConfig, {"preset": "llama-8b"}, presets=PRESETS), 2048, 8, 1e8, "bf16")
    card = parse_hardware("rtx-4090:1")
    assert not search(llama8b, card).ranked  # the native engine alone: nothing fits
    both = search(llama8b, card, {"engine": "all"})
    assert both.ranked and {(c.plan.engine, c.plan.zero_stage) for c in both.ranked} == {("deepspeed", 3)}
    assert [c.plan.offload for c in both.ranked if c.plan.micro_batch == 1] == ["cpu", "nvme"]
    best = both.ranked[0]
    assert best.memory.offloaded == pytest.approx(llama8b.params * (2 + 2 + 4 + 8))  # bf16 params, grads; master, m, v
    assert best.time.optimizer < both.ranked[1].time.optimizer  # NVMe: 12 bytes/param read + written each step
    cfg = load_config(write_config(tmp_path / "job.toml", llama8b, best.plan, "gpu"))
    assert (cfg.parallel.engine, cfg.parallel.zero_stage, cfg.deepspeed.offload_optimizer,
            cfg.deepspeed.offload_param) == ("deepspeed", 3, "cpu", "cpu")
    check_runnable(cfg, 1, "cuda", cfg.train.precision)
    small = search(gpt2(batch=64), parse_hardware("a100-40gb:2"), {"engine": "all"})
    engines = [c.plan.engine for c in small.ranked]
    assert "native" in engines and "deepspeed" in engines
