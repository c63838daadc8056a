"""The planner's whole wall (evaluation, samples, checkpoints beside the steps), the line said when evaluation would
dominate a run, and one MFU in train, report and plan (issues 49 and 54)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from scaletrain.cli import main
from scaletrain.config import FinetuneConfig, ModelConfig, load_config, to_toml
from scaletrain.finetune.flops import trained_flops_per_token
from scaletrain.hardware.catalog import CATALOG, Cluster, with_calibration
from scaletrain.hardware.peak import devices_in_job, host_cores, peak_flops
from scaletrain.hardware.reference_cpu import REFERENCE_CPU_CALIBRATION
from scaletrain.model.presets import flops_per_token, matmul_params, projection_shapes
from scaletrain.plan.timing import job_peak_flops, planned_mfu
from scaletrain.plan.wall import LoopSettings, evaluation_note, predicted_wall
from scaletrain.plan.workload import Plan, Workload

# a run whose evaluations dwarf its steps: 4 steps, an evaluation of 40 batches after every one (5 in all)
EVAL_HEAVY = {"train.steps": "4", "train.eval_interval": "1", "train.eval_batches": "40"}
# and one where they do not: 40 steps, one evaluation of 2 batches at the end
EVAL_LIGHT = {"train.steps": "40", "train.eval_interval": "0", "train.eval_batches": "2"}


def _train(tiny, run, capsys, **extra) -> tuple[int, str]:
    over = tiny(run, **extra)
    status = main(["train"] + [f"--{k}={v}" for k, v in over.items()])
    return status, capsys.readouterr().out


def test_the_loop_makes_the_evaluations_and_checkpoints_the_planner_counts(tmp_path, tiny):
    """LoopSettings.evaluations / checkpoints are the trainer's own: at step 0 with an interval, every interval
    before the last step and at the end; a save every checkpoint.interval steps before the last and one at the
    end."""
    from scaletrain.train.trainer import Trainer

    for steps, every, save_every in ((12, 5, 5), (6, 0, 4), (8, 20, 3)):
        cfg = load_config(None, tiny(tmp_path / f"run-{steps}-{every}-{save_every}", **{
            "train.steps": steps, "train.eval_interval": every, "checkpoint.interval": save_every,
            "train.eval_batches": 1}))
        trainer = Trainer(cfg, log=False)
        saves = []
        save = trainer.save
        trainer.save = lambda blocking=None: saves.append(trainer.state.step) or save(blocking)
        summary = trainer.train()
        loop = LoopSettings.of_job(cfg)
        assert len(summary["evals"]) == loop.evaluations(), (steps, every, summary["evals"])
        assert len(saves) == loop.checkpoints(), (steps, save_every, saves)


def test_plan_wall_is_the_steps_plus_evaluation_samples_and_checkpoints(tmp_path):
    """`plan`'s wall time (and its cost) is the done line's: the steps, the evaluations (their count x
    train.eval_batches x the no-grad forward of a batch), the samples and the checkpoints."""
    job = load_config(None, {"model.vocab_size": "65", "train.eval_interval": "100", "train.eval_batches": "30",
                             "train.sample_tokens": "50", "checkpoint.interval": "200"})
    config = tmp_path / "job.toml"
    config.write_text(to_toml(job))
    out = tmp_path / "plan.json"
    assert main(["plan", "--config", str(config), "--hardware", "cpu", "--tokens", str(1000 * 16 * 128),
                 "--json", str(out)]) == 0
    best = json.loads(out.read_text())["plans"][0]
    wall = best["wall"]
    assert wall["steps"] == pytest.approx(1000 * best["time"]["step"])
    assert wall["evaluations"] == 11 and wall["eval_batches"] == 30 and wall["checkpoint_count"] == 5
    assert wall["evaluation"] == pytest.approx(11 * 30 * wall["eval_batch_seconds"])
    # an evaluation batch is a forward: cheaper than the training step of the same rows, not free
    assert 0.1 * best["time"]["step"] < wall["eval_batch_seconds"] < 0.6 * best["time"]["step"]
    assert wall["samples"] > 0 and wall["checkpoints"] > 0
    assert best["total_seconds"] == pytest.approx(wall["steps"] + wall["evaluation"] + wall["samples"]
                                                  + wall["checkpoints"])
    assert best["cost"]["device_hours"] == pytest.approx(best["total_seconds"] / 3600)


def test_evaluation_that_dominates_is_said_by_train_and_plan_in_one_line(tmp_path, tiny, capsys):
    """Before training, train says in one line when the planned evaluation takes over a quarter of the predicted
    wall, naming train.eval_batches and train.eval_interval; plan says the same; neither says it otherwise."""
    status, out = _train(tiny, tmp_path / "heavy", capsys, **EVAL_HEAVY)
    assert status == 0
    notes = [line for line in out.splitlines() if line.startswith("note: evaluation is predicted")]
    assert len(notes) == 1 and "train.eval_batches = 40" in notes[0] and "train.eval_interval" in notes[0], out
    assert out.index(notes[0]) < out.index("done:")  # said before the run, not after

    status, out = _train(tiny, tmp_path / "light", capsys, **EVAL_LIGHT)
    assert status == 0 and "note: evaluation" not in out

    for settings, said in ((EVAL_HEAVY, True), (EVAL_LIGHT, False)):
        config = tmp_path / "job.toml"
        config.write_text(to_toml(load_config(None, tiny(tmp_path / "x", **settings, **{"model.vocab_size": 65}))))
        steps = int(settings["train.steps"])
        assert main(["plan", "--config", str(config), "--hardware", "cpu", "--tokens", str(steps * 4 * 32)]) == 0
        out = capsys.readouterr().out
        assert ("note: evaluation is predicted" in out) is said, out
        assert "train.eval_batches" in out if said else True


def test_a_finetune_whose_evaluation_dominates_says_so(tmp_path, tiny, capsys):
    """`finetune` is `train` with a base: the same one line before the first step (a LoRA of a tiny base)."""
    from helpers.tiny import tiny_hf_base

    base = tiny_hf_base(tmp_path / "base")
    over = {k: v for k, v in tiny(tmp_path / "run", **EVAL_HEAVY).items() if not k.startswith("model.")}
    assert main(["finetune", "--from", str(base)] + [f"--{k}={v}" for k, v in over.items()]) == 0
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if line.startswith("note: evaluation is predicted")]
    assert len(notes) == 1 and "train.eval_batches = 40" in notes[0], out


def test_the_evaluation_of_an_eight_step_lora_of_a_big_head_is_said():
    """Issue 49's case, planned: an 8-step LoRA of a 0.5B family base (151,936-token head), sequence 512, batch 1,
    the default evaluation (at step 0 and the end, 20 batches): most of the wall; with 2 batches it is not."""
    from scaletrain.config import build
    from scaletrain.model.presets import PRESETS
    from scaletrain.plan.finetune import finetune_step_time

    model = build(ModelConfig, {"preset": "qwen2.5-0.5b"}, presets=PRESETS)
    assert model.vocab_size == 151_936
    workload = Workload(model, 512, 1, 8 * 512, "fp32")
    cluster = Cluster(CATALOG["cpu"], 1)
    ft = FinetuneConfig(method="lora")
    plan = Plan(micro_batch=1)
    step = finetune_step_time(workload, plan, cluster, ft)["step_seconds"]
    loop = LoopSettings(steps=8, eval_interval=250, eval_batches=20, eval_rows=1, sample_tokens=0)
    wall = predicted_wall(workload, plan, cluster, step, loop, ft)
    assert wall.evaluations == 2 and wall.evaluation > 0.5 * wall.total
    note = evaluation_note(wall, loop)
    assert note is not None and "train.eval_batches = 20" in note
    fewer = dataclasses.replace(loop, eval_batches=2)
    assert evaluation_note(predicted_wall(workload, plan, cluster, step, fewer, ft), fewer) is None


@pytest.mark.parametrize("layers", [1, 4])
def test_the_decode_ops_the_sample_is_charged_are_what_a_decode_step_dispatches(layers):
    """timing.decode_ops (constants, so that `plan` never counts): the aten ops of one cached decode step of the
    trainer's sample (top-k 200 at temperature 0.8), counted here on the real generate."""
    from scaletrain.model.decoder import Transformer
    from scaletrain.model.generate import generate
    from scaletrain.plan.aten_ops import count_aten_ops
    from scaletrain.plan.timing import decode_ops

    cfg = ModelConfig(dim=16, n_heads=2, head_dim=8, ffn_hidden_dim=16, vocab_size=32, max_seq_len=32,
                      n_layers=layers)
    model = Transformer(cfg).eval()

    def run(tokens: int) -> None:
        generate(model, [0], tokens, max_seq_len=32, temperature=0.8, top_k=200,
                 generator=torch.Generator().manual_seed(0), vocab_limit=32, slide=False)

    with torch.no_grad():
        per_token = (count_aten_ops(lambda: run(12)) - count_aten_ops(lambda: run(4))) / 8
    assert decode_ops(cfg) == per_token


def test_a_lora_counts_no_weight_gradient_for_its_frozen_weights():
    """MFU's numerator (finetune/flops.py): a frozen weight does a forward and an input gradient (4 FLOPs a
    token), an adapter weight trains (6); pretraining counts every matmul weight at 6."""
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, vocab_size=100, max_seq_len=32)
    attention = 12.0 * 2 * 32 * 64
    assert trained_flops_per_token(cfg, 32) == flops_per_token(cfg, 32) == 6 * matmul_params(cfg) + attention
    ft = FinetuneConfig(method="lora", lora_rank=4, lora_targets=["q", "v"])
    shapes = projection_shapes(cfg)
    adapters = 2 * 4 * (sum(shapes["q"]) + sum(shapes["v"]))
    assert trained_flops_per_token(cfg, 32, ft) == 4 * matmul_params(cfg) + 6 * adapters + attention
    full = FinetuneConfig(method="full", freeze_blocks=1)
    block = sum(i * o for i, o in shapes.values())
    assert trained_flops_per_token(cfg, 32, full) == 6 * matmul_params(cfg) - 2 * block + attention


def test_plan_counts_the_cores_a_two_rank_run_uses_as_the_trainer_does():
    """Issue 54's two MFUs: two DDP ranks of one thread each on a 2-core host use 2 cores; a calibration measured
    with 2 threads must not make the plan divide by 4 (it printed 34% where train printed 66.2%)."""
    core = 50e9
    hw = with_calibration(CATALOG["cpu"], {**REFERENCE_CPU_CALIBRATION, "threads": 2, "cores": 2,
                                           "matmul_flops_fp32": 1.9 * core, "core_matmul_flops_fp32": core})
    trainer_devices = devices_in_job("cpu", 2, 1, ranks_per_host=2, cores_per_host=2)
    assert trainer_devices == 2
    assert job_peak_flops(Cluster(hw, 2), "fp32") == pytest.approx(core * trainer_devices)
    assert job_peak_flops(Cluster(hw, 1), "fp32") == pytest.approx(2 * core)  # one process, 2 threads
    assert devices_in_job("cuda", 8, 4) == 8
    h100 = CATALOG["h100-sxm"]
    assert job_peak_flops(Cluster(h100, 8), "bf16") == pytest.approx(8 * h100.flops("bf16"))


@pytest.mark.parametrize("method", ["", "lora"])
def test_train_report_and_plan_print_the_same_mfu(tmp_path, tiny, capsys, monkeypatch, method):
    """One MFU: the done line's, the report's and the one `plan` computes for the run's measured tokens/s on this
    machine (``--hardware auto``: the one-core peak the trainer divides by, times the cores it used) agree."""
    from helpers.tiny import tiny_hf_base
    from scaletrain.plan import hardware_spec
    from scaletrain.report.html import run_mfu
    from scaletrain.report.runs import read_run

    run = tmp_path / "run"
    extra = {"train.steps": "12", "logging.log_interval": "4"}
    if method:
        extra |= {"finetune.source": str(tiny_hf_base(tmp_path / "base")), "finetune.method": method}
    over = tiny(run, **extra)
    if method:  # the base's [model]
        over = {k: v for k, v in over.items() if not k.startswith("model.")}
    assert main(["train"] + [f"--{k}={v}" for k, v in over.items()]) == 0
    done = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("done:"))
    info = json.loads((run / "run_info.json").read_text())["segments"][-1]["summary"]
    printed = f"MFU {100 * info['mfu']:.1f}%"
    assert printed in done
    assert run_mfu(read_run(run)) == printed.removeprefix("MFU ")
    # plan, with this machine's calibration (the reference CPU's rates, this machine's one-core peak and threads)
    threads = torch.get_num_threads()
    monkeypatch.setattr(hardware_spec, "calibration_entry", lambda device: {
        **REFERENCE_CPU_CALIBRATION, "threads": threads, "cores": host_cores()})
    cluster = hardware_spec.parse_hardware("auto")
    cfg = load_config(run / "config.toml")
    ft = cfg.finetune if method else None  # what plan --method lora counts: the run's own finetune section
    planned = planned_mfu(trained_flops_per_token(cfg.model, cfg.data.seq_len, ft), info["tokens_per_second"],
                          "fp32", cluster)
    assert planned == pytest.approx(info["mfu"], rel=1e-9)
    assert job_peak_flops(cluster, "fp32") == pytest.approx(
        peak_flops("cpu", "fp32") * devices_in_job("cpu", 1, threads, 1, host_cores()))
