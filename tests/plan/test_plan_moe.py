"""The planner's mixture of experts: total vs active parameters of published shapes, memory against a real step."""

import pytest

from scaletrain.config import ConfigError, load_config
from scaletrain.model.presets import active_params, num_params

# (preset, published total, published active, in billions): the model cards / papers. gpt-oss's card counts the
# unembedding but not the input embedding among the active parameters; the others count both tables.
PUBLISHED = [("olmoe-1b-7b", 6.9, 1.3, False), ("qwen3-30b-a3b", 30.5, 3.3, False),
             ("qwen3-235b-a22b", 235.1, 22.2, False),
             ("mixtral-8x7b", 46.7, 12.9, False), ("gpt-oss-20b", 21.0, 3.6, True)]


@pytest.mark.parametrize("preset,total,active,without_input_embedding", PUBLISHED)
def test_moe_presets_have_the_published_parameter_counts(preset, total, active, without_input_embedding):
    cfg = load_config(None, {"model.preset": preset}).model
    counted = active_params(cfg) - (cfg.vocab_size * cfg.dim if without_input_embedding else 0)
    assert num_params(cfg) / 1e9 == pytest.approx(total, rel=0.02)
    assert counted / 1e9 == pytest.approx(active, rel=0.03)
    assert active_params(cfg) < num_params(cfg)


def _saved_bytes(cfg, batch: int, seq: int) -> int:
    """Bytes of the distinct storages block 0 saves for backward (parameters and buffers excluded)."""
    import torch

    from scaletrain.model.decoder import TransformerBlock, rope_tables

    block = TransformerBlock(cfg, 0)
    cos, sin = rope_tables(cfg.dim // cfg.n_heads, seq, cfg.rope_theta)
    owned = {t.untyped_storage().data_ptr() for t in [*block.parameters(), *block.buffers(), cos, sin]}
    seen: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in owned:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(torch.randn(batch, seq, cfg.dim, requires_grad=True), cos, sin)
    return sum(seen.values())


@pytest.mark.parametrize("experts,top_k,shared", [(8, 2, 0), (8, 2, 1), (16, 4, 0)])
def test_sparse_block_activations_are_what_autograd_saves(experts, top_k, shared):
    from scaletrain.config import ModelConfig
    from scaletrain.plan.memory import RECIPES, block_activation_bytes, moe_activation_bytes

    cfg = ModelConfig(dim=64, n_heads=4, ffn_hidden_dim=160, vocab_size=97, max_seq_len=32, moe_experts=experts,
                      moe_top_k=top_k, moe_hidden_dim=48, moe_shared_experts=shared)
    rec = RECIPES["fp32"]
    dense_ffn = 4 * 96 * 160 * 4  # what block_activation_bytes counts for the dense feed-forward it replaces
    predicted = block_activation_bytes(cfg, 3, 32, rec) - dense_ffn + moe_activation_bytes(cfg, 3, 32, rec)
    assert predicted == pytest.approx(_saved_bytes(cfg, 3, 32), rel=0.01)


@pytest.mark.parametrize("ac,batch,seq,precision", [("none", 4, 64, "fp32"), ("full", 4, 64, "fp32"),
                                                    ("none", 8, 64, "bf16")])
def test_moe_peak_matches_a_real_step(ac, batch, seq, precision):
    """The simulated peak of a tiny mixture of experts against exact tensor bytes of the trainer's step (forward
    .. AdamW, one process), within 10%."""
    from scaletrain.config import ModelConfig
    from scaletrain.plan.measure import resident_extras, single_process_run
    from scaletrain.plan.memory import memory_breakdown
    from scaletrain.plan.workload import Plan, Workload

    cfg = ModelConfig(dim=64, n_layers=3, n_heads=4, ffn_hidden_dim=176, vocab_size=256, max_seq_len=64,
                      moe_experts=8, moe_top_k=2, moe_hidden_dim=64)
    measured = single_process_run(cfg, batch, seq, ac, steps=1, precision=precision)["peak_bytes"]
    plan = Plan(micro_batch=batch, activation_checkpointing=ac)
    predicted = memory_breakdown(Workload(cfg, seq, batch, 1e6, precision), plan, "cpu").tensor_total + \
        resident_extras(cfg, batch, seq)
    assert predicted == pytest.approx(measured, rel=0.10)


def test_search_includes_expert_parallel_degrees(monkeypatch):
    """ep: divisors of the data-parallel ranks dividing the expert count, each plan's expert states split by it and
    its all-to-alls charged on the link its group spans. The trainer's own check stands in for the expert
    parallelism it gains on another branch (today it runs a mixture of experts in one process only)."""
    import scaletrain.plan.workload as spec
    from scaletrain.hardware.catalog import CATALOG, Cluster
    from scaletrain.plan.search import ep_degrees, search
    from scaletrain.plan.workload import Plan, Workload

    assert ep_degrees(8, 128) == [1, 2, 4, 8] and ep_degrees(6, 8) == [1, 2] and ep_degrees(8, 0) == [1]
    monkeypatch.setattr(spec, "check_runnable", lambda *args, **kwargs: None)
    cfg = load_config(None, {"model.preset": "olmoe-1b-7b"}).model
    workload = Workload(cfg, 2048, 256, 1e9, "bf16")
    cluster = Cluster(CATALOG["h100-sxm"], 8)
    found = search(workload, cluster, {"zero_stage": 2, "activation_checkpointing": "full", "micro_batch": 4})
    by_ep = {c.plan.ep: c for c in found.ranked if c.plan.dp_shard == 8}
    assert set(by_ep) == {1, 2, 4, 8}
    # ZeRO-2 keeps whole parameters: the experts' weights shrink with ep, the dense part does not
    assert by_ep[8].memory.params < by_ep[2].memory.params < by_ep[1].memory.params
    assert "ep" in by_ep[8].time.comm_detail and "ep" not in by_ep[1].time.comm_detail
    with pytest.raises(Exception, match="ep 3 must divide"):
        spec.check_plan(workload, Plan(dp_shard=8, ep=3, zero_stage=2), 8, "gpu")


def test_search_tries_every_expert_parallel_layout_the_trainer_runs():
    """The search asks the trainer's own checks: on 4 ranks it tries ep inside pipeline stages (pp 2 x dp_shard 2,
    ep 2), under HSDP (dp_replicate 2 x dp_shard 2) and with tensor parallelism (dp_shard 2 x tp 2, ep 2: the
    experts split over ep and tp), each tp layout with and without sequence parallelism (the sparse input
    all-gathered, or the tokens replicated all along), and not what the trainer refuses (a pipeline under DDP)."""
    from scaletrain.hardware.catalog import CATALOG, Cluster
    from scaletrain.plan.search import enumerate_plans
    from scaletrain.plan.workload import Workload

    cfg = load_config(None, {"model.preset": "olmoe-1b-7b"}).model
    plans = enumerate_plans(Workload(cfg, 2048, 256, 1e9, "bf16"), Cluster(CATALOG["h100-sxm"], 4),
                            {"zero_stage": 3, "activation_checkpointing": "full", "micro_batch": 4})
    layouts = {(p.dp_replicate, p.dp_shard, p.tp, p.pp, p.ep) for p in plans}
    # (dp_replicate, dp_shard, tp, pp, ep)
    assert layouts == {(1, 4, 1, 1, 1), (1, 4, 1, 1, 2), (1, 4, 1, 1, 4), (1, 2, 1, 2, 1), (1, 2, 1, 2, 2),
                       (2, 2, 1, 1, 1), (2, 2, 1, 1, 2), (1, 2, 2, 1, 1), (1, 2, 2, 1, 2)}
    assert all(p.sequence_parallel for p in plans if p.tp == 1)
    for layout in ((1, 2, 2, 1, 1), (1, 2, 2, 1, 2)):  # both tensor-parallel layouts, with and without SP
        assert {p.sequence_parallel for p in plans if (p.dp_replicate, p.dp_shard, p.tp, p.pp, p.ep) == layout} \
            == {True, False}


def test_active_flops_and_parameters_are_printed(capsys):
    from scaletrain.cli import main

    assert main(["plan", "--model.preset=nano-moe", "--model.vocab_size=256", "--hardware", "h100-sxm",
                 "--count", "1", "--tokens", "1e8"]) == 0
    out = capsys.readouterr().out
    assert "active a token (top-2 of 8 experts)" in out


def test_folded_expert_layers_keep_the_ep_group_in_the_node():
    """ep 8 x tp 2 on 8-GPU nodes: our trainer's layout (ep at stride tp) spans two nodes and its all-to-alls go over
    InfiniBand; Megatron's folding (expert-TP 1) keeps the ep group on one node's NVLink and dispatches each rank's
    sequence shard. A checkpointed block's recompute dispatches and combines again (6 all-to-alls, not 4)."""
    from scaletrain.hardware.catalog import CATALOG, Cluster
    from scaletrain.plan.timing import all_to_all_seconds, ep_group_stride, group_link
    from scaletrain.plan.workload import Plan, Workload

    cfg = load_config(None, {"model.preset": "olmoe-1b-7b"}).model
    workload = Workload(cfg, 4096, 256, 1e9, "bf16")
    cluster = Cluster(CATALOG["h100-sxm"], 8, 4)
    ours, folded = Plan(dp_shard=16, tp=2, ep=8, zero_stage=3), Plan(dp_shard=16, tp=2, ep=8, zero_stage=3,
                                                                     ep_folded=True)
    assert (ep_group_stride(ours), ep_group_stride(folded), ep_group_stride(Plan(dp_shard=8, ep=8))) == (2, 1, 1)
    assert "InfiniBand" in group_link(cluster, 8, ep_group_stride(ours))[1]
    assert "NVLink" in group_link(cluster, 8, ep_group_stride(folded))[1]
    assert "ep8 etp1" in folded.label() and "etp1" not in ours.label()
    seconds = {plan: all_to_all_seconds(workload, plan, cluster, 4 * 4096, 0.0) for plan in (ours, folded)}
    assert seconds[folded] < seconds[ours] / 2  # half the tokens, over NVLink
    recompute = Plan(dp_shard=16, tp=2, ep=8, zero_stage=3, ep_folded=True, activation_checkpointing="full")
    assert all_to_all_seconds(workload, recompute, cluster, 4 * 4096, 0.0) == pytest.approx(1.5 * seconds[folded])


def test_folded_experts_are_whole_on_a_rank_and_priced_only():
    """Folded (expert-TP 1): a rank holds E / ep whole experts, sharded by ZeRO-3 over dp x tp / ep ranks: the same
    expert states a rank as our layout's E / (ep tp) over dp / ep, twice the experts in the block FSDP gathers, and,
    without checkpointing, fewer saved activations (a rank routes its sequence shard). check_plan refuses it with
    tp > 1 (the trainer splits the experts over tp, our layout; with tp = cp = 1 the two layouts are one)."""
    from scaletrain.plan.memory import memory_breakdown, rank_block_params
    from scaletrain.plan.workload import Plan, Workload, check_plan

    cfg = load_config(None, {"model.preset": "olmoe-1b-7b"}).model
    workload = Workload(cfg, 4096, 256, 1e9, "bf16")
    ours, folded = Plan(dp_shard=16, tp=2, ep=8, zero_stage=3), Plan(dp_shard=16, tp=2, ep=8, zero_stage=3,
                                                                     ep_folded=True)
    assert (ours.expert_tp, folded.expert_tp) == (2, 1)
    assert rank_block_params(cfg, 2, 8, 1) > 1.5 * rank_block_params(cfg, 2, 8, 2)
    mine, theirs = memory_breakdown(workload, ours), memory_breakdown(workload, folded)
    assert (theirs.params, theirs.optimizer) == pytest.approx((mine.params, mine.optimizer))
    assert theirs.saved_activations < mine.saved_activations
    with pytest.raises(ConfigError, match="ep_folded with tp 2"):
        check_plan(workload, folded, 32)
    flat = (Plan(dp_shard=32, ep=8, zero_stage=3, ep_folded=folding) for folding in (False, True))
    assert len({memory_breakdown(workload, p).total for p in flat}) == 1


def test_expert_tensor_parallelism_prices_the_routed_copies_all_reduce():
    """Under expert TP (our layout, with or without ep) a sparse block's experts all-reduce the tokens' top-k routed
    copies (parallel/tensor.py): 1 + k units of tensor-parallel traffic where a dense block has 2, half a unit more
    with sequence parallelism (the sparse input's all-gather, each way); folded (expert-TP 1) the experts take none,
    and a dense model is priced as before."""
    from scaletrain.plan.timing import tp_traffic_factor
    from scaletrain.plan.workload import Plan

    cfg = load_config(None, {"model.preset": "olmoe-1b-7b"}).model  # top-8 of 64, every layer sparse, no shared
    assert (cfg.moe_top_k, cfg.moe_shared_experts) == (8, 0)
    for ep in (1, 2):
        assert tp_traffic_factor(cfg, Plan(dp_shard=2, tp=2, ep=ep, sequence_parallel=False), cfg.n_layers) == 4.5
        assert tp_traffic_factor(cfg, Plan(dp_shard=2, tp=2, ep=ep), cfg.n_layers) == 4.75  # (1 + 8 + 0.5) / 2
    assert tp_traffic_factor(cfg, Plan(dp_shard=16, tp=2, ep=8, ep_folded=True), cfg.n_layers) == 1.0
    dense = load_config(None, {"model.preset": "gpt2-124m"}).model
    assert tp_traffic_factor(dense, Plan(dp_shard=2, tp=2), dense.n_layers) == 1.0


def test_cpu_expert_parallel_charges_every_exchange_its_fixed_cost():
    """On gloo ranks the ep term is, per micro-batch and sparse block, the 4 rows' all-to-alls (6 under
    checkpointing) at their bytes, the collective latency and the host cost GLOO_ALL_TO_ALL_HOST_S, plus one counts
    exchange a forward (2 under checkpointing) at the latency: it grows with the sparse blocks and the
    micro-batches, and there is none at ep 1. A GPU's NCCL pays the bytes alone (its latency and host cost 0)."""
    import dataclasses

    from scaletrain.hardware.catalog import CATALOG, Cluster
    from scaletrain.plan.timing import GLOO_ALL_TO_ALL_HOST_S, all_to_all_seconds, step_time
    from scaletrain.plan.workload import Plan, Workload

    cfg = load_config(None, {"model.preset": "nano-moe", "model.vocab_size": 256}).model
    cpu = Cluster(CATALOG["cpu"], 2)
    latency = CATALOG["cpu"].calibration["collective_latency_s"]
    assert GLOO_ALL_TO_ALL_HOST_S > latency > 0

    def ep_seconds(model, global_batch: int, **plan) -> float:
        plan = Plan(dp_replicate=2, micro_batch=8, **plan)
        return step_time(Workload(model, 128, global_batch, 1e6), plan, cpu).comm_detail.get("ep", 0.0)

    plan = Plan(dp_replicate=2, ep=2, micro_batch=8)
    workload = Workload(cfg, 128, 16, 1e6)
    wire = all_to_all_seconds(workload, plan, cpu, 8 * 128, 0.0)  # the bytes alone
    fixed = cfg.n_layers * (4 * (latency + GLOO_ALL_TO_ALL_HOST_S) + latency)
    assert ep_seconds(cfg, 16, ep=2) == pytest.approx(wire + fixed)
    assert ep_seconds(cfg, 16) == 0.0
    assert ep_seconds(cfg, 32, ep=2) == pytest.approx(2 * (wire + fixed))  # two micro-batches a step
    deeper = dataclasses.replace(cfg, n_layers=2 * cfg.n_layers)
    assert ep_seconds(deeper, 16, ep=2) == pytest.approx(2 * (wire + fixed))
    recompute = ep_seconds(cfg, 16, ep=2, activation_checkpointing="full")
    assert recompute == pytest.approx(1.5 * wire + cfg.n_layers * (6 * (latency + GLOO_ALL_TO_ALL_HOST_S)
                                                                   + 2 * latency))
    gpu, gpu_plan = Cluster(CATALOG["h100-sxm"], 8), Plan(dp_shard=8, ep=8, zero_stage=3, micro_batch=8)
    gpu_workload = Workload(cfg, 128, 64, 1e6, "bf16")
    assert step_time(gpu_workload, gpu_plan, gpu).comm_detail["ep"] == pytest.approx(
        all_to_all_seconds(gpu_workload, gpu_plan, gpu, 8 * 128, 0.0))
