"""`scaletrain eval`: a run's latest checkpoint scored on its validation split (the numbers training's eval
records, train/evaluate.py), on any text with sliding windows, or on lm-evaluation-harness tasks (tasks.py)."""

from __future__ import annotations

import argparse

from scaletrain.config import ConfigError, add_job_field_arguments, override_job, overrides_from_args

# The run's job fields `eval` reads, each a --section.field flag over the run's saved config (the one flag
# vocabulary): how the val split is cut (data.seq_len windows, train.batch_size of them a batch,
# train.eval_batches batches: --batches' default) and the precision it is scored in. The model, tokenizer and data
# are what is evaluated, so they stay the run's.
EVAL_JOB_FIELDS = ("train.eval_batches", "train.batch_size", "data.seq_len", "train.precision")


def add_eval_arguments(p: argparse.ArgumentParser) -> None:
    """`scaletrain eval`'s flags: what to score (the val split, --text, --tasks) and the job fields it reads."""
    p.add_argument("--run", required=True, help="the run folder (train.run_dir)")
    p.add_argument("--text", help="a UTF-8 text file (or builtin:NAME; builtin:wikitext-2 is WikiText-2's validation "
                                  "split) to score instead of the run's validation split, with sliding windows: "
                                  "token perplexity, word-level perplexity and bits per byte (with a char tokenizer, "
                                  "characters outside its vocabulary are skipped and counted)")
    p.add_argument("--batches", type=int, default=None,
                   help="of the validation split: batches of train.batch_size x data.seq_len tokens, spread "
                        "evenly over it as training's eval spreads them (default: train.eval_batches, so the loss is "
                        "the val_loss the run recorded for this checkpoint; 0 = every window); of --text: score "
                        "only the tokens of its first BATCHES x train.batch_size windows (default: all of it)")
    p.add_argument("--context", type=int, default=None,
                   help="--text: tokens of context each prediction may see at most (default: data.seq_len, the "
                        "context the run trained at; at most model.max_seq_len)")
    p.add_argument("--stride", type=int, default=None,
                   help="--text: tokens between the starts of two windows (default: half the context); each token "
                        "is scored once, in the window that gives it the most context")
    p.add_argument("--check-transformers", action="store_true",
                   help="--text: also score the same windows with transformers on the run's Hugging Face export "
                        "(a temporary folder) and print the relative difference (needs scaletrain[export])")
    # lm-evaluation-harness tasks (evaluation/tasks.py): only read when --tasks is given
    p.add_argument("--tasks", help="comma-separated lm-evaluation-harness tasks (hellaswag,arc_easy,...) or "
                                   "gutenberg-cloze (built from the run's held-out text), run by lm-eval's own "
                                   "evaluator on this run (needs scaletrain[eval]; see docs/evaluation.md)")
    p.add_argument("--limit", type=int, help="--tasks: score the first N samples of each task (default: all)")
    p.add_argument("--num-fewshot", type=int, help="--tasks: few-shot examples before each sample (default: each "
                                                   "task's own)")
    p.add_argument("--include-path", help="--tasks: a folder of your own task YAMLs (local data: dataset_path: json "
                                          "with dataset_kwargs.data_files)")
    p.add_argument("--apply-chat-template", action="store_true",
                   help="--tasks: render each prompt in the chat template of the run's Hugging Face base")
    p.add_argument("--batch-size", type=int, default=8, help="--tasks: requests scored a forward pass")
    p.add_argument("--log-samples", nargs="?", const="", default=None, metavar="FILE",
                   help="--tasks: also write every sample (doc, target, requests, log-likelihoods or generation, "
                        "metrics; lm-eval's --log_samples) as JSON lines to FILE (default: beside --json, "
                        "NAME.samples.jsonl)")
    p.add_argument("--json", help="write the numbers (loss, perplexity, bpb, tokens, bytes; with --tasks the scores) "
                                  "with the windows and settings to this JSON file")
    add_job_field_arguments(p, EVAL_JOB_FIELDS, "the run's job fields (override its saved config for this "
                                                "evaluation; not with --tasks)")




def run_eval(args: argparse.Namespace) -> int:
    from scaletrain.core.files import check_output_path
    from scaletrain.evaluation.tasks import evaluate_tasks, task_request  # lm-eval itself only with --tasks

    if args.json:  # before the scoring (minutes), not after it
        check_output_path(args.json, f"--json {args.json}")

    overrides = overrides_from_args(args)
    request = task_request(args)  # --tasks: lm-evaluation-harness benchmarks instead of the loss below
    if request is not None:
        if overrides:  # lm-eval's requests are its own (--batch-size): the field would be ignored
            raise ConfigError(f"--{next(iter(overrides))} sets how the val split or a --text is scored; --tasks runs "
                              f"lm-eval's own requests (--batch-size): drop one of them")
        if request.log_samples:  # as --json: before the scoring
            check_output_path(request.log_samples, f"--log-samples {request.log_samples}")
        evaluate_tasks(request)
        return 0
    from scaletrain.infer.load import load_run  # any run folder, quantized ones too
    from scaletrain.train import evaluate

    if not args.text:  # `--context 0` is given too: it would be ignored, not what ran
        given = [flag for flag, value in (("--context", args.context), ("--stride", args.stride),
                                          ("--check-transformers", args.check_transformers))
                 if value is not None and value is not False]
        if given:
            raise ConfigError(f"{given[0]} applies to --text (the sliding-window score of a text); the validation "
                              f"split is scored on training's windows")
    if args.batches is not None and args.batches < 0:  # it read as "every window", not what was asked
        raise ConfigError(f"--batches {args.batches}: must be >= 0 (0 scores every window; leave it out for "
                          f"train.eval_batches)")
    path, text = evaluate.read_eval_text(args.text) if args.text else (None, "")  # a bad file: before loading
    saved, model, tokenizer, ckpt = load_run(args.run)
    cfg = override_job(saved, overrides)  # --train.batch_size, --data.seq_len, ...: for this evaluation only
    settings = {"run": str(args.run), "checkpoint": ckpt.name, "batch_size": cfg.train.batch_size,
                **({"job_fields": overrides} if overrides else {})}  # what the command line set over the run's
    if not args.text:  # the run's validation loss and bpb: the numbers training's eval computes (train/evaluate.py)
        run_score = evaluate.score_run(cfg, model, tokenizer, args.batches, run_dir=args.run, trained=saved)
        print(f"{run_score.line} ({ckpt.name})")
        record = {"source": "val split", **evaluate.validation_record(run_score, cfg),
                  "settings": {**settings, "batches": run_score.batches, "precision": run_score.precision}}
    else:
        context = args.context if args.context is not None else cfg.data.seq_len  # 0 is refused, not defaulted
        stride = args.stride if args.stride is not None else max(1, context // 2)
        evaluate.check_window(context, stride, cfg.model.max_seq_len)
        max_tokens = context + (args.batches * cfg.train.batch_size - 1) * stride + 1 \
            if args.batches else None  # 0: all of it, as for the val split (a negative count is refused above)
        score, tokens = evaluate.score_text(model, tokenizer, text, context, stride, cfg.train.batch_size, max_tokens,
                                            where=f"--text {path}")
        if score.skipped:
            from scaletrain.data.tokenizer import describe_skipped

            print(describe_skipped(score.skipped), flush=True)
        print(f"{evaluate.text_line(str(path), score)} ({ckpt.name})")
        check = None
        if args.check_transformers:
            from scaletrain.train.transformers_check import exported_nll

            check = exported_nll(args.run, cfg, model, tokenizer, tokens, context, stride)
        record = {"source": str(args.text), "path": str(path), **evaluate.text_record(score, check),
                  "settings": {**settings, "context": context, "stride": stride, "max_tokens": max_tokens,
                               "precision": str(next(model.parameters()).dtype).removeprefix("torch.")}}
        if check is not None:
            theirs = record["transformers_check"]
            print(f"transformers on the Hugging Face export, the same windows: token perplexity "
                  f"{theirs['perplexity']:.3f}, word perplexity {theirs['word_perplexity']:.3f}, bpb "
                  f"{theirs['bpb']:.4f}; largest relative difference {theirs['relative_difference']:.1e}")
    if args.json:
        write_json(args.json, record)
    return 0


def write_json(path: str, record: dict) -> None:
    """``record`` as indented JSON at ``path`` (a user's path: written whole or not at all, ``write_file``)."""
    import json

    from scaletrain.core.files import write_file

    write_file(path, json.dumps(record, indent=2) + "\n", f"the JSON {path}")
