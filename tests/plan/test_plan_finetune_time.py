"""The planner's fine-tuning step time (scaletrain.plan.finetune.finetune_step_time): a full fine-tune is
pretraining's step, frozen weights cost their weight-gradient GEMMs less, QLoRA pays its dequantization,
and `scaletrain plan --method` prints it. Its accuracy against measured steps is benchmarks/finetune_plan.py."""

from __future__ import annotations

import json

import pytest

from scaletrain.commands.plan import main
from scaletrain.config import FinetuneConfig, ModelConfig, build
from scaletrain.model.presets import PRESETS
from scaletrain.plan.finetune import finetune_step_time
from scaletrain.plan.hardware_spec import parse_hardware
from scaletrain.plan.timing import step_time
from scaletrain.plan.workload import Plan, Workload

SMALL = ModelConfig(vocab_size=2048, dim=256, n_layers=6, n_heads=4, ffn_hidden_dim=688, max_seq_len=160)


def _times(model: ModelConfig, seq: int, batch: int, hardware: str, precision: str) -> tuple[float, dict]:
    workload = Workload(model=model, seq_len=seq, global_batch=batch, train_tokens=seq * batch, precision=precision)
    plan, cluster = Plan(micro_batch=batch), parse_hardware(hardware)
    return step_time(workload, plan, cluster).step, {
        m: finetune_step_time(workload, plan, cluster, FinetuneConfig(method=m))["step_seconds"]
        for m in ("full", "lora", "qlora", "prompt", "prefix")}


@pytest.mark.parametrize("model,seq,batch,hardware,precision", [
    (SMALL, 128, 4, "cpu", "fp32"),
    (build(ModelConfig, {"preset": "llama-8b", "vocab_size": 128256}, presets=PRESETS), 2048, 2, "h100-sxm", "bf16"),
])
def test_frozen_weights_cost_less_and_full_is_pretraining(model, seq, batch, hardware, precision):
    pretrain, t = _times(model, seq, batch, hardware, precision)
    assert t["full"] == pytest.approx(pretrain, rel=1e-9)
    # Frozen projections keep their input-gradient GEMM (about a third of a step's matmul work) but lose the
    # weight-gradient one, and AdamW steps only the adapters: LoRA is well under full, above half of it.
    assert 0.45 * t["full"] < t["lora"] < 0.85 * t["full"]
    assert t["qlora"] > t["lora"]  # the 4-bit weights are dequantized in the forward and the backward
    assert t["prefix"] < t["full"] and t["prompt"] < t["full"]


def test_plan_method_prints_the_step_time(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--model.preset=llama-8b", "--model.vocab_size=128256", "--finetune.method=qlora",
                 "--hardware", "rtx-4090:1", "--data.seq_len=2048", "--parallel.activation_checkpointing=full",
                 "--json", str(out)]) == 0
    assert "step time on 1 x rtx-4090" in capsys.readouterr().out
    answer = json.loads(out.read_text())["finetune"]
    assert answer["step_seconds"] > 0 and answer["tokens_per_second"] > 0


def test_the_gpu_lora_step_charges_the_frozen_weight_casts_and_the_adapters_passes():
    """The GPU check's 1B LoRA row (llama-1b blocks, vocabulary 8192, 4 x 1024 tokens, bf16 autocast on one H100):
    autocast recasts every frozen fp32 weight to bf16 each forward (6 bytes a weight) and the q/k/v/o adapters
    pass ~6 times over their input and output activations; by hand, at 3.35 TB/s."""
    from scaletrain.model.presets import num_params
    from scaletrain.plan.finetune import gpu_memory_bound_seconds, trainable_parameters
    from scaletrain.plan.memory import projection_shapes

    model = build(ModelConfig, {"preset": "llama-1b", "vocab_size": 8192}, presets=PRESETS)
    ft = FinetuneConfig(method="lora")
    hw = parse_hardware("h100-sxm").hardware
    shapes = projection_shapes(model)
    frozen = num_params(model) - trainable_parameters(model, ft)
    cast = frozen * 6 / 3.35e12
    adapters = 16 * ((2048 + 2048) * 2 + (2048 + 512) * 2) * 6 * 4096 * 2 / 3.35e12
    got = gpu_memory_bound_seconds(model, ft, hw, 4096, shapes, ["q", "k", "v", "o"], 0, autocast=True)
    assert got == pytest.approx(cast + adapters, rel=1e-6)
    assert 1.7e-3 < cast < 1.9e-3 and 3.0e-3 < adapters < 3.3e-3
    # without autocast (fp32, or FSDP's bf16 parameters) nothing is recast; a full fine-tune has no adapters
    assert gpu_memory_bound_seconds(model, ft, hw, 4096, shapes, ["q", "k", "v", "o"], 0, autocast=False) \
        == pytest.approx(adapters, rel=1e-6)
    assert gpu_memory_bound_seconds(model, FinetuneConfig(method="full"), hw, 4096, shapes, [], 0, True) == 0


@pytest.mark.parametrize("hardware,precision", [("cpu", "fp32"), ("h100-sxm", "bf16")])
def test_a_preference_step_is_two_rows_a_pair_plus_dpos_reference_forward(hardware, precision):
    """plan/finetune.preference_step_time: pairs are two rows through the SFT step (SimPO / ORPO add nothing
    else), DPO with adapters adds the base's no-grad forward each micro-batch (cheaper than the step it rides on,
    QLoRA's dearer by its dequantization), DPO with full fine-tuning precomputes it once before training."""
    import dataclasses

    from scaletrain.plan.finetune import preference_step_time

    pairs, micro = 8, 2
    workload = Workload(model=SMALL, seq_len=128, global_batch=pairs, train_tokens=1e6, precision=precision)
    rows = dataclasses.replace(workload, global_batch=2 * pairs)
    cluster = parse_hardware(hardware)

    def ft(method: str, objective: str) -> FinetuneConfig:
        return FinetuneConfig(method=method, objective=objective)

    for method in ("lora", "full"):
        sft = finetune_step_time(rows, Plan(micro_batch=2 * micro), cluster, ft(method, "sft"))
        for objective in ("simpo", "orpo"):
            other = preference_step_time(workload, Plan(micro_batch=micro), cluster, ft(method, objective))
            assert other["step_seconds"] == pytest.approx(sft["step_seconds"], rel=1e-12)
            assert other["reference"] == "none" and other["tokens_per_second"] == pytest.approx(
                sft["tokens_per_second"], rel=1e-12)
    lora_sft = finetune_step_time(rows, Plan(micro_batch=2 * micro), cluster, ft("lora", "sft"))
    dpo = preference_step_time(workload, Plan(micro_batch=micro), cluster, ft("lora", "dpo"))
    assert dpo["reference"] == "adapters" and dpo["micro_steps"] == pairs // micro
    assert dpo["reference_seconds"] == pytest.approx(dpo["micro_steps"] * dpo["base_forward_seconds"], rel=1e-12)
    assert dpo["step_seconds"] == pytest.approx(lora_sft["step_seconds"] + dpo["reference_seconds"], rel=1e-12)
    per_micro = lora_sft["compute_seconds"] / lora_sft["micro_steps"]
    assert 0.15 * per_micro < dpo["base_forward_seconds"] < 0.6 * per_micro  # a forward of a LoRA step
    qlora = preference_step_time(workload, Plan(micro_batch=micro), cluster, ft("qlora", "dpo"))
    assert qlora["base_forward_seconds"] > dpo["base_forward_seconds"]
    full = preference_step_time(workload, Plan(micro_batch=micro), cluster, ft("full", "dpo"))
    full_sft = finetune_step_time(rows, Plan(micro_batch=2 * micro), cluster, ft("full", "sft"))
    assert full["reference"] == "precomputed" and full["reference_seconds"] == 0.0
    assert full["step_seconds"] == pytest.approx(full_sft["step_seconds"], rel=1e-12)
    assert full["reference_pass_seconds"] == pytest.approx(full["base_forward_seconds"], rel=1e-12)
    assert full["reference_pass_seconds"] > 0


def test_plan_objective_dpo_prints_the_modelled_step(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--model.preset=qwen3-0.6b", "--finetune.method=lora", "--finetune.objective=dpo",
                 "--hardware", "h100-sxm:1", "--data.seq_len=1024", "--global-batch", "8", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "not modelled" not in text and "reference's no-grad forward (adapters off)" in text, text
    answer = json.loads(out.read_text())["finetune"]
    assert answer["reference"] == "adapters" and answer["reference_seconds"] > 0


def test_compiled_qlora_is_a_rate_of_its_own_that_a_gpu_measurement_can_refit(monkeypatch, capsys, tmp_path):
    """finetune.qlora_compile is charged at its own named rate, resolved as the trainer resolves it (auto: compiled on
    a GPU, eager on a CPU): on a CPU the measured compiled rate makes the step cheaper; on a GPU the compiled rate is
    still today's eager one (not measured yet), so the prediction is unchanged until it is refitted."""
    from scaletrain.plan import finetune as plan_ft

    cpu_auto, cpu_on = FinetuneConfig(method="qlora"), FinetuneConfig(method="qlora", qlora_compile="true")
    assert plan_ft.nf4_dequant_rate(cpu_auto, "cpu") == plan_ft.REFERENCE_NF4_DEQUANT_S_PER_ELEMENT
    assert plan_ft.nf4_dequant_rate(cpu_on, "cpu") == plan_ft.REFERENCE_NF4_COMPILED_DEQUANT_S_PER_ELEMENT
    assert plan_ft.nf4_dequant_rate(cpu_on, "cpu", {"nf4_compiled_dequant_s_per_element": 2e-9}) == 2e-9
    eager_gpu = FinetuneConfig(method="qlora", qlora_compile="false")
    assert plan_ft.nf4_dequant_rate(cpu_auto, "gpu") == plan_ft.GPU_NF4_COMPILED_DEQUANT_BYTES_PER_WEIGHT
    assert plan_ft.nf4_dequant_rate(eager_gpu, "gpu") == plan_ft.GPU_NF4_DEQUANT_BYTES_PER_WEIGHT
    assert plan_ft.GPU_NF4_COMPILED_DEQUANT_BYTES_PER_WEIGHT == plan_ft.GPU_NF4_DEQUANT_BYTES_PER_WEIGHT  # unmeasured

    workload = Workload(model=SMALL, seq_len=128, global_batch=4, train_tokens=512, precision="fp32")
    cpu = parse_hardware("cpu")
    seconds = {ft.qlora_compile: finetune_step_time(workload, Plan(micro_batch=4), cpu, ft)["step_seconds"]
               for ft in (cpu_auto, cpu_on)}
    lora = finetune_step_time(workload, Plan(micro_batch=4), cpu, FinetuneConfig(method="lora"))["step_seconds"]
    assert lora < seconds["true"] < seconds["auto"]

    model = build(ModelConfig, {"preset": "llama-1b", "vocab_size": 8192}, presets=PRESETS)
    gpu_workload = Workload(model=model, seq_len=1024, global_batch=4, train_tokens=4096, precision="bf16")
    h100 = parse_hardware("h100-sxm:1")

    def gpu_tokens_per_second(ft):
        return finetune_step_time(gpu_workload, Plan(micro_batch=4), h100, ft)["tokens_per_second"]

    before = gpu_tokens_per_second(cpu_auto)
    assert before == pytest.approx(gpu_tokens_per_second(eager_gpu), rel=1e-12)
    monkeypatch.setattr(plan_ft, "GPU_NF4_COMPILED_DEQUANT_BYTES_PER_WEIGHT", 2.6)  # what a refit would write
    assert gpu_tokens_per_second(cpu_auto) > 1.5 * before
    assert gpu_tokens_per_second(eager_gpu) == pytest.approx(before, rel=1e-12)
    # `scaletrain plan --qlora-compile` asks for either
    out = tmp_path / "plan.json"
    args = ["plan", "--model.preset=llama-1b", "--model.vocab_size=8192", "--finetune.method=qlora", "--hardware",
            "h100-sxm:1", "--data.seq_len=1024", "--micro-batch", "4", "--global-batch", "4", "--train.precision=bf16",
            "--json", str(out)]
    assert main(args + ["--finetune.qlora_compile=false"]) == 0
    eager = json.loads(out.read_text())["finetune"]["tokens_per_second"]
    assert main(args) == 0
    assert json.loads(out.read_text())["finetune"]["tokens_per_second"] > 1.5 * eager


def test_a_fine_tune_runs_own_config_is_planned_as_a_fine_tune(tmp_path, capsys):
    """A fine-tune run's config.toml names its base (finetune.source) and method: `plan --config` of it plans the
    fine-tune (the adapters' step, their checkpoint), as `--finetune.method` does, not a pretraining of every
    weight (seen: a LoRA run's config planned a 9.7 MB full checkpoint beside its 0.4 MB adapters)."""
    config = tmp_path / "lora.toml"
    config.write_text('[finetune]\nsource = "runs/base"\nmethod = "lora"\n')
    args = ["plan", "--hardware", "cpu", "--tokens", "204800", "--model.vocab_size=65"]
    assert main([*args, "--config", str(config), "--json", str(tmp_path / "from_config.json")]) == 0
    from_config = capsys.readouterr().out
    assert main([*args, "--finetune.method=lora", "--json", str(tmp_path / "flag.json")]) == 0
    flag = capsys.readouterr().out
    assert "step time on" in from_config and "step time on" in flag, from_config
    wall_line = [line for line in from_config.splitlines() if line.startswith("wall ")]
    assert wall_line and wall_line == [line for line in flag.splitlines() if line.startswith("wall ")]
    assert "finetune" in json.loads((tmp_path / "from_config.json").read_text())
