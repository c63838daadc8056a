"""Launch templates, run as far as one machine allows: the Kubernetes PyTorchJob's command as two torchrun agents
on localhost (c10d rendezvous, the PET_* variables the operator sets), the SLURM script with stand-in
``srun``/``scontrol`` (again two agents), the SageMaker entry point under a simulated SM_* environment, and
``accelerate launch`` starting two ranks. Each training run is compared with one plain process on the same global
batch (the loader's sample order does not depend on the world size)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from helpers.faults import finish, output, wait_for
from helpers.launch import env_for_ranks, free_port
from helpers.tiny import tiny_overrides
from helpers.waits import CEILING_S

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "scripts" / "launch"
PARITY_RTOL = 1e-5
STEPS = 6
SHARDED = {"parallel.dp_shard": -1}  # FSDP2 over the ranks present (what the templates run)

pytestmark = pytest.mark.distributed


def flags(run_dir: Path, **extra) -> list[str]:
    over = tiny_overrides(run_dir, **{"train.steps": STEPS, "checkpoint.interval": 0,
                                            "logging.log_interval": 1, **extra})
    return [f"--{k}={v}" for k, v in over.items()]


def losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in line]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[float]:
    """One plain process, 8 rows a step = 2 ranks x 4 rows, started as the ``scaletrain`` command is (``python -m
    scaletrain``: the allocator preload of allocator.py, which its run_info.json names)."""
    from scaletrain.hardware.allocator import find

    run_dir = tmp_path_factory.mktemp("reference") / "run"
    env = {k: v for k, v in env_for_ranks().items() if k not in ("SCALETRAIN_MALLOC", "_SCALETRAIN_MALLOC_DONE")}
    proc = subprocess.run([sys.executable, "-m", "scaletrain", "train", *flags(run_dir, **{"train.batch_size": 8})],
                          env=env, capture_output=True, text=True, timeout=CEILING_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = "jemalloc" if find("jemalloc") else "tcmalloc" if find("tcmalloc") else "system"
    assert json.loads((run_dir / "run_info.json").read_text())["segments"][0]["allocator"] == expected
    return losses(run_dir)


def assert_two_rank_run_matches(run_dir: Path, reference: list[float]) -> None:
    got = losses(run_dir)
    assert len(got) == len(reference) == STEPS
    assert max(abs(a - b) / b for a, b in zip(got, reference)) < PARITY_RTOL, (got, reference)
    record = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert len(record[-1]["peak_memory_mb_per_rank"]) == 2  # two ranks really trained
    assert (run_dir / "checkpoints" / f"step-{STEPS:08d}").is_dir()


def test_pytorchjob_command_runs_as_two_torchrun_agents_on_localhost(tmp_path, reference):
    """The manifest's container command, started twice (two 'pods') with the operator's PET_* settings:
    one rendezvous (c10d on 127.0.0.1), one 2-rank job, the single-process losses."""
    yaml = pytest.importorskip("yaml")
    docs = yaml.safe_load_all((LAUNCH / "pytorchjob.yaml").read_text())
    job = [doc for doc in docs if doc["kind"] == "PyTorchJob"][0]
    assert job["spec"]["elasticPolicy"]["rdzvBackend"] == "c10d"
    assert job["spec"]["elasticPolicy"]["minReplicas"] < job["spec"]["elasticPolicy"]["maxReplicas"]
    pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    (container,) = pod["containers"]
    assert {"name": "checkpoints", "mountPath": "/checkpoints"} in container["volumeMounts"]
    assert any(v.get("persistentVolumeClaim") for v in pod["volumes"])
    command = container["command"]
    assert command[:4] == ["torchrun", "-m", "scaletrain.cli", "train"] and "--resume" in command
    # Keep the manifest's own flags, but point the recipe at a tiny CPU job (later flags win).
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "torch.distributed.run", *command[1:], *flags(run_dir)]
    argv[argv.index("--config") + 1] = str(ROOT / "docs" / "examples" / "tiny.toml")
    env = env_for_ranks(PET_NNODES="2", PET_NPROC_PER_NODE="1", PET_RDZV_BACKEND="c10d",
                        PET_RDZV_ENDPOINT=f"127.0.0.1:{free_port()}", PET_RDZV_ID="pytorchjob-test",
                        PET_MAX_RESTARTS="0")
    agents = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for _ in range(2)]
    outputs = [agent.communicate(timeout=CEILING_S)[0] for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert_two_rank_run_matches(run_dir, reference)


@pytest.mark.slow  # not in the default pass (README): a launcher; torchrun's own are in it
def test_slurm_script_runs_two_agents_through_srun(tmp_path, reference):
    """scripts/slurm_train.sbatch with stand-ins: `scontrol show hostnames` names 127.0.0.1 and `srun` starts
    its command once per 'node' (in the background, as SLURM does), so the script's own torchrun line makes a
    2-node c10d job on this machine."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho 127.0.0.1\n")
    (bin_dir / "srun").write_text("#!/bin/bash\n# stand-in: drop srun's own options, start one copy per node\n"
                                  "while [[ $1 == --* ]]; do shift; done\n"
                                  "for node in $(seq 0 $((SLURM_JOB_NUM_NODES - 1))); do\n"
                                  "  SLURM_NODEID=$node SLURM_PROCID=$node \"$@\" & done\n"
                                  "status=0; for job in $(jobs -p); do wait $job || status=1; done; exit $status\n")
    (bin_dir / "torchrun").write_text(f"#!/bin/bash\nexec {sys.executable} -m torch.distributed.run \"$@\"\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    run_dir = tmp_path / "run"
    env = env_for_ranks(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", SLURM_JOB_NODELIST="node[1-2]",
                        SLURM_JOB_NUM_NODES="2", SLURM_JOB_ID="4242", NPROC_PER_NODE="1",
                        RDZV_PORT=str(free_port()))
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "slurm_train.sbatch"), str(ROOT / "docs/examples/tiny.toml"),
                           *flags(run_dir, **SHARDED)], env=env, capture_output=True, text=True,
                          timeout=CEILING_S)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert_two_rank_run_matches(run_dir, reference)


def test_slurm_script_requeues_itself_near_the_time_limit(tmp_path):
    """`--signal=B:USR1@180` reaches the batch script: it runs `scontrol requeue $SLURM_JOB_ID` and keeps waiting
    for srun (whose ranks checkpoint on the SIGTERM that follows), then exits with srun's status."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "scontrol.log"
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\necho "$@" >> {log}\necho 127.0.0.1\n')
    started = tmp_path / "srun-started"  # the script reached srun, after its trap: a signal now is handled
    (bin_dir / "srun").write_text(f"#!/bin/bash\ntouch {started}\nsleep 4\nexit 0\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = env_for_ranks(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", SLURM_JOB_NODELIST="node1",
                        SLURM_JOB_NUM_NODES="1", SLURM_JOB_ID="4242")
    out_file = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(["bash", str(ROOT / "scripts" / "slurm_train.sbatch"), "recipe.toml"], env=env,
                            stdout=out_file, stderr=subprocess.STDOUT, text=True)
    proc.log = out_file  # as faults.launch does: what wait_for and output() read
    wait_for(started.exists, proc, what="srun")  # a fixed 1.5 s raced the script's start on a slow machine
    proc.send_signal(signal.SIGUSR1)
    code = finish(proc)
    out = output(proc)
    assert code == 0, out
    assert "requeue 4242" in log.read_text() and "requeueing job 4242" in out


def load_entry():
    sys.path.insert(0, str(LAUNCH))
    try:
        import sagemaker_entry
    finally:
        sys.path.remove(str(LAUNCH))
    return sagemaker_entry


@pytest.mark.slow  # not in the default pass (README): a launcher; torchrun's own are in it
def test_sagemaker_entry_point_reads_the_sm_environment(tmp_path, reference):
    """The entry point under a simulated SageMaker environment (2 processes on one 'instance'): hyperparameters
    become flags, the train channel the data, the checkpoint folder the run folder, and the model is exported
    to SM_MODEL_DIR; started again (a spot restart), it resumes and finds the run complete."""
    entry = load_entry()
    channel = tmp_path / "channel"
    channel.mkdir()
    shutil.copy(ROOT / "src" / "scaletrain" / "assets" / "tinyshakespeare" / "input.txt", channel / "input.txt")
    ckpt, model_dir = tmp_path / "opt-ml-checkpoints", tmp_path / "opt-ml-model"
    hps = {"config": str(ROOT / "docs/examples/tiny.toml"), "checkpoint-dir": str(ckpt), "nproc-per-node": 2,
           "logging.log_interval": 1, **SHARDED,
           **{k: v for k, v in tiny_overrides(ckpt, **{"train.steps": STEPS, "train.batch_size": 4}).items()
              if k != "train.run_dir"}}
    env = env_for_ranks(SM_HPS=json.dumps(hps), SM_HOSTS='["127.0.0.1"]', SM_CURRENT_HOST="127.0.0.1",
                        SM_NUM_GPUS="0", SM_CHANNEL_TRAIN=str(channel), SM_MODEL_DIR=str(model_dir),
                        TRAINING_JOB_NAME="sm-test")
    command = entry.torchrun_command(env)
    assert "--nnodes=1" in command and "--nproc-per-node=2" in command and "--resume" in command
    assert f"--data.path={channel}" in command and f"--train.run_dir={ckpt}" in command
    proc = subprocess.run([sys.executable, str(LAUNCH / "sagemaker_entry.py")], env=env, capture_output=True,
                          text=True, timeout=CEILING_S)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert_two_rank_run_matches(ckpt, reference)  # the channel holds the same text as builtin:tinyshakespeare
    assert (model_dir / "config.json").is_file() and (model_dir / "model.safetensors").is_file()
    again = subprocess.run([sys.executable, str(LAUNCH / "sagemaker_entry.py")], env=env, capture_output=True,
                           text=True, timeout=CEILING_S)
    assert again.returncode == 0 and "already complete at step 6" in again.stdout, again.stdout + again.stderr[-2000:]


def test_sagemaker_entry_point_multi_host_command():
    """Two instances: one agent each, c10d rendezvous on the first host, one rank per GPU."""
    entry = load_entry()
    env = {"SM_HOSTS": '["algo-1", "algo-2"]', "SM_CURRENT_HOST": "algo-2", "SM_NUM_GPUS": "8",
           "SM_HPS": json.dumps({"config": "configs/gpt2_124m.toml", "parallel.dp_shard": -1, "export": False})}
    command = entry.torchrun_command(env)
    assert command[3:8] == ["--nnodes=2", "--nproc-per-node=8", "--rdzv-backend=c10d",
                            "--rdzv-endpoint=algo-1:29500", "--rdzv-id=scaletrain"]
    assert command[-4:] == ["--config", "configs/gpt2_124m.toml", "--train.run_dir=/opt/ml/checkpoints",
                            "--parallel.dp_shard=-1"]
    assert not entry.is_first_host(env)


def test_accelerate_launch_starts_two_scaletrain_ranks(tmp_path, reference):
    """`accelerate launch` with the multi-CPU config starts two ranks through torch's elastic launcher, which
    scaletrain's trainer joins like any torchrun job."""
    if shutil.which("accelerate") is None and not (Path(sys.executable).parent / "accelerate").exists():
        pytest.skip("accelerate is not installed (pip install accelerate)")
    accelerate = shutil.which("accelerate") or str(Path(sys.executable).parent / "accelerate")
    run_dir = tmp_path / "run"
    proc = subprocess.run([accelerate, "launch", "--config_file", str(LAUNCH / "accelerate_multi_cpu.yaml"),
                           "--main_process_port", str(free_port()), "-m", "scaletrain.cli", "train",
                           "--config", str(ROOT / "docs/examples/tiny.toml"), *flags(run_dir, **SHARDED)],
                          env=env_for_ranks(HF_HUB_OFFLINE="1"), capture_output=True, text=True, timeout=CEILING_S)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert_two_rank_run_matches(run_dir, reference)
