"""`scaletrain train` and `scaletrain finetune` (train with finetune.source set from --from): the job resolved
from --config, --section.field flags and (on --resume) the run's saved config; the trainer built and run;
progress and the result said by rank 0."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from scaletrain.config import (
    ConfigError,
    JobConfig,
    add_config_arguments,
    config_differences,
    load_config,
    overrides_from_args,
    read_toml,
    to_toml,
)
from scaletrain.finetune.objectives import objective_entry
from scaletrain.model.presets import matmul_params


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    """`scaletrain train`'s flags: --config, --resume, --overwrite and every job field."""
    p.description = ("Train a model. Settings come from --config TOML, "
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


def run_train(args: argparse.Namespace) -> int:
    """`scaletrain train` (and `finetune`, which sets finetune.source): resolve the job, build the trainer, train,
    say the result; the exit status says preempted or interrupted."""
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
    from scaletrain.plan.memory_check import memory_refusal  # the planner's estimate against this machine's memory

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
    say(_model_line(trainer))
    n = trainer.cfg
    if n.finetune.source and n.finetune.method != "full":
        say(_trainable_line(trainer))
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


def _model_line(trainer) -> str:
    """'model: 0.82M parameters (4 layers x 128), vocab ...; data ...; N tokens/step; device ...; run folder ...'."""
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
    return (f"model: {counts['parameters'] / 1e6:.2f}M parameters{trainable} ({n.model.n_layers} layers x "
            f"{n.model.dim}), vocab {trainer.vocab_note}; data {data}; {trainer.tokens_per_step:,} tokens/step; "
            f"device {trainer.device}, {precision}; run folder {trainer.run_dir}"
            + (f"; {trainer.disk_note}" if trainer.disk_note else ""))


def _trainable_line(trainer) -> str:
    """'trainable: 1,024 attention, 6,144 experts, 256 router, 0 other; adapter 29.0 KiB' (an adapter method)."""
    from scaletrain.finetune.methods import trainable_by_kind

    counts, nbytes = trainable_by_kind(trainer.pm.modules)
    return (f"trainable: {', '.join(f'{n:,} {kind}' for kind, n in counts.items())}; adapter "
            f"{nbytes / 2**10:.1f} KiB ({nbytes:,} bytes)")


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
