"""Fine-tuning (finetune/): parity with peft on the exported base, merge, HF import round trip, bad input."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers.tiny import CHARS, tiny_hf_base
from scaletrain.checkpoint.export import export_hf
from scaletrain.cli import main
from scaletrain.config import ConfigError, JobConfig, ModelConfig, load_config
from scaletrain.data.tokenizer import CharTokenizer
from scaletrain.finetune.export import base_model, merge_adapters, save_peft_adapter
from scaletrain.finetune.run import build_finetuned_model
from scaletrain.model import build_model

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

# The bundled Tiny Shakespeare's characters: the CLI tests fine-tune on it with this base's tokenizer.



@pytest.fixture(scope="module")
def hf_base(tmp_path_factory):
    """A tiny random Llama exported as a Hugging Face folder (GQA, untied), the base for every method."""
    return tiny_hf_base(tmp_path_factory.mktemp("base"))


def _job(source, **finetune) -> JobConfig:
    from scaletrain.finetune import resolve_finetune

    cfg = JobConfig()
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=16),
                              finetune=dataclasses.replace(cfg.finetune, source=str(source), **finetune))
    return resolve_finetune(cfg)


def _random_adapters(model, seed=1) -> dict[str, torch.Tensor]:
    """Non-zero values for every trainable tensor (a fresh LoRA B is zero, which would prove nothing)."""
    gen = torch.Generator().manual_seed(seed)
    return {name: 0.1 * torch.randn(tuple(p.shape), generator=gen)
            for name, p in model.named_parameters() if p.requires_grad}


def _peft_logits(base_folder, adapter_folder, ids):
    hf = transformers.LlamaForCausalLM.from_pretrained(str(base_folder), torch_dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(hf, str(adapter_folder)).eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    return logits[:, -ids.shape[1]:]  # prompt tuning returns the virtual positions too


@pytest.mark.parametrize("finetune", [
    {"method": "lora", "lora_targets": ["q", "k", "v", "o", "gate", "up", "down"], "lora_rank": 4},
    {"method": "lora", "lora_targets": ["v", "down"], "rslora": True, "lora_alpha": 3.0},
    {"method": "lora", "lora_targets": ["q", "k", "v", "o", "gate", "up", "down"], "lora_rank": 4, "dora": True},
    {"method": "prompt", "virtual_tokens": 5},
    {"method": "prefix", "virtual_tokens": 5},
])
def test_adapter_logits_match_peft(hf_base, tmp_path, finetune):
    cfg = _job(hf_base, **finetune)
    model = build_finetuned_model(cfg)
    model = build_finetuned_model(cfg, adapters=_random_adapters(model)).eval()
    save_peft_adapter(model, cfg, tmp_path / "adapter")
    ids = torch.randint(0, len(CHARS), (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = model(ids)
    theirs = _peft_logits(hf_base, tmp_path / "adapter", ids)
    assert ours.shape == theirs.shape
    assert torch.allclose(ours, theirs, rtol=0, atol=1e-5), (ours - theirs).abs().max()


@pytest.mark.parametrize("dora", [False, True])
def test_adapted_projection_keeps_the_base_dtype_under_autocast(dora):
    """Under bf16 autocast an adapted projection returns what the plain one does (bf16, also from an fp32
    residual stream), and keeps no copy of a bf16 input for the backward: its output was once in the input's
    dtype (fp32 after the norms, doubling the activations after every adapted projection), and the adapter's
    input was cast to fp32 and back (a second saved copy)."""
    from torch.autograd.graph import saved_tensors_hooks

    from scaletrain.finetune.lora import LoRALinear

    plain = torch.nn.Linear(32, 48, bias=False)
    adapted = LoRALinear.from_linear(plain, rank=4, alpha=8, dropout=0.0, rslora=False, dora=dora)
    adapted.weight.requires_grad_(False)
    torch.nn.init.normal_(adapted.lora_B)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        x32 = torch.randn(4, 8, 32)
        assert adapted(x32).dtype == plain(x32).dtype == torch.bfloat16
    x = torch.randn(4, 8, 32, dtype=torch.bfloat16, requires_grad=True)
    saved: list[torch.Tensor] = []
    with torch.autocast("cpu", dtype=torch.bfloat16), saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = adapted(x)
    inputs = [t for t in saved if t.numel() == x.numel()]
    assert inputs and all(t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for t in inputs)
    out.float().sum().backward()
    assert adapted.lora_A.grad is not None and x.grad is not None


@pytest.mark.parametrize("dora", [False, True])
def test_merged_lora_equals_unmerged(hf_base, tmp_path, dora):
    cfg = _job(hf_base, method="lora", lora_targets=["q", "v", "up"], dora=dora)
    model = build_finetuned_model(cfg)
    model = build_finetuned_model(cfg, adapters=_random_adapters(model)).eval()
    ids = torch.randint(0, len(CHARS), (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        before = model(ids)
        merged = merge_adapters(model, cfg)
        after = merged(ids)
    assert torch.allclose(before, after, rtol=0, atol=1e-5), (before - after).abs().max()
    export_hf(merged, cfg.model, CharTokenizer(CHARS), tmp_path / "merged")
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "merged"), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.allclose(hf(ids).logits, before, rtol=0, atol=1e-5)


def test_hf_import_reexport_is_bitwise(hf_base, tmp_path):
    cfg = _job(hf_base, method="lora")
    export_hf(base_model(cfg), cfg.model, CharTokenizer(CHARS), tmp_path / "again")
    first = load_file(str(hf_base / "model.safetensors"))
    again = load_file(str(tmp_path / "again" / "model.safetensors"))
    assert first.keys() == again.keys()
    assert all(torch.equal(first[k], again[k]) for k in first)
    config_again = json.loads((tmp_path / "again" / "config.json").read_text())
    assert json.loads((hf_base / "config.json").read_text()) == config_again


def test_hf_import_of_a_head_dim_apart_from_hidden_over_heads(tmp_path):
    # A head-pruned model (2 heads x head_dim 24 != hidden 32): exported, imported back, transformers' logits.
    cfg = ModelConfig(vocab_size=len(CHARS), dim=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=24,
                      ffn_hidden_dim=64, max_seq_len=64)
    export_hf(build_model(cfg, seed=0), cfg, CharTokenizer(CHARS), tmp_path / "hf")
    job = _job(tmp_path / "hf", method="lora")
    assert (job.model.n_heads, job.model.n_kv_heads, job.model.head_dim) == (2, 1, 24)
    ids = torch.randint(0, len(CHARS), (1, 12))
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.allclose(base_model(job)(ids), hf(ids).logits, atol=1e-5)
    # 3 heads do not divide 32: transformers' LlamaConfig refuses that, so export says so in one line.
    with pytest.raises(ConfigError, match="does not divide model.dim"):
        export_hf(build_model(dataclasses.replace(cfg, n_heads=3), seed=0), dataclasses.replace(cfg, n_heads=3),
                  CharTokenizer(CHARS), tmp_path / "hf3")


def test_qlora_base_is_4bit_and_close(hf_base):
    from scaletrain.finetune.lora import LoRALinear, is_nf4, nf4_bytes

    cfg = _job(hf_base, method="qlora", lora_targets=["q", "k", "v", "o", "gate", "up", "down"])
    model = build_finetuned_model(cfg).eval()
    plain = build_finetuned_model(dataclasses.replace(cfg, finetune=dataclasses.replace(cfg.finetune,
                                                                                         method="lora"))).eval()
    layers = [m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and name.startswith("layers.")]
    assert any(isinstance(m, LoRALinear) for m in layers) and all(is_nf4(m.weight) for m in layers)
    assert not is_nf4(model.output.weight)  # the head stays in full precision, as in QLoRA
    stored = sum(nf4_bytes(m.weight) for m in layers)
    fp32 = sum(m.in_features * m.out_features * 4 for m in layers)
    assert stored <= 0.30 * fp32, stored / fp32
    ids = torch.randint(0, len(CHARS), (1, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        err = (model(ids) - plain(ids)).abs().max()
    assert 0 < err < 0.5  # quantized (not equal), yet the same model


def test_qlora_build_never_holds_the_fp32_base(hf_base, monkeypatch):
    """QLoRA reads and quantizes the base one tensor at a time, before the model is materialized: whenever a
    weight is quantized, the live tensor bytes are far below the fp32 projections' (materializing the model
    first and quantizing after held all of them)."""
    from scaletrain.config import OptimConfig, ParallelConfig, TrainConfig
    from scaletrain.finetune import lora
    from scaletrain.parallel import ParallelDims
    from scaletrain.plan.measure import LiveTensorBytes
    from scaletrain.train.step import build_parallel_training

    job = _job(hf_base, method="qlora", lora_targets=["q", "k", "v", "o", "gate", "up", "down"])
    cfg = JobConfig(model=job.model, optim=OptimConfig(), train=TrainConfig(seed=0), finetune=job.finetune)
    live_at_quantize, to_nf4 = [], lora.to_nf4
    monkeypatch.setattr(lora, "to_nf4", lambda *a: live_at_quantize.append(tracker.live) or to_nf4(*a))
    with LiveTensorBytes() as tracker:
        pm, _ = build_parallel_training(cfg, ParallelDims.from_config(ParallelConfig(), 1), torch.device("cpu"))
    layers = [m for name, m in pm.modules[0].named_modules() if isinstance(m, torch.nn.Linear)
              and name.startswith("layers.")]
    assert len(live_at_quantize) == len(layers) == 14 and all(lora.is_nf4(m.weight) for m in layers)
    fp32 = sum(m.in_features * m.out_features * 4 for m in layers)
    assert max(live_at_quantize) < fp32 / 2, (live_at_quantize, fp32)
    # the same weights as quantizing the loaded model (what eval / generate of the run build)
    built = build_finetuned_model(job)
    for mine, theirs in zip(layers, [m for n, m in built.named_modules() if isinstance(m, torch.nn.Linear)
                                     and n.startswith("layers.")]):
        assert torch.equal(mine.weight.get_original_weight(), theirs.weight.get_original_weight())


def test_a_finetune_materializes_without_a_reference_model(monkeypatch):
    """A sharded or split fine-tune allocates its weights and computes the rotary tables only: the random
    reference model that pretraining's layouts copy from (a second whole model on every rank) is not built,
    since the base overwrites every weight. Ties survive (2-rank parity: tests/finetune/test_finetune_dist.py)."""
    from scaletrain.model import Transformer
    from scaletrain.parallel import init

    monkeypatch.setattr(init, "build_model", lambda *a, **k: pytest.fail("a reference model was built"))
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=16, tie_embeddings=True)
    with torch.device("meta"):
        model = Transformer(cfg)
    init.materialize([model], cfg, torch.device("cpu"), seed=0, distributed=True, weights=False)
    reference = build_model(cfg, seed=0)
    assert torch.equal(model.rope_cos, reference.rope_cos) and torch.equal(model.rope_sin, reference.rope_sin)
    assert model.output.weight is model.tok_embeddings.weight and not model.rope_cos.is_meta


@pytest.mark.parametrize("field, value, message", [
    ("model_type", "falcon", "model_type 'falcon' is not supported"),
    ("hidden_act", "gelu", "hidden_act = 'gelu'"),
    ("intermediate_size", 48, "has shape"),
])
def test_unsupported_hf_folder_is_one_line(hf_base, tmp_path, field, value, message):
    import shutil

    folder = tmp_path / "bad"
    shutil.copytree(hf_base, folder)
    config = json.loads((folder / "config.json").read_text())
    config[field] = value
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message):
        build_finetuned_model(_job(folder, method="lora"))


def test_no_matching_lora_target_is_refused(hf_base):
    with pytest.raises(ConfigError, match="match no module"):
        build_finetuned_model(_job(hf_base, method="lora", lora_targets=[]))


def _finetune_args(source, run, tiny, **extra):
    over = tiny(run, **{"train.steps": 6, **extra})
    for key in [k for k in over if k.startswith("model.")]:
        over.pop(key)  # the model comes from the base
    return ["finetune", "--from", str(source)] + [f"--{k}={v}" for k, v in over.items()]


def test_cli_bad_input_exits_2(hf_base, tmp_path, tiny, capsys):
    assert main(_finetune_args(hf_base, tmp_path / "a", tiny, **{"finetune.lora_rank": 0})) == 2
    assert "finetune.lora_rank must be >= 1" in capsys.readouterr().err
    assert main(_finetune_args(hf_base, tmp_path / "b", tiny, **{"finetune.lora_targets": "q,attn"})) == 2
    assert "unknown target(s) attn" in capsys.readouterr().err
    assert main(_finetune_args(tmp_path / "nowhere", tmp_path / "c", tiny)) == 2
    assert "not a folder" in capsys.readouterr().err
    assert main(_finetune_args(hf_base, tmp_path / "d", tiny, **{"finetune.method": "prompt",
                                                                  "finetune.lora_plus_ratio": 16})) == 2
    assert "finetune.lora_plus_ratio=16 scales the LoRA B matrices' learning rate" in capsys.readouterr().err


def test_a_truncated_safetensors_base_is_one_line_naming_it(hf_base, tmp_path, tiny, capsys):
    """Before: safetensors' SafetensorError traceback (an interrupted download of model.safetensors)."""
    import shutil

    folder = tmp_path / "cut"
    shutil.copytree(hf_base, folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert main(_finetune_args(folder, tmp_path / "run", tiny)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"ConfigError: {weights}: not a readable safetensors file") and "truncated" in err, err
    assert len(err.splitlines()) == 1


def test_lora_plus_trains_b_at_ratio_times_the_rate(hf_base, tmp_path, tiny):
    """LoRA+: every B matrix sits in a group at 16x the schedule's rate (the trainer sets lr x lr_scale each
    step), every A matrix at 1x."""
    from scaletrain.train.trainer import Trainer

    over = {k: str(v) for k, v in tiny(tmp_path / "run", **{"train.steps": 2}).items() if not k.startswith("model.")}
    cfg = load_config(None, {**over, "finetune.source": str(hf_base), "finetune.lora_plus_ratio": "16",
                             "optim.lr": "1e-3", "schedule.warmup_steps": "0"})
    trainer = Trainer(cfg, log=False)
    names = {id(p): n for m in trainer.pm.modules for n, p in m.named_parameters()}
    scale = {names[id(p)]: g["lr_scale"] for g in trainer.optimizer.param_groups for p in g["params"]}
    assert {v for k, v in scale.items() if k.endswith("lora_B")} == {16.0}
    assert {v for k, v in scale.items() if k.endswith("lora_A")} == {1.0}
    trainer.step()
    lrs = {g["lr_scale"]: g["lr"] for g in trainer.optimizer.param_groups}
    assert lrs[16.0] == pytest.approx(16 * lrs[1.0]) and lrs[1.0] > 0


def test_changed_base_is_refused_on_resume_and_eval(hf_base, tmp_path, tiny, capsys):
    import shutil

    base = tmp_path / "base"
    shutil.copytree(hf_base, base)
    run = tmp_path / "run"
    assert main(_finetune_args(base, run, tiny, **{"train.stop_at_step": 3})) == 0
    weights = load_file(str(base / "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"] * 1.01
    from safetensors.torch import save_file

    save_file(weights, str(base / "model.safetensors"), metadata={"format": "pt"})
    capsys.readouterr()
    assert main(_finetune_args(base, run, tiny) + ["--resume"]) == 2
    assert "trained on a base with checksum" in capsys.readouterr().err
    assert main(["eval", "--run", str(run), "--batches", "1"]) == 2
    assert "trained on a base with checksum" in capsys.readouterr().err


@pytest.mark.parametrize("method", ["lora", "prefix"])
def test_adapter_resume_is_bitwise(hf_base, tmp_path, tiny, method):
    """Stop at step 3 and resume to 6 == 6 steps straight; the checkpoint holds only the trainable tensors."""
    extra = {"finetune.method": method, "finetune.virtual_tokens": 4}
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(_finetune_args(hf_base, straight, tiny, **extra)) == 0
    assert main(_finetune_args(hf_base, resumed, tiny, **extra, **{"train.stop_at_step": 3})) == 0
    assert main(_finetune_args(hf_base, resumed, tiny, **extra) + ["--resume"]) == 0
    from scaletrain.infer.load import load_run

    _, a, _, ckpt = load_run(straight)
    _, b, _, _ = load_run(resumed)
    for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(x, y), name
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["base"]["kind"] == "hf"
    saved = torch.distributed.checkpoint.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    model_keys = {k for k in saved if k.startswith("model.")}
    suffixes = ("lora_A", "lora_B") if method == "lora" else ("prefix_key", "prefix_value")
    assert model_keys and all(k.endswith(suffixes) for k in model_keys), model_keys


FIXTURE = Path(__file__).parents[1] / "fixtures" / "instructions.jsonl"


def test_instruction_rows_target_the_answers_only():
    from scaletrain.data.instructions import IGNORE, encode_example, make_rows, read_instructions

    tok = CharTokenizer(CHARS)
    ids, target = encode_example([("Instruction:\nHi\n\nResponse:\n", False), ("Yes.", True)], tok)
    (inputs,), (targets,) = make_rows([(__import__("numpy").array(ids), __import__("numpy").array(target))], 64)
    learned = tok.decode([t for t in targets.tolist() if t != IGNORE])
    assert learned == "Yes.\n\n"  # the answer and its end marker (a char tokenizer has no end-of-text token)
    assert inputs[:len(ids) - 1].tolist() == ids[:-1] and (targets[len(ids) - 1:] == IGNORE).all()
    examples = read_instructions(FIXTURE, tok)
    assert len(examples) == 12
    chat_ids, chat_target = examples[10]
    answers = tok.decode(chat_ids[chat_target].tolist())
    assert answers == "Resolved. resolved.\n\nWe know it, we know it.\n\n"


def test_instruction_finetune_trains_and_bad_line_exits_2(hf_base, tmp_path, tiny, capsys):
    extra = {"finetune.instructions": str(FIXTURE), "data.seq_len": 64, "data.val_fraction": 0.2,
             "train.steps": 12, "optim.lr": 0.01, "train.eval_interval": 12}
    assert main(_finetune_args(hf_base, tmp_path / "run", tiny, **extra)) == 0
    vals = [json.loads(line)["val_loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
            if "val_loss" in line]
    assert len(vals) == 2 and vals[1] < vals[0]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "no response"}\n')
    capsys.readouterr()
    assert main(_finetune_args(hf_base, tmp_path / "bad", tiny, **{**extra, "finetune.instructions": str(bad)})) == 2
    assert f"{bad}:2: needs string fields 'prompt' and 'response'" in capsys.readouterr().err


def test_instruction_data_given_as_text_points_at_finetune_instructions(hf_base, tmp_path, tiny, capsys):
    alpaca = FIXTURE.with_name("alpaca.jsonl")  # instruction/input/output: no 'text' field to read as text
    capsys.readouterr()
    assert main(_finetune_args(hf_base, tmp_path / "run", tiny, **{"data.path": str(alpaca)})) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "4 without a 'text' field" in err, err
    assert f"fields: instruction, input, output: instruction data in the Alpaca layout, which " \
           f"finetune.instructions={alpaca} reads" in err and "set data.text_field" in err
    report = Path(err.rsplit("; see ", 1)[1])
    assert report.name == "report.json" and report.is_file()  # the report the line names exists


@pytest.mark.parametrize("method", ["full", "lora", "qlora", "prompt", "dora"])
def test_planner_finetune_memory_matches_measured(hf_base, method):
    """The planner's fine-tuning memory vs the exact live tensor bytes of the trainer's step (10%)."""
    from scaletrain.config import FinetuneConfig, OptimConfig, ParallelConfig, TrainConfig
    from scaletrain.parallel import ParallelDims
    from scaletrain.plan.finetune import finetune_memory
    from scaletrain.plan.measure import LiveTensorBytes, measure_step, resident_extras
    from scaletrain.plan.workload import Plan, Workload
    from scaletrain.train.step import StepOptions, build_parallel_training, training_step

    model = _job(hf_base).model
    ft = FinetuneConfig(source=str(hf_base), method="lora" if method == "dora" else method, lora_targets=["q", "v"],
                        virtual_tokens=8, dora=method == "dora")
    cfg = JobConfig(model=model, optim=OptimConfig(), train=TrainConfig(seed=0), finetune=ft)
    batch, seq = 4, 32
    tracker = LiveTensorBytes().__enter__()
    pm, optimizer = build_parallel_training(cfg, ParallelDims.from_config(ParallelConfig(), 1), torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    micro = [(torch.randint(0, model.vocab_size, (batch, seq), generator=gen),
              torch.randint(0, model.vocab_size, (batch, seq), generator=gen), None)]
    measured = measure_step(lambda: training_step(pm, optimizer, iter(micro), 1, StepOptions(grad_clip=1.0)).loss,
                            tracker, steps=1)["peak_bytes"]
    workload = Workload(model=model, seq_len=seq, global_batch=batch, train_tokens=batch * seq)
    predicted = finetune_memory(workload, Plan(micro_batch=batch), ft, "cpu")["tensor_total"]
    predicted += resident_extras(model, batch, seq)
    assert abs(predicted / measured - 1) < 0.10, (predicted, measured)


def test_plan_answers_whether_qlora_fits_a_24gb_card(capsys):
    args = ["plan", "--model.preset=llama-8b", "--model.vocab_size=128256", "--hardware", "rtx-4090:1",
            "--data.seq_len=2048", "--global-batch", "16"]
    assert main(args + ["--finetune.method=lora"]) == 2  # a 16 GB bf16 base alone nearly fills it
    assert "does NOT fit" in capsys.readouterr().out
    assert main(args + ["--finetune.method=qlora", "--parallel.activation_checkpointing=full"]) == 0
    out = capsys.readouterr().out
    # The verdict names the card's usable memory, and the predicted total is under it.
    need, have = re.search(r"per device .*?: ([\d.]+) GiB = .*?rtx-4090 has ([\d.]+) GiB: fits", out, re.S).groups()
    assert 0 < float(need) < float(have) < 24, out


def test_lora_with_activation_checkpointing_gives_the_same_losses(hf_base, tmp_path, tiny):
    runs = {}
    for name, extra in (("plain", {}), ("ac", {"parallel.activation_checkpointing": "full"})):
        run = tmp_path / name
        assert main(_finetune_args(hf_base, run, tiny, **{"logging.log_interval": 1, **extra})) == 0
        runs[name] = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
                      if '"loss"' in line]
    assert len(runs["plain"]) == 6 and runs["plain"] == runs["ac"]


def test_fresh_dora_is_the_base(hf_base):
    """A fresh DoRA adapter (B = 0, magnitude = the base's row norms) leaves the base's function unchanged, and
    the magnitude trains: one value per output row of every adapted projection."""
    cfg = _job(hf_base, method="lora", lora_targets=["q", "down"], dora=True)
    model = build_finetuned_model(cfg).eval()
    ids = torch.randint(0, len(CHARS), (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.allclose(model(ids), base_model(cfg).eval()(ids), rtol=0, atol=1e-5)
    magnitudes = {n: p for n, p in model.named_parameters() if n.endswith("lora_magnitude")}
    assert len(magnitudes) == 2 * cfg.model.n_layers and all(p.requires_grad for p in magnitudes.values())


@pytest.mark.parametrize("method", ["prompt", "prefix"])
def test_virtual_tokens_are_optimized_on_the_schedule(hf_base, tmp_path, tiny, method):
    """Prompt and prefix tuning barely moved the val loss at 3e-2 in the fine-tuning benchmark: the virtual
    tokens are trainable, in the optimizer, get gradients and move at the schedule's rate; the base does not."""
    from scaletrain.config import load_config
    from scaletrain.train.schedule import lr_at
    from scaletrain.train.trainer import Trainer

    over = {k: v for k, v in tiny(tmp_path / method, **{"train.steps": 4, "optim.lr": "3e-2"}).items()
            if not k.startswith("model.")}
    cfg = load_config(None, {**over, "finetune.source": str(hf_base), "finetune.method": method,
                             "finetune.virtual_tokens": "4"})
    trainer = Trainer(cfg, log=False)
    named = {n: p for m in trainer.pm.modules for n, p in m.named_parameters()}
    trainable = {n: p for n, p in named.items() if p.requires_grad}
    suffixes = ("prompt",) if method == "prompt" else ("prefix_key", "prefix_value")
    assert trainable and all(n.endswith(suffixes) for n in trainable), list(trainable)
    in_optimizer = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert all(id(p) in in_optimizer for p in trainable.values())
    before = {n: p.detach().clone() for n, p in named.items()}
    grads = {}
    for n, p in trainable.items():
        p.register_post_accumulate_grad_hook(lambda p, n=n: grads.__setitem__(n, p.grad.abs().sum().item()))
    trainer.train()
    for n, p in named.items():
        moved = (p.detach() - before[n]).abs().max().item()
        if n in trainable:  # Adam moves each element by up to ~lr a step
            assert grads[n] > 0 and 0 < moved <= 4 * 3e-2 * 1.01, (n, grads.get(n), moved)
        else:
            assert moved == 0, n
    final = lr_at(cfg.train.steps - 1, cfg.optim.lr, cfg.train.steps, cfg.schedule)
    assert all(g["lr"] == pytest.approx(final) for g in trainer.optimizer.param_groups)


def test_run_base_is_read_tensor_by_tensor(tmp_path, tiny):
    """A scaletrain run as the base: its weights are read one at a time (finetune/base.py RunWeights, so loading
    never holds a second whole copy of the base) and land in the fine-tuned model exactly as saved."""
    from scaletrain.checkpoint.manager import load_tensors
    from scaletrain.checkpoint.state import model_tensors
    from scaletrain.finetune.base import RunWeights, open_base

    run = tmp_path / "base"
    assert main(["train"] + [f"--{k}={v}" for k, v in tiny(run, **{"train.steps": 2}).items()]) == 0
    base = open_base(str(run))
    weights = base.state()
    assert isinstance(weights, RunWeights) and "layers.0.attention.wq.weight" in weights and "nothing" not in weights
    saved = build_model(base.model, "meta")
    saved.to_empty(device="cpu")
    load_tensors(base.checkpoint, {"model": model_tensors([saved])})
    model = build_finetuned_model(_job(run, method="lora", lora_targets=["q", "v", "down"], lora_rank=2))
    params = dict(model.named_parameters())
    for name, tensor in saved.named_parameters():
        assert torch.equal(params[name], tensor), name
        assert torch.equal(weights[name], tensor), name
    assert sum(name.endswith("lora_A") for name in params) == 3 * base.model.n_layers


def test_hf_base_is_read_tensor_by_tensor(hf_base):
    """A Hugging Face base, too, is read one tensor at a time (HFWeights), with the same values as stored."""
    from scaletrain.finetune.base import HFWeights, open_base
    from scaletrain.model.hf_names import from_hf

    base = open_base(str(hf_base))
    weights = base.state()
    stored = {from_hf(k): v for k, v in load_file(str(hf_base / "model.safetensors")).items() if from_hf(k)}
    assert isinstance(weights, HFWeights) and set(weights) == set(stored) and "nothing" not in weights
    for name, tensor in stored.items():
        assert torch.equal(weights[name], tensor.float()), name


def test_muon_adapters_train_lora_with_muon_and_resume_bitwise(hf_base, tmp_path, tiny):
    """optim.muon_adapters: every lora_A / lora_B is a Muon matrix (one momentum buffer, no AdamW moments), the
    fine-tune learns, and a run stopped and resumed ends with the straight run's every loss and weight."""
    from helpers import faults
    from scaletrain.train.trainer import Trainer

    muon = {"optim.name": "muon", "optim.muon_adapters": "true", "optim.lr": "1e-2",
            "finetune.lora_targets": "q,v,down", "logging.log_interval": "1"}
    over = {k: str(v) for k, v in tiny(tmp_path / "probe", **{"train.steps": 2}).items() if not k.startswith("model.")}
    trainer = Trainer(load_config(None, {**over, **muon, "finetune.source": str(hf_base)}), log=False)
    named = {n: p for m in trainer.pm.modules for n, p in m.named_parameters() if p.requires_grad}
    on_muon = {id(p) for g in trainer.optimizer.muon.param_groups for p in g["params"]}
    assert named and {n for n, p in named.items() if id(p) in on_muon} == set(named)  # adapters only train
    assert all(n.rsplit(".", 1)[-1] in ("lora_A", "lora_B") for n in named)
    trainer.step()
    assert all(set(trainer.optimizer.state[p]) == {"momentum_buffer"} for p in named.values())

    args = lambda run, **extra: _finetune_args(hf_base, run, tiny, **{**muon, **extra})  # noqa: E731
    assert main(args(tmp_path / "straight", **{"checkpoint.interval": 3})) == 0
    assert main(args(tmp_path / "resumed", **{"checkpoint.interval": 3, "train.stop_at_step": 3})) == 0
    assert main([*args(tmp_path / "resumed", **{"checkpoint.interval": 3}), "--resume"]) == 0
    faults.assert_same_run(tmp_path / "straight", tmp_path / "resumed")
    losses = [loss for _, loss in sorted(faults.losses(tmp_path / "straight").items())]
    assert len(losses) == 6 and max(losses[-2:]) < losses[0], losses


def test_muon_adapters_without_lora_exit_2(hf_base, tmp_path, tiny, capsys):
    assert main(_finetune_args(hf_base, tmp_path / "a", tiny, **{"finetune.method": "prompt", "optim.name": "muon",
                                                                  "optim.muon_adapters": "true"})) == 2
    assert "optim.muon_adapters puts LoRA's adapter matrices under Muon: it needs finetune.method=lora" \
        in capsys.readouterr().err
    assert main(_finetune_args(hf_base, tmp_path / "b", tiny, **{"optim.muon_adapters": "true"})) == 2
    assert "optim.muon_adapters applies to optim.name=muon only" in capsys.readouterr().err


def test_qlora_without_torchao_is_one_line_naming_the_extra(hf_base, tmp_path, tiny):
    """On an install without the finetune extra: not ``ModuleNotFoundError: torchao`` from inside the model."""
    import subprocess
    import sys

    helper = Path(__file__).parents[1] / "helpers" / "without_module.py"
    args = _finetune_args(hf_base, tmp_path / "run", tiny, **{"finetune.method": "qlora"})
    done = subprocess.run([sys.executable, str(helper), "torchao", *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip() == ("ConfigError: finetune.method=qlora needs torchao for its 4-bit base (No module "
                                   "named 'torchao'): pip install 'scaletrain[finetune]', or use finetune.method=lora")
    assert not (tmp_path / "run" / "checkpoints").exists()
