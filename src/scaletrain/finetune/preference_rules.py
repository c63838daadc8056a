"""What each objective combines with (the ``refuse`` of finetune/objectives.py's entries), kept apart from their
losses so that the entry check (train/validate.py) loads no model or checkpoint code."""

from __future__ import annotations

from scaletrain.core.options import ConfigError
from scaletrain.finetune.method_table import method_entry


def check_sft(cfg, world_size: int) -> None:
    """The next-token objective: preference pairs would be left unread."""
    if cfg.finetune.preferences:
        raise ConfigError("finetune.preferences is set but finetune.objective=sft; set finetune.objective to "
                          "dpo, simpo or orpo to train on preference pairs")


def check_distillation(cfg, world_size: int) -> None:
    """finetune.teacher (finetune/distill.py): a fine-tune on one model part whose logits are plain tensors."""
    check_sft(cfg, world_size)
    if not cfg.finetune.source:
        raise ConfigError("finetune.teacher needs finetune.source (the student to fine-tune, e.g. a pruned run)")
    par = cfg.parallel
    if par.tp > 1 or par.pp > 1 or par.cp > 1 or par.engine != "native":
        raise ConfigError("finetune.teacher runs with data parallelism (DDP, FSDP2) on the native engine only; set "
                          "parallel.tp/pp/cp=1")


def check_preference(cfg, world_size: int, reference: bool = False) -> None:
    """Refuse, in one line, a preference objective without its data or in a layout its loss does not support;
    ``reference``: the objective scores against a reference model (DPO), which virtual tokens would be part of."""
    ft, par = cfg.finetune, cfg.parallel
    if not ft.source or not ft.preferences:
        raise ConfigError(f"finetune.objective={ft.objective} needs finetune.source (the model to tune) and "
                          f"finetune.preferences (a JSONL of prompt/chosen/rejected pairs)")
    if ft.instructions or ft.teacher:
        raise ConfigError(f"finetune.objective={ft.objective} trains on finetune.preferences alone; drop "
                          f"finetune.instructions / finetune.teacher")
    if reference and method_entry(ft.method).virtual_tokens:
        raise ConfigError(f"finetune.objective={ft.objective} with finetune.method={ft.method} is not supported (its "
                          f"reference would need the virtual tokens switched off); use method=lora, or "
                          f"objective=simpo/orpo (no reference)")
    if par.tp > 1 or par.pp > 1 or par.cp > 1 or par.engine != "native" or par.balance != "none":
        raise ConfigError(f"finetune.objective={ft.objective} runs with data parallelism only (DDP, FSDP2) on the "
                          f"native engine; set parallel.tp/pp/cp=1, parallel.engine=native, parallel.balance=none")
