"""One dispatcher: ``scaletrain <command>`` -> the command's package (``COMMANDS``, below).

Each command's flags and body live in its package's ``cli.py`` (data/cli.py, evaluation/cli.py, ...), or in
``commands/`` where they draw on several packages (train, finetune, export, plan, doctor); this file is the table,
the one-line parser, and the rule every command shares: an error a person can fix (config, data, checkpoint) is
printed as one line and exits with code 2.
"""

from __future__ import annotations

import argparse
import sys

from scaletrain.core.invocation import record_invocation
from scaletrain.core.options import UserError


def _command_parser(sub, name: str, module: str, add: str, run: str, help: str, *, load: bool) -> None:
    """One row of ``COMMANDS``: its arguments and implementation live in its package's cli.py. Only the
    command being run imports its package (``load``); the others are listed by name and help, so
    ``scaletrain prepare`` or ``scaletrain --help`` do not pay for importing the planner or torch.distributed."""
    p = sub.add_parser(name, help=help)
    if not load:
        return
    import importlib

    mod = importlib.import_module(module)
    getattr(mod, add)(p)
    p.set_defaults(func=getattr(mod, run))


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line (naming it) on stderr and exit code 2, not usage + error."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


FLAG_VOCABULARY = ("Flags: --section.field=VALUE sets a job field wherever a command reads a job (train, finetune, "
                   "plan, tune, lr-find: the same fields, checked alike; `scaletrain train --help` lists them; eval "
                   "and compress: the fields of the run's saved job they read); "
                   "kebab-case flags are a command's own inputs (--run, --config, --hardware); what a command "
                   "writes is --out (a training run's folder is the job field train.run_dir).")


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The whole command line. With ``argv``, only the command named in it is imported (see ``_command_parser``);
    without, every command is (for tools that inspect the full parser)."""
    parser = OneLineParser(prog="scaletrain", description=__doc__.splitlines()[0], epilog=FLAG_VOCABULARY)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    wanted = None if argv is None else next((a for a in argv if not a.startswith("-")), "")
    for name, module, add, run, help in COMMANDS:
        _command_parser(sub, name, module, add, run, help, load=wanted is None or wanted == name)
    return parser


# Every command, in `scaletrain --help`'s order: (name, its package's cli module, the function that adds its flags
# to its parser, the function that runs it, the one-line help).
COMMANDS = [
    ("train", "scaletrain.commands.train", "add_train_arguments", "run_train",
     "train a model (default: the tiny CPU recipe on bundled Tiny Shakespeare)"),
    ("eval", "scaletrain.evaluation.cli", "add_eval_arguments", "run_eval",
     "loss, perplexity and bits per byte of a run's latest checkpoint, on its validation split or any text "
     "(docs/evaluation.md)"),
    ("export", "scaletrain.commands.export", "add_export_arguments", "run_export",
     "export a run's latest checkpoint (a Hugging Face folder of its family's class, or GGUF)"),
    ("finetune", "scaletrain.commands.train", "add_finetune_arguments", "run_finetune",
     "adapt an existing model (a run or a Hugging Face folder): full, lora, qlora, prompt or prefix tuning"),
    ("generate", "scaletrain.infer.cli", "add_generate_arguments", "run_generate",
     "continue a prompt (or a JSONL file of prompts, batched) with a run's model; --stream"),
    ("chat", "scaletrain.infer.cli", "add_chat_arguments", "run_chat",
     "talk to a run's model in the terminal (its instruction template; /reset, /system TEXT, /exit)"),
    ("serve", "scaletrain.serve.cli", "add_serve_arguments", "run_serve",
     "serve a run's model over the OpenAI API (batched streaming) with a chat page; needs scaletrain[serve]"),
    ("prepare", "scaletrain.data.cli", "add_prepare_arguments", "run_prepare",
     "clean, deduplicate and tokenize raw text into sharded token files"),
    ("plan", "scaletrain.commands.plan", "add_plan_arguments", "run_plan",
     "predict memory, time and cost of a training job and pick the parallel plan"),
    ("doctor", "scaletrain.commands.plan", "add_doctor_arguments", "run_doctor",
     "describe this machine and measure its FLOP/s and bandwidths for the planner"),
    ("report", "scaletrain.report.cli", "add_report_arguments", "run_report",
     "one offline HTML page of a run's curves, resources, events and predicted vs measured (several overlay)"),
    ("scale", "scaletrain.scaling.cli", "add_scale_arguments", "run_scale",
     "scaling law: train a grid of short runs sized to a --budget, fit L(N, D) in bits per byte, store it by the data"),
    ("tune", "scaletrain.tune.cli", "add_tune_arguments", "run_tune",
     "hyperparameter search over config fields (Optuna TPE + pruning; a resumable SQLite study)"),
    ("lr-find", "scaletrain.tune.cli", "add_lr_find_arguments", "run_lr_find",
     "learning-rate range test: exponential sweep to divergence, the curve and a suggested optim.lr"),
    ("compress", "scaletrain.compress.cli", "add_compress_arguments", "run_compress",
     "prune (magnitude, Wanda, 2:4, structured) and/or quantize (torchao) a run into a new run folder; --report"),
]


def main(argv: list[str] | None = None) -> int:
    from scaletrain.core.quiet import quiet_known_noise

    quiet_known_noise()  # torchao's harmless import lines (QLoRA, compress)
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    record_invocation(argv)  # run_info.json records the command as given, also when called from Python
    try:
        return args.func(args) or 0
    except UserError as exc:  # ConfigError, DataError, CheckpointError, TrainingError, StorageError
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(INTERRUPTED_NOTES.get(args.command, "interrupted (Ctrl-C)"), file=sys.stderr)
        return 130


_TRAINING_INTERRUPTED = ("interrupted (a second Ctrl-C, or before training started): nothing saved since the last "
                         "checkpoint")
# What a Ctrl-C that reaches ``main`` leaves behind, for each command that writes (train's graceful first Ctrl-C is
# said by run_train, commands/train.py); each is what that command's writer guarantees (the temporaries are removed by
# guarded_write).
INTERRUPTED_NOTES = {
    "train": _TRAINING_INTERRUPTED,
    "finetune": _TRAINING_INTERRUPTED,
    "prepare": "interrupted (Ctrl-C): the output folder is not used until its manifest.json is written, last; run "
               "the same command again (the passes that completed are reused)",
    "export": "interrupted (Ctrl-C): nothing exported (the export is written beside --out and renamed into place "
              "last); an earlier export there is as it was",
    "compress": "interrupted (Ctrl-C): nothing written to --out (the compressed run is written beside it and renamed "
                "into place last); run the same command again",
    "scale": "interrupted (Ctrl-C): the grid's finished runs are kept (each holds its scale_run.json); run the same "
             "command again to go on from the unfinished one",
}


if __name__ == "__main__":
    sys.exit(main())
