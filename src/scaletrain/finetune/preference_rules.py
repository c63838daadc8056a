"""The one rule for what ``finetune.objective = dpo | simpo | orpo`` combines with (finetune/preference.py), kept
apart from it so that the entry check (train/validate.py) loads no model or checkpoint code."""

from __future__ import annotations

from scaletrain.finetune.method_table import method_entry
from scaletrain.options import ConfigError


def check_preference(cfg, world_size: int) -> None:
    """Refuse, in one line, a preference objective without its data or in a layout its loss does not support."""
    ft, par = cfg.finetune, cfg.parallel
    if ft.objective == "sft":
        if ft.preferences:
            raise ConfigError("finetune.preferences is set but finetune.objective=sft; set finetune.objective to "
                              "dpo, simpo or orpo to train on preference pairs")
        return
    if not ft.source or not ft.preferences:
        raise ConfigError(f"finetune.objective={ft.objective} needs finetune.source (the model to tune) and "
                          f"finetune.preferences (a JSONL of prompt/chosen/rejected pairs)")
    if ft.instructions or ft.teacher:
        raise ConfigError(f"finetune.objective={ft.objective} trains on finetune.preferences alone; drop "
                          f"finetune.instructions / finetune.teacher")
    if ft.objective == "dpo" and method_entry(ft.method).virtual_tokens:
        raise ConfigError(f"finetune.objective=dpo with finetune.method={ft.method} is not supported (its reference "
                          f"would need the virtual tokens switched off); use method=lora, or objective=simpo/orpo "
                          f"(no reference)")
    if par.tp > 1 or par.pp > 1 or par.cp > 1 or par.engine != "native" or par.balance != "none":
        raise ConfigError(f"finetune.objective={ft.objective} runs with data parallelism only (DDP, FSDP2) on the "
                          f"native engine; set parallel.tp/pp/cp=1, parallel.engine=native, parallel.balance=none")


def rows_per_example(ft) -> int:
    """Rows of data.seq_len tokens one example of train.batch_size is: 2 for a preference pair (chosen and
    rejected), else 1."""
    return 1 if ft.objective == "sft" else 2
