"""The plan `scaletrain plan --emit` writes is a config `scaletrain train` runs, and `scaletrain doctor` runs."""

from __future__ import annotations

import json
import math

from scaletrain.cli import main
from scaletrain.config import load_config, to_toml
from scaletrain.plan import calibration, timing


def test_emitted_cpu_plan_trains(tmp_path, tiny):
    # A tiny job (char-level Tiny Shakespeare, 65 symbols): plan it for the reference CPU, emit the winner.
    job = tmp_path / "tiny.toml"
    over = tiny(tmp_path / "unused")
    job.write_text(to_toml(load_config(None, {k: v for k, v in over.items() if k.startswith(("model.", "data."))})))
    emitted = tmp_path / "best.toml"
    assert main(["plan", "--config", str(job), "--model.vocab_size=65", "--hardware", "cpu", "--tokens", "4096",
                 "--global-batch", "8", "--emit", str(emitted)]) == 0
    plan = load_config(emitted)
    assert plan.model.dim == 32 and plan.model.n_layers == 2 and plan.data.seq_len == 32
    assert plan.train.batch_size * plan.train.grad_accum_steps == 8  # the global batch asked for
    run = tmp_path / "run"
    assert main(["train", "--config", str(emitted), "--train.steps=2", f"--train.run_dir={run}",
                 f"--data.cache_dir={tmp_path / 'data'}", "--logging.progress=off", "--logging.tensorboard=false",
                 "--train.eval_interval=0", "--train.sample_tokens=0", "--checkpoint.interval=0",
                 "--schedule.warmup_steps=1"]) == 0
    # The run used the emitted plan (its saved config) and reached step 2 with a finite loss.
    saved = load_config(run / "config.toml")
    assert saved.train.batch_size == plan.train.batch_size
    assert saved.parallel.activation_checkpointing == plan.parallel.activation_checkpointing
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    assert max(losses) == 2 and all(math.isfinite(v) for v in losses.values()), losses


def test_doctor_smoke(tmp_path, monkeypatch, capsys):
    # One round, CPU clock (one thread): the quickest doctor; it must describe the machine and write a
    # calibration with every rate the CPU time model reads.
    monkeypatch.setenv("SCALETRAIN_CACHE", str(tmp_path / "cache"))
    # Fewer sample points on each measured curve (the code path is the same; a full doctor takes ~1 min).
    for name, points in (("GEMM_WIDTHS", (64, 256)), ("GEMM_ROWS", (64, 256)), ("ATTN_HEAD_DIMS", (32,)),
                         ("ATTN_SEQ_LENS", (64, 128)),
                         ("CE_VOCABS", (256,)), ("OPT_SIZES", (1 << 16,)), ("ELEMENTWISE_BATCHES", (1,))):
        monkeypatch.setattr(calibration, name, points)
    # The head's curves (a 131,072-row weight: 50 of the 77 s this test took) and the weight cast / NF4 rates, on
    # small weights: the same code paths.
    monkeypatch.setattr(calibration, "HEAD_DIMS", (64, 256))
    monkeypatch.setattr(calibration, "WEIGHT_CAST_ELEMENTS", 1 << 20)
    monkeypatch.setattr(calibration, "NF4_DEQUANT_SIDE", 256)
    monkeypatch.setattr(timing, "HEAD_CHUNK_ROWS", (16, 64))
    monkeypatch.setattr(timing, "HEAD_CHUNK_VOCAB", 8192)
    report = tmp_path / "doctor.json"
    assert main(["doctor", "--rounds", "1", "--clock", "cpu", "--json", str(report)]) == 0
    doc = json.loads(report.read_text())
    assert doc["system"]["cpu_cores_usable"] >= 1 and doc["system"]["torch"]
    cal = doc["calibration"]
    for key in ("matmul_flops_fp32", "gemm_curve", "gemm_curve_by_rows", "attention_curve", "cross_entropy_curve",
                "optimizer_curve",
                "elementwise_curve", "op_overhead_s", "block_ops", "head_curve", "head_chunk_curve",
                "weight_cast_s_per_element"):
        assert key in cal, key
    assert cal["matmul_flops_fp32"] > 1e8 and cal["op_overhead_s"] > 0
    saved = json.loads((tmp_path / "cache" / "calibration.json").read_text())
    assert any(entry.get("elementwise_s_per_element") for entry in saved.values())
