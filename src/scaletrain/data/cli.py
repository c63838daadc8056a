"""``scaletrain prepare``: the command-line face of ``data.prepare`` (wired into ``scaletrain.cli``).

    scaletrain prepare TEXT_FILE_OR_FOLDER... --out DIR [--tokenizer char|bpe|PATH] [--vocab-size N]
                       [--val-fraction F]
    scaletrain prepare --config configs/data/gutenberg.toml [--dedup.threshold=0.3 ...]
    scaletrain prepare --verify DIR          # recompute every checksum of a prepared folder
    scaletrain prepare --config X --print-config

Exit codes: 0 done (input problems that were skipped are counted in the table and report.json),
2 a problem that makes the output wrong or impossible (bad config, no input, empty corpus after
filtering, a vocabulary that does not fit the dtype, a checksum mismatch, non-UTF-8 with
``encoding_errors = 'fail'``), printed as one line naming the file.
"""

from __future__ import annotations

import argparse
import sys

from scaletrain.config import ConfigError, add_config_arguments, load_config, overrides_from_args, to_toml
from scaletrain.data.prepare_config import PrepareConfig


def add_prepare_arguments(parser: argparse.ArgumentParser) -> None:
    """The minimal flags, ``--config``, and one ``--section.field`` flag per config field."""
    parser.add_argument("sources", nargs="*", metavar="TEXT_FILE_OR_FOLDER",
                        help="raw input (files, folders, hf:NAME); sets source.paths")
    parser.add_argument("--out", help="output folder (output.dir)")
    parser.add_argument("--config", help="a data.toml (see configs/data/)")
    parser.add_argument("--tokenizer", dest="tokenizer_kind", help="char, bpe or a tokenizer.json (tokenizer.kind)")
    parser.add_argument("--vocab-size", type=int, help="BPE vocabulary size (tokenizer.vocab_size)")
    parser.add_argument("--val-fraction", type=float, help="validation fraction (split.val_fraction)")
    parser.add_argument("--force", action="store_true", help="rebuild every stage (output.force)")
    parser.add_argument("--verify", metavar="DIR", help="verify the checksums of a prepared folder and exit")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config as TOML and exit")
    add_config_arguments(parser, PrepareConfig)


def config_from_args(args: argparse.Namespace) -> PrepareConfig:
    """CLI > TOML > defaults; the minimal flags are shorthands for config fields."""
    overrides: dict = overrides_from_args(args)
    shorthand = {"source.paths": args.sources or None, "output.dir": args.out,
                 "tokenizer.kind": args.tokenizer_kind, "tokenizer.vocab_size": args.vocab_size,
                 "split.val_fraction": args.val_fraction, "output.force": True if args.force else None}
    overrides.update({k: v for k, v in shorthand.items() if v is not None})
    if not args.config and "source.paths" not in overrides:
        raise ConfigError("nothing to prepare: give TEXT_FILE_OR_FOLDER (with --out DIR) or --config data.toml")
    return load_config(args.config, overrides, cls=PrepareConfig)


def run_prepare(args: argparse.Namespace) -> int:
    """Run ``prepare`` (or ``--verify``); ConfigError/DataError propagate to the caller, which prints
    them as one line and exits with code 2."""
    from scaletrain.data.prepare import prepare
    from scaletrain.data.report import Report
    from scaletrain.data.shards import verify_checksums

    if args.verify:
        checked = verify_checksums(args.verify)
        print(f"{args.verify}: {checked} files match the manifest's checksums")
        return 0
    cfg = config_from_args(args)
    if args.print_config:
        print(to_toml(cfg), end="")
        return 0
    from scaletrain.core.writer_lock import one_writer  # train's one-writer lock, on the output folder

    report = Report(echo=True)
    with one_writer(cfg.output.dir, f"output folder {cfg.output.dir}", "prepare into another --out"):
        manifest = prepare(cfg, report, log=print)
    if report.documents_in:  # zero when the output was already up to date
        print(report.table())
    splits = ", ".join(f"{s} {info['tokens']:,} tokens" for s, info in manifest["splits"].items())
    asked = manifest["tokenizer"].get("vocab_size_asked")
    vocab = f"{manifest['vocab_size']:,}" + (f" of {asked:,} asked: the corpus supports no more" if asked else "")
    print(f"wrote {cfg.output.dir} (vocab {vocab}, {manifest['dtype']}; {splits})")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m scaletrain.data.cli`` (the same as ``scaletrain prepare``)."""
    from scaletrain.data.tokenizer import DataError

    parser = argparse.ArgumentParser(prog="scaletrain prepare", description=__doc__.splitlines()[0])
    add_prepare_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_prepare(args)
    except (ConfigError, DataError) as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
