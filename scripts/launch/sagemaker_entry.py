"""SageMaker training entry point: turns the SM_* environment into a ``scaletrain train`` run.

SageMaker starts this script on every instance (with ``distribution={"torch_distributed": {"enabled": True}}``
it is started by SageMaker's own torchrun, one process per GPU; see scripts/launch/sagemaker_estimator.py).
What it reads:

- ``SM_HPS`` (JSON of the estimator's ``hyperparameters``): ``config`` (a recipe path inside ``source_dir``
  or the installed package), ``checkpoint-dir`` (default ``/opt/ml/checkpoints``, the estimator's
  ``checkpoint_local_path``, which SageMaker syncs with ``checkpoint_s3_uri``: spot interruptions resume from
  it), ``nproc-per-node`` (only used when SageMaker did not start torchrun itself), and any ``section.field``
  key, passed on as ``--section.field=value``.
- ``SM_CHANNEL_TRAIN``: the ``train`` input channel (a prepared dataset folder or raw text); becomes
  ``--data.path`` when present.
- ``SM_HOSTS`` / ``SM_CURRENT_HOST`` / ``SM_NUM_GPUS``: when the script is not already under torchrun
  (``WORLD_SIZE`` unset), it starts ``torchrun`` itself over the hosts (c10d rendezvous on the first).
- ``SM_MODEL_DIR``: after training, the first host's rank 0 exports the model there
  (``scaletrain export --format hf``), which SageMaker uploads as ``model.tar.gz``.

The run always resumes when the checkpoint folder has a checkpoint (a spot instance restarted by SageMaker
continues where it stopped); a preempted run exits with status 75.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

DEFAULT_CHECKPOINT_DIR = "/opt/ml/checkpoints"
RDZV_PORT = 29500
# Hyperparameters this script consumes; every other key is a scaletrain config field.
OWN_KEYS = ("config", "checkpoint-dir", "nproc-per-node", "export")


def hyperparameters(env: dict[str, str]) -> dict[str, str]:
    """The estimator's hyperparameters (SageMaker passes them JSON-encoded in SM_HPS)."""
    raw = json.loads(env.get("SM_HPS", "{}") or "{}")
    return {str(k): str(v).lower() if isinstance(v, bool) else str(v) for k, v in raw.items()}


def train_arguments(env: dict[str, str]) -> list[str]:
    """``scaletrain train`` arguments from the SM_* environment."""
    hps = hyperparameters(env)
    args = ["train", "--resume"]
    if "config" in hps:
        args += ["--config", hps["config"]]
    args.append(f"--train.run_dir={checkpoint_dir(env)}")
    if env.get("SM_CHANNEL_TRAIN"):
        args.append(f"--data.path={env['SM_CHANNEL_TRAIN']}")
    args += [f"--{key}={value}" for key, value in sorted(hps.items()) if key not in OWN_KEYS]
    return args


def checkpoint_dir(env: dict[str, str]) -> str:
    return hyperparameters(env).get("checkpoint-dir", DEFAULT_CHECKPOINT_DIR)


def torchrun_command(env: dict[str, str]) -> list[str]:
    """torchrun over SM_HOSTS: one agent per host, c10d rendezvous on the first host, this host's processes
    = SM_NUM_GPUS (or the ``nproc-per-node`` hyperparameter; 1 on a CPU instance)."""
    hosts = json.loads(env.get("SM_HOSTS", '["localhost"]'))
    hps = hyperparameters(env)
    nproc = int(hps.get("nproc-per-node", 0)) or int(env.get("SM_NUM_GPUS", "0") or 0) or 1
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(hosts)}", f"--nproc-per-node={nproc}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={hosts[0]}:{RDZV_PORT}",
            f"--rdzv-id={env.get('TRAINING_JOB_NAME', 'scaletrain')}",
            "-m", "scaletrain.cli", *train_arguments(env)]


def is_first_host(env: dict[str, str]) -> bool:
    hosts = json.loads(env.get("SM_HOSTS", '["localhost"]'))
    return env.get("SM_CURRENT_HOST", hosts[0]) == hosts[0]


def main() -> int:
    env = dict(os.environ)
    # Restarted workers must not reuse the agent's TCP store (gloo's re-initialisation fails otherwise).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if "WORLD_SIZE" in env:  # SageMaker's torch_distributed already started us under torchrun: one rank
        from scaletrain.cli import main as scaletrain_main

        status = scaletrain_main(train_arguments(env))
        is_rank_zero = env.get("RANK", "0") == "0"
    else:
        status = subprocess.call(torchrun_command(env))
        is_rank_zero = is_first_host(env)
    model_dir = env.get("SM_MODEL_DIR")
    if status == 0 and model_dir and is_rank_zero and hyperparameters(env).get("export", "true") == "true":
        status = subprocess.call([sys.executable, "-m", "scaletrain.cli", "export", "--run", checkpoint_dir(env),
                                  "--out", model_dir, "--overwrite"])  # a restarted job exports again
    return status


if __name__ == "__main__":
    sys.exit(main())
