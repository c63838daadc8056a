"""The DeepSpeed engine (parallel.engine = "deepspeed"): its bad-input rules (one line, exit 2; these need no
DeepSpeed), ds_config merging, and with DeepSpeed installed: ZeRO-1/2/3 on 2 gloo ranks against the native
engine's losses and the planner's model-state bytes, kill -9 + resume, and eval / export of its checkpoints."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.faults import (
    HELPERS,
    TORCHRUN,
    assert_same_run,
    env,
    finish,
    last_step,
    launch,
    losses,
    run_ok,
    train_args,
    wait_for,
    worker_pids,
    write_config,
)
from helpers.waits import CEILING_S
from scaletrain.config import ConfigError, load_config
from scaletrain.train.deepspeed_engine.ds_config import build_ds_config, deepspeed_missing_reason

ROOT = Path(__file__).resolve().parents[2]
NO_DEEPSPEED = deepspeed_missing_reason()
needs_deepspeed = pytest.mark.skipif(NO_DEEPSPEED is not None, reason=f"{NO_DEEPSPEED}")
RTOL = 1e-5


def train_cli(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "scaletrain.cli", "train", "--config",
                           str(ROOT / "docs/examples/tiny.toml"), "--parallel.engine=deepspeed", *flags],
                          env=env(), capture_output=True, text=True, timeout=CEILING_S)


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, proc.stdout + proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_unknown_ds_config_key_is_one_line(tmp_path):
    ds = tmp_path / "ds_config.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 8, "zero_optimisation": {"stage": 2}}))
    assert_one_line_error(train_cli(f"--deepspeed.config={ds}"), str(ds), "unknown key 'zero_optimisation'")


def test_zero3_with_pipeline_parallelism_is_one_line():
    assert_one_line_error(train_cli("--parallel.zero_stage=3", "--parallel.pp=2"), "ZeRO-3 with pipeline parallelism",
                          "parallel.pp=2")


def test_unwritable_nvme_path_is_one_line(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    # A path below a regular file cannot be created, even by root (permission bits would not stop root).
    assert_one_line_error(train_cli("--parallel.zero_stage=3", "--deepspeed.offload_optimizer=nvme",
                                    f"--deepspeed.nvme_path={blocker / 'nvme'}"),
                          "deepspeed.nvme_path", "is not writable")


def test_ds_config_conflict_is_one_line_and_omissions_are_filled(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"gradient_clipping": 0.5, "zero_optimization": {"stage": 2, "overlap_comm": False}}))
    assert_one_line_error(train_cli(f"--deepspeed.config={ds}", "--optim.grad_clip=1.0"),
                          "gradient_clipping = 0.5 conflicts with optim.grad_clip")
    cfg = load_config(None, {"parallel.engine": "deepspeed", "deepspeed.config": str(ds), "optim.grad_clip": "0.5",
                             "train.batch_size": "4", "train.grad_accum_steps": "2"})
    merged = build_ds_config(cfg, dp_size=2, precision="fp32")
    assert merged["zero_optimization"] == {"stage": 2, "overlap_comm": False}  # theirs kept, stage from theirs
    assert (merged["train_micro_batch_size_per_gpu"], merged["gradient_accumulation_steps"],
            merged["train_batch_size"], merged["gradient_clipping"]) == (4, 2, 16, 0.5)  # ours filled in
    ds.write_text(json.dumps({"optimizer": {"type": "Adam", "params": {"lr": 1e-4}}}))
    with pytest.raises(ConfigError, match="'optimizer' is set by scaletrain"):
        build_ds_config(cfg, dp_size=2, precision="fp32")


def test_precision_maps_to_ds_config_and_fp16_needs_a_gpu():
    """train.precision -> DeepSpeed's bf16 / fp16 sections (fp16 with its dynamic loss scaler); fp16 is refused
    on the CPU (DeepSpeed's CPU accelerator has no fp16), accepted for a GPU (the planner asks for cuda)."""
    from scaletrain.train.deepspeed_engine.ds_config import check_deepspeed

    cfg = load_config(None, {"parallel.engine": "deepspeed", "parallel.zero_stage": "2"})
    bf16, fp16 = build_ds_config(cfg, 2, "bf16"), build_ds_config(cfg, 2, "fp16")
    assert bf16["bf16"] == {"enabled": True} and bf16["fp16"] == {"enabled": False}
    assert fp16["fp16"] == {"enabled": True, "loss_scale": 0} and fp16["bf16"] == {"enabled": False}
    with pytest.raises(ConfigError, match="fp16 on the deepspeed engine needs a GPU"):
        check_deepspeed(cfg, 2, "cpu", "fp16")
    if NO_DEEPSPEED is None:
        assert check_deepspeed(cfg, 2, "cuda", "fp16").dp_size == 2
    recompute = load_config(None, {"parallel.engine": "deepspeed", "parallel.activation_checkpointing": "full"})
    with pytest.raises(ConfigError, match="activation_checkpointing is not applied by the deepspeed engine"):
        check_deepspeed(recompute, 1, "cpu", "fp32")  # it used to be accepted and silently not applied


def test_engines_are_chosen_from_the_config_and_share_one_interface(tmp_path):
    """The trainer holds an engine (train/engine.py) instead of being subclassed: ``engine_for`` picks it from
    parallel.engine, and every method of the TrainingEngine protocol has the same parameters on each engine,
    so the trainer never passes an engine arguments it does not take."""
    import inspect

    from scaletrain.checkpoint import CheckpointManager
    from scaletrain.train.deepspeed_engine.engine import DeepSpeedEngine
    from scaletrain.train.engine import NativeEngine, TrainingEngine, engine_for

    store = CheckpointManager(tmp_path / "checkpoints")
    native, deepspeed = (engine_for(load_config(None, {"parallel.engine": name}), "fp32", store)
                         for name in ("native", "deepspeed"))
    assert type(native) is NativeEngine and type(deepspeed) is DeepSpeedEngine
    for name in ("build", "step", "checkpoint", "sampling_model", "describe"):
        protocol = list(inspect.signature(getattr(TrainingEngine, name)).parameters)[1:]  # without self
        for engine in (native, deepspeed):
            assert list(inspect.signature(getattr(engine, name)).parameters) == protocol, (engine, name)
    # One step signature (train/step.py: StepFunction): the engines' step functions are written alike, the step's
    # settings in one StepOptions.
    from scaletrain.train.deepspeed_engine.engine import deepspeed_training_step
    from scaletrain.train.step import training_step

    assert str(inspect.signature(training_step)) == str(inspect.signature(deepspeed_training_step)) == \
        "(pm: 'ParallelModel', optimizer: 'torch.optim.Optimizer', micro_batches: 'Iterator[MicroBatch]', " \
        "accum: 'int', options: 'StepOptions') -> 'StepResult'"


@needs_deepspeed
def test_unknown_zero_optimization_field_is_one_line(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 1, "reduce_bucket_sise": 5}}))
    assert_one_line_error(train_cli(f"--deepspeed.config={ds}"), "zero_optimization.reduce_bucket_sise")


@needs_deepspeed
@pytest.mark.distributed
@pytest.mark.slow  # ~2 min on the AVX2-only CI machine: seven strategies, each a DeepSpeed engine on 2 ranks
def test_zero_stages_match_the_native_engine_and_the_planner(tmp_path):
    """2 gloo ranks, 2 accumulated micro-batches, clipping on: DeepSpeed ZeRO-1/2/3 (and ZeRO-2 with the optimizer
    state offloaded to the CPU, DeepSpeedCPUAdam; ZeRO-3 with optimizer state and parameters on "NVMe", a folder, where
    libaio is installed and SCALETRAIN_TEST_NVME=1) give the native engine's ZeRO-1 losses to 1e-5, and ZeRO-2/3 in
    DeepSpeed's bf16 within bf16 rounding (5e-3) with the module's parameters in bf16; each rank holds
    the params, fp32 master partition and Adam moments the planner's DeepSpeed recipe says (plan/memory.py:
    model_states with RECIPES["deepspeed-fp32"]), to 10%."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    out = tmp_path / "parity.json"
    # ZeRO-Infinity (ZeRO-3, optimizer state and parameters swapped to a folder) where libaio is installed and
    # SCALETRAIN_TEST_NVME=1: the first use compiles DeepSpeed's async_io and pin_memory ops (minutes on 2 cores,
    # more than the rest of this file), so the suite leaves it to that switch and benchmarks/deepspeed_nvme.py.
    nvme = ["ds3_nvme"] if os.environ.get("SCALETRAIN_TEST_NVME") == "1" and AsyncIOBuilder().is_compatible(
        verbose=False) else []
    strategies = ",".join(["native", "ds1", "ds2", "ds3", "ds2_cpu", "ds2_bf16", "ds3_bf16", *nvme])
    # DeepSpeedCPUAdam (ds2_cpu) compiles its C++ op on first use: ~50 s quiet on 2 cores, minutes beside the
    # other worker's tests. Built here first, under its own ceiling, so the parity run's ceiling times training.
    build = "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()"
    built = subprocess.run([sys.executable, "-c", build], env=env(), capture_output=True, text=True, timeout=CEILING_S)
    assert built.returncode == 0, built.stderr[-2000:]
    try:
        proc = subprocess.run([*TORCHRUN, "--standalone", "--nproc-per-node=2", str(HELPERS / "deepspeed_parity.py"),
                               "--out", str(out), "--strategies", strategies, "--nvme", str(tmp_path / "swap")],
                              env=env(), capture_output=True, text=True, timeout=CEILING_S)
    except subprocess.TimeoutExpired as stopped:  # name the strategy it was in, not a page of collective warnings
        stderr = stopped.stderr.decode(errors="replace") if isinstance(stopped.stderr, bytes) else stopped.stderr or ""
        progress = [line for line in stderr.splitlines() if line.startswith("parity: ")]
        pytest.fail(f"the parity run passed its {CEILING_S:.0f} s ceiling; its progress:\n" + "\n".join(progress))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    records = {r["strategy"]: r for r in json.loads(out.read_text())}
    native = records["native"]["losses"]
    assert native[-1] < native[0] - 0.05  # the updates happen (two batches alternate, so the loss falls)
    for name in ("ds1", "ds2", "ds3", "ds2_cpu", *nvme):
        got = records[name]["losses"]
        assert max(abs(a - b) / b for a, b in zip(got, native)) < RTOL, (name, got, native)
    for name in ("ds2_bf16", "ds3_bf16"):  # DeepSpeed's bf16: the module in bf16, fp32 masters; bf16 rounding
        assert records[name]["param_dtypes"] == ["torch.bfloat16"], records[name]
        got = records[name]["losses"]
        assert max(abs(a - b) / b for a, b in zip(got, native)) < 5e-3, (name, got, native)  # measured 5e-4
    for name in ("ds1", "ds2", "ds3"):
        predicted = records[name]["planner_bytes_per_rank"]
        for rank_bytes in records[name]["measured_bytes_per_rank"]:
            for part in ("params", "master", "optimizer"):
                assert abs(rank_bytes[part] - predicted[part]) <= 0.1 * predicted[part], (name, part, rank_bytes)


@pytest.mark.slow  # not in the default pass (README): the optional engine's resume
@needs_deepspeed
@pytest.mark.distributed
def test_kill9_then_resume_is_exact_and_checkpoints_export(tmp_path):
    """ZeRO-2 on 2 ranks: rank 1 killed (SIGKILL) at a random step, the run resumed from DeepSpeed's checkpoint
    ends with the uninterrupted run's losses and weights, bitwise; `scaletrain export` reads the checkpoint."""
    config = write_config(tmp_path, steps=30, interval=5)
    plan = ["--parallel.engine=deepspeed", "--parallel.zero_stage=2", "--train.batch_size=4"]
    straight = tmp_path / "straight"
    run_ok(["train", "--config", str(config), f"--train.run_dir={straight}", *plan], nproc=2,
           TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    run = tmp_path / "run"
    args = ["train", "--config", str(config), f"--train.run_dir={run}", *plan]
    kill_at = random.Random(0).randint(7, 20)
    proc = launch(args, nproc=2, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    wait_for(lambda: last_step(run) >= kill_at, proc, what=f"step {kill_at}")
    subprocess.run(["kill", "-9", str(worker_pids(proc)[1])], check=True)
    assert finish(proc) != 0 and last_step(run) < 30
    out = run_ok(args + ["--resume"], nproc=2, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    assert "resumed from" in out and "DeepSpeed checkpoint" in out
    assert_same_run(straight, run)  # losses per step and final weights (read through zero_to_fp32), bitwise
    exported = subprocess.run([sys.executable, "-m", "scaletrain.cli", "export", "--run", str(run), "--out",
                               str(tmp_path / "hf")], env=env(), capture_output=True, text=True, timeout=CEILING_S)
    assert exported.returncode == 0, exported.stderr[-2000:]
    assert (tmp_path / "hf" / "model.safetensors").is_file()


@pytest.mark.slow  # not in the default pass (README): the optional engine's reshard
@needs_deepspeed
@pytest.mark.distributed
def test_resume_on_another_world_size_through_the_universal_checkpoint(tmp_path):
    """ZeRO-2 on 2 ranks for 3 steps, resumed on 1 process (DeepSpeed's universal checkpoint, converted by
    ds_to_universal; the global batch kept by accumulating 2 micro-batches): losses per step and final weights of
    an uninterrupted 1-process run with the same global batch, to 1e-5."""
    config = write_config(tmp_path, steps=3, interval=3)
    plan = ["--parallel.engine=deepspeed", "--parallel.zero_stage=2"]
    run, straight = tmp_path / "run", tmp_path / "straight"
    run_ok(train_args(config, run, *plan), nproc=2, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    out = run_ok(train_args(config, run, *plan, "--resume", "--train.steps=6"))
    assert "resumed from" in out and "grad_accum_steps 1 -> 2" in out, out[-2000:]
    assert (run / "universal" / "step-00000003" / "deepspeed").is_dir()
    run_ok(train_args(config, straight, *plan, "--train.steps=6", "--train.grad_accum_steps=2"))
    assert sorted(losses(run)) == list(range(1, 7))
    assert_same_run(straight, run, rtol=1e-5)
