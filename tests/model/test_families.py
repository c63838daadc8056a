"""The open families as options of our decoder (model/family/, model/families.py): for each family's published
config.json, shrunk (tests/fixtures/families/), saved by transformers and read through the real import
(``finetune --from FOLDER``'s loader: finetune/base.open_base -> hf_import), our logits equal the transformers
model's, the KV-cached forward equals the full one, and Hugging Face -> ours -> Hugging Face is bitwise the same
tensors and loads in the family's class."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from scaletrain.core.options import ConfigError
from scaletrain.model import Transformer
from scaletrain.model.cache import KVCache
from scaletrain.model.config import ModelConfig
from scaletrain.model.families import hf_config_from_model_config, model_config_from_hf, state_dict_to_hf
from scaletrain.model.family import FAMILIES as REGISTERED
from scaletrain.model.family import family as family_entry
from scaletrain.model.hf_names import from_hf, to_hf

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

FIXTURES = Path(__file__).parents[1] / "fixtures" / "families"
FAMILIES = sorted(p.stem for p in FIXTURES.glob("*.json"))
SEQ = 24  # longer than the Gemma 3 (8) and Phi-3 (12) fixtures' sliding windows
CONTEXT = 64


def _fixture(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def _with_tokenizer(folder: Path) -> Path:
    """A base folder needs its tokenizer to be a fine-tuning base (the ChatML fixture's 384 ids < 512)."""
    for file in (FIXTURES.parent / "chatml_tokenizer").iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    return folder


def _folder(folder: Path, config: dict, tensors: dict) -> Path:
    """A Hugging Face folder of ``config`` and ``tensors`` (as save_pretrained writes one)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    safetensors_torch.save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return _with_tokenizer(folder)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(name, the saved config.json as a dict, its tensors, the transformers model, the saved folder) for one
    fixture: built from the config with random weights (every norm, bias and offset moved off its init), saved with
    save_pretrained beside a tokenizer."""
    name = request.param
    torch.manual_seed(0)
    hf_config = transformers.AutoConfig.for_model(**_fixture(name))
    hf_model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager").float()
    with torch.no_grad():
        for p in hf_model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    hf_model.eval()
    folder = tmp_path_factory.mktemp(name)
    hf_model.save_pretrained(folder)
    saved = json.loads((folder / "config.json").read_text())
    tensors = safetensors_torch.load_file(str(folder / "model.safetensors"))
    return name, saved, tensors, hf_model, _with_tokenizer(folder)


def _base_state(folder: Path) -> tuple[ModelConfig, dict]:
    """(the ModelConfig, the weights under our names) as ``finetune --from folder`` reads them."""
    from scaletrain.finetune.base import open_base

    base = open_base(str(folder))
    return dataclasses.replace(base.model, max_seq_len=CONTEXT), base.state()


def _ours(folder: Path) -> Transformer:
    cfg, state = _base_state(folder)
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    model.init_buffers()
    model.load_state_dict(state)
    return model.eval()


def _tokens() -> torch.Tensor:
    return torch.randint(0, 512, (2, SEQ), generator=torch.Generator().manual_seed(1))


def test_logits_equal_transformers(family):
    """fp32, same weights, same input: max |ours - theirs| <= 1e-4 (Gemma 3 and Phi-3: past the window)."""
    name, _, _, hf_model, folder = family
    model = _ours(folder)
    tokens = _tokens()
    with torch.no_grad():
        ours, theirs = model(tokens), hf_model(tokens).logits
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() <= 1e-4, name


def test_cached_forward_equals_full(family):
    """Prefill 10 tokens, then one a step past every sliding window: the logits of the full forward."""
    model = _ours(family[-1])
    tokens = _tokens()
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache(2, CONTEXT)
        steps = [model(tokens[:, :10], cache=cache)]
        steps += [model(tokens[:, i:i + 1], cache=cache) for i in range(10, SEQ)]
    assert (torch.cat(steps, dim=1) - full).abs().max().item() <= 1e-4


def test_cached_left_padded_row_equals_alone(family):
    """A row left-padded in a batch (cache positions and windows count only its tokens) = the row alone."""
    model = _ours(family[-1])
    tokens = _tokens()
    padded = torch.cat([tokens[:1], torch.cat([torch.zeros(1, 5, dtype=torch.long), tokens[1:, 5:]], 1)])
    padding = torch.zeros_like(padded, dtype=torch.bool)
    padding[1, :5] = True
    with torch.no_grad():
        batch = model(padded, cache=KVCache(2, CONTEXT), padding=padding)[1, 5:]
        alone = model(tokens[1:, 5:])[0]
    assert (batch - alone).abs().max().item() <= 1e-4


def test_round_trip_is_bitwise_and_loads_in_the_family_class(family):
    """HF tensors -> ours -> HF: the same names and bits; our config -> config.json -> ours: the same config; the
    export builds the family's own class and computes the same logits."""
    name, config, tensors, hf_model, folder = family
    cfg, state = _base_state(folder)
    back = state_dict_to_hf(dict(state), cfg)
    assert sorted(back) == sorted(tensors)
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)
    exported = hf_config_from_model_config(cfg)
    assert exported["architectures"] == [family_entry(cfg.family).hf_class] == config["architectures"]
    assert model_config_from_hf(exported, "exported", max_seq_len=CONTEXT) == cfg
    # The token ids are the tokenizer's, not the model's: an export copies them from the base's config.json.
    tokens_ids = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    # Loaded as transformers loads a folder (from_pretrained: its checkpoint conversions, e.g. one tensor per
    # expert -> transformers 5's fused experts), every tensor used and none missing.
    out = _folder(folder.parent / f"{name}_exported", {**tokens_ids, **exported}, back)
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, attn_implementation="eager", dtype=torch.float32, output_loading_info=True)
    assert not info["unexpected_keys"] and not info["missing_keys"] and not info["mismatched_keys"], info
    reloaded.eval()
    tokens = _tokens()
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, hf_model(tokens).logits), name


def test_gemma3_multimodal_config_reads_its_text_config():
    text = _fixture("gemma3_text")
    cfg = model_config_from_hf({"model_type": "gemma3", "text_config": text}, "config.json")
    assert cfg == model_config_from_hf(text, "config.json")
    assert cfg.sliding_layers == [0, 2] and cfg.local_rope_theta == 10000.0 and cfg.rope_scaling == "linear"


@pytest.mark.parametrize("family_name, change, field", [
    ("llama", {"model_type": "gpt_neox"}, "model_type"),
    ("phi3", {"rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}}, "longrope"),
    # every rope type transformers computes that the decoder does not, beside default rope_parameters too
    ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
               "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}},
     "rope_scaling.rope_type = 'longrope'"),
    ("llama", {"rope_scaling": None, "rope_parameters": {"rope_type": "proportional", "rope_theta": 1e4}},
     "rope_parameters.rope_type = 'proportional'"),
    ("phi3", {"partial_rotary_factor": 0.75}, "partial_rotary_factor"),
    ("gemma3_text", {"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
    ("gemma3_text", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ("gemma3_text", {"hidden_activation": "gelu"}, "hidden_activation"),
    ("llama", {"attention_bias": True}, "attention_bias"),
    ("llama", {"mlp_bias": True}, "mlp_bias"),
    ("mistral", {"hidden_size": None}, "hidden_size"),
    ("qwen3", {"head_dim": 15}, "head_dim"),
    ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}, "max_position_embeddings": 32},
     "max_position_embeddings"),
])
def test_unsupported_fields_are_refused_in_one_line(family_name, change, field):
    config = {k: v for k, v in {**_fixture(family_name), **change}.items() if v is not None}
    with pytest.raises(ConfigError) as err:
        model_config_from_hf(config, "x/config.json", max_seq_len=CONTEXT)
    message = str(err.value)
    assert "\n" not in message and field in message and message.startswith("x/config.json")


def test_every_rope_type_transformers_computes_is_computed_or_refused():
    """The rope types transformers knows (``ROPE_INIT_FUNCTIONS``) are ours or refused: none is dropped."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    base = {k: v for k, v in _fixture("llama").items() if k != "rope_scaling"}
    for rope_type in ROPE_INIT_FUNCTIONS:
        config = {**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
                  "rope_scaling": {"rope_type": rope_type, "factor": 2.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}
        try:
            cfg = model_config_from_hf(config, "x/config.json", max_seq_len=CONTEXT)
        except ConfigError as exc:
            assert f"rope_scaling.rope_type = {rope_type!r} is not computed" in str(exc)
            continue
        assert cfg.rope_scaling == rope_type and cfg.rope_scaling_factor == 2.0


def test_yarn_beside_default_rope_parameters_is_yarn_as_transformers_reads_it(tmp_path):
    """The issue's config.json: default rope_parameters plus rope_scaling yarn factor 4 (no theta in it): YaRN
    with the original context max_position_embeddings, and the logits of transformers' model of that file."""
    config = _fixture("llama_yarn")
    cfg = model_config_from_hf(config, "config.json", max_seq_len=CONTEXT)
    assert (cfg.rope_scaling, cfg.rope_scaling_factor, cfg.rope_original_max_seq_len) == ("yarn", 4.0, 32)
    assert cfg.rope_theta == 10000.0
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config),
                                                             attn_implementation="eager").float().eval()
    with torch.no_grad():
        for p in hf_model.parameters():  # off the small init, so a rotary difference shows in the logits
            p.add_(torch.randn_like(p) * 0.1)
    tensors = {k: v.detach().clone() for k, v in hf_model.state_dict().items()}
    tokens = _tokens()
    with torch.no_grad():
        theirs = hf_model(tokens).logits
        ours = _ours(_folder(tmp_path / "yarn", config, tensors))(tokens)
        plain = _ours(_folder(tmp_path / "plain", {**config, "rope_scaling": None}, tensors))(tokens)
    assert (ours - theirs).abs().max().item() <= 1e-4
    assert (plain - theirs).abs().max().item() > 0.1  # plain rotary would be another model


def test_an_export_the_family_cannot_express_is_refused():
    with pytest.raises(ConfigError, match="qk_norm"):
        hf_config_from_model_config(ModelConfig(vocab_size=64, family="llama", qk_norm=True))
    with pytest.raises(ConfigError, match="sliding_window"):
        hf_config_from_model_config(ModelConfig(vocab_size=64, family="llama", sliding_window=8))


def test_default_config_exports_as_llama():
    cfg = ModelConfig(vocab_size=64)
    hf = hf_config_from_model_config(cfg)
    assert hf["model_type"] == "llama" and hf["rope_scaling"] is None and hf["head_dim"] == 32
    assert model_config_from_hf(hf, "x", max_seq_len=cfg.max_seq_len) == ModelConfig(
        vocab_size=64, n_kv_heads=4, norm_eps=cfg.norm_eps)


def test_name_table_is_family_aware():
    """Gemma 3's post_attention_layernorm is the attention output's norm, not the one before the feed-forward."""
    assert to_hf("layers.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert to_hf("layers.0.ffn_norm.weight", "gemma3_text") == "model.layers.0.pre_feedforward_layernorm.weight"
    assert from_hf("model.layers.1.post_attention_layernorm.weight", "gemma3_text") == \
        "layers.1.attention_post_norm.weight"
    assert from_hf("model.layers.1.self_attn.q_proj.bias", "qwen2") == "layers.1.attention.wq.bias"
    assert from_hf("model.layers.1.self_attn.k_norm.weight", "qwen3") == "layers.1.attention.k_norm.weight"


# The published parameter counts of the presets' models (their model cards / safetensors headers).
PUBLISHED = {"qwen2.5-0.5b": 494_032_768, "qwen3-0.6b": 596_049_920, "llama-3.2-1b": 1_235_814_400,
             "smollm2-135m": 134_515_008, "gemma-3-270m": 268_098_176, "gemma-3-1b": 999_885_952,
             "mistral-7b-v0.3": 7_248_023_552}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_family_presets_have_the_published_shapes(preset):
    """The planner's closed-form count = the module's = the published one (bias, q/k norms, head_dim, post norms)."""
    from scaletrain.model.presets import PRESETS, num_params

    cfg = ModelConfig(**PRESETS[preset])
    with torch.device("meta"):
        model = Transformer(cfg)
    assert num_params(cfg) == sum(p.numel() for p in model.parameters()) == PUBLISHED[preset]
    assert model_config_from_hf(hf_config_from_model_config(cfg), preset) == ModelConfig(
        **{**PRESETS[preset], "n_kv_heads": cfg.n_kv_heads})


def test_a_family_folder_is_a_fine_tuning_base(family):
    """``finetune --from FOLDER`` reads the family's folder lazily (headers first, then tensor by tensor; a fused
    Phi-3 projection row by row) into the same model transformers computes."""
    from scaletrain.config import JobConfig
    from scaletrain.finetune import resolve_finetune
    from scaletrain.finetune.export import base_model

    name, _, _, hf_model, folder = family
    cfg = JobConfig()
    cfg = resolve_finetune(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=16),
                                               finetune=dataclasses.replace(cfg.finetune, source=str(folder),
                                                                            method="lora")))
    assert family_entry(cfg.model.family).hf_class == type(hf_model).__name__
    ids = _tokens()
    with torch.no_grad():
        diff = (base_model(cfg).eval()(ids).float() - hf_model(ids).logits).abs().max()
    assert diff <= 1e-4, (name, diff)


def test_every_registered_family_has_a_fixture_and_no_name_branch_outside_its_entry():
    """Adding a family is its file in model/family/ plus a fixture here: each entry is tested against transformers,
    and no other module compares a family name as a string (the registry is read, never branched on)."""
    import re

    assert set(REGISTERED) <= {json.loads(p.read_text())["model_type"] for p in FIXTURES.glob("*.json")}
    names = "|".join(map(re.escape, [*REGISTERED, "gemma3"]))
    branch = re.compile(rf"""(==|!=|\bin)\s*\(?[^)\n]*["']({names})["']""")
    src = Path(__file__).parents[2] / "src" / "scaletrain"
    offenders = [f"{p.relative_to(src)}:{i}" for p in src.rglob("*.py") if "model/family/" not in p.as_posix()
                 for i, line in enumerate(p.read_text().splitlines(), 1) if branch.search(line)]
    assert not offenders


@pytest.mark.parametrize("change, field", [
    (dict(moe_capacity_factor=1.25), "model.moe_capacity_factor"), (dict(moe_bias_rate=0.001), "model.moe_bias_rate"),
    (dict(moe_shared_experts=1), "model.moe_shared_experts"), (dict(moe_score="sigmoid"), "model.moe_score"),
    (dict(moe_route_scale=2.5), "model.moe_route_scale")])
@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_an_moe_export_the_family_cannot_express_is_refused(name, change, field):
    """What no MoE family's config.json computes (capacity, the selection bias, shared experts, ...) is refused
    naming the field, not exported as something else; the imported config itself exports."""
    cfg = model_config_from_hf(_fixture(name), name)
    assert model_config_from_hf(hf_config_from_model_config(cfg), name) == cfg
    with pytest.raises(ConfigError, match=field):
        hf_config_from_model_config(dataclasses.replace(cfg, **change))


def test_a_checkpoint_missing_an_expert_is_one_line(tmp_path):
    """A per-expert checkpoint lacking one expert's tensor (an interrupted download) names it, not a shape error."""
    from scaletrain.finetune.hf_import import hf_index

    transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(
        **_fixture("qwen3_moe"))).save_pretrained(tmp_path / "hf")
    tensors = safetensors_torch.load_file(str(tmp_path / "hf" / "model.safetensors"))
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    folder = _folder(tmp_path / "broken", _fixture("qwen3_moe"), tensors)
    with pytest.raises(ConfigError, match=r"expert 5 of layers\.2\.feed_forward\.experts\.w3 is missing"):
        hf_index(folder, model_config_from_hf(_fixture("qwen3_moe")))


def test_projection_wide_qk_norm_is_refused_under_tensor_parallelism():
    """OLMoE's q/k norm spans all heads, which tensor parallelism splits: one line naming the field."""
    from scaletrain.config import JobConfig, validate_job

    cfg = JobConfig()
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, qk_norm=True, qk_norm_width="projection"),
                              parallel=dataclasses.replace(cfg.parallel, tp=2))
    with pytest.raises(ConfigError, match="model.qk_norm_width = projection .* set parallel.tp = 1"):
        validate_job(cfg)


MOE_FAMILIES = ["mixtral", "olmoe", "qwen3_moe"]


def _fused_save(name: str, folder: Path):
    """A random tiny model of an MoE fixture saved in transformers 5's own layout (``save_original_format=False``:
    ``mlp.experts.gate_up_proj`` (E, 2h, d) and ``down_proj`` (E, d, h), Mixtral's ``block_sparse_moe`` as
    ``mlp``), and the model."""
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**_fixture(name)), attn_implementation="eager").float()
    with torch.no_grad():
        for p in hf_model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    hf_model.eval().save_pretrained(folder, save_original_format=False)
    return hf_model, _with_tokenizer(folder)


@pytest.mark.parametrize("name", MOE_FAMILIES)
def test_fused_expert_layout_reads_to_the_same_logits(name, tmp_path):
    """transformers 5's fused 3-D experts read through the real loader: logits equal transformers' within 1e-4,
    and the same weights as the per-expert files save_pretrained writes by default (what our export writes)."""
    hf_model, folder = _fused_save(name, tmp_path / "fused")
    stored = safetensors_torch.load_file(str(folder / "model.safetensors"))
    gate_up = stored["model.layers.0.mlp.experts.gate_up_proj"]
    cfg = model_config_from_hf(_fixture(name))
    assert gate_up.shape == (cfg.moe_experts, 2 * cfg.moe_hidden_dim, cfg.dim)
    assert not any(".experts.0." in k for k in stored)
    model = _ours(folder)
    tokens = _tokens()
    with torch.no_grad():
        assert (model(tokens) - hf_model(tokens).logits).abs().max().item() <= 1e-4
    hf_model.save_pretrained(tmp_path / "per_expert")  # the default: one tensor per expert, the files' names
    fused_state, per_expert_state = _base_state(folder)[1], _base_state(_with_tokenizer(tmp_path / "per_expert"))[1]
    assert sorted(fused_state) == sorted(per_expert_state)
    assert all(torch.equal(fused_state[k].float(), per_expert_state[k].float()) for k in fused_state)


@pytest.mark.parametrize("tensor", ["gate_up_proj", "down_proj"])
def test_a_fused_checkpoint_missing_an_expert_is_one_line(tensor, tmp_path):
    """A fused expert tensor with one expert fewer than config.json names the tensor and the counts."""
    from scaletrain.finetune.hf_import import hf_index

    _fused_save("qwen3_moe", tmp_path / "hf")
    tensors = safetensors_torch.load_file(str(tmp_path / "hf" / "model.safetensors"))
    name = f"model.layers.2.mlp.experts.{tensor}"
    tensors[name] = tensors[name][:-1]
    folder = _folder(tmp_path / "broken", _fixture("qwen3_moe"), tensors)
    experts = _fixture("qwen3_moe")["num_experts"]
    with pytest.raises(ConfigError, match=rf"{name} holds {experts - 1} experts but config.json implies {experts}"):
        hf_index(folder, model_config_from_hf(_fixture("qwen3_moe")))
