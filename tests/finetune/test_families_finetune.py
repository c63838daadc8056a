"""Fine-tuning the open families (model/families.py) end to end: every method on every family's folder, the export
back to the family's own class (plain and merged), the peft adapter on that class, compression and bad input.

Each base is a fixture config (tests/fixtures/families/) built in transformers with random weights and saved with
the ChatML fixture tokenizer (384 ids inside the fixtures' 512)."""

from __future__ import annotations

import json
import shutil
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import torch

from scaletrain.cli import main
from scaletrain.finetune.export import save_peft_adapter
from scaletrain.finetune.run import build_finetuned_model
from scaletrain.infer.load import load_run
from scaletrain.model.family import family as family_entry

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
safetensors_torch = pytest.importorskip("safetensors.torch")

FIXTURES = Path(__file__).parents[1] / "fixtures"
FAMILIES = sorted(p.stem for p in (FIXTURES / "families").glob("*.json"))
# Fixtures with experts: fine-tuned in full and with LoRA on every expert (tests/model/test_moe_lora.py: the adapters)
MOE_FAMILIES = sorted(n for n in FAMILIES if "num_experts_per_tok" in json.loads(
    (FIXTURES / "families" / f"{n}.json").read_text()))
DENSE_FAMILIES = [n for n in FAMILIES if n not in MOE_FAMILIES]
ALL_TARGETS = "q,k,v,o,gate,up,down"
TEXT = (Path(__file__).resolve().parents[2] / "src/scaletrain/assets/tinyshakespeare/input.txt")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("families_finetune")


@cache
def _hf_model(name: str):
    """The transformers model of a fixture: random weights, every norm and bias moved off its init."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**json.loads((FIXTURES / "families" / f"{name}.json").read_text()))
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def _base(workdir: Path, name: str) -> Path:
    """The family's folder as a user downloads it: config.json, model.safetensors, generation_config.json and a
    tokenizer with a chat template."""
    folder = workdir / "bases" / name
    if not (folder / "model.safetensors").is_file():
        _hf_model(name).save_pretrained(folder)
        for file in (FIXTURES / "chatml_tokenizer").iterdir():
            shutil.copy(file, folder / file.name)
    return folder


def _text(workdir: Path) -> Path:
    path = workdir / "text.txt"
    if not path.is_file():
        path.write_text(TEXT.read_text(encoding="utf-8")[:12000], encoding="utf-8")
    return path


def _finetune(workdir: Path, base: Path, run: Path, **extra) -> int:
    """``scaletrain finetune --from base`` for 3 steps of 2 x 32 tokens, an evaluation at the end."""
    over = {"data.path": _text(workdir), "data.cache_dir": workdir / "data", "data.seq_len": 32,
            "train.batch_size": 2, "train.steps": 3, "train.eval_interval": 3, "train.eval_batches": 1,
            "train.sample_tokens": 0, "train.run_dir": run, "schedule.warmup_steps": 0, "logging.progress": "off",
            "logging.log_interval": 1, "logging.tensorboard": "false", "checkpoint.interval": 0,
            "train.precision": "fp32", "finetune.virtual_tokens": 4, **extra}
    return main(["finetune", "--from", str(base)] + [f"--{k}={v}" for k, v in over.items()])


def _ids(length: int = 20) -> torch.Tensor:
    return torch.randint(0, 384, (2, length), generator=torch.Generator().manual_seed(5))


def _hf_logits(folder: Path, ids: torch.Tensor, adapter: Path | None = None):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                              attn_implementation="eager")
    cls = type(model).__name__
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, str(adapter))
    with torch.no_grad():
        return cls, model.eval()(input_ids=ids).logits[:, -ids.shape[1]:]  # prompt tuning returns its positions too


@pytest.mark.parametrize("name", DENSE_FAMILIES)
def test_lora_run_exports_to_the_family_class_and_as_a_peft_adapter(workdir, name):
    """LoRA on every projection, 3 steps; export plain (the base untouched + a peft adapter) and --merge: both load
    in the family's own class with our logits (<= 1e-4), the plain one holds the base's tensors bit for bit, and
    both carry the base's token ids, generation config and tokenizer files."""
    base = _base(workdir, name)
    run = workdir / "runs" / f"lora-{name}"
    assert _finetune(workdir, base, run, **{"finetune.method": "lora", "finetune.lora_targets": ALL_TARGETS,
                                            "optim.lr": 0.05}) == 0
    plain, merged = workdir / "export" / f"{name}-plain", workdir / "export" / f"{name}-merged"
    assert main(["export", "--run", str(run), "--out", str(plain)]) == 0
    assert main(["export", "--run", str(run), "--out", str(merged), "--merge"]) == 0
    _, model, _, _ = load_run(run)
    ids = _ids()
    with torch.no_grad():
        ours = model.eval()(ids)
    cls, theirs = _hf_logits(merged, ids)
    assert cls == family_entry(model.cfg.family).hf_class == type(_hf_model(name)).__name__
    assert (ours - theirs).abs().max().item() <= 1e-4, name
    cls, theirs = _hf_logits(plain, ids, plain / "adapter")
    assert (ours - theirs).abs().max().item() <= 1e-4, name
    with torch.no_grad():  # the adapter trained: the comparison is not of the base with itself
        assert (ours - _hf_model(name)(ids).logits).abs().max().item() > 1e-3
    original = safetensors_torch.load_file(str(base / "model.safetensors"))
    exported = safetensors_torch.load_file(str(plain / "model.safetensors"))
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[k], original[k]) for k in original), name
    base_config = json.loads((base / "config.json").read_text())
    for folder in (plain, merged):
        config = json.loads((folder / "config.json").read_text())
        assert config["architectures"] == base_config["architectures"]
        assert all(config[k] == base_config[k] for k in ("bos_token_id", "eos_token_id") if k in base_config)
        for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
            assert (folder / file).read_bytes() == (base / file).read_bytes(), file


@pytest.mark.parametrize("name", MOE_FAMILIES)
def test_moe_full_fine_tune_exports_to_the_family_class(workdir, name, capsys):
    """A full fine-tune of an MoE family's folder (3 steps), ``scaletrain export``: the family's own class with
    one tensor per expert loads it (from_pretrained, nothing missing or left over) and computes our logits
    (<= 1e-4); the run trained (its logits left the base's)."""
    base = _base(workdir, name)
    run = workdir / "runs" / f"full-{name}"
    assert _finetune(workdir, base, run, **{"finetune.method": "full", "optim.lr": 0.01}) == 0
    out = workdir / "export" / f"{name}-full"
    assert main(["export", "--run", str(run), "--out", str(out)]) == 0
    _, model, _, _ = load_run(run)
    ids = _ids()
    with torch.no_grad():
        ours = model.eval()(ids)
        assert (ours - _hf_model(name)(ids).logits).abs().max().item() > 1e-3
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(out), dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert type(reloaded).__name__ == family_entry(model.cfg.family).hf_class == type(_hf_model(name)).__name__
    with torch.no_grad():
        assert (ours - reloaded.eval()(input_ids=ids).logits).abs().max().item() <= 1e-4, name
    experts = [k for k in safetensors_torch.load_file(str(out / "model.safetensors")) if ".experts." in k]
    assert experts and len(experts) == len([k for k in safetensors_torch.load_file(str(base / "model.safetensors"))
                                            if ".experts." in k])


@pytest.mark.parametrize("name", MOE_FAMILIES)
def test_moe_qlora_on_every_expert_trains_and_exports_merged(workdir, name):
    """QLoRA with every expert's gate / up / down, attention and the router as targets (3 steps): the experts'
    stacked weights are 4-bit (one 2-D NF4 tensor each), the adapters move the function off the 4-bit base, and
    ``export --merge`` (dequantized, adapters folded in) loads in the family's own class with our logits (<= 1e-4)."""
    if not _has_torchao():
        pytest.skip("finetune.method=qlora needs torchao")
    from scaletrain.finetune.lora import LoRAExperts, adapters_disabled, is_nf4

    base = _base(workdir, name)
    run = workdir / "runs" / f"qlora-{name}"
    assert _finetune(workdir, base, run, **{"finetune.method": "qlora", "finetune.lora_rank": 4, "optim.lr": 0.05,
                                            "finetune.lora_targets": ALL_TARGETS + ",router"}) == 0
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]
    assert len(losses) == 3 and all(np.isfinite(losses)), losses
    _, model, _, _ = load_run(run)
    experts = [m for m in model.modules() if isinstance(m, LoRAExperts)]
    assert experts and all(is_nf4(getattr(e, k)) and getattr(e, k).dim() == 2 for e in experts for k in ("w1", "w2"))
    ids = _ids()
    with torch.no_grad():
        ours = model.eval()(ids)
        with adapters_disabled(model):  # the 4-bit base alone: the adapters trained away from it
            assert (ours - model(ids)).abs().max().item() > 1e-3
    merged = workdir / "export" / f"{name}-qlora-merged"
    assert main(["export", "--run", str(run), "--out", str(merged), "--merge"]) == 0
    cls, theirs = _hf_logits(merged, ids)
    assert cls == type(_hf_model(name)).__name__
    assert (ours - theirs).abs().max().item() <= 1e-4, name


@pytest.mark.parametrize("name", MOE_FAMILIES)
def test_moe_lora_on_every_expert_exports_merged_to_the_family_class(workdir, name, capsys):
    """LoRA on attention, every expert's gate / up / down and the router (3 steps): the run says its trainable
    parameters per kind and the adapter's bytes; ``export --merge`` loads in the family's own class with our
    logits (<= 1e-4), which left the base's; so does the plain export's peft adapter (peft's target_parameters on
    transformers 5's fused 3-D experts and the router) on the untouched base."""
    base = _base(workdir, name)
    run = workdir / "runs" / f"lora-{name}"
    capsys.readouterr()
    assert _finetune(workdir, base, run, **{"finetune.method": "lora", "finetune.lora_targets": ALL_TARGETS
                                            + ",router", "finetune.lora_rank": 4, "optim.lr": 0.05}) == 0
    said = capsys.readouterr().out
    line = next(x for x in said.splitlines() if x.startswith("trainable: "))
    counts = dict((kind, int(n.replace(",", ""))) for n, kind in
                  (part.split(" ") for part in line.removeprefix("trainable: ").split("; ")[0].split(", ")))
    assert counts["attention"] > 0 and counts["experts"] > 0 and counts["router"] > 0
    _, model, _, _ = load_run(run)
    adapters = {k: v for k, v in model.state_dict().items() if ".lora_" in k}
    assert sum(v.numel() for v in adapters.values()) == sum(counts.values())
    assert f"({4 * sum(counts.values()):,} bytes)" in line
    merged = workdir / "export" / f"{name}-lora-merged"
    assert main(["export", "--run", str(run), "--out", str(merged), "--merge"]) == 0
    ids = _ids()
    with torch.no_grad():
        ours = model.eval()(ids)
        assert (ours - _hf_model(name)(ids).logits).abs().max().item() > 1e-3
    cls, theirs = _hf_logits(merged, ids)
    assert cls == type(_hf_model(name)).__name__
    assert (ours - theirs).abs().max().item() <= 1e-4, name
    plain = workdir / "export" / f"{name}-lora-plain"
    assert main(["export", "--run", str(run), "--out", str(plain)]) == 0
    config = json.loads((plain / "adapter" / "adapter_config.json").read_text())
    assert {"mlp.experts.down_proj", "mlp.experts.gate_up_proj", "mlp.gate.weight"} <= set(config["target_parameters"])
    cls, theirs = _hf_logits(plain, ids, plain / "adapter")
    assert cls == type(_hf_model(name)).__name__
    assert (ours - theirs).abs().max().item() <= 1e-4, name


def _job(base: Path, **finetune):
    import dataclasses

    from scaletrain.config import JobConfig
    from scaletrain.finetune import resolve_finetune

    cfg = JobConfig()
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=24),
                              finetune=dataclasses.replace(cfg.finetune, source=str(base), **finetune))
    return resolve_finetune(cfg)


def _with_random_adapters(cfg):
    """The fine-tune of ``cfg`` with non-zero values in every trainable tensor (a fresh LoRA B is zero)."""
    model = build_finetuned_model(cfg)
    gen = torch.Generator().manual_seed(1)
    adapters = {n: 0.1 * torch.randn(tuple(p.shape), generator=gen)
                for n, p in model.named_parameters() if p.requires_grad}
    for n, p in model.named_parameters():
        if n.endswith("lora_magnitude") and p.requires_grad:  # DoRA: near the base's row norms
            adapters[n] = p.detach() * (1 + adapters[n])
    return build_finetuned_model(cfg, adapters=adapters).eval()


@pytest.mark.parametrize("name, finetune", [
    ("phi3", {"method": "lora", "lora_targets": ["q", "v", "up", "o"], "dora": True}),  # fused, parts left out
    ("phi3", {"method": "lora", "lora_targets": ["q", "k", "v", "gate", "up"], "rslora": True, "lora_rank": 2}),
    ("qwen2", {"method": "lora", "lora_targets": ALL_TARGETS.split(","), "dora": True}),  # biases beside DoRA
    ("gemma3_text", {"method": "lora", "lora_targets": ALL_TARGETS.split(","), "dora": True}),
    ("gemma3_text", {"method": "prompt", "virtual_tokens": 5}),  # virtual tokens not scaled by sqrt(dim)
    ("llama", {"method": "prompt", "virtual_tokens": 5}),
    ("gemma3_text", {"method": "prefix", "virtual_tokens": 5}),  # the prefix inside the sliding window
    ("phi3", {"method": "prefix", "virtual_tokens": 5}),
    ("qwen3", {"method": "prefix", "virtual_tokens": 5}),  # q/k norms
    ("smollm3", {"method": "prefix", "virtual_tokens": 5}),  # no-rope layers
    ("llama", {"method": "prefix", "virtual_tokens": 5}),  # llama3 rope scaling
    # experts: gate alone beside a dense layer's (mlp_only_layers), rsLoRA's alpha on the rank-2r gate_up_proj
    ("qwen3_moe", {"method": "lora", "lora_targets": ["q", "gate", "router"], "rslora": True, "lora_rank": 2}),
    ("mixtral", {"method": "lora", "lora_targets": ["up", "down"], "lora_dropout": 0.1}),  # block_sparse_moe
    ("olmoe", {"method": "lora", "lora_targets": ["k", "down", "router"]}),  # down_proj alone: no base_layer.
])
def test_adapter_loads_in_peft_on_the_family_class(workdir, name, finetune):
    base = _base(workdir, name)
    cfg = _job(base, **finetune)
    model = _with_random_adapters(cfg)
    adapter = workdir / "adapters" / f"{name}-{'-'.join(f'{k}{v}' for k, v in finetune.items())}".replace(",", "")
    save_peft_adapter(model, cfg, adapter)
    ids = _ids(24)  # past the Gemma 3 (8) and Phi-3 (12) windows
    with torch.no_grad():
        ours = model(ids)
    _, theirs = _hf_logits(base, ids, adapter)
    assert (ours - theirs).abs().max().item() <= 1e-4, (name, finetune)


def test_dora_on_experts_has_no_peft_adapter_one_line(workdir):
    cfg = _job(_base(workdir, "qwen3_moe"), method="lora", lora_targets=["q", "gate"], dora=True)
    with pytest.raises(Exception) as err:
        save_peft_adapter(build_finetuned_model(cfg), cfg, workdir / "adapters" / "dora-experts")
    assert "finetune.dora" in str(err.value) and "--merge" in str(err.value) and "\n" not in str(err.value)


METHODS = {"full": {"finetune.method": "full"}, "lora": {"finetune.method": "lora"},
           "dora": {"finetune.method": "lora", "finetune.dora": "true"}, "qlora": {"finetune.method": "qlora"},
           "prompt": {"finetune.method": "prompt"}, "prefix": {"finetune.method": "prefix"}}


def _has_torchao() -> bool:
    try:
        import torchao  # noqa: F401
    except ImportError:
        return False
    return True


# Every method on at least two families and every family under two methods (LoRA on all eight is the export test
# above), each family's structural feature met by the methods that touch it: QLoRA's 4-bit base beside biases
# (qwen2), fused projections (phi3), sandwich norms (gemma3) and NoPE layers (smollm3); prefix tuning with a
# sliding window (gemma3, mistral) and q/k norms (qwen3); prompt tuning with and without tied embeddings. The
# full 8 x 6 grid was run once (48 runs, all finite) when this landed; 16 cells keep the suite's time.
GRID = [("gemma3_text", "qlora"), ("gemma3_text", "prefix"), ("llama", "full"), ("llama", "prompt"),
        ("mistral", "dora"), ("mistral", "prefix"), ("phi3", "qlora"), ("phi3", "prompt"), ("qwen2", "qlora"),
        ("qwen2", "dora"), ("qwen3", "prefix"), ("qwen3", "full"), ("smollm2", "prompt"), ("smollm2", "dora"),
        ("smollm3", "prefix"), ("smollm3", "qlora")]


@pytest.mark.parametrize("name, method", GRID)
def test_every_method_trains_and_evaluates_on_every_family(workdir, name, method):
    if method == "qlora" and not _has_torchao():
        pytest.skip("finetune.method=qlora needs torchao (pip install scaletrain[qlora])")
    run = workdir / "runs" / f"matrix-{method}-{name}"
    assert _finetune(workdir, _base(workdir, name), run, **METHODS[method], **{"optim.lr": 0.01}) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 3 and np.all(np.isfinite(losses))
    assert any("val_loss" in r and np.isfinite(r["val_loss"]) for r in records)  # the evaluation at the end


def test_qlora_keeps_biases_and_norms_in_full_precision(workdir):
    """Qwen2: only the block Linears' weights are 4-bit; the q/k/v biases stay fp32 and equal the base's."""
    pytest.importorskip("torchao")
    from scaletrain.finetune.lora import frozen_linear, is_nf4

    cfg = _job(_base(workdir, "qwen2"), method="qlora", lora_targets=["q", "v"])
    model = build_finetuned_model(cfg)
    base = _hf_model("qwen2").model.layers[0].self_attn
    for role in ("q", "k", "v"):
        proj = model.layers["0"].attention.get_submodule(f"w{role}")
        assert is_nf4(proj.weight)
        assert proj.bias.dtype == torch.float32 and not is_nf4(proj.bias)
        assert torch.equal(proj.bias, getattr(base, f"{role}_proj").bias)
    x = torch.randn(3, 64)
    with torch.no_grad():  # the forward adds the bias to the 4-bit product
        proj = model.layers["0"].attention.wk
        assert torch.allclose(proj(x) - frozen_linear(x, proj.weight, None), proj.bias.expand(3, -1), atol=1e-6)


@pytest.mark.parametrize("name", ["qwen3", "qwen2"])
def test_compress_a_family_fine_tune(workdir, name):
    """A LoRA fine-tune of Qwen3 (q/k norms) and Qwen2 (q/k/v biases): head and neuron pruning cut the biases with
    their rows and keep the norms, the pruned run evaluates and exports to the family's class with its logits;
    unstructured pruning and int8 quantization evaluate."""
    run = workdir / "runs" / f"compress-{name}"
    assert _finetune(workdir, _base(workdir, name), run, **{"finetune.method": "lora"}) == 0
    pruned = workdir / "compressed" / f"{name}-heads"
    assert main(["compress", "--run", str(run), "--out", str(pruned), "--head-fraction", "0.5", "--mlp-fraction",
                 "0.25", "--calibration-sequences", "4"]) == 0
    cfg, model, _, _ = load_run(pruned)
    assert cfg.model.family == name and cfg.model.n_heads == 2
    if name == "qwen2":
        assert model.layers["0"].attention.wq.bias.shape == (2 * 16,)
    assert main(["eval", "--run", str(pruned), "--batches", "1"]) == 0
    assert main(["export", "--run", str(pruned), "--out", str(pruned / "hf")]) == 0
    ids = _ids()
    with torch.no_grad():
        ours = model.eval()(ids)
    cls, theirs = _hf_logits(pruned / "hf", ids)
    assert cls == family_entry(name).hf_class and (ours - theirs).abs().max().item() <= 1e-4
    for extra in (["--prune", "wanda", "--calibration-sequences", "4"], ["--quantize", "int8-weight"]):
        out = workdir / "compressed" / f"{name}-{extra[1]}"
        assert main(["compress", "--run", str(run), "--out", str(out), *extra]) == 0
        assert main(["eval", "--run", str(out), "--batches", "1"]) == 0


@pytest.mark.parametrize("name", ["qwen2", "gemma3_text"])
def test_gguf_of_another_layout_is_refused_in_one_line(workdir, name, capsys):
    pytest.importorskip("gguf")
    run = workdir / "runs" / f"gguf-{name}"
    assert _finetune(workdir, _base(workdir, name), run, **{"finetune.method": "full"}) == 0
    capsys.readouterr()
    assert main(["export", "--run", str(run), "--format", "gguf", "--out", str(workdir / f"{name}.gguf")]) == 2
    err = capsys.readouterr().err.strip()
    # qwen2: llama.cpp's converter handles it; gemma3_text with query_pre_attn_scalar != head_dim: llama.cpp
    # itself would compute another model, so only the Hugging Face folder is offered
    assert len(err.splitlines()) == 1 and name in err and "--format hf" in err


def _broken_base(workdir: Path, tag: str, config_change: dict | None = None) -> Path:
    folder = workdir / "broken" / tag
    shutil.copytree(_base(workdir, "qwen3"), folder, dirs_exist_ok=True)
    if config_change:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **config_change}))
    return folder


def test_bad_family_folders_are_one_line_exit_2(workdir, capsys):
    """An unsupported model_type, a rope scaling we do not compute (longrope), only pickled weights, a config/weights
    shape mismatch, and the base's template asked for when the tokenizer has none: one line each, exit 2."""
    unsupported = _broken_base(workdir, "gpt_neox", {"model_type": "gpt_neox"})
    longrope = _broken_base(workdir, "longrope", {"rope_parameters": {  # yarn is computed now (test_families.py)
        "rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0], "rope_theta": 1e6,
        "original_max_position_embeddings": 4096}})
    pickled = _broken_base(workdir, "pickled")
    torch.save(safetensors_torch.load_file(str(pickled / "model.safetensors")), pickled / "pytorch_model.bin")
    (pickled / "model.safetensors").unlink()
    mismatch = _broken_base(workdir, "mismatch", {"intermediate_size": 128})
    no_template = _broken_base(workdir, "no_template")
    (no_template / "chat_template.jinja").unlink()
    chat = workdir / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"},
                                             {"role": "assistant", "content": "Hello."}]}) + "\n")
    cases = [(unsupported, {}, "model_type 'gpt_neox' is not supported"),
             (longrope, {}, "rope_parameters.rope_type = 'longrope' is not computed"),
             (pickled, {}, "only pickled weights"),
             (mismatch, {}, "has shape"),
             (no_template, {"finetune.instructions": chat, "finetune.chat_template": "base"},
              "tokenizer_config.json has no chat_template")]
    for base, extra, message in cases:
        capsys.readouterr()
        assert _finetune(workdir, base, workdir / "runs" / f"bad-{base.name}", **extra) == 2, base.name
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, err


@pytest.mark.parametrize("objective", ["dpo", "sft"])
def test_moe_lora_preference_and_packed_instruction_tuning_train(workdir, objective):
    """On an MoE family's folder (Mixtral), LoRA on every expert and the router: DPO on the preference fixture,
    and packed instruction tuning with the chunked loss (train.loss_chunk_rows), train and finish (exit 0) with a
    finite loss that moved, as on a dense base."""
    base = _base(workdir, "mixtral")
    run = workdir / "runs" / f"moe-lora-{objective}"
    data = {"finetune.preferences": FIXTURES / "preferences.jsonl", "finetune.objective": "dpo",
            "data.seq_len": 72} if objective == "dpo" else \
        {"finetune.instructions": FIXTURES / "instructions.jsonl", "finetune.packing": "true",
         "train.loss_chunk_rows": 16, "data.seq_len": 64}
    assert _finetune(workdir, base, run, **{"finetune.method": "lora", "finetune.lora_targets": "q,v,gate,up,down,"
                                            "router", "optim.lr": 0.05, "train.steps": 4, "train.eval_interval": 0,
                                            "logging.log_interval": 1, **data}) == 0
    losses = [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert len(losses) == 4 and all(np.isfinite(losses)) and losses[-1] != losses[0]
