"""Start scaletrain on AWS SageMaker: a PyTorch estimator with torch_distributed (SageMaker runs torchrun on
every instance) and managed spot training that resumes from the checkpoint folder SageMaker syncs with S3.

    pip install sagemaker
    python scripts/launch/sagemaker_estimator.py --role arn:aws:iam::123456789012:role/SageMakerRole \\
        --bucket my-bucket --train-s3 s3://my-bucket/data/my-prepared-folder

NOT run here (no AWS account or network on the machine this was written on). What is tested locally is
the entry point (scripts/launch/sagemaker_entry.py) under a simulated SM_* environment
(tests/train/test_launch.py), and --dry-run prints the estimator's arguments without importing `sagemaker`.
Written against the SageMaker Python SDK v2 `sagemaker.pytorch.PyTorch` API.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def estimator_arguments(args: argparse.Namespace) -> dict:
    """Keyword arguments of ``sagemaker.pytorch.PyTorch`` for a scaletrain job."""
    return dict(
        entry_point="scripts/launch/sagemaker_entry.py",
        source_dir=str(REPO),  # the repository is uploaded; requirements.txt there would be installed
        dependencies=[],
        role=args.role,
        framework_version="2.5",  # a SageMaker PyTorch training image; scaletrain needs torch >= 2.11, so the
        py_version="py311",       # image_uri of a newer image (or your own) may be required - check the AWS list
        instance_type=args.instance_type,
        instance_count=args.instances,
        distribution={"torch_distributed": {"enabled": True}},  # SageMaker runs torchrun, one rank per GPU
        hyperparameters={
            "config": args.config,
            "checkpoint-dir": "/opt/ml/checkpoints",
            "parallel.dp_shard": -1,  # FSDP2 over every GPU of every instance
        },
        # Managed spot training: an interrupted job restarts and the entry point resumes from the checkpoints
        # SageMaker copied to checkpoint_s3_uri and back to checkpoint_local_path.
        use_spot_instances=args.spot,
        max_run=args.max_run,
        max_wait=args.max_run * 2 if args.spot else None,
        checkpoint_s3_uri=f"s3://{args.bucket}/scaletrain/checkpoints/{args.job_name}",
        checkpoint_local_path="/opt/ml/checkpoints",
        base_job_name=args.job_name,
        environment={"PYTHONPATH": "/opt/ml/code/src"},  # the uploaded repository's package
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--role", default="arn:aws:iam::123456789012:role/SageMakerRole")
    p.add_argument("--bucket", default="my-bucket")
    p.add_argument("--train-s3", default="", help="S3 prefix of the training data (the 'train' channel)")
    p.add_argument("--config", default="configs/gpt2_124m.toml")
    p.add_argument("--instance-type", default="ml.p4d.24xlarge")
    p.add_argument("--instances", type=int, default=2)
    p.add_argument("--spot", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--max-run", type=int, default=24 * 3600, help="seconds")
    p.add_argument("--job-name", default="scaletrain")
    p.add_argument("--dry-run", action="store_true", help="print the estimator's arguments and exit")
    args = p.parse_args()
    kwargs = estimator_arguments(args)
    if args.dry_run:
        print(json.dumps(kwargs, indent=2))
        return
    from sagemaker.pytorch import PyTorch  # pip install sagemaker

    estimator = PyTorch(**kwargs)
    estimator.fit({"train": args.train_s3} if args.train_s3 else None)


if __name__ == "__main__":
    main()
