"""The training objectives as entries, as ``train/optimizer.py:OPTIMIZERS`` is a table of optimizers: what a
step's loss is and what it needs, in one place. ``finetune.objective`` names an entry; the trainer, its entry
check (train/validate.py), evaluation (train/evaluate.py), the planner (plan/) and ``--help`` read it here, so a
new objective (KTO, say) is one entry plus its loss, and no name is compared as a string elsewhere.

An entry's ``install(pm, cfg, data_loss, say)`` runs once where the training is built (the objective converter
of train/converters.py, after the base and adapters are loaded) and returns the loss on whole logits that the
step calls (``ParallelModel.objective_loss``, train/loss.py), or None for the next-token loss (which may run by
chunks). ``data_loss`` is that next-token loss, for objectives that mix it in (distillation).

Distillation is the next-token objective with a teacher: ``finetune.teacher`` turns ``sft`` into ``distill``
(``with_teacher``); it is no value of ``finetune.objective`` (``configurable`` False).

The loss code stays with its objective (finetune/preference.py, finetune/distill.py) and is imported when an
entry installs it, so the entry check loads no model or checkpoint code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from scaletrain.core.options import ConfigError
from scaletrain.finetune.preference_rules import check_distillation, check_preference, check_sft

# (logits, targets) -> 0-dim loss
LogitsLoss = Callable[[Any, Any], Any]


@dataclass(frozen=True)
class Objective:
    """One training objective: its loss, its metrics, its rows per example, its reference, its refusals."""

    name: str
    summary: str  # one line, for --help and the docs' table
    install: Callable[..., LogitsLoss | None]  # (pm, cfg, data_loss, say) -> objective_loss, or None
    refuse: Callable[[Any, int], None]  # (cfg, world_size): a one-line ConfigError for what it cannot run with
    rows_per_example: int = 1  # rows of data.seq_len one example of train.batch_size is (a preference pair: 2)
    reference: bool = False  # needs a reference model (DPO: the base through disabled adapters, or precomputed)
    pairs: bool = False  # trains on finetune.preferences pairs (the preference loss, its rewards logged)
    configurable: bool = True  # a value of finetune.objective (distillation is chosen by finetune.teacher)
    with_teacher: str = ""  # the entry finetune.teacher turns this one into
    # On a finished run's loaded model (``scaletrain eval``): (pm, cfg, run_dir) -> objective_loss, or None.
    evaluate: Callable[..., LogitsLoss | None] = lambda pm, cfg, run_dir: None
    # The metrics it logs besides the loss: (pm, "train" | "eval") -> {name: value}; collective over ranks.
    metrics: Callable[[Any, str], dict] = lambda pm, mode: {}


def _next_token(pm, cfg, data_loss: LogitsLoss, say) -> None:
    return None  # the step's own next-token loss (train/loss.py), chunked where it can be


def _distill(pm, cfg, data_loss: LogitsLoss, say) -> LogitsLoss:
    from scaletrain.finetune.distill import attach_teacher

    return attach_teacher(pm, cfg.finetune, cfg.data.tokenizer, data_loss).loss


def _preference(score: str, reference: bool) -> Callable[..., LogitsLoss]:
    def install(pm, cfg, data_loss: LogitsLoss, say) -> LogitsLoss:
        from scaletrain.finetune import preference

        return preference.attach_preference(pm, cfg, getattr(preference, score), reference, say=say).loss

    return install


def _preference_for_evaluation(score: str, reference: bool) -> Callable[..., LogitsLoss]:
    def evaluate(pm, cfg, run_dir) -> LogitsLoss:
        from scaletrain.finetune import preference

        return preference.attach_for_evaluation(pm, cfg, run_dir, getattr(preference, score), reference).loss

    return evaluate


def _preference_metrics(pm, mode: str) -> dict:
    from scaletrain.finetune.preference import preference_metrics

    return preference_metrics(pm, mode)


def _pairs(name: str, summary: str, score: str, reference: bool = False) -> Objective:
    """A preference objective's entry: ``score`` names its loss in finetune/preference.py."""
    return Objective(name, summary, _preference(score, reference), partial(check_preference, reference=reference),
                     rows_per_example=2, reference=reference, pairs=True,
                     evaluate=_preference_for_evaluation(score, reference), metrics=_preference_metrics)


OBJECTIVES: dict[str, Objective] = {
    "sft": Objective("sft", "next-token loss on the data or instructions", _next_token, check_sft,
                     with_teacher="distill"),
    "distill": Objective("distill", "finetune.teacher: the next-token loss mixed with the KL divergence to a "
                         "frozen teacher", _distill, check_distillation, configurable=False),
    "dpo": _pairs("dpo", "on finetune.preferences pairs, with a reference: the base through disabled adapters, or "
                  "log-probs precomputed for method=full", "dpo_scores", reference=True),
    "simpo": _pairs("simpo", "on finetune.preferences pairs, no reference", "simpo_scores"),
    "orpo": _pairs("orpo", "on finetune.preferences pairs, no reference", "orpo_scores"),
}


def objective_names() -> tuple[str, ...]:
    """The values ``finetune.objective`` takes (train and plan read it as ``--finetune.objective``)."""
    return tuple(name for name, entry in OBJECTIVES.items() if entry.configurable)


def objective_entry(name: str, where: str = "finetune.objective") -> Objective:
    """The entry of ``name``; a one-line ConfigError naming the objectives there are."""
    if name not in OBJECTIVES or not OBJECTIVES[name].configurable:
        raise ConfigError(f"{where} must be one of {', '.join(objective_names())} (got {name!r})")
    return OBJECTIVES[name]


def objective_of(ft) -> Objective:
    """The objective a fine-tune config trains: ``finetune.objective``'s entry, or what ``finetune.teacher``
    turns it into."""
    entry = objective_entry(ft.objective)
    return OBJECTIVES[entry.with_teacher] if ft.teacher and entry.with_teacher else entry
