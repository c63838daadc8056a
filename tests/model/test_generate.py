"""Generation with the KV cache: the same greedy tokens as re-running the whole context, for every model option
and adapter; batched prompts of different lengths equal each alone; sampling options and bad input."""

from __future__ import annotations

import pytest
import torch

from scaletrain.config import ModelConfig, build
from scaletrain.core.options import ConfigError
from scaletrain.finetune.lora import apply_lora
from scaletrain.finetune.prompt import apply_prefix_tuning, apply_prompt_tuning
from scaletrain.model import PRESETS, build_model
from scaletrain.model.generate import Sampling, cut_at_stop, generate_batch, stop_at_strings, stream

VOCAB = 97


def tiny_model(seed: int = 0, **kw) -> torch.nn.Module:
    # init_std 0.1: logits far enough apart that greedy ties (where fp32 rounding may pick either) do not occur
    base = dict(dim=64, n_layers=2, n_heads=4, ffn_hidden_dim=96, vocab_size=VOCAB, max_seq_len=256, init_std=0.1)
    return build_model(build(ModelConfig, {**base, **kw}, presets=PRESETS), seed=seed).eval()


@torch.no_grad()
def _randomize(model: torch.nn.Module, names: tuple[str, ...]) -> None:
    """Adapter weights away from their identity init, so the adapters change the output."""
    gen = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        if name.rsplit(".", 1)[-1] in names:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def with_lora():
    model = tiny_model()
    apply_lora(model, ["q", "v", "down"], rank=4, alpha=8, dropout=0.0, rslora=False)
    _randomize(model, ("lora_A", "lora_B"))
    return model


def with_prompt_tuning():
    model = tiny_model()
    apply_prompt_tuning(model, 5)
    _randomize(model, ("prompt",))
    return model


def with_prefix_tuning():
    model = tiny_model(n_kv_heads=2)
    apply_prefix_tuning(model, 3)
    _randomize(model, ("prefix_key", "prefix_value"))
    return model


def pruned():
    """What structured pruning leaves (fewer heads of the old width, a narrower MLP, head_dim apart from dim)
    plus unstructured zeros."""
    model = tiny_model(n_heads=2, head_dim=16, ffn_hidden_dim=48)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("layers.") and p.dim() == 2:
                p.mul_(torch.rand(p.shape, generator=torch.Generator().manual_seed(2)) > 0.5)
    return model


def int8():
    pytest.importorskip("torchao")
    from scaletrain.compress.quantize import quantize_model

    model = tiny_model()
    quantize_model(model, "int8-weight")
    return model


MODELS = {
    "plain": tiny_model,
    "gqa": lambda: tiny_model(n_heads=4, n_kv_heads=1),
    "tied": lambda: tiny_model(tie_embeddings=True),
    "padded-vocab": lambda: tiny_model(vocab_size=128),  # generation limited to the 97 real ids
    "mup": lambda: tiny_model(parametrization="mup", mup_base_width=32),
    "lora": with_lora,
    "prompt-tuning": with_prompt_tuning,
    "prefix-tuning": with_prefix_tuning,
    "pruned": pruned,
    "int8": int8,
}


@pytest.mark.parametrize("option", list(MODELS))
def test_cached_greedy_equals_rerunning_the_context(option):
    model = MODELS[option]()
    prompt = torch.randint(0, VOCAB, (8,), generator=torch.Generator().manual_seed(3)).tolist()
    # greedy; the repetition penalty keeps a random model from settling into a loop early (after which any
    # cache content would give the same tokens), so all 200 steps compare something
    kw = dict(max_seq_len=240, vocab_limit=VOCAB, sampling=Sampling(temperature=0.0, repetition_penalty=2.0))
    cached = generate_batch(model, [prompt], 200, **kw)[0]
    reference = generate_batch(model, [prompt], 200, use_cache=False, **kw)[0]
    assert len(cached) == 200
    assert cached == reference
    assert len(set(cached[-50:])) > 5  # no loop: the comparison has something to compare to the end


def test_past_the_context_the_window_slides_as_without_cache():
    """Once prompt + generated fill the context, each step re-prefills the last max_seq_len tokens."""
    model = tiny_model()
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [11, 12, 13]]
    cached = generate_batch(model, prompts, 40, max_seq_len=24)
    reference = [generate_batch(model, [p], 40, max_seq_len=24, use_cache=False)[0] for p in prompts]
    assert cached == reference


@pytest.mark.parametrize("option", ["plain", "gqa", "prompt-tuning", "prefix-tuning"])
def test_batched_prompts_of_different_lengths_equal_each_alone(option):
    model = MODELS[option]()
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (3, 17, 9, 1)]
    batched = generate_batch(model, prompts, 60, max_seq_len=128)
    alone = [generate_batch(model, [p], 60, max_seq_len=128)[0] for p in prompts]
    assert batched == alone


def test_sampling_is_seeded_and_options_change_it():
    model = tiny_model()
    prompts = [[5, 6, 7], [8, 9]]

    def run(seed=0, **kw):
        return generate_batch(model, prompts, 30, max_seq_len=64, sampling=Sampling(**kw),
                              generator=torch.Generator().manual_seed(seed))

    assert run(temperature=1.0) == run(temperature=1.0)
    assert run(temperature=1.0) != run(1, temperature=1.0)
    greedy = run(temperature=0.0)
    assert run(temperature=1.0, top_k=1) == greedy  # top-1 sampling is greedy
    assert run(temperature=1.0, top_p=1e-6) == greedy  # so is a vanishing nucleus
    penalized = run(temperature=0.0, repetition_penalty=5.0)
    assert penalized != greedy
    assert all(len(set(row)) >= len(set(g)) for row, g in zip(penalized, greedy))


def test_stop_id_stop_strings_and_streaming():
    model = tiny_model()
    prompt = [5, 6, 7]
    full = generate_batch(model, [prompt], 30, max_seq_len=64)[0]
    assert generate_batch(model, [prompt], 30, max_seq_len=64, stop_id=full[10])[0] == full[:full.index(full[10])]
    decode = lambda ids: "".join(chr(65 + i % 26) for i in ids)  # noqa: E731
    stop = decode(full[12:14])
    cut = generate_batch(model, [prompt], 30, max_seq_len=64, stop=stop_at_strings(decode, [stop]))[0]
    assert stop in decode(cut) and stop not in decode(cut[:-1])
    assert cut_at_stop(decode(cut), [stop]) == decode(full)[:decode(full).find(stop)]
    steps = list(stream(model, [prompt, [1]], 5, max_seq_len=64))
    assert [len(s) for s in steps] == [2] * 5


def test_bad_input_is_one_line():
    model = tiny_model()
    with pytest.raises(ConfigError, match="longer than the model's context of 16"):
        generate_batch(model, [list(range(17))], 4, max_seq_len=16)
    with pytest.raises(ConfigError, match="must not be empty"):
        stop_at_strings(str, ["", "x"])


def test_decode_report_has_prefill_and_decode_at_batch_1_and_8():
    from scaletrain.model.generate import decode_report

    row = decode_report(tiny_model(), VOCAB, prompt_tokens=8, new_tokens=6, max_seq_len=10)  # slides past 10
    assert sorted(row) == ["decode_tokens_per_s_batch1", "decode_tokens_per_s_batch8",
                           "prefill_tokens_per_s_batch1", "prefill_tokens_per_s_batch8"]
    assert all(v > 0 for v in row.values())


def test_several_stop_ids_end_a_row_at_any_of_them():
    """A chat template's end of turn and the EOS both end an answer (``stop_id`` takes one id or several)."""
    from scaletrain.config import ModelConfig
    from scaletrain.model import build_model
    from scaletrain.model.generate import generate

    cfg = ModelConfig(vocab_size=32, dim=16, n_layers=1, n_heads=2, ffn_hidden_dim=32, max_seq_len=16)
    model = build_model(cfg, seed=0).eval()
    free = generate(model, [1, 2, 3], 6, max_seq_len=16, temperature=0.0)
    assert len(free) == 6
    first = free.index(free[2])  # the first place that id comes
    assert generate(model, [1, 2, 3], 6, max_seq_len=16, temperature=0.0, stop_id=[31, free[2]]) == free[:first]
    assert generate(model, [1, 2, 3], 6, max_seq_len=16, temperature=0.0, stop_id=free[0]) == []


@pytest.mark.parametrize("make", [tiny_model, with_prompt_tuning, with_prefix_tuning],
                         ids=["plain", "prompt", "prefix"])
def test_last_only_is_the_last_position_of_the_whole_logits(make):
    """``last_only`` (what generation asks for): the head on the last position alone gives that position's logits
    of the full forward, with and without a KV cache (prefill, then one decode step)."""
    from scaletrain.model.cache import KVCache

    model = make()
    tokens = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(tokens)
        last = model(tokens, last_only=True)
        assert last.shape == (2, 1, full.shape[-1])
        torch.testing.assert_close(last[:, 0], full[:, -1], rtol=1e-5, atol=1e-5)
        whole, part = KVCache(2, 16), KVCache(2, 16)
        for step in (tokens[:, :8], tokens[:, 8:]):
            expected = model(step, cache=whole)[:, -1]
            got = model(step, cache=part, last_only=True)
            assert got.shape[1] == 1
            torch.testing.assert_close(got[:, 0], expected, rtol=1e-5, atol=1e-5)
