"""The planner plans the optimizer the job trains with: optim.name = muon (train/muon.py) changes the optimizer's
memory (one momentum buffer a Muon matrix, Newton-Schulz temporaries), its time (Newton-Schulz FLOPs at the
measured matmul rates) and, under FSDP2, its communication (an all-gather of every Muon matrix per step)."""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from pathlib import Path

import pytest
import torch

from helpers.tiny import tiny_hf_base
from scaletrain.cli import main
from scaletrain.config import (
    FinetuneConfig,
    JobConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
    load_config,
)
from scaletrain.hardware.catalog import LINKS
from scaletrain.model.presets import PRESETS
from scaletrain.parallel import ParallelDims
from scaletrain.plan.finetune import finetune_memory, finetune_step_time
from scaletrain.plan.hardware_spec import parse_hardware
from scaletrain.plan.measure import LiveTensorBytes, measure_step, resident_extras
from scaletrain.plan.memory import memory_breakdown, muon_matrix_params, muon_shapes
from scaletrain.plan.timing import newton_schulz_flops, step_time
from scaletrain.plan.workload import Plan, Workload
from scaletrain.train.step import StepOptions, build_parallel_training, training_step

ROOT = Path(__file__).resolve().parents[2]
BABY = str(ROOT / "configs" / "shakespeare_char_baby_adamw.toml")  # the nano preset, 12 x 64 characters, fp32


def _plan_json(tmp_path: Path, name: str, *args: str) -> dict:
    out = tmp_path / f"{name}.json"
    assert main(["plan", "--model.vocab_size=65", "--hardware", "cpu:1", "--top", "1", "--json", str(out), *args]) == 0
    return json.loads(out.read_text())


def test_a_muon_config_plans_muon_and_the_flag_overrides_it(tmp_path, capsys):
    """A job TOML with optim.name = muon is planned with Muon: less optimizer memory than the same job with AdamW
    (the m/v bytes of the blocks' matrices, which keep one momentum buffer) and a slower step (Newton-Schulz);
    ``--optimizer`` overrides the config, and the JSON and the emitted job say which optimizer was planned."""
    muon_toml = tmp_path / "baby_muon.toml"
    muon_toml.write_text(Path(BABY).read_text().replace("[optim]\n", "[optim]\nname = \"muon\"\n"))
    assert load_config(str(muon_toml)).optim.name == "muon"
    adamw = _plan_json(tmp_path, "adamw", "--config", BABY)
    muon = _plan_json(tmp_path, "muon", "--config", str(muon_toml), "--emit", str(tmp_path / "best.toml"))
    overridden = _plan_json(tmp_path, "over", "--config", str(muon_toml), "--optim.name=adamw")
    flagged = _plan_json(tmp_path, "flag", "--config", BABY, "--optim.name=muon")
    assert [d["workload"]["optimizer"] for d in (adamw, muon, overridden, flagged)] == ["adamw", "muon", "adamw",
                                                                                        "muon"]
    a, m = adamw["plans"][0], muon["plans"][0]
    model = load_config(BABY).model
    matrices = muon_matrix_params(dataclasses.replace(model, vocab_size=65), model.n_layers)
    assert a["memory"]["optimizer"] - m["memory"]["optimizer"] == pytest.approx(4 * matrices)
    assert m["time"]["newton_schulz"] > 0 == a["time"]["newton_schulz"]
    assert m["time"]["step"] > a["time"]["step"]
    assert overridden["plans"][0] == a and flagged["plans"][0] == m
    assert load_config(str(tmp_path / "best.toml")).optim.name == "muon"
    assert "muon (Muon with one momentum buffer" in capsys.readouterr().out


def test_muon_plans_only_what_the_trainer_runs_with_muon(capsys):
    """The planner asks the trainer's own check: Muon needs whole matrices, so no tensor parallelism."""
    args = ["plan", "--model.preset=llama-8b", "--hardware", "h100-sxm:8", "--data.seq_len=2048",
            "--global-batch", "64", "--parallel.tp=2", "--parallel.dp_shard=4", "--parallel.zero_stage=3"]
    assert main(args) == 0
    capsys.readouterr()
    assert main(args + ["--optim.name=muon"]) == 2
    assert "optim.name=muon needs whole weight matrices: not with parallel.tp > 1" in capsys.readouterr().err


def test_memory_breakdown_plans_the_workloads_optimizer():
    cfg = dataclasses.replace(load_config(BABY).model, vocab_size=65)
    adamw, muon = Workload(cfg, 64, 12, 1e6), Workload(cfg, 64, 12, 1e6, optimizer="muon")
    plan = Plan(micro_batch=12)
    assert memory_breakdown(muon, plan, "cpu") == memory_breakdown(adamw, plan, "cpu", optimizer="muon")
    assert memory_breakdown(muon, plan, "cpu", optimizer="adamw") == memory_breakdown(adamw, plan, "cpu")


def test_fsdp2_gathers_every_muon_matrix_and_every_rank_orthogonalizes_it():
    """Under FSDP2 (zero_stage 3 over dp_shard 8) each rank all-gathers every Muon matrix's fp32 update once per
    step and runs Newton-Schulz on the whole matrix: the Newton-Schulz time is one device's, not divided by the
    shards, and the gather is (n-1)/n of 4 bytes a Muon parameter over the FSDP group's link."""
    model = ModelConfig(**PRESETS["gpt2-124m"])
    one, eight = parse_hardware("h100-sxm:1"), parse_hardware("h100-sxm:8")
    hw = one.hardware
    w = Workload(model, 1024, 64, 1e9, "bf16", optimizer="muon")
    single = step_time(w, Plan(micro_batch=8), one)
    sharded = step_time(w, Plan(dp_shard=8, zero_stage=3, micro_batch=8), eight)
    assert single.newton_schulz > 0 and sharded.newton_schulz == pytest.approx(single.newton_schulz)
    link = LINKS[hw.intra_node]
    gathered = 7 / 8 * 4 * muon_matrix_params(model, model.n_layers)
    assert sharded.comm_detail["muon_gather"] == pytest.approx(gathered / (link.bandwidth * link.efficiency))
    assert sharded.comm_exposed >= sharded.comm_detail["muon_gather"]
    adamw = step_time(dataclasses.replace(w, optimizer="adamw"), Plan(dp_shard=8, zero_stage=3, micro_batch=8), eight)
    assert "muon_gather" not in adamw.comm_detail and adamw.newton_schulz == 0
    # bf16 on a GPU: Newton-Schulz's FLOPs (every matrix's smaller side is dim here) at the peak x the GEMM
    # utilisation at that width
    flops = newton_schulz_flops(muon_shapes(model, model.n_layers))
    assert single.newton_schulz == pytest.approx(flops / (hw.flops("bf16") * hw.utilisation_at(model.dim, 0.0)))


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory):
    return tiny_hf_base(tmp_path_factory.mktemp("base"))


def _lora_step(source: Path, optim: OptimConfig, batch: int, seq: int) -> tuple[JobConfig, dict]:
    """The trainer's LoRA step (every projection adapted, rank 8) measured: peak and at-rest tensor bytes."""
    from scaletrain.finetune import resolve_finetune

    ft = FinetuneConfig(source=str(source), method="lora", lora_rank=8,
                        lora_targets=["q", "k", "v", "o", "gate", "up", "down"])
    cfg = JobConfig(optim=optim, train=TrainConfig(seed=0), finetune=ft)
    cfg = resolve_finetune(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=seq)))
    tracker = LiveTensorBytes().__enter__()
    pm, optimizer = build_parallel_training(cfg, ParallelDims.from_config(ParallelConfig(), 1), torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    vocab = cfg.model.vocab_size
    micro = [(torch.randint(0, vocab, (batch, seq), generator=gen), torch.randint(0, vocab, (batch, seq),
                                                                                  generator=gen), None)]
    return cfg, measure_step(lambda: training_step(pm, optimizer, iter(micro), 1, StepOptions(grad_clip=1.0)).loss,
                             tracker, steps=1)


def test_muon_adapters_finetune_memory_matches_a_real_lora_step(hf_base):
    """optim.muon_adapters: lora_A / lora_B keep one fp32 momentum buffer (4 bytes a parameter) instead of AdamW's
    two moments. The planner's peak against the exact live tensor bytes of the trainer's LoRA step, within the
    10% of tests/finetune/test_finetune.py's finetune_memory check, for AdamW and for Muon on the adapters; and the
    state bytes Muon saves against what the real optimizers hold at rest."""
    batch, seq = 4, 32
    measured, predicted = {}, {}
    for name, optim, adapters in (("adamw", OptimConfig(), False),
                                  ("muon", OptimConfig(name="muon", muon_adapters=True), True)):
        cfg, measured[name] = _lora_step(hf_base, optim, batch, seq)
        workload = Workload(cfg.model, seq, batch, batch * seq, optimizer=optim.name, muon_adapters=adapters)
        predicted[name] = finetune_memory(workload, Plan(micro_batch=batch), cfg.finetune, "cpu")
        total = predicted[name]["tensor_total"] + resident_extras(cfg.model, batch, seq)
        assert total == pytest.approx(measured[name]["peak_bytes"], rel=0.10), name
    adapters = predicted["muon"]["muon_parameters"]
    assert adapters == predicted["muon"]["trainable_parameters"] > 0  # no DoRA: every adapter is a matrix
    saved = predicted["adamw"]["optimizer_state_bytes"] - predicted["muon"]["optimizer_state_bytes"]
    assert saved == 4 * adapters
    # AdamW also keeps a 4-byte step count per tensor (fused): a few bytes beyond the moments
    measured_saved = measured["adamw"]["at_rest_bytes"] - measured["muon"]["at_rest_bytes"]
    assert measured_saved == pytest.approx(saved, rel=0.02)


def test_muon_adapters_cost_newton_schulz_time_and_need_lora(hf_base, capsys):
    model = load_config(BABY).model
    cfg = dataclasses.replace(model, vocab_size=65)
    ft = FinetuneConfig(method="lora", lora_targets=["q", "v"])
    cluster = parse_hardware("cpu")
    plain = finetune_step_time(Workload(cfg, 64, 12, 1e6, optimizer="muon"), Plan(micro_batch=12), cluster, ft)
    adapters = finetune_step_time(Workload(cfg, 64, 12, 1e6, optimizer="muon", muon_adapters=True),
                                  Plan(micro_batch=12), cluster, ft)
    assert plain["newton_schulz_seconds"] == 0 < adapters["newton_schulz_seconds"]
    assert adapters["step_seconds"] == pytest.approx(plain["step_seconds"] + adapters["newton_schulz_seconds"])
    args = ["plan", "--model.preset=nano", "--model.vocab_size=65", "--hardware", "cpu", "--global-batch", "12",
            "--data.seq_len=64"]
    assert main(args + ["--finetune.method=lora", "--optim.name=muon", "--optim.muon_adapters=true"]) == 0
    assert "optimizer muon (Muon with one momentum buffer on the blocks' matrices, LoRA's lora_A / lora_B too" \
        in capsys.readouterr().out.replace("\n", " ")
    assert main(args + ["--finetune.method=prompt", "--optim.name=muon", "--optim.muon_adapters=true"]) == 2
    assert "optim.muon_adapters puts LoRA's adapter matrices under Muon: it needs finetune.method=lora" \
        in capsys.readouterr().err
    assert main(args + ["--finetune.method=lora", "--optim.muon_adapters=true"]) == 2
    assert "--optim.muon_adapters puts LoRA's adapters under Muon: it needs --optim.name=muon" \
        in capsys.readouterr().err


# The predicted Muon / AdamW step ratio of the nano recipe is checked against one measured in the test, both
# steps alternating in one process (load slows both alike) on ONE thread timed by process CPU time, as the
# calibration measures its rates (``scaletrain doctor --clock cpu``; the catalog's `cpu` entry is this machine
# kind's). Measured here (2 vCPU AMD EPYC, shared with other jobs), five runs: 1.47 to 1.51 on one thread against
# 1.47 predicted; on two threads on a quiet machine the same ratio was 1.36 (benchmarks/results/time_to_loss.json,
# the whole trainer step). 0.25 covers both with room for noise; the planner before it knew Muon predicted 1.00.
RATIO_TOLERANCE = 0.25


def test_predicted_muon_over_adamw_step_ratio_of_the_nano_recipe_matches_a_measured_one():
    base = load_config(BABY)
    base = dataclasses.replace(base, model=dataclasses.replace(base.model, vocab_size=65))
    batch, seq = base.train.batch_size, base.data.seq_len
    cluster = parse_hardware("cpu")
    predicted = {name: step_time(Workload(base.model, seq, batch, 1e6, "fp32", optimizer=name),
                                 Plan(micro_batch=batch), cluster).step for name in ("adamw", "muon")}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        steps = {}
        for name in ("adamw", "muon"):
            cfg = dataclasses.replace(base, optim=dataclasses.replace(base.optim, name=name))
            pm, optimizer = build_parallel_training(cfg, ParallelDims.from_config(ParallelConfig(), 1),
                                                    torch.device("cpu"))
            gen = torch.Generator().manual_seed(0)
            micro = [(torch.randint(0, 65, (batch, seq), generator=gen), torch.randint(0, 65, (batch, seq),
                                                                                       generator=gen), None)]
            steps[name] = (lambda pm=pm, optimizer=optimizer, micro=micro:  # noqa: E731
                           training_step(pm, optimizer, iter(micro), 1, StepOptions(grad_clip=base.optim.grad_clip)))
        seconds: dict[str, list[float]] = {name: [] for name in steps}
        for i in range(25):
            for name, step in steps.items():
                t0 = time.process_time()
                step()
                if i >= 3:  # warm-up: the optimizer states are created on the first step
                    seconds[name].append(time.process_time() - t0)
    finally:
        torch.set_num_threads(threads)
    measured = statistics.median(seconds["muon"]) / statistics.median(seconds["adamw"])
    ratio = predicted["muon"] / predicted["adamw"]
    assert abs(ratio - measured) <= RATIO_TOLERANCE, (ratio, measured, predicted)


def test_the_planner_refuses_an_optimizer_it_does_not_model():
    """An optimizer outside the optimizer table (train/optimizer.py) is refused in one line, not planned with
    AdamW's states and step."""
    from scaletrain.config import ConfigError, ModelConfig
    from scaletrain.plan.workload import Workload
    from scaletrain.train.optimizer import OPTIMIZERS

    with pytest.raises(ConfigError, match="not 'lion'") as err:
        Workload(ModelConfig(vocab_size=64), 64, 8, 1e6, optimizer="lion")
    assert "\n" not in str(err.value) and all(name in str(err.value) for name in OPTIMIZERS)
    assert Workload(ModelConfig(vocab_size=64), 64, 8, 1e6, optimizer="muon").optimizer == "muon"
