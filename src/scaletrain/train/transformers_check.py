"""An independent check of ``evaluate.score_text``: the run exported as a Hugging Face folder (``export_hf``, the
same code `scaletrain export` runs), loaded by transformers' ``AutoModelForCausalLM``, and the same token ids
scored with the Hugging Face perplexity guide's own loop (labels -100 on what the previous window scored).

Nothing here calls ``sliding_window_nll``: the windows, the shift and the loss are the guide's, written out
again on purpose, so that a mistake in ours shows up as a difference instead of being repeated."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.checkpoint.export import export_hf, hf_base_folder
from scaletrain.checkpoint.run import run_kind
from scaletrain.config import ConfigError, JobConfig
from scaletrain.data.tokenizer import Tokenizer
from scaletrain.finetune.export import is_plain, merge_adapters
from scaletrain.finetune.method_table import method_entry


def transformers_nll(folder: str | Path, tokens: torch.Tensor, context: int, stride: int,
                     vocab_limit: int) -> tuple[float, int]:
    """(summed NLL in nats, tokens scored) of ``tokens`` under the transformers model in ``folder``: the guide's
    loop with ``max_length = context + 1`` (our window: ``context`` inputs and the target after them). The loss
    is taken over the first ``vocab_limit`` logits, as ours is (a base's vocabulary can be padded beyond its
    tokenizer's)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    model.eval()
    max_length, seq_len = context + 1, tokens.numel()
    nll, count, prev_end = 0.0, 0, 0
    for begin in range(0, seq_len, stride):
        end = min(begin + max_length, seq_len)
        target_len = end - prev_end  # may differ from the stride on the last window
        input_ids = tokens[begin:end].unsqueeze(0)
        target_ids = input_ids.clone()
        target_ids[:, :-target_len] = -100
        with torch.no_grad():
            logits = model(input_ids).logits[..., :vocab_limit].float()
        labels = target_ids[:, 1:]  # the shift transformers' own loss makes
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
        nll += float(loss)
        count += int((labels != -100).sum())
        prev_end = end
        if end == seq_len:
            break
    return nll, count


def exported_nll(run: str | Path, cfg: JobConfig, model: nn.Module, tokenizer: Tokenizer, tokens: torch.Tensor,
                 context: int, stride: int) -> tuple[float, int]:
    """``transformers_nll`` of ``model`` exported into a temporary folder (adapters merged first: the export
    transformers loads as one model). A quantized run has no Hugging Face export: a ConfigError says so."""
    if run_kind(Path(run), cfg) == "quantized":
        raise ConfigError(f"--check-transformers: {run} is quantized (torchao tensors, which no Hugging Face export "
                          f"holds); check the run it was quantized from")
    if method_entry(cfg.finetune.method).virtual_tokens and not is_plain(model):
        raise ConfigError(f"--check-transformers: finetune.method={cfg.finetune.method} has virtual tokens, which "
                          f"no exported Hugging Face model holds; check the base run instead")
    if not is_plain(model):
        model = merge_adapters(model, cfg)
    with tempfile.TemporaryDirectory(prefix="scaletrain-check-") as tmp:
        folder = export_hf(model, cfg.model, tokenizer, Path(tmp) / "export", hf_base_folder(run, cfg))
        return transformers_nll(folder, tokens, context, stride, tokenizer.vocab_size)
