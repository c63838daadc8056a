"""Knowledge distillation while fine-tuning (``finetune.teacher``): recover a pruned or quantized model
from the original, Minitron-style.

The student's loss becomes ``(1 - w) * data loss + w * T^2 * KL(teacher_T || student_T)``, where ``_T`` are
the softmaxes of the logits divided by the temperature T (Hinton et al. 2015; T^2 keeps the gradient's
scale as T changes), averaged over the tokens the data loss counts (instruction prompts masked with -100
are left out of both). It is a transform over what ``build_parallel_training`` returns, not a second step:
a forward pre-hook on the student keeps the batch's token ids, and the ``ParallelModel``'s objective loss
(``objective_loss``, train/loss.py) is one that runs the frozen teacher on them (no gradient) and mixes the
two losses. In evaluation (the student in eval mode) the loss is the data loss alone, so validation losses
stay comparable.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.config import ConfigError, FinetuneConfig
from scaletrain.core.files import file_sha256
from scaletrain.finetune.base import open_base
from scaletrain.model import Transformer


def load_teacher(source: str, student_tokenizer: str, device: torch.device) -> nn.Module:
    """The frozen teacher (a run folder or Hugging Face folder, read as ``finetune.source`` is)."""
    try:
        base = open_base(source)
    except ConfigError as exc:
        raise ConfigError(str(exc).replace("finetune.source", "finetune.teacher", 1)) from None
    if student_tokenizer and file_sha256(base.tokenizer) != file_sha256(student_tokenizer):
        raise ConfigError(f"finetune.teacher {source}: its tokenizer differs from the student's ({student_tokenizer}); "
                          f"distillation compares logits token by token, so both need the same vocabulary")
    with torch.device("meta"):
        teacher = Transformer(base.model)
    teacher.to_empty(device=device)
    teacher.init_weights()  # the rotary tables; the weights are loaded below
    teacher.load_state_dict(base.state(), strict=False)
    teacher.tie_weights()
    return teacher.requires_grad_(False).eval()


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, targets: torch.Tensor,
                      temperature: float) -> torch.Tensor:
    """T^2 * mean over counted tokens (targets != -100) of KL(softmax(t / T) || softmax(s / T))."""
    vocab = min(student_logits.size(-1), teacher_logits.size(-1))
    s = F.log_softmax(student_logits[..., :vocab].float() / temperature, dim=-1)
    t = F.log_softmax(teacher_logits[..., :vocab].float() / temperature, dim=-1)
    kl = (t.exp() * (t - s)).sum(-1)  # (B, T)
    counted = (targets != -100).to(kl.dtype)
    return (kl * counted).sum() / counted.sum().clamp(min=1) * temperature ** 2


class Distiller:
    """Installed on a ``ParallelModel`` (single part: no pipeline, no tensor/context parallelism)."""

    def __init__(self, pm, teacher: nn.Module, weight: float, temperature: float,
                 data_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        self.teacher, self.weight, self.temperature = teacher, weight, temperature
        self.student = pm.modules[0]
        self.vocab_limit = pm.vocab_limit
        self.data_loss = data_loss  # the next-token loss (train/loss.py)
        self.inputs: tuple | None = None
        pm.parts[0].register_forward_pre_hook(self._keep_inputs, with_kwargs=True)

    def _keep_inputs(self, _module, args, kwargs):
        self.inputs = (args[0], kwargs.get("attn_mask"))

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        data = self.data_loss(logits, targets)
        if not self.student.training or self.inputs is None or self.weight == 0:
            return data
        tokens, attn_mask = self.inputs
        self.inputs = None
        with torch.no_grad():
            teacher_logits = self.teacher(tokens, attn_mask=attn_mask)
        limit = self.vocab_limit or logits.size(-1)
        kd = distillation_loss(logits[..., :limit], teacher_logits[..., :limit], targets, self.temperature)
        return (1 - self.weight) * data + self.weight * kd


def attach_teacher(pm, ft: FinetuneConfig, tokenizer: str,
                   data_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Distiller:
    """Distil from ``ft.teacher`` (finetune/objectives.py's ``distill`` entry installs its ``loss``)."""
    return Distiller(pm, load_teacher(ft.teacher, tokenizer, pm.device), ft.distill_weight, ft.distill_temperature,
                     data_loss)
