"""A model vocabulary padded beyond the tokenizer's (issue 9): the padding rule, the masked loss (equal to the
loss on the sliced logits, zero gradient for the padding rows), sampling that never draws a padding id, the
trainer's wiring and evaluation. Export: tests/checkpoint/test_export.py; tensor-parallel parity on real gloo ranks:
tests/parallel/test_parallel_dist.py (``*_padded`` strategies and the tp=2 CLI run)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.config import ConfigError, JobConfig, ModelConfig, ParallelConfig, load_config
from scaletrain.data.run_data import resolve_vocab
from scaletrain.model import build_model
from scaletrain.model.generate import generate
from scaletrain.parallel import ParallelDims
from scaletrain.parallel.dims import padded_vocab_size
from scaletrain.train.evaluate import token_loss
from scaletrain.train.loss import cross_entropy
from scaletrain.train.step import StepOptions, training_step
from scaletrain.train.trainer import Trainer


@pytest.mark.parametrize("vocab,tp,expected", [
    (65, 1, 65),  # the character vocabulary is not doubled to 128 (the baby recipe's step time stays)
    (65, 2, 66),  # a multiple of tp always
    (65, 3, 66),
    (50257, 1, 50304),  # GPT-2 BPE: +47 rows (0.09%) buys the GPU-friendly multiple of 64
    (50257, 8, 50304),
    (8192, 1, 8192),
    (8192, 2, 8192),
    (100, 4, 100),  # already a multiple of 4; 128 would add 28% rows
    (6350, 1, 6400),  # +50 rows = 0.79%: rounded
    (1000, 1, 1000),  # 1024 would add 2.4% rows: not
])
def test_padding_rule(vocab, tp, expected):
    assert padded_vocab_size(vocab, tp) == expected


def test_resolve_vocab_pads_only_a_data_derived_vocabulary():
    auto = JobConfig()
    cfg, note = resolve_vocab(auto, {"vocab_size": 65}, tp=2)
    assert cfg.model.vocab_size == 66
    assert note == "65 -> 66 (padded for parallel.tp=2; padding rows masked out of the loss and sampling)"
    cfg, note = resolve_vocab(auto, {"vocab_size": 50257}, tp=1)
    assert (cfg.model.vocab_size, note.split(" (")[0]) == (50304, "50257 -> 50304")
    assert "padded to a multiple of 64" in note
    assert resolve_vocab(auto, {"vocab_size": 65}, tp=1) == (JobConfig(model=ModelConfig(vocab_size=65)), "65")
    explicit = JobConfig(model=ModelConfig(vocab_size=65))
    assert resolve_vocab(explicit, {"vocab_size": 65}, tp=2)[0].model.vocab_size == 65  # kept as is ...
    with pytest.raises(ConfigError, match=r"must be divisible by parallel.tp \(2\).*leave model.vocab_size = 0"):
        ParallelDims.from_config(ParallelConfig(tp=2), 2).check_model(ParallelConfig(tp=2), explicit.model, 32, 4)
    with pytest.raises(ConfigError, match="smaller than the data's tokenizer vocabulary"):
        resolve_vocab(explicit, {"vocab_size": 70})


def test_the_vocab_line_says_a_bpe_smaller_than_asked():
    manifest = {"vocab_size": 65, "tokenizer": {"kind": "bpe", "vocab_size_asked": 70001}}  # prepare recorded it
    assert resolve_vocab(JobConfig(), manifest)[1] == "65 (a BPE of 70001 was asked; the text supports only 65)"


def test_masked_cross_entropy_equals_the_loss_on_sliced_logits():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 70, generator=g)
    logits[..., 64:] += 20.0  # padding logits larger than any real one: unmasked, they would take the mass
    targets = torch.randint(0, 64, (3, 7), generator=g)
    padded = logits.clone().requires_grad_()
    loss = cross_entropy(padded, targets, vocab_limit=64)
    loss.backward()
    reference = F.cross_entropy(logits[..., :64].flatten(0, 1), targets.flatten())
    torch.testing.assert_close(loss, reference, rtol=0, atol=1e-6)
    assert torch.count_nonzero(padded.grad[..., 64:]) == 0  # exactly zero, not just small
    assert torch.count_nonzero(padded.grad[..., :64]) > 0
    assert torch.equal(padded, logits)  # the caller's logits are not modified in place
    unmasked = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    assert torch.equal(cross_entropy(logits, targets), unmasked)
    assert torch.equal(cross_entropy(logits, targets, vocab_limit=70), unmasked)  # nothing to mask
    assert unmasked > reference + 5  # the mask matters here


def test_padding_rows_get_exactly_zero_gradient_in_a_training_step(tmp_path, tiny):
    """Through the trainer's wiring: the tokenizer's size (65) reaches the loss of a 66-row model."""
    trainer = Trainer(load_config(None, tiny(tmp_path / "run", **{"model.vocab_size": 66})), log=False)
    assert trainer.tokenizer.vocab_size == 65 and trainer.pm.vocab_limit == 65
    assert trainer.vocab_note == "66 (model.vocab_size; tokenizer 65, rows >= 65 masked out of the loss and sampling)"
    model = trainer.model
    checked = []

    def before_update(loss: float, grad_norm: float) -> bool:
        for name in ("output.weight", "tok_embeddings.weight"):
            grad = model.get_parameter(name).grad
            assert torch.count_nonzero(grad[65:]) == 0, name
            assert torch.count_nonzero(grad[:65]) > 0, name
        checked.append(loss)
        return True

    embedding_padding = model.tok_embeddings.weight[65:].detach().clone()
    inputs, targets = next(trainer.train_loader)
    with torch.no_grad():
        expected = F.cross_entropy(model(inputs)[..., :65].flatten(0, 1), targets.flatten())
    training_step(trainer.pm, trainer.optimizer, iter([(inputs, targets, None)]), 1,
                  StepOptions(grad_clip=1.0, before_update=before_update))
    assert checked == [pytest.approx(float(expected), rel=1e-6)]
    # Zero gradient and no weight decay on embeddings: AdamW leaves the padding row exactly as it was.
    assert torch.equal(model.tok_embeddings.weight[65:], embedding_padding)


def test_token_loss_masks_the_padding_columns():
    model = build_model(ModelConfig(vocab_size=70, dim=32, n_layers=1, n_heads=2, ffn_hidden_dim=64,
                                    max_seq_len=16), "cpu", seed=0)
    with torch.no_grad():
        model.output.weight[64:] = 5 * model.output.weight[:64].abs().max()  # large padding logits
    tokens = torch.randint(0, 64, (16 * 3 + 1,), generator=torch.Generator().manual_seed(0))
    masked, count = token_loss(model, tokens, 16, vocab_limit=64)
    with torch.no_grad():
        rows = torch.stack([tokens[i * 16:i * 16 + 17] for i in range(3)])
        reference = F.cross_entropy(model(rows[:, :-1])[..., :64].flatten(0, 1), rows[:, 1:].flatten())
    assert count == 48 and masked == pytest.approx(float(reference), rel=1e-6)
    assert token_loss(model, tokens, 16)[0] > masked + 0.1  # unmasked, they take mass


class PaddingFavoured(nn.Module):
    """Logits where the padding ids (>= ``limit``) are the most likely by far, and id 3 the best real one."""

    def __init__(self, vocab: int, limit: int):
        super().__init__()
        self.anchor = nn.Parameter(torch.zeros(()))  # generate reads the device from the parameters
        self.vocab, self.limit = vocab, limit

    def forward(self, ids: torch.Tensor, cache=None, padding=None, last_only=False) -> torch.Tensor:  # (no cache)
        logits = torch.zeros(ids.shape[0], 1 if last_only else ids.shape[1], self.vocab)
        logits[..., 3] = 2.0
        logits[..., self.limit:] = 50.0
        return logits


def test_generate_never_returns_a_padding_id():
    model = PaddingFavoured(vocab=70, limit=65)
    assert set(generate(model, [1], 5, max_seq_len=8, temperature=0)) <= set(range(65, 70))  # the trap works
    assert generate(model, [1], 5, max_seq_len=8, temperature=0, vocab_limit=65) == [3] * 5
    for options in (dict(temperature=1.0), dict(temperature=2.0, top_k=10), dict(temperature=5.0, top_p=0.99)):
        gen = torch.Generator().manual_seed(0)
        new = generate(model, [1], 200, max_seq_len=8, generator=gen, vocab_limit=65, **options)
        assert len(new) == 200 and max(new) < 65, options
