"""Big vocabularies on a CPU (issue 36: a 151,936-token vocabulary spent 87.5% of a short fine-tune in
evaluation and the end-of-run sample): evaluation holds the logits of a few positions at a time, with the loss
of the whole batch to float rounding."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import scaletrain.model.loss as loss_module
import scaletrain.train.loss as step_loss
from scaletrain.config import ModelConfig
from scaletrain.model import build_model


class _WholeModel:
    """The fields of a ParallelModel that evaluation reads, for one process holding the whole model."""

    sharded = False
    pipeline = None
    tp_enabled = False
    loss_rows = -1
    dims = SimpleNamespace(cp=1)
    objective_loss = None

    def __init__(self, model, vocab_limit=None):
        self.modules = self.parts = [model]
        self.vocab_limit = vocab_limit


@pytest.mark.parametrize("vocab_limit,masked", [(None, False), (1000, True)])
def test_evaluation_past_the_logits_budget_runs_the_head_by_chunks_with_the_same_loss(monkeypatch, vocab_limit,
                                                                                        masked):
    model = build_model(ModelConfig(vocab_size=1024, dim=32, n_layers=2, n_heads=2, ffn_hidden_dim=64,
                                    max_seq_len=16), seed=0).eval()
    tokens = torch.randint(0, 1000, (3, 17), generator=torch.Generator().manual_seed(0))
    inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
    if masked:  # instruction data: prompt positions are no targets (-100), a whole chunk of them included
        targets[0, :12] = -100
        targets[2, 3:5] = -100
    pm = _WholeModel(model, vocab_limit)
    with torch.no_grad():
        whole = step_loss.forward_loss(pm, inputs, targets)  # 3 x 16 x 1024 x 4 bytes: under the budget
        rows: list[int] = []
        real = loss_module._chunk_logits
        monkeypatch.setattr(loss_module, "_chunk_logits", lambda h, *a: rows.append(h.shape[0]) or real(h, *a))
        pm.loss_rows = 10  # 10 positions' logits at a time
        chunked = step_loss.forward_loss(pm, inputs, targets)
    assert rows == [10, 10, 10, 10, 8]  # never the whole batch's 48 positions at once
    assert chunked.item() == pytest.approx(whole.item(), rel=1e-6)
    assert (torch.isfinite(chunked)).item()


def test_the_chunked_loss_is_not_used_for_a_replaced_loss(monkeypatch):
    """Distillation sets its own loss on the logits (pm.objective_loss): it keeps the whole logits."""
    model = build_model(ModelConfig(vocab_size=256, dim=16, n_layers=1, n_heads=2, ffn_hidden_dim=32,
                                    max_seq_len=8), seed=0).eval()
    pm = _WholeModel(model)
    seen = []
    pm.objective_loss = lambda logits, targets: seen.append(logits.shape) or logits.float().mean()
    pm.loss_rows = 1
    with torch.no_grad():
        step_loss.forward_loss(pm, torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long))
    assert seen == [torch.Size([2, 8, 256])]
