"""Distributed tests with real gloo processes launched by torchrun.

One launch per world size runs the whole parity matrix of that size (tests/helpers/dist_parity.py): 5 AdamW
steps of a tiny Llama from the same initialisation, parallel losses vs a single-process run on the
same global batches. Further launches cover the per-rank memory accounting, ``scaletrain train`` under
torchrun end to end (parity with a single process, checkpoint + resume), and DiLoCo vs DDP.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.dist_parity import MODEL
from helpers.launch import HELPERS, PARITY_RTOL, torchrun
from helpers.waits import CEILING_S

pytestmark = pytest.mark.distributed
def parity_run(tmp_path_factory, nproc: int, strategies: list[str], memory: list[str] = ()) -> dict:
    out = tmp_path_factory.mktemp(f"parity{nproc}") / "results.json"
    torchrun(nproc, str(HELPERS / "dist_parity.py"), "--out", str(out), "--strategies", ",".join(strategies),
             "--memory", ",".join(memory))
    records = json.loads(out.read_text())
    return {"parity": {r["strategy"]: r for r in records if r["kind"] == "parity"},
            "memory": [r for r in records if r["kind"] == "memory"]}


# "_compile": the same strategy with per-block torch.compile. A cold compile costs ~20 s on 2 cores; the
# inductor cache (/tmp/torchinductor_$USER) brings reruns down to a few seconds.
# "_padded": 60 tokens in the model's 64 rows, the padding columns masked out of the loss (on the
# vocabulary-sharded logits under TP, in the pipeline's loss_fn under PP) vs a reference on sliced logits.
WORLD2 = ["ddp", "ddp_accum2", "zero1", "fsdp2", "fsdp3", "fsdp3_accum2", "fsdp3_ac", "fsdp3_offload", "fsdp3_bf16",
          "tp", "tp_sp", "pp_gpipe", "pp_1f1b", "pp_interleaved", "pp_1f1b_accum2",
          "tp_padded", "tp_sp_padded", "pp_1f1b_padded",
          "ddp_muon", "ddp_accum2_muon", "fsdp2_muon", "fsdp3_muon", "fsdp3_accum2_muon", "pp_1f1b_muon"]
# Their own launch, in the slow tier: two cold compiles were ~40 s of the default pass's 2-rank launch (CI's cache
# is empty), and the compiled frames the checks below ask for need nothing else of the matrix.
WORLD2_COMPILED = ["ddp", "fsdp3", "ddp_compile", "fsdp3_compile"]
WORLD4 = ["hsdp", "fsdp_tp", "fsdp_tp_nosp", "pp_fsdp", "pp_tp", "pp_tp_padded"]


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return parity_run(tmp_path_factory, 2, WORLD2, memory=["ddp", "zero1", "fsdp2", "fsdp3"])


@pytest.fixture(scope="module")
def world2_compiled(tmp_path_factory):
    return parity_run(tmp_path_factory, 2, WORLD2_COMPILED)


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return parity_run(tmp_path_factory, 4, WORLD4)


def check_parity(record: dict, rtol: float = PARITY_RTOL) -> None:
    assert len(record["parallel"]) == len(record["reference"]) == 5
    assert record["reference"][-1] < record["reference"][0] - 0.3  # it learns: a wrong update would show
    assert record["max_rel_diff"] < rtol, (record["reference"], record["parallel"])


@pytest.mark.parametrize("strategy", [s for s in WORLD2 if s != "fsdp3_bf16"])
def test_parity_2_ranks(world2, strategy):
    check_parity(world2["parity"][strategy])


@pytest.mark.slow  # two cold compiles (world2_compiled)
@pytest.mark.parametrize("strategy", ["ddp_compile", "fsdp3_compile"])
def test_compiled_strategies_match_and_really_compile(world2_compiled, strategy):
    """Per-block torch.compile under DDP and FSDP2 matches one process, and only means something if torch.compile
    ran: at least one frame compiled during the run (DDP's blocks share one graph; FSDP2's hooks add a
    recompile)."""
    parity = world2_compiled["parity"]
    check_parity(parity[strategy])
    assert parity[strategy]["compiled_frames"] >= 1
    assert parity[strategy.removesuffix("_compile")]["compiled_frames"] == 0
    if strategy == "ddp_compile":
        assert parity[strategy]["all_reduce_calls"] == 5  # the counting comm hook survives compile


def test_ddp_accumulation_skips_all_reduce_on_non_final_micro_steps(world2):
    """``no_sync``: 5 steps x 2 micro-steps issue one gradient all-reduce per optimizer step, like 5 steps
    without accumulation (the tiny model fits in one DDP bucket), not one per micro-step (10)."""
    parity = world2["parity"]
    assert parity["ddp"]["all_reduce_calls"] == 5
    assert parity["ddp_accum2"]["grad_accum_steps"] == 2
    assert parity["ddp_accum2"]["all_reduce_calls"] == 5


def test_padded_strategies_mask_a_padding_column(world2, world4):
    """The "_padded" parity rows above ran with a vocabulary limit below the model's rows (60 of 64)."""
    records = {**world2["parity"], **world4["parity"]}
    assert {name for name, r in records.items() if r["vocab_limit"] == 60} == \
        {name for name in WORLD2 + WORLD4 if name.endswith("_padded")}


def test_muon_under_fsdp2_gathers_each_matrix_once_per_step(world2):
    """Muon (train/muon.py) on FSDP2 shards: each rank all-gathers every block matrix's update once a step (it
    receives the other rank's half: 4 bytes x half the matrix elements); DDP and pipeline ranks hold whole
    matrices and gather nothing. The parity rows above show the gathered update is the single-process one."""
    block = MODEL.dim * MODEL.dim * 4 + 3 * MODEL.dim * MODEL.ffn_hidden_dim  # wq, wk, wv, wo, w1, w2, w3
    per_step = MODEL.n_layers * block * 4 // 2
    parity = world2["parity"]
    for name in ("fsdp2_muon", "fsdp3_muon", "fsdp3_accum2_muon"):
        assert parity[name]["optimizer"] == "muon"
        assert parity[name]["muon_gathered_bytes"] == 5 * per_step
    assert parity["ddp_muon"]["muon_gathered_bytes"] == parity["pp_1f1b_muon"]["muon_gathered_bytes"] == 0


def test_bf16_mixed_precision_stays_close(world2):
    # bf16 params (fp32 reduce) cannot match fp32 to 1e-5; it must still track it closely.
    check_parity(world2["parity"]["fsdp3_bf16"], rtol=5e-2)


@pytest.mark.parametrize("strategy", WORLD4)
def test_parity_4_ranks(world4, strategy):
    check_parity(world4["parity"][strategy])


@pytest.mark.slow
def test_parity_3d_8_ranks(tmp_path_factory):
    """PP x TP x FSDP (interleaved 1F1B, sequence parallel) on 8 ranks."""
    check_parity(parity_run(tmp_path_factory, 8, ["pp_tp_fsdp"])["parity"]["pp_tp_fsdp"])


def test_memory_matches_zero_accounting(world2):
    """Per-rank bytes on N = 2 ranks, fp32 AdamW (Psi parameters): params 4 Psi, grads 4 Psi, moments 8 Psi,
    divided by N where the ZeRO paper says so. FSDP2 'ZeRO-2-like' holds full params only during a step."""
    by = {}
    for r in world2["memory"]:
        by.setdefault(r["strategy"], []).append(r)
    n = 2
    psi = by["ddp"][0]["num_params"]
    full_p, full_g, full_o = 4 * psi, 4 * psi, 8 * psi
    expected = {  # strategy: (params at rest, params during the step, grads, optimizer moments)
        "ddp": (full_p, full_p, full_g, full_o),
        "fsdp2": (full_p / n, full_p, full_g / n, full_o / n),
        "fsdp3": (full_p / n, full_p / n, full_g / n, full_o / n),
    }
    for name, (p_rest, p_step, g, o) in expected.items():
        for r in by[name]:
            assert (r["params_at_rest"], r["params_in_step"], r["grads"],
                    r["optimizer_states"]) == (p_rest, p_step, g, o)
    # ZeRO-1 splits whole parameters between ranks, so shares are 1/N up to one parameter's states.
    zero1 = by["zero1"]
    assert sum(r["optimizer_states"] for r in zero1) == full_o
    for r in zero1:
        assert (r["params_at_rest"], r["grads"]) == (full_p, full_g)
        assert abs(r["optimizer_states"] - full_o / n) <= 8 * r["largest_param"]


TINY_TOML = """
[model]
dim = 64
n_layers = 4
n_heads = 4
ffn_hidden_dim = 128
max_seq_len = 64
[data]
seq_len = 64
cache_dir = "{cache}"
[train]
steps = {steps}
batch_size = 8
eval_interval = 0
eval_batches = 2
sample_tokens = 0
seed = 7
precision = "fp32"  # parity to fp32 rounding (auto may measure bf16 faster)
[schedule]
warmup_steps = 5
[logging]
log_interval = 1
progress = "off"
tensorboard = false
[checkpoint]
interval = 5
"""


def train_losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines if '"loss"' in line]


def test_cli_under_torchrun_matches_single_process_and_resumes(tmp_path):
    """`scaletrain train` unchanged under torchrun: FSDP on 2 ranks x 4 rows == 1 process x 8 rows (the
    loader's global sample order does not depend on the world size); then a resume repeats the losses."""
    config = tmp_path / "tiny.toml"
    config.write_text(TINY_TOML.format(cache=tmp_path / "data", steps=10))
    cli = ["-m", "scaletrain.cli", "train", "--config", str(config)]
    single = subprocess.run([sys.executable, *cli, f"--train.run_dir={tmp_path / 'single'}"], capture_output=True,
                            text=True, timeout=CEILING_S)
    assert single.returncode == 0, single.stderr[-3000:]
    proc = torchrun(2, *cli, f"--train.run_dir={tmp_path / 'fsdp'}", "--parallel.dp_shard=2", "--train.batch_size=4")
    # Only rank 0 speaks: one model line and one summary line, whole (not two ranks' lines run together).
    lines = proc.stdout.splitlines()
    assert [line.split(":")[0] for line in lines if line.startswith(("model:", "done:"))] == ["model", "done"], lines
    expected, got = train_losses(tmp_path / "single"), train_losses(tmp_path / "fsdp")
    assert len(got) == len(expected) == 10  # rank-0-only logging: one record per step, not one per rank
    assert max(abs(a - b) / b for a, b in zip(got, expected)) < PARITY_RTOL
    record = json.loads((tmp_path / "fsdp" / "metrics.jsonl").read_text().splitlines()[-2])
    assert len(record["peak_memory_mb_per_rank"]) == 2
    # Resume from step 5 on 2 ranks: steps 6..10 repeat exactly.
    (tmp_path / "fsdp" / "metrics.jsonl").unlink()
    shutil.rmtree(tmp_path / "fsdp" / "checkpoints" / "step-00000010")
    torchrun(2, *cli, f"--train.run_dir={tmp_path / 'fsdp'}", "--parallel.dp_shard=2", "--train.batch_size=4",
             "--resume")
    assert train_losses(tmp_path / "fsdp") == got[5:]


def test_top_plan_for_two_cpu_ranks_trains_under_torchrun(tmp_path):
    """`plan --hardware cpu:2 --emit` then `torchrun --nproc-per-node 2 ... train` on the emitted file: the
    search's first choice for a 2-rank CPU job is a job the trainer accepts and trains."""
    from scaletrain.cli import main
    from scaletrain.config import load_config

    job = tmp_path / "tiny.toml"
    job.write_text(TINY_TOML.format(cache=tmp_path / "data", steps=2))
    emitted = tmp_path / "best.toml"
    assert main(["plan", "--config", str(job), "--model.vocab_size=65", "--hardware", "cpu:2", "--tokens", "8192",
                 "--global-batch", "8", "--emit", str(emitted)]) == 0
    plan = load_config(emitted)
    degrees = {k: getattr(plan.parallel, k) for k in ("dp_replicate", "dp_shard", "tp", "pp", "cp")}
    assert plan.parallel.dp_replicate * plan.parallel.dp_shard * plan.parallel.tp * plan.parallel.pp == 2, degrees
    run = tmp_path / "run"
    torchrun(2, "-m", "scaletrain.cli", "train", "--config", str(emitted), "--train.steps=2",
             f"--train.run_dir={run}", f"--data.cache_dir={tmp_path / 'data'}", "--logging.progress=off",
             "--logging.tensorboard=false", "--train.eval_interval=0", "--train.sample_tokens=0",
             "--checkpoint.interval=0", "--schedule.warmup_steps=1", "--logging.log_interval=1")
    saved = load_config(run / "config.toml")
    assert {k: getattr(saved.parallel, k) for k in degrees} == degrees  # it ran the plan it was given
    losses = train_losses(run)
    assert len(losses) == 2 and all(0 < loss < 10 for loss in losses), losses


def test_tp2_pads_a_data_derived_vocabulary_and_matches_single_process(tmp_path):
    """`scaletrain train --parallel.tp=2` on the 65-character data with model.vocab_size = 0: the vocabulary
    is padded to 66 (said in the log line), it trains, and its losses match one process training the same
    66-row model (an explicit model.vocab_size, its extra row masked the same way); the export has 65 rows."""
    config = tmp_path / "tiny.toml"
    config.write_text(TINY_TOML.format(cache=tmp_path / "data", steps=5))
    cli = ["-m", "scaletrain.cli", "train", "--config", str(config)]
    single = subprocess.run([sys.executable, *cli, f"--train.run_dir={tmp_path / 'single'}", "--model.vocab_size=66"],
                            capture_output=True, text=True, timeout=CEILING_S)
    assert single.returncode == 0, single.stderr[-3000:]
    proc = torchrun(2, *cli, f"--train.run_dir={tmp_path / 'tp'}", "--parallel.tp=2", "--parallel.dp_shard=1")
    assert "vocab 65 -> 66 (padded for parallel.tp=2; padding rows masked out of the loss and sampling)" in proc.stdout
    expected, got = train_losses(tmp_path / "single"), train_losses(tmp_path / "tp")
    assert len(got) == len(expected) == 5
    assert max(abs(a - b) / b for a, b in zip(got, expected)) < PARITY_RTOL
    assert got[-1] < got[0]
    from safetensors.torch import load_file

    from scaletrain.cli import main

    assert main(["export", "--run", str(tmp_path / "tp"), "--out", str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"] == 65
    weights = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert weights["model.embed_tokens.weight"].shape == weights["lm_head.weight"].shape == (65, 64)


def low_comm_recipe(cache: Path) -> str:
    """The tiny recipe DDP, local SGD and DiLoCo are compared on (here and in benchmarks/low_comm.py):
    dim 64, 4 layers, char-level Tiny Shakespeare, seq 64, 8 sequences per rank, 200 steps, warm-up 20."""
    return TINY_TOML.format(cache=cache, steps=200).replace("warmup_steps = 5", "warmup_steps = 20")


@pytest.mark.slow  # not in the default pass (README): a 3-way training comparison
def test_diloco_reaches_ddp_loss_with_h_times_fewer_all_reduces(tmp_path):
    """Tiny recipe, 2 replicas, equal tokens (200 steps x 2 x 8 x 64): DiLoCo (H = 10) ends within 5% of
    DDP's validation loss while issuing H times fewer (and H times fewer bytes of) all-reduces."""
    config = tmp_path / "tiny.toml"
    config.write_text(low_comm_recipe(tmp_path / "data"))
    out = tmp_path / "runs.json"
    common = "parallel.dp_replicate=2,checkpoint.enabled=false,logging.log_interval=50"
    torchrun(2, str(HELPERS / "dist_train.py"), "--config", str(config), "--out", str(out),
             f"ddp:{common},train.run_dir={tmp_path / 'ddp'}",
             f"diloco:{common},parallel.low_comm=diloco,parallel.sync_every=10,train.run_dir={tmp_path / 'diloco'}")
    runs = json.loads(out.read_text())
    ddp, diloco = runs["ddp"], runs["diloco"]
    assert ddp["steps"] == diloco["steps"] == 200
    assert ddp["final_val_loss"] < 3.0  # both actually trained
    assert abs(diloco["final_val_loss"] - ddp["final_val_loss"]) / ddp["final_val_loss"] < 0.05
    assert diloco["all_reduce_calls"] * 10 <= ddp["all_reduce_calls"]
    assert diloco["all_reduce_bytes"] * 10 <= ddp["all_reduce_bytes"]


@pytest.mark.slow
def test_two_rank_doctor_measures_tensor_parallel_and_fsdp_host_overheads(tmp_path, monkeypatch):
    """With a single-process calibration cached (the reference CPU's, under this machine's one-thread key, as
    `scaletrain doctor` would write it), `torchrun ... doctor` also measures what TP and FSDP2 ZeRO-3 add
    beyond their compute and bytes, per block and per model (FSDP2 also per parameter of its big units), and the
    optimizer step per tensor and per element in each layout; the planner charges them."""
    from scaletrain.hardware.peak import device_fingerprint
    from scaletrain.hardware.reference_cpu import REFERENCE_CPU_CALIBRATION
    from scaletrain.plan.hardware_spec import COMMUNICATION_KEYS

    monkeypatch.setenv("SCALETRAIN_CACHE", str(tmp_path))
    single = {k: v for k, v in REFERENCE_CPU_CALIBRATION.items() if k not in COMMUNICATION_KEYS}
    (tmp_path / "calibration.json").write_text(json.dumps({device_fingerprint("cpu", threads=1): single}))
    proc = torchrun(2, "-m", "scaletrain.cli", "doctor", "--clock", "cpu", timeout=CEILING_S)
    assert "FSDP2 ZeRO-3" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    data = json.loads((tmp_path / "calibration.json").read_text())
    (comm,) = [v for k, v in data.items() if k.startswith("comm|")]
    for cost in comm["tp_overhead"].values():
        assert set(cost) == {"per_block_s", "per_model_s"}
        assert 0.0 <= cost["per_block_s"] < 1.0 and 0.0 <= cost["per_model_s"] < 1.0
    assert sum(comm["tp_overhead"]["replicated"].values()) > 0  # DTensor's host work is never free
    fsdp = comm["fsdp_overhead"]  # and per parameter of a unit past glibc's mmap threshold (its fresh pages)
    assert set(fsdp) == {"per_block_s", "per_model_s", "per_param_s"}
    assert 0.0 <= fsdp["per_block_s"] < 1.0 and 0.0 <= fsdp["per_model_s"] < 1.0 and 0.0 <= fsdp["per_param_s"] < 1e-6
    # The optimizer step (clipping + AdamW) as the ranks run it, per layout: every step touches every element
    assert set(comm["optimizer_step"]) == {"plain", "fsdp", "tp"}
    for rates in comm["optimizer_step"].values():
        assert 1e-12 < rates["per_element_s"] < 1e-7 and 0.0 <= rates["per_tensor_s"] < 0.01
    assert "ns/element" in proc.stdout + proc.stderr


@pytest.mark.slow  # not in the default pass (README): the doctor's 2-rank clock
def test_two_rank_doctor_measures_communication_and_contention(tmp_path, monkeypatch):
    """`torchrun ... scaletrain doctor` on 2 gloo ranks writes the host's communication entry: all-reduce
    bandwidth and latency, DTensor overhead and the co-running slowdown the time model charges ranks
    that share a host (without a single-process calibration it says TP overhead needs one)."""
    monkeypatch.setenv("SCALETRAIN_CACHE", str(tmp_path))
    proc = torchrun(2, "-m", "scaletrain.cli", "doctor", "--clock", "cpu", timeout=CEILING_S)
    assert "run `scaletrain doctor`" in proc.stdout + proc.stderr  # no TP overhead without the 1-process entry
    data = json.loads(next(tmp_path.glob("*.json")).read_text())
    (comm,) = [v for k, v in data.items() if k.startswith("comm|")]
    assert comm["allreduce_busbw"] > 0 and comm["collective_latency_s"] > 0 and comm["allreduce_world_size"] == 2
    assert 1.0 <= comm["corun_slowdown"] < 4.0
    assert set(comm["optimizer_step"]) == {"plain", "fsdp", "tp"}  # needs no single-process rate: measured too
