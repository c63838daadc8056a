"""Loader: same seed -> same batches; stop + resume = uninterrupted (also with prefetch and with another
world size); ranks disjoint within an epoch; document ids and the block-causal mask."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from scaletrain.data.loader import TokenLoader, block_causal_mask, eval_batches
from scaletrain.data.shards import ShardWriter, verify_checksums, write_manifest
from scaletrain.data.tokenizer import DataError

SEQ, B = 8, 4


def _dataset(path, n_tokens=1000, doc_len=37, shard_tokens=300, with_index=True, eos=None):
    """Token i at position i (so a window is identified by its first token), cut into documents."""
    w = ShardWriter(path, "train", np.dtype("<u4"), shard_tokens=shard_tokens)
    for start in range(0, n_tokens, doc_len):
        w.add(np.arange(start, min(start + doc_len, n_tokens), dtype="<u4"))
    info = {"tokens": w.tokens, "documents": len(w.doc_ends), "shards": w.close()}
    if with_index:
        info["doc_index"] = w.write_doc_index()
    write_manifest(path, {"dtype": "<u4", "vocab_size": n_tokens, "eos_id": eos, "splits": {"train": info}})
    return path


def _firsts(loader, steps):
    return [next(loader)[0][:, 0].tolist() for _ in range(steps)]


@pytest.mark.parametrize("prefetch", [0, 3])
def test_same_seed_same_batches_and_exact_resume(tmp_path, prefetch):
    data = _dataset(tmp_path)
    make = lambda: TokenLoader(str(data), "train", SEQ, B, seed=7, prefetch=prefetch)  # noqa: E731
    full = _firsts(make(), 90)  # > 3 epochs of 124 windows / 4
    assert full == _firsts(make(), 90)
    assert full != _firsts(TokenLoader(str(data), "train", SEQ, B, seed=8, prefetch=prefetch), 90)
    first = make()
    head = _firsts(first, 40)
    state = first.state_dict()  # taken while the prefetch thread has already read ahead
    resumed = make()
    resumed.load_state_dict(state)
    assert head + _firsts(resumed, 50) == full


def test_targets_are_inputs_shifted(tmp_path):
    data = _dataset(tmp_path)
    assert verify_checksums(data) == 5  # 4 streamed shards of <= 300 tokens + the document index
    x, y = next(TokenLoader(str(data), "train", SEQ, B, seed=1))
    assert x.dtype == torch.int64 and x.shape == (B, SEQ)
    assert torch.equal(y, x + 1)  # token i is followed by i + 1, also across shard boundaries


def test_ranks_disjoint_and_complete_within_an_epoch(tmp_path):
    data = _dataset(tmp_path)
    world = 3
    n_windows = (1000 - 1) // SEQ
    steps = n_windows // (B * world)
    seen = [sum(_firsts(TokenLoader(str(data), "train", SEQ, B, rank=r, world_size=world, seed=3), steps), [])
            for r in range(world)]
    flat = sum(seen, [])
    assert len(flat) == len(set(flat)) == steps * B * world  # no sample on two ranks
    assert all(f % SEQ == 0 for f in flat)  # epoch 0 starts at offset 0: windows at multiples of SEQ


def test_resume_on_another_world_size_continues_the_global_order(tmp_path):
    data = _dataset(tmp_path)
    single = sum(_firsts(TokenLoader(str(data), "train", SEQ, B, seed=5), 12), [])  # 48 samples in order
    two = [TokenLoader(str(data), "train", SEQ, B, rank=r, world_size=2, seed=5) for r in range(2)]
    got = []
    for _ in range(3):  # 3 steps x 2 ranks x 4 = 24 samples
        got += sum((next(loader)[0][:, 0].tolist() for loader in two), [])
    state = two[0].state_dict()
    assert state == two[1].state_dict()
    one = TokenLoader(str(data), "train", SEQ, B, seed=5)
    one.load_state_dict(state)
    got += sum(_firsts(one, 6), [])
    assert got == single


def test_resume_refuses_another_stream(tmp_path):
    data = _dataset(tmp_path)
    state = TokenLoader(str(data), "train", SEQ, B, seed=5).state_dict()
    with pytest.raises(DataError, match="seq_len"):
        TokenLoader(str(data), "train", SEQ * 2, B, seed=5).load_state_dict(state)


@pytest.mark.parametrize("with_index", [True, False])
def test_document_ids_and_block_causal_mask(tmp_path, with_index):
    # without a doc index the ids come from EOS: make token 36 (last of the first document) the EOS
    data = _dataset(tmp_path, with_index=with_index, eos=None if with_index else 36, doc_len=37)
    loader = TokenLoader(str(data), "train", SEQ, B, seed=0, shuffle=False, return_doc_ids=True)
    for _ in range(5):
        x, y, doc = next(loader)
        if with_index:
            expected = x // 37 - x[:, :1] // 37  # token i belongs to document i // 37
        else:
            expected = torch.cumsum((x == 36).long(), 1) - (x == 36).long()
        assert torch.equal(doc, expected)
    x, y, doc = next(TokenLoader(str(data), "train", SEQ, B, seed=0, shuffle=False, return_doc_ids=True))
    mask = block_causal_mask(torch.tensor([[0, 0, 1, 1]]))
    assert mask.shape == (1, 1, 4, 4)
    assert mask[0, 0].tolist() == [[True, False, False, False], [True, True, False, False],
                                   [False, False, True, False], [False, False, True, True]]


def test_eval_batches_fixed_and_cover_split(tmp_path):
    data = _dataset(tmp_path)
    a = [x[:, 0].tolist() for x, _ in eval_batches(str(data), "train", SEQ, B, 3)]
    assert a == [x[:, 0].tolist() for x, _ in eval_batches(str(data), "train", SEQ, B, 3)]
    assert len(a) == 3
    everything = sum((x[:, 0].tolist() for x, _ in eval_batches(str(data), "train", SEQ, B, 0)), [])
    assert everything == [i * SEQ for i in range((1000 - 1) // SEQ)]


def test_block_causal_mask_confines_attention_in_the_model(tmp_path):
    """With the mask, a token's output does not change when the previous document changes."""
    from scaletrain.config import ModelConfig
    from scaletrain.model import build_model

    data = _dataset(tmp_path, doc_len=37)
    x, _, doc = next(TokenLoader(str(data), "train", 32, 2, seed=0, shuffle=False, return_doc_ids=True))
    row = 1  # tokens 32..63: a document boundary at 37
    t = int((doc[row] > 0).nonzero()[0])
    model = build_model(ModelConfig(vocab_size=1000, dim=32, n_layers=1, n_heads=2, max_seq_len=32), seed=0)
    changed = x.clone()
    changed[row, :t] = (changed[row, :t] + 1) % 1000  # rewrite the end of the previous document
    mask = block_causal_mask(doc)
    with torch.no_grad():
        assert torch.allclose(model(x, attn_mask=mask)[row, t:], model(changed, attn_mask=mask)[row, t:], atol=1e-5)
        assert not torch.allclose(model(x)[row, t:], model(changed)[row, t:], atol=1e-5)  # plain causal leaks
