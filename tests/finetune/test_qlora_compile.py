"""finetune.qlora_compile: QLoRA's 4-bit base dequantized through torch.compile (finetune/lora.py:
``CompiledLinearNF4``) computes what torchao's eager ``linear_nf4`` computes - the weight bitwise, the forward and the
gradients (input and adapters) to 1e-5 in fp32 - and a fine-tune with it trains, resumes and keeps the model eager."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers import faults
from helpers.tiny import CHARS, tiny_hf_base
from scaletrain.cli import main

pytest.importorskip("torchao", reason="finetune.method=qlora needs torchao (pip install 'scaletrain[finetune]')")

from scaletrain.finetune import lora  # noqa: E402  (after the skip: lora's NF4 paths import torchao)

TOL = 1e-5


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory):
    return tiny_hf_base(tmp_path_factory.mktemp("base"))


@pytest.fixture
def eager_linear_nf4_refused(monkeypatch):
    """Makes torchao's eager ``linear_nf4`` raise: a compiled path that fell back to it would fail the test."""
    from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor

    def refuse(*args):
        raise AssertionError("the eager linear_nf4 ran on the compiled path")

    monkeypatch.setattr(nf4_tensor.LinearNF4, "apply", refuse)


@pytest.mark.parametrize("shape", [(96, 64), (64, 256), (48, 40)])  # 48 x 40: blocks torchao's defaults do not tile
def test_compiled_dequantization_is_torchaos_bitwise(shape):
    weight = lora.to_nf4(torch.randn(shape, generator=torch.Generator().manual_seed(0)), 64, 256)
    for dtype in (torch.float32, torch.bfloat16):
        expected = weight.get_original_weight().to(dtype)
        assert torch.equal(lora.compiled_dequantize_nf4(weight, dtype), expected)
        inner = [getattr(weight, n) for n in ("quantized_data", "quantized_scalers", "quantization_factor",
                                              "scaler_mean", "nf4")]
        eager = lora.dequantize_nf4(*inner, weight.block_size, weight.scaler_block_size, tuple(weight.shape),
                                    weight.dtype, dtype)
        assert torch.equal(eager, expected)


@pytest.mark.parametrize("autocast", [False, True])
def test_compiled_linear_equals_torchaos_forward_and_input_gradient(autocast):
    gen = torch.Generator().manual_seed(1)
    weight, bias = lora.to_nf4(torch.randn(96, 64, generator=gen), 64, 256), torch.randn(96, generator=gen)
    x = torch.randn(3, 5, 64, generator=gen, requires_grad=True)
    grad = torch.randn(3, 5, 96, generator=gen)
    results = []
    for compiled in (False, True):
        x.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = lora.frozen_linear(x, weight, bias, compiled)
        y.float().backward(grad)
        results.append((y.detach(), x.grad.clone()))
    (y_eager, g_eager), (y_compiled, g_compiled) = results
    assert y_compiled.dtype == y_eager.dtype == (torch.bfloat16 if autocast else torch.float32)
    assert torch.allclose(y_compiled.float(), y_eager.float(), atol=TOL, rtol=0)
    assert torch.allclose(g_compiled, g_eager, atol=TOL, rtol=0)


def _model(hf_base, compiled: str, dora: bool = False):
    from scaletrain.config import JobConfig
    from scaletrain.finetune import resolve_finetune
    from scaletrain.finetune.run import build_finetuned_model

    cfg = JobConfig()
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=16), finetune=dataclasses.replace(
        cfg.finetune, source=str(hf_base), method="qlora", qlora_compile=compiled, dora=dora,
        lora_targets=["q", "v", "down"]))  # adapted and plain (NF4Linear) 4-bit projections both
    return build_finetuned_model(resolve_finetune(cfg))


@pytest.mark.parametrize("dora", [False, True])
def test_compiled_qlora_model_equals_the_eager_one(hf_base, dora):
    """The whole QLoRA model, with non-zero adapters: logits and every adapter's gradient to 1e-5 (fp32)."""
    models = {mode: _model(hf_base, mode, dora) for mode in ("false", "true")}
    four_bit = [m for m in models["true"].modules() if lora.is_nf4(getattr(m, "weight", torch.empty(0)))]
    assert len(four_bit) == 2 * 7 and all(m.nf4_compiled for m in four_bit)
    assert not any(m.nf4_compiled for m in models["false"].modules() if hasattr(m, "nf4_compiled"))
    gen = torch.Generator().manual_seed(2)
    adapters = {n: 0.1 * torch.randn(p.shape, generator=gen) for n, p in models["false"].named_parameters()
                if p.requires_grad}
    ids = torch.randint(0, len(CHARS), (2, 16), generator=gen)
    out = {}
    for mode, model in models.items():
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.requires_grad:
                    p.copy_(adapters[name])
        logits = model(ids)
        logits.square().mean().backward()
        out[mode] = logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert torch.allclose(out["true"][0], out["false"][0], atol=TOL, rtol=0)
    assert out["true"][1].keys() == out["false"][1].keys() and out["true"][1]
    for name, grad in out["false"][1].items():
        assert torch.allclose(out["true"][1][name], grad, atol=TOL, rtol=0), name


def test_the_compiled_model_never_calls_the_eager_linear(hf_base, eager_linear_nf4_refused):
    model = _model(hf_base, "true")
    model(torch.randint(0, len(CHARS), (1, 8))).sum().backward()
    with pytest.raises(AssertionError, match="eager linear_nf4 ran"):
        _model(hf_base, "false")(torch.randint(0, len(CHARS), (1, 8)))


def test_auto_compiles_on_cuda_only():
    assert lora.qlora_compiled("auto", "cuda") and lora.qlora_compiled("auto", torch.device("cuda", 0))
    assert not lora.qlora_compiled("auto", "cpu")
    assert lora.qlora_compiled("true", "cpu") and not lora.qlora_compiled("false", "cuda")


def _finetune(hf_base, run, tiny, **extra) -> list[str]:
    over = tiny(run, **{"train.steps": 6, "logging.log_interval": 1, "finetune.method": "qlora",
                        "finetune.lora_targets": "q,v,down", "checkpoint.interval": 3, **extra})
    for key in [k for k in over if k.startswith("model.")]:
        over.pop(key)  # the model comes from the base
    return ["finetune", "--from", str(hf_base)] + [f"--{k}={v}" for k, v in over.items()]


def _adapters(run) -> dict[str, torch.Tensor]:
    """The run's final adapter tensors (``faults.final_weights`` clones every tensor, and cloning a small NF4
    weight makes torchao re-quantize it at its default blocks, which do not tile it)."""
    from scaletrain.infer.load import load_run

    _, model, _, _ = load_run(run)
    return {k: v.detach().clone() for k, v in model.named_parameters() if ".lora_" in k}


@pytest.mark.slow  # five 6-step fine-tunes and the cold compiles of 4 weight shapes: ~20 s on 2 shared cores
def test_compiled_qlora_trains_as_the_eager_one_resumes_bitwise_and_keeps_the_model_eager(hf_base, tmp_path, tiny,
                                                                                          capsys):
    eager, straight, resumed = tmp_path / "eager", tmp_path / "straight", tmp_path / "resumed"
    assert main(_finetune(hf_base, eager, tiny, **{"finetune.qlora_compile": "false"})) == 0
    assert main(_finetune(hf_base, straight, tiny, **{"finetune.qlora_compile": "true"})) == 0
    # train.compile=auto keeps a QLoRA model eager: only the dequantization is compiled (no second compile)
    assert "train.compile=auto: eager (QLoRA's model runs eagerly" in capsys.readouterr().out
    assert main(_finetune(hf_base, resumed, tiny, **{"finetune.qlora_compile": "true", "train.stop_at_step": 3})) == 0
    assert main(_finetune(hf_base, resumed, tiny, **{"finetune.qlora_compile": "true"}) + ["--resume"]) == 0
    losses = {run: faults.losses(run) for run in (eager, straight, resumed)}
    assert sorted(losses[eager]) == list(range(1, 7))
    for step, loss in losses[eager].items():  # compiled against eager: fp32 rounding at most
        assert abs(losses[straight][step] - loss) <= TOL * abs(loss), step
    assert losses[resumed] == losses[straight]  # the resume: bitwise
    final = {run: _adapters(run) for run in (eager, straight, resumed)}
    assert final[straight].keys() == final[eager].keys() and final[straight]
    for name, tensor in final[straight].items():
        assert torch.equal(final[resumed][name], tensor), name
        assert torch.allclose(final[eager][name], tensor, atol=TOL, rtol=0), name
    # a model compiled whole beside it is refused in one line, as for eager QLoRA
    assert main(_finetune(hf_base, tmp_path / "both", tiny, **{"finetune.qlora_compile": "true",
                                                                 "train.compile": "true"})) == 2
    assert "finetune.qlora_compile compiles its dequantization alone" in capsys.readouterr().err
