"""The model FLOPs a token of a run does (MFU's numerator), pretraining or fine-tuning: one function for the
trainer's progress and ``done:`` lines, the report (which shows the trainer's numbers) and ``plan``.

A frozen weight computes no weight gradient: a fine-tune counts 4 FLOPs a token for it (forward and input
gradient), not pretraining's 6, because that GEMM is not run (the usual choice: counting it would credit a
LoRA step with work it never does). LoRA's A and B are matmuls that train: 6 FLOPs a weight. Prompt and prefix
tuning freeze every matrix. Where autograd also skips an input gradient (the first block's q, k, v when nothing
below them trains) it is still counted: a detail of autograd, not of the model (docs/planning.md, "One MFU").
"""

from __future__ import annotations

from scaletrain.config import FinetuneConfig, ModelConfig
from scaletrain.finetune.method_table import method_entry
from scaletrain.model.presets import flops_per_token, matmul_params, projection_shapes


def frozen_and_adapter_params(cfg: ModelConfig, ft: FinetuneConfig) -> tuple[float, float]:
    """(matmul weights that stay frozen, adapter weights that train) of fine-tuning ``cfg`` with ``ft``."""
    shapes, entry = projection_shapes(cfg), method_entry(ft.method)
    if entry.trains_base:
        block_matrices = sum(i * o for i, o in shapes.values())
        # a tied head is the embedding: frozen with it
        head = cfg.vocab_size * cfg.dim if cfg.tie_embeddings and ft.freeze_embeddings else 0
        return float(ft.freeze_blocks * block_matrices + head), 0.0
    adapters = 0.0
    if entry.lora:
        adapters = cfg.n_layers * sum(ft.lora_rank * sum(shapes[t]) for t in ft.lora_targets if t in shapes)
    return float(matmul_params(cfg)), float(adapters)


def trained_flops_per_token(cfg: ModelConfig, seq_len: int, ft: FinetuneConfig | None = None) -> float:
    """Model FLOPs a token of training ``cfg`` at ``seq_len`` (``model.presets.flops_per_token``); with ``ft``
    (a fine-tune) its frozen weights count no weight gradient and its adapters count as trained matmuls."""
    if ft is None:
        return flops_per_token(cfg, seq_len)
    frozen, adapters = frozen_and_adapter_params(cfg, ft)
    return flops_per_token(cfg, seq_len, frozen, adapters)
