"""The compiled decode (model/decode.py): the static KV cache gives today's greedy tokens, eager and compiled, at
batch 1 and for ragged batches, with grouped-query attention and sliding-window layers; the compiled step is one
graph for every position (no graph break, no recompile a token); what it cannot run is said."""

from __future__ import annotations

import pytest
import torch
from test_generate import MODELS, VOCAB, tiny_model

from scaletrain.core.options import ConfigError
from scaletrain.model.cache import StaticKVCache
from scaletrain.model.decode import StaticDecoder, static_capacity, supports
from scaletrain.model.generate import Sampling, generate_batch

GREEDY = dict(max_seq_len=240, vocab_limit=VOCAB, sampling=Sampling(temperature=0.0, repetition_penalty=2.0))


def ragged_prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(4)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (3, 17, 9, 1, 5, 12, 2, 30)]


def gqa_sliding():
    """Grouped-query attention (4 query heads a KV head) and a sliding-window layer with its own rotary base
    (Gemma 3's local layers), the window shorter than the generation."""
    return tiny_model(n_kv_heads=1, sliding_window=6, sliding_layers=[0], local_rope_theta=500.0)


MODELS_STATIC = {**{k: v for k, v in MODELS.items() if k != "prompt-tuning"}, "gqa-sliding": gqa_sliding}


@pytest.mark.parametrize("option", list(MODELS_STATIC))
def test_static_cache_eager_gives_todays_tokens(option):
    model = MODELS_STATIC[option]()
    decoder = StaticDecoder(model, compile=False)
    prompts = ragged_prompts()
    for batch in (prompts[:1], prompts):
        assert generate_batch(model, batch, 50, decoder=decoder, **GREEDY) == generate_batch(model, batch, 50, **GREEDY)


def unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@pytest.mark.slow  # ~30 s: two compiles (batch 1 and 8) on 2 cores
def test_compiled_step_gives_todays_tokens_with_one_graph_for_all_positions():
    model = gqa_sliding()
    decoder = StaticDecoder(model)
    prompts = ragged_prompts()
    for batch in (prompts[:1], prompts):
        before = unique_graphs()
        assert generate_batch(model, batch, 40, decoder=decoder, **GREEDY) == generate_batch(model, batch, 40, **GREEDY)
        assert unique_graphs() - before == 1  # 39 positions, one compiled graph (fullgraph: no graph break)
    before = unique_graphs()  # another prompt of the same shape: the graph and the cache are reused
    other = [[(t + 1) % VOCAB for t in p] for p in prompts]
    assert generate_batch(model, other, 40, decoder=decoder, **GREEDY) == generate_batch(model, other, 40, **GREEDY)
    assert unique_graphs() == before


def test_capacity_rounds_up_within_the_context_and_past_it_the_window_slides_eagerly():
    assert static_capacity(10, 20, 240) == 64 and static_capacity(60, 20, 240) == 128
    assert static_capacity(200, 100, 240) == 240
    model = tiny_model()
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [11, 12, 13]]
    decoder = StaticDecoder(model, compile=False)
    assert generate_batch(model, prompts, 40, max_seq_len=24, decoder=decoder) == \
        generate_batch(model, prompts, 40, max_seq_len=24)


def test_a_full_static_cache_is_refused_not_overwritten():
    decoder = StaticDecoder(tiny_model(), compile=False)
    cache = decoder.cache(1, 4)
    decoder.prefill(torch.tensor([[1, 2, 3, 4]]), torch.zeros(1, 4, dtype=torch.bool), cache)
    with pytest.raises(ValueError, match="full"):
        decoder.step(torch.tensor([[5]]), cache)
    assert isinstance(cache, StaticKVCache) and cache.tokens == 4


def test_prompt_tuning_is_said_and_generate_compile_refuses_it_in_one_line(tmp_path):
    from scaletrain.infer.cli import compiled_decoder

    model = MODELS["prompt-tuning"]()
    assert "prompt tuning" in supports(model)
    with pytest.raises(ValueError, match="prompt tuning"):
        StaticDecoder(model)
    with pytest.raises(ConfigError, match="--compile: the compiled decode cannot run"):
        compiled_decoder(model, str(tmp_path))


@pytest.mark.parametrize("rows", [1, 8])
def test_streamed_linear_computes_what_linear_and_torchaos_int8_linear_compute(rows):
    """StreamedLinear's fused loop (compiled, as in the decode step) equals F.linear on a float weight and
    torchao's int8 weight-only linear on its Int8Tensor, within float rounding; more rows than it takes pass by."""
    from scaletrain.model.decode import STREAMED_ROWS, StreamedLinear, streamed_linear

    layer = MODELS["int8"]().layers["0"].feed_forward.w2  # an Int8Tensor weight (96 -> 64)
    dense = torch.nn.Linear(96, 64, bias=True)
    x = torch.randn(rows, 1, 96)

    def run(module, x):
        with StreamedLinear():
            return module(x)

    with torch.no_grad():
        for module in (layer, dense):
            compiled = torch.compile(run, fullgraph=True, dynamic=False)(module, x)
            torch.testing.assert_close(compiled, module(x), rtol=1e-5, atol=1e-5)
    assert streamed_linear(torch.randn(STREAMED_ROWS + 1, 96), dense.weight) is None  # a prefill: mm as before


@pytest.mark.slow  # ~20 s a compile of a quantized model
@pytest.mark.parametrize("capability", ["AVX512", "AVX2"])
def test_compiled_int8_decode_gives_the_eager_tokens(capability, monkeypatch):
    """Every int8 step: streamed int8 loops (an AVX-512 CPU); without AVX-512 the integers streamed from a float16
    copy at one row and folded to float32 in a frozen step at three, both in torchao's order
    (x @ qdata.T * scale). Each runs on any x86 CPU: the capability only chooses."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    model = MODELS["int8"]()
    decoder = StaticDecoder(model)
    assert decoder.held == decoder.frozen == (capability == "AVX2")
    for prompts in (ragged_prompts()[:1], ragged_prompts()[:3]):
        expected = generate_batch(model, prompts, 30, **GREEDY)
        assert generate_batch(model, prompts, 30, decoder=decoder, **GREEDY) == expected
    assert (decoder._held is not None) == (capability == "AVX2")  # made by the one-row generation


def test_the_float16_copy_shares_every_tensor_but_the_int8_weights_and_computes_torchaos_product():
    """half_held: a copy of the module tree, no parameter copied; each int8 weight-only Linear's integers as
    float16, exactly; its product (eager, and streamed at one row) is torchao's int8 linear's."""
    from scaletrain.model.decode import HalfHeldLinear, half_held

    model = MODELS["int8"]()
    held = half_held(model)
    originals = {id(p) for p in model.parameters()}
    assert all(id(p) in originals for p in held.parameters())
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)
               and type(m.weight).__name__ == "Int8Tensor"]
    assert linears
    for name, linear in linears:
        copy = held.get_submodule(name)
        assert isinstance(copy, HalfHeldLinear) and copy.values.dtype == torch.float16
        assert torch.equal(copy.values.to(torch.int8), linear.weight.qdata)
        for rows in (1, 5):
            x = torch.randn(rows, linear.in_features)
            torch.testing.assert_close(copy(x), linear(x), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(torch.compile(copy, fullgraph=True)(x), linear(x), rtol=1e-5, atol=1e-5)
        break  # one Linear's compile is enough (the slow test above decodes with all of them)
    assert isinstance(model.get_submodule(linears[0][0]), torch.nn.Linear)  # the model itself unchanged


def test_a_float_model_is_frozen_into_the_cpu_step_and_a_quantized_one_streams():
    """On the CPU a float model's batched step compiles with its weights frozen in (inductor's C++ GEMM
    template); a model with torchao's int8 weights keeps StreamedLinear (freezing would fold its int8 weights to
    float). The slow test above checks both paths' tokens (batch 1 streams, batch 8 is frozen)."""
    assert StaticDecoder(tiny_model()).frozen
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
        assert not StaticDecoder(MODELS["int8"]()).frozen
    assert not StaticDecoder(tiny_model(), compile=False).frozen


@pytest.mark.slow  # ~30 s: two compiles of the frozen step
def test_a_frozen_step_follows_weights_written_after_it_compiled():
    """The frozen step holds the weights it compiled with: after an in-place write (an optimizer step, a load)
    the next generation compiles it again, so it never decodes with stale weights."""
    model = tiny_model()
    decoder = StaticDecoder(model)
    prompts = ragged_prompts()[:2]
    assert generate_batch(model, prompts, 12, decoder=decoder, **GREEDY) == generate_batch(model, prompts, 12, **GREEDY)
    with torch.no_grad():
        model.output.weight.copy_(torch.roll(model.output.weight, 1, dims=0))  # another model's next tokens
    expected = generate_batch(model, prompts, 12, **GREEDY)
    assert generate_batch(model, prompts, 12, decoder=decoder, **GREEDY) == expected


@pytest.mark.slow  # ~30 s: the frozen step compiled for two capacities
def test_a_second_decoder_of_the_same_model_decodes_with_its_own_cache():
    """Two decoders of one model share dynamo's compiled steps (same shapes, same weights): each call must read
    and write the cache it is given. The frozen CPU step once folded the first decoder's cache into its graph
    (a static address counts as a parameter), so the second decoder wrote the first one's slots: a 64-slot run,
    then a 128-slot one, crashed on an index past the end."""
    model = tiny_model()
    prompts = ragged_prompts()[:2]
    short, long = (generate_batch(model, prompts, n, **GREEDY) for n in (4, 40))  # 64 and 128 slots
    for _ in range(2):
        decoder = StaticDecoder(model)
        assert generate_batch(model, prompts, 4, decoder=decoder, **GREEDY) == short
        assert generate_batch(model, prompts, 40, decoder=decoder, **GREEDY) == long


def test_int8_on_an_avx2_cpu_compiles_dequantized_and_other_quantized_weights_decode_eagerly(
        monkeypatch, tmp_path, capsys):
    """Where inductor's int8 kernels were measured slower than the eager decode (no AVX-512: 4-9x slower than
    its fp32 ones), --compile holds int8 weight-only weights as float16 at one row and as float32 in the frozen
    step at more, and says so in one line (with the memory it costs); other quantized weights (int4 here)
    decode eagerly, said in one line; float models and AVX-512 CPUs compile as before."""
    from scaletrain.compress.quantize import quantize_model
    from scaletrain.infer.cli import compiled_decoder
    from scaletrain.model.decode import dequantized_in_step, slower_than_eager

    int8, plain, int4 = MODELS["int8"](), tiny_model(), tiny_model()
    quantize_model(int4, "int4-weight")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert dequantized_in_step(int8) and not dequantized_in_step(plain) and not dequantized_in_step(int4)
    assert slower_than_eager(int8) == "" and slower_than_eager(plain) == ""
    assert "without AVX-512" in slower_than_eager(int4)
    decoder = compiled_decoder(int8, str(tmp_path))
    assert isinstance(decoder, StaticDecoder) and decoder.frozen and decoder.held
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "float16 at one row (+" in err and "float32 at more (+" in err
    assert compiled_decoder(int4, str(tmp_path)) is None
    assert capsys.readouterr().err.count("\n") == 1
    assert isinstance(compiled_decoder(plain, str(tmp_path)), StaticDecoder)
    unfrozen = StaticDecoder(int8, freeze=False)  # freeze=False: the float16 copy streamed at every batch
    assert not unfrozen.frozen and unfrozen.held
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert slower_than_eager(int8) == "" and slower_than_eager(int4) == ""
    decoder = compiled_decoder(int8, str(tmp_path))
    assert isinstance(decoder, StaticDecoder) and not decoder.frozen and not decoder.held
    assert capsys.readouterr().err == ""
