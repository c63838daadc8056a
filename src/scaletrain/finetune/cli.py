"""`scaletrain finetune`: `scaletrain train` with finetune.source set from --from (train/cli.py runs it)."""

from __future__ import annotations

import argparse

from scaletrain.config import JobConfig, add_config_arguments
from scaletrain.train.cli import run_train


def add_finetune_arguments(p: argparse.ArgumentParser) -> None:
    """`scaletrain finetune`'s flags: --from (the base), then train's."""
    p.description = ("Fine-tune: `scaletrain train` with finetune.source set from --from. The [model] "
            "fields and data.tokenizer come from the base, and so does the data when the base "
            "is a run and data.path is not given (its prepared tokens); everything else "
            "(steps, parallelism, resume) works as for train. See docs/finetuning.md.")
    p.add_argument("--from", dest="source", required=True,
                   help="the base: a scaletrain run folder or a Hugging Face folder of a supported family "
                        "(docs/families.md)")
    p.add_argument("--config", help="TOML recipe (see configs/)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as TOML and exit")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in train.run_dir")
    p.add_argument("--overwrite", action="store_true",
                   help="start afresh in a train.run_dir that holds an earlier run (as for train)")
    add_config_arguments(p, JobConfig)




def run_finetune(args: argparse.Namespace) -> int:
    setattr(args, "cfg:finetune.source", args.source)
    return run_train(args)
