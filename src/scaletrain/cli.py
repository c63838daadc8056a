"""One dispatcher: ``scaletrain <command>`` -> one function per command.

Every error a person can fix (config, data, checkpoint) is printed as one line and exits with code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from scaletrain.config import (
    ConfigError,
    JobConfig,
    add_config_arguments,
    add_job_field_arguments,
    config_differences,
    load_config,
    override_job,
    overrides_from_args,
    read_toml,
    to_toml,
)
from scaletrain.core.invocation import record_invocation
from scaletrain.core.options import UserError
from scaletrain.finetune.objectives import objective_entry
from scaletrain.model.presets import matmul_params


def _train_parser(sub) -> None:
    p = sub.add_parser("train", help="train a model (default: the tiny CPU recipe on bundled Tiny Shakespeare)",
                       description="Train a model. Settings come from --config TOML, "
                                   "overridden by --section.field flags. With --resume the run's saved "
                                   "<train.run_dir>/config.toml is the base instead, overridden by the flags; "
                                   "a --config given too must agree with the saved config in every field the "
                                   "flags do not set, or the run is refused with the differing fields listed.")
    p.add_argument("--config", help="TOML recipe (see configs/)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as TOML and exit")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in train.run_dir, with the run's saved config.toml "
                        "overridden by the --section.field flags")
    p.add_argument("--overwrite", action="store_true",
                   help="start afresh in a train.run_dir that holds an earlier run: delete its checkpoints (its "
                        "logs are moved to <run_dir>/replaced-<time>/); without it, such a start is refused")
    add_config_arguments(p, JobConfig)
    p.set_defaults(func=cmd_train)


# Fields a --config may set differently from the run's saved config on --resume: this invocation's controls
# (not kept in the saved config), and grad_accum_steps, which a resume re-derives from the checkpoint's
# global batch whatever the config says.
RESUME_FREE_FIELDS = ("train.resume", "train.overwrite", "train.stop_at_step", "train.grad_accum_steps")


def resolve_job_config(args: argparse.Namespace) -> JobConfig:
    """A new run: --config TOML (or the defaults) + --section.field flags. A resume whose run folder has a
    config.toml: that saved config + the flags; a --config given too must agree with the saved config in
    every field the flags do not set (ConfigError listing the differences), so no setting changes unseen."""
    overrides = overrides_from_args(args)
    if getattr(args, "resume", False):
        overrides["train.resume"] = "true"
    if getattr(args, "overwrite", False):
        overrides["train.overwrite"] = "true"
    recipe = load_config(args.config) if args.config else None
    flag = overrides.get("train.resume")
    resume = flag.lower() in ("true", "1", "yes", "on") if flag is not None else bool(recipe and recipe.train.resume)
    run_dir = overrides.get("train.run_dir") or (recipe or JobConfig()).train.run_dir
    saved = Path(run_dir) / "config.toml"
    if resume and not saved.is_file():
        saved = _restore_saved_config(Path(run_dir), args.config) or saved
    if not resume or not saved.is_file():
        cfg = load_config(args.config, overrides)
        given = "data.path" in overrides or (args.config and "path" in read_toml(args.config).get("data", {}))
        if cfg.finetune.source and not given:  # a fine-tune goes on with its base run's data unless told
            from scaletrain.finetune.base import with_base_data
            from scaletrain.parallel.distributed import say

            cfg = with_base_data(cfg, announce=None if getattr(args, "print_config", False) else say)
        return cfg
    overrides["train.resume"] = "true"  # the saved config keeps resume = false
    if recipe is not None:
        saved_cfg = load_config(saved)
        # A fine-tune's saved [model] and data.tokenizer are its base's (finetune.resolve_finetune), not the recipe's,
        # and so is its data.path where the recipe left the default.
        from_base = ("model.", "data.tokenizer") if saved_cfg.finetune.source else ()
        if (Path(saved_cfg.data.path) / "manifest.json").is_file():  # prepared data: the tokenizer is its record
            from_base = (*from_base, "data.tokenizer")
        default_data = JobConfig().data.path
        differ = [(key, mine, theirs) for key, mine, theirs in config_differences(recipe, saved_cfg)
                  if key not in overrides and key not in RESUME_FREE_FIELDS and not key.startswith(from_base)
                  and not (key == "data.path" and saved_cfg.finetune.source and mine == default_data)
                  and not (key == "model.vocab_size" and mine == 0)  # 0: the data's, resolved in the saved one
                  and not (key == "train.compile" and mine == "auto")]  # auto: decided, the saved one says how
        if differ:
            shown = ", ".join(f"{key} ({mine!r} vs saved {theirs!r})" for key, mine, theirs in differ[:6])
            more = f" and {len(differ) - 6} more" if len(differ) > 6 else ""
            raise ConfigError(f"--config {args.config} differs from the run's saved {saved} in {shown}{more}; on "
                              f"--resume the saved config is the base and --section.field flags override it: "
                              f"drop --config and pass the changes as flags, or train into a new train.run_dir")
        if recipe.train.stop_at_step and "train.stop_at_step" not in overrides:
            overrides["train.stop_at_step"] = str(recipe.train.stop_at_step)  # this invocation's control
    return load_config(saved, overrides)


def _restore_saved_config(run_dir: Path, recipe: str | None) -> Path | None:
    """A resume whose run folder lost its config.toml: restored from the config saved with its newest checkpoint
    (said in one line), so the run goes on as it was trained, not under the defaults. None when the folder holds
    no checkpoint (a start from scratch) or only ones without a config while ``recipe`` (--config) says what the
    run was; a ConfigError when nothing does."""
    from scaletrain.checkpoint.run_folder import checkpoint_config
    from scaletrain.core.files import write_file
    from scaletrain.parallel.distributed import say

    found = checkpoint_config(run_dir)
    if found is None:
        if recipe is None and any((run_dir / "checkpoints").glob("step-*")):
            raise ConfigError(f"--resume: {run_dir / 'config.toml'} is missing and no checkpoint in {run_dir} holds "
                              f"the config it was trained with (they predate that); restore config.toml, or pass "
                              f"the run's recipe with --config")
        return None
    text, checkpoint = found
    saved = write_file(run_dir / "config.toml", text)
    say(f"note: {saved} was missing; restored it from the config saved with checkpoint {checkpoint}")
    return saved


def cmd_train(args: argparse.Namespace) -> int:
    cfg = resolve_job_config(args)
    objective_entry(cfg.finetune.objective)  # a name outside the table: one line before anything starts
    if args.print_config:
        print(to_toml(cfg), end="")
        return 0
    # Every line below is said by rank 0 only (``say``); errors are printed by every rank (main).
    from scaletrain.parallel.distributed import restart_attempt, say
    from scaletrain.train.trainer import Trainer  # every engine (parallel.engine) behind the one trainer

    if restart_attempt() > 0 and not cfg.train.resume:  # torchrun --max-restarts restarted us after a failure
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, resume=True))
        say(f"elastic restart {restart_attempt()}: resuming from the latest checkpoint")
    from scaletrain.plan.fit import memory_refusal  # the planner's estimate against this machine's memory

    trainer = Trainer(cfg, memory_check=memory_refusal)
    if cfg.train.resume and not trainer.resume():
        say(f"no checkpoint in {cfg.train.run_dir}; starting from scratch")
    step, steps, stop_at = trainer.state.step, trainer.cfg.train.steps, trainer.cfg.train.stop_at_step
    if step >= steps or 0 < stop_at <= step:  # nothing to train: say so instead of timing zero steps
        state = f"already complete at step {step} (train.steps = {steps}); raise --train.steps" if step >= steps \
            else f"already at step {step} (train.stop_at_step = {stop_at}); raise --train.stop_at_step"
        say(f"{state} to continue")
        trainer.close()
        return 0
    n = trainer.cfg
    precision = f"{trainer.precision} ({trainer.precision_why})" if trainer.precision_why else trainer.precision
    counts = trainer.summary()
    trainable = "" if not n.finetune.source else \
        f" ({counts['trainable_parameters']:,} trainable, finetune.method={n.finetune.method})"
    if n.model.moe_experts:  # a mixture of experts: what a token runs, besides what is held
        trainable += (f" ({matmul_params(n.model) / 1e6:.2f}M active in matmuls: {n.model.moe_top_k} of "
                      f"{n.model.moe_experts} experts a token)")
    data = (f"preference pairs {n.finetune.preferences} (finetune.objective={n.finetune.objective})"
            if n.finetune.preferences else f"instructions {n.finetune.instructions}" if n.finetune.instructions
            else n.data.path)
    say(f"model: {counts['parameters'] / 1e6:.2f}M parameters{trainable} ({n.model.n_layers} layers x {n.model.dim}), "
        f"vocab {trainer.vocab_note}; data {data}; {trainer.tokens_per_step:,} tokens/step; device {trainer.device}, "
        f"{precision}; run folder {trainer.run_dir}" + (f"; {trainer.disk_note}" if trainer.disk_note else ""))
    if trainer.is_main and step == 0:  # evaluation that would take over a quarter of the wall: said before it runs
        from scaletrain.plan.wall import job_evaluation_note

        if note := job_evaluation_note(n, trainer.precision, trainer.device.type, trainer.dims):
            say(note)
    summary = trainer.train()
    if summary["preempted"]:
        from scaletrain.train.preemption import INTERRUPTED, INTERRUPTED_EXIT_CODE, PREEMPTED_EXIT_CODE

        if summary["preempted"] == INTERRUPTED:  # Ctrl-C: a graceful stop; a second one would not have saved
            saved = f"checkpoint written to {trainer.run_dir / 'checkpoints'}" if trainer.cfg.checkpoint.enabled \
                else "nothing saved (checkpoint.enabled = false)"
            say(f"interrupted (Ctrl-C) at step {summary['steps']}: {saved}; continue with the same command and "
                f"--resume (it reads the run's saved config from --train.run_dir {trainer.run_dir})")
            return INTERRUPTED_EXIT_CODE

        say(f"stopped at step {summary['steps']} ({summary['preempted']}); exit status {PREEMPTED_EXIT_CODE} "
            f"means 'preempted, resume me'")
        return PREEMPTED_EXIT_CODE
    final = summary["final_val_loss"]
    say(f"done: {summary['steps']} steps, median {summary['median_step_ms']:.1f} ms/step, "
        f"{summary['tokens_per_second']:,.0f} tokens/s, MFU {100 * summary['mfu']:.1f}%, "
        f"peak memory {summary['peak_memory_mb']:.0f} MB"
        + (f", final val loss {final:.4f} (bpb {summary['final_val_bpb']:.4f})" if final else "")
        + _stall_note(summary))
    return 0


def _stall_note(summary: dict) -> str:
    """'; eval/sample/checkpoint 3.1% of 95 s (eval 1.2 s, sample 1.0 s, checkpoint 0.7 s)' for the done line."""
    stalls, wall = summary.get("stall_seconds", {}), summary.get("loop_seconds", 0.0)
    if not wall:
        return ""
    def seconds(x: float) -> str:  # 0.031 s, 1.2 s, 95 s: short runs keep their digits
        return f"{x:.2g} s" if x < 1 else f"{x:.1f} s" if x < 10 else f"{x:.0f} s"

    parts = ", ".join(f"{name} {seconds(value)}" for name, value in stalls.items())
    return f"; eval/sample/checkpoint {100 * summary['stall_share']:.1f}% of {seconds(wall)}" + \
        (f" ({parts})" if parts else "")


# The run's job fields `eval` reads, each a --section.field flag over the run's saved config (the one flag
# vocabulary): how the val split is cut (data.seq_len windows, train.batch_size of them a batch,
# train.eval_batches batches: --batches' default) and the precision it is scored in. The model, tokenizer and data
# are what is evaluated, so they stay the run's.
EVAL_JOB_FIELDS = ("train.eval_batches", "train.batch_size", "data.seq_len", "train.precision")


def _eval_parser(sub) -> None:
    p = sub.add_parser("eval", help="loss, perplexity and bits per byte of a run's latest checkpoint, on its "
                                    "validation split or any text (docs/evaluation.md)")
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
    # lm-evaluation-harness tasks (harness/): only read when --tasks is given
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
    p.set_defaults(func=cmd_eval)


def cmd_eval(args: argparse.Namespace) -> int:
    from scaletrain.core.files import check_output_path
    from scaletrain.harness.tasks import evaluate_tasks, task_request  # lm-eval itself only with --tasks

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
        _write_json(args.json, record)
    return 0


def _write_json(path: str, record: dict) -> None:
    """``record`` as indented JSON at ``path`` (a user's path: written whole or not at all, ``write_file``)."""
    import json

    from scaletrain.core.files import write_file

    write_file(path, json.dumps(record, indent=2) + "\n", f"the JSON {path}")


def _export_parser(sub) -> None:
    p = sub.add_parser("export", help="export a run's latest checkpoint (a Hugging Face folder of its family's "
                                      "class, or GGUF)")
    p.add_argument("--run", required=True, help="the run folder (train.run_dir)")
    p.add_argument("--format", default="hf", choices=["hf", "gguf"],
                   help="hf: config.json + model.safetensors + tokenizer; gguf: one file for llama.cpp / Ollama "
                        "(tokenizer and chat template inside; needs scaletrain[gguf])")
    p.add_argument("--out", help="output folder (default: <run>/export-hf), or file for gguf (<run>/model.gguf)")
    p.add_argument("--dtype", default=None, choices=["f32", "f16", "q8_0"],
                   help="gguf: the weights' type (default f32; norms stay f32); the Hugging Face export writes f32 "
                        "only")
    p.add_argument("--merge", action="store_true",
                   help="a LoRA/QLoRA fine-tune: fold the adapters into the weights and write one plain folder "
                        "(default for an adapter run: the base's folder plus a peft adapter in <out>/adapter). "
                        "QLoRA: the merged weights are the NF4-rounded base + adapter (what the run trained), "
                        "the default folder holds the original base + adapter; their logits differ: merge to get "
                        "what was trained, keep the adapter to stay on the original")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier export in --out (its adapter/ too, or the GGUF file); without it, that "
                        "is refused")
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    from scaletrain.core.writer_lock import one_writer

    if args.format == "hf" and args.dtype not in (None, "f32"):  # it would be written f32 all the same
        raise ConfigError(f"--dtype {args.dtype} is for --format gguf; the Hugging Face export writes float32 "
                          f"(cast it when loading: from_pretrained(..., dtype=torch.float16)), or export --format "
                          f"gguf --dtype {args.dtype}")
    args.dtype = args.dtype or "f32"

    # One writer per target (train's run-folder lock): a second export into the same --out is refused naming the
    # first. The lock file sits beside the target, which the export replaces as a whole, and goes with the lock; a
    # target refused outright is refused before it is made, and checked again under the lock (a concurrent export).
    target = Path(args.out or Path(args.run) / ("model.gguf" if args.format == "gguf" else "export-hf"))
    _check_export_target(args, target)
    with one_writer(target.parent, f"--out {target}", "choose another --out", name=f".{target.name}.lock",
                    remove=True):
        _check_export_target(args, target)
        return _export(args)


def _check_export_target(args: argparse.Namespace, out: Path) -> None:
    """Refuse, before the run is loaded, an --out that would lose a file or folder (without --overwrite)."""
    if args.format == "gguf":  # one file
        from scaletrain.checkpoint.gguf import gguf_target

        gguf_target(out, args.overwrite)
    # a folder of other files: export_hf refuses it
    if args.format == "hf" and (out / "config.json").is_file() and not args.overwrite:
        held = "an earlier export" + (" and its adapter/" if (out / "adapter").is_dir() else "")
        raise ConfigError(f"--out {out} holds {held}; pass --overwrite to replace it, or choose a new folder")


def _export(args: argparse.Namespace) -> int:
    from scaletrain.checkpoint.export import export_hf, hf_base_folder
    from scaletrain.finetune.export import base_model, is_plain, merge_adapters, save_peft_adapter
    from scaletrain.finetune.method_table import method_entry
    from scaletrain.infer.load import load_run  # any run folder; a quantized one is refused in one line
    from scaletrain.model.family import family
    from scaletrain.model.moe import refuse_moe

    cfg, model, tokenizer, ckpt = load_run(args.run, quantized_ok=False)
    refuse_moe(cfg.model, f"scaletrain export --format {args.format}")  # the families' files have no experts
    method = method_entry(cfg.finetune.method)
    if method.quantized_base:  # the two exports are not the same model: say which one this is
        print("QLoRA: " + ("--merge writes the NF4-rounded base + adapter, what the run trained (without --merge: "
                           "the original base + adapter, whose logits differ)" if args.merge else
                           "the original (unrounded) base + the adapter trained on its NF4-rounded copy; "
                           "--merge gives what the run trained (logits differ)"), flush=True)
    if args.merge:
        model = merge_adapters(model, cfg)
    if args.format == "gguf":
        from scaletrain.checkpoint.gguf import export_gguf, trained_context

        out = export_gguf(model, cfg.model, tokenizer, args.out or Path(args.run) / "model.gguf", args.dtype,
                          name=Path(args.run).resolve().name, template=cfg.finetune.chat_template,
                          context=trained_context(cfg, hf_base_folder(args.run, cfg) is not None))
        print(f"exported {ckpt.name} to {out} ({args.dtype}, {out.stat().st_size / 1e6:.2f} MB; run it with "
              f"llama.cpp: llama-cli -m {out}, or Ollama: see docs/inference.md)")
        return 0
    out = Path(args.out or Path(args.run) / "export-hf")
    base, family_class = hf_base_folder(args.run, cfg), family(cfg.model.family).hf_class
    if is_plain(model):
        export_hf(model, cfg.model, tokenizer, out, base)
        merged = " with the adapters merged" if cfg.finetune.source and not method.trains_base else ""
        print(f"exported {ckpt.name}{merged} to {out} (load with transformers.{family_class}.from_pretrained)")
        return 0
    export_hf(base_model(cfg), cfg.model, tokenizer, out, base)  # the base, unchanged, and the adapter beside it
    adapter = save_peft_adapter(model, cfg, out / "adapter")
    print(f"exported the base to {out} and the {cfg.finetune.method} adapter of {ckpt.name} to {adapter} (load with "
          f"peft.PeftModel.from_pretrained({family_class}.from_pretrained({str(out)!r}), {str(adapter)!r}))")
    return 0


def _finetune_parser(sub) -> None:
    p = sub.add_parser("finetune", help="adapt an existing model (a run or a Hugging Face folder): full, lora, "
                                        "qlora, prompt or prefix tuning",
                       description="Fine-tune: `scaletrain train` with finetune.source set from --from. The [model] "
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
    p.set_defaults(func=cmd_finetune)


def cmd_finetune(args: argparse.Namespace) -> int:
    setattr(args, "cfg:finetune.source", args.source)
    return cmd_train(args)


def _plugin_parser(sub, name: str, module: str, add: str, run: str, help: str, *, load: bool) -> None:
    """Commands whose arguments and implementation live in their own package (data, plan, report). Only the
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
    """The whole command line. With ``argv``, only the plugin command named in it is imported (see
    ``_plugin_parser``); without, every plugin is (for tools that inspect the full parser)."""
    parser = OneLineParser(prog="scaletrain", description=__doc__.splitlines()[0], epilog=FLAG_VOCABULARY)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _train_parser(sub)
    _eval_parser(sub)
    _export_parser(sub)
    _finetune_parser(sub)
    wanted = None if argv is None else next((a for a in argv if not a.startswith("-")), "")
    for name, module, add, run, help in PLUGINS:
        _plugin_parser(sub, name, module, add, run, help, load=wanted is None or wanted == name)
    return parser


PLUGINS = [
    ("generate", "scaletrain.infer.cli", "add_generate_arguments", "run_generate",
     "continue a prompt (or a JSONL file of prompts, batched) with a run's model; --stream"),
    ("chat", "scaletrain.infer.cli", "add_chat_arguments", "run_chat",
     "talk to a run's model in the terminal (its instruction template; /reset, /system TEXT, /exit)"),
    ("serve", "scaletrain.serve.cli", "add_serve_arguments", "run_serve",
     "serve a run's model over the OpenAI API (batched streaming) with a chat page; needs scaletrain[serve]"),
    ("prepare", "scaletrain.data.cli", "add_prepare_arguments", "run_prepare",
     "clean, deduplicate and tokenize raw text into sharded token files"),
    ("plan", "scaletrain.plan.cli", "add_plan_arguments", "run_plan",
     "predict memory, time and cost of a training job and pick the parallel plan"),
    ("doctor", "scaletrain.plan.cli", "add_doctor_arguments", "run_doctor",
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
# cmd_train's); each is what that command's writer guarantees (the temporaries are removed by guarded_write).
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
