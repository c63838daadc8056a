"""Preference tuning (finetune/preference.py, data/preferences.py): TRL's losses as the oracle, the reference
through disabled adapters, the stored reference of full fine-tuning across a resume, bad input in one line."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from helpers.tiny import CHARS, tiny_hf_base, tiny_overrides
from scaletrain.cli import main
from scaletrain.config import ModelConfig
from scaletrain.data.preferences import pair_rows, read_preferences
from scaletrain.data.tokenizer import CharTokenizer, DataError
from scaletrain.finetune.lora import adapters_disabled, apply_lora
from scaletrain.finetune.preference import dpo_loss, orpo_loss, sequence_logps, simpo_loss
from scaletrain.model import build_model

FIXTURE = Path(__file__).parents[1] / "fixtures" / "preferences.jsonl"
SEQ = 72  # the fixture's longest rendered pair is 72 tokens


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory):
    return tiny_hf_base(tmp_path_factory.mktemp("base"))


def _finetune(source, run, **extra) -> list[str]:
    over = tiny_overrides(run, **{"train.steps": 6, "data.seq_len": SEQ, "finetune.preferences": str(FIXTURE),
                                  "finetune.objective": "dpo", "data.val_fraction": 0.25, "optim.lr": 0.01,
                                  "logging.log_interval": 1, **extra})
    return ["finetune", "--from", str(source)] + [f"--{k}={v}" for k, v in over.items() if not k.startswith("model.")]


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


# -- data ---------------------------------------------------------------------------------------------------
def test_pairs_score_the_completions_only():
    tok = CharTokenizer(CHARS)
    pairs = read_preferences(FIXTURE, tok, SEQ)
    assert len(pairs) == 12
    (chosen, chosen_target), (rejected, rejected_target) = pairs[0]
    assert tok.decode(chosen[chosen_target].tolist()) == "The king speaks first.\n\n"
    assert tok.decode(rejected[rejected_target].tolist()) == "A dog barks first.\n\n"
    # a conversation's earlier assistant turn is context, not scored
    (ids, target), _ = pairs[10]
    assert tok.decode(ids[target].tolist()) == "A friend.\n\n" and "Hail." in tok.decode(ids.tolist())
    ci, ct, ri, rt = pair_rows(pairs, SEQ)
    assert ci.shape == ri.shape == (12, SEQ) and int((ct[0] != -100).sum()) == len("The king speaks first.\n\n")


def test_a_preference_file_with_a_bom_reads_and_one_not_utf8_is_one_line(tmp_path):
    tok = CharTokenizer(CHARS)
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + FIXTURE.read_bytes())  # a Windows editor's UTF-8
    assert len(read_preferences(bom, tok, SEQ)) == 12
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(json.dumps({"prompt": "Caf\u00e9?", "chosen": "Yes.", "rejected": "No."},
                                  ensure_ascii=False).encode("latin-1") + b"\n")
    with pytest.raises(DataError, match=rf"^{latin1}:1: not UTF-8 at byte 15 of the file; it reads as Windows-1252"):
        read_preferences(latin1, tok, SEQ)


@pytest.mark.parametrize("line, message", [
    ({"prompt": "Hi", "chosen": "Yes."}, ":2: missing field 'rejected'"),
    ({"prompt": "Hi", "chosen": " ", "rejected": "No."}, ":2: 'chosen' is empty"),
    ({"prompt": "Hi", "chosen": "Yes.", "rejected": "Yes."}, ":2: 'chosen' and 'rejected' are identical"),
    ({"chosen": "Yes.", "rejected": "No."}, ":2: needs a 'prompt' string or a 'messages' list"),
    ({"prompt": "Hi", "chosen": "Yes " * 30, "rejected": "No."}, ":2: the prompt and its 'chosen' completion are "
                                                                 "149 tokens, longer than data.seq_len + 1 = 73; "
                                                                 "pairs are refused, not cut"),
])
def test_bad_pair_is_one_line_naming_the_line(tmp_path, line, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "Hi", "chosen": "Yes.", "rejected": "No."}) + "\n" + json.dumps(line) + "\n")
    with pytest.raises(DataError) as err:
        read_preferences(bad, CharTokenizer(CHARS), SEQ)
    assert str(err.value).startswith(f"{bad}{message}"), str(err.value)


def test_cli_bad_preferences_exit_2(hf_base, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "a", "chosen": "b"}\n')
    assert main(_finetune(hf_base, tmp_path / "a", **{"finetune.preferences": str(bad)})) == 2
    err = capsys.readouterr().err
    assert f"{bad}:2: missing field 'rejected'" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert main(_finetune(hf_base, tmp_path / "b", **{"finetune.method": "prompt"})) == 2
    assert "finetune.objective=dpo with finetune.method=prompt is not supported" in capsys.readouterr().err
    assert main(_finetune(hf_base, tmp_path / "c", **{"finetune.objective": "sft"})) == 2
    assert "finetune.preferences is set but finetune.objective=sft" in capsys.readouterr().err


# -- the oracle: TRL's loss computations on the same log-probabilities ----------------------------------------
@pytest.fixture(scope="module")
def batch():
    """A real (2B, T) batch of the fixture's pairs through two tiny random models (policy, reference): the
    logits, targets and each row's summed log-probabilities."""
    tok = CharTokenizer(CHARS)
    ci, ct, ri, rt = pair_rows(read_preferences(FIXTURE, tok, SEQ)[:6], SEQ)
    inputs, targets = torch.cat([ci, ri]), torch.cat([ct, rt])
    cfg = ModelConfig(vocab_size=len(CHARS), dim=32, n_layers=2, n_heads=4, ffn_hidden_dim=64, max_seq_len=SEQ)
    with torch.no_grad():
        logits = build_model(cfg, seed=1)(inputs)
        ref_logits = build_model(cfg, seed=2)(inputs)
    return SimpleNamespace(inputs=inputs, targets=targets, logits=logits, ref_logits=ref_logits)


def _trl_logps(logits, targets):
    """TRL's own per-row summed log-probabilities (``get_batch_logps``; it shifts labels itself, so ours,
    already shifted, get one ignored column in front and the logits one unused position at the end)."""
    from trl.experimental.orpo import ORPOTrainer

    labels = torch.cat([torch.full((len(targets), 1), -100), targets], dim=1)
    padded = torch.cat([logits, torch.zeros_like(logits[:, :1])], dim=1)
    return ORPOTrainer.get_batch_logps(padded, labels)


def _trl_dpo(batch, loss_type, beta, label_smoothing):
    """TRL 1.16's ``DPOTrainer._compute_loss`` (precomputed reference log-probs) on our per-token log-probs:
    the loss and the logged rewards."""
    from trl.trainer.dpo_trainer import DPOTrainer

    per_token = -torch.nn.functional.cross_entropy(batch.logits.flatten(0, 1), batch.targets.flatten(),
                                                   reduction="none").view(batch.targets.shape)
    ref, _ = sequence_logps(batch.ref_logits, batch.targets)
    completion = torch.cat([torch.zeros(len(batch.targets), 1, dtype=torch.long), (batch.targets != -100).long()], 1)
    zeros = torch.zeros_like(per_token)
    model = SimpleNamespace(training=True)

    def forward(**kwargs):
        return SimpleNamespace(log_probs=per_token, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())

    model.__call__ = forward
    accelerator = SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x, gather=lambda x: x)
    trainer = SimpleNamespace(model=model, accelerator=accelerator, aux_loss_enabled=False, ld_alpha=None,
                              precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=[loss_type],
                              loss_weights=[1.0], beta=beta, label_smoothing=label_smoothing, use_weighting=False,
                              _metrics={"train": defaultdict(list)}, _total_train_tokens=0, _tp_size=1)
    inputs = {"input_ids": torch.cat([batch.inputs, batch.inputs[:, :1]], 1), "completion_mask": completion,
              "attention_mask": torch.ones_like(completion), "ref_chosen_logps": ref.chunk(2)[0],
              "ref_rejected_logps": ref.chunk(2)[1]}
    loss = DPOTrainer._compute_loss(trainer, lambda **kw: forward(**kw), inputs, False)
    return float(loss), {k: v[0] for k, v in trainer._metrics["train"].items()}


def test_sequence_logps_equal_trls(batch):
    ours, tokens = sequence_logps(batch.logits, batch.targets)
    theirs = _trl_logps(batch.logits, batch.targets)
    assert torch.allclose(ours, theirs, rtol=0, atol=1e-5) and (tokens > 0).all()


ORACLE = {}  # (objective, variant) -> (ours, TRL's) loss, printed by the last oracle test for the report


@pytest.mark.parametrize("loss_type, label_smoothing, trl_type", [
    ("sigmoid", 0.0, "sigmoid"), ("ipo", 0.0, "ipo"), ("robust", 0.1, "robust")])
def test_dpo_equals_trl(batch, loss_type, label_smoothing, trl_type):
    beta = 0.2
    logps, tokens = sequence_logps(batch.logits, batch.targets)
    ref, _ = sequence_logps(batch.ref_logits, batch.targets)
    ours = dpo_loss(*logps.chunk(2), *ref.chunk(2), beta, loss_type, label_smoothing, *tokens.chunk(2))
    theirs, metrics = _trl_dpo(batch, trl_type, beta, label_smoothing)
    ORACLE[f"DPO {loss_type} e={label_smoothing}"] = (float(ours.loss), theirs)
    assert abs(float(ours.loss) - theirs) < 1e-5, (float(ours.loss), theirs)
    assert abs(float(ours.chosen_rewards.mean()) - metrics["rewards/chosen"]) < 1e-5
    assert abs(float(ours.rejected_rewards.mean()) - metrics["rewards/rejected"]) < 1e-5
    margin = ours.chosen_rewards - ours.rejected_rewards
    assert abs(float(margin.mean()) - metrics["rewards/margins"]) < 1e-5
    assert not ours.ties().any() and float(ours.wins().float().mean()) == metrics["rewards/accuracies"]


def test_rounding_level_rewards_are_ties_not_wins(batch):
    """DPO's first step, where the policy is the reference: TRL (the reference exactly the policy) logs accuracy 0;
    ours, whose stored fp32 reference differs from the policy's forward by rounding (a full fine-tune), counted
    the signs of ~1e-7 rewards as wins (0.125 logged). Within TIE_TOLERANCE of the rewards' scale a pair is a tie:
    accuracy 0 as TRL's, every pair a tie; a margin one step of training gives (1e-3) is a win again."""
    from scaletrain.finetune.preference import TIE_TOLERANCE

    beta = 0.1
    logps, tokens = sequence_logps(batch.logits, batch.targets)
    generator = torch.Generator().manual_seed(0)  # one float32 step up or down: the rounding of another batching
    towards = torch.where(torch.rand(logps.shape, generator=generator) < 0.5, 0.0, -1e9)
    rounded = torch.nextafter(logps, towards)
    ours = dpo_loss(*logps.chunk(2), *rounded.chunk(2), beta)
    margin = ours.chosen_rewards - ours.rejected_rewards
    assert (margin != 0).any() and float((margin > 0).float().mean()) > 0  # what was counted before
    _, metrics = _trl_dpo(SimpleNamespace(**{**vars(batch), "ref_logits": batch.logits}), "sigmoid", beta, 0.0)
    assert metrics["rewards/accuracies"] == 0.0 == float(ours.wins().float().mean())
    assert ours.ties().all()
    assert float((margin.abs() / ours.reward_scale).max()) < TIE_TOLERANCE
    chosen, rejected = logps.chunk(2)
    moved = dpo_loss(chosen + 1e-2, rejected, *rounded.chunk(2), beta)  # a margin of beta x 1e-2
    assert moved.wins().all() and not moved.ties().any()


def _cpo(loss_type, beta, label_smoothing=0.0, gamma=0.5):
    from trl.experimental.cpo import CPOTrainer

    fake = SimpleNamespace(alpha=0.0, loss_type=loss_type, simpo_gamma=gamma, beta=beta,
                           label_smoothing=label_smoothing, accelerator=SimpleNamespace(device=torch.device("cpu")))
    return lambda chosen, rejected: CPOTrainer.cpo_loss(fake, chosen, rejected)


def test_conservative_dpo_equals_trls_label_smoothed_sigmoid(batch):
    """DPO's sigmoid with label smoothing (cDPO): TRL 1.16's DPO ``sigmoid`` has no smoothing any more, its
    CPO ``sigmoid`` has the same formula on a difference of log-ratios: given the log-ratios, it is the oracle."""
    beta, e = 0.2, 0.1
    logps, tokens = sequence_logps(batch.logits, batch.targets)
    ref, _ = sequence_logps(batch.ref_logits, batch.targets)
    ours = dpo_loss(*logps.chunk(2), *ref.chunk(2), beta, "sigmoid", e)
    ratios = (logps - ref).chunk(2)
    losses, chosen, rejected = _cpo("sigmoid", beta, e)(*ratios)
    ORACLE["DPO sigmoid e=0.1 (cDPO)"] = (float(ours.loss), float(losses.mean()))
    assert abs(float(ours.loss) - float(losses.mean())) < 1e-5
    assert torch.allclose(ours.chosen_rewards, chosen, atol=1e-5) and torch.allclose(ours.rejected_rewards, rejected,
                                                                                     atol=1e-5)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_simpo_equals_trls_cpo_simpo(batch, label_smoothing):
    beta, gamma = 2.0, 0.5
    logps, tokens = sequence_logps(batch.logits, batch.targets)
    ours = simpo_loss(*logps.chunk(2), *tokens.chunk(2), beta, gamma, label_smoothing)
    average = (logps / tokens).chunk(2)  # CPO's simpo reads length-averaged log-probs (average_log_prob=True)
    losses, chosen, rejected = _cpo("simpo", beta, label_smoothing, gamma)(*average)
    ORACLE[f"SimPO e={label_smoothing}"] = (float(ours.loss), float(losses.mean()))
    assert abs(float(ours.loss) - float(losses.mean())) < 1e-5
    assert torch.allclose(ours.chosen_rewards, chosen, atol=1e-5) and torch.allclose(ours.rejected_rewards, rejected,
                                                                                     atol=1e-5)


def test_orpo_equals_trls_odds_ratio_loss(batch):
    """ORPO = the chosen completions' NLL - mean(beta log s(log odds)); TRL's ``odds_ratio_loss`` gives the
    second term (and the rewards); the NLL is the cross-entropy over the chosen rows' completion tokens."""
    from trl.experimental.orpo import ORPOTrainer

    beta = 0.1
    logps, tokens = sequence_logps(batch.logits, batch.targets)
    ours = orpo_loss(*logps.chunk(2), *tokens.chunk(2), beta)
    fake = SimpleNamespace(beta=beta, accelerator=SimpleNamespace(device=torch.device("cpu")))
    losses, chosen, rejected, _, _ = ORPOTrainer.odds_ratio_loss(fake, *(logps / tokens).chunk(2))
    half = len(batch.targets) // 2
    nll = torch.nn.functional.cross_entropy(batch.logits[:half].flatten(0, 1), batch.targets[:half].flatten())
    theirs = float(nll - losses.mean())
    ORACLE["ORPO"] = (float(ours.loss), theirs)
    assert abs(float(ours.loss) - theirs) < 1e-5
    assert torch.allclose(ours.chosen_rewards, chosen, atol=1e-5) and torch.allclose(ours.rejected_rewards, rejected,
                                                                                     atol=1e-5)


def test_oracle_table(capsys):
    """The table the issue's closing note quotes (run after the oracle tests above)."""
    with capsys.disabled():
        for name, (ours, theirs) in ORACLE.items():
            print(f"\n{name:28s} ours {ours:.8f}  TRL {theirs:.8f}  |diff| {abs(ours - theirs):.1e}", end="")
    assert all(abs(a - b) < 1e-5 for a, b in ORACLE.values())


# -- the reference ------------------------------------------------------------------------------------------
def test_disabled_adapters_are_the_base():
    cfg = ModelConfig(vocab_size=len(CHARS), dim=32, n_layers=2, n_heads=4, ffn_hidden_dim=64, max_seq_len=32)
    base, adapted = build_model(cfg, seed=3), build_model(cfg, seed=3)
    apply_lora(adapted, ["q", "v", "down"], 4, 8.0, 0.0, False)
    for name, p in adapted.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)  # a trained adapter (a fresh B is zero and proves nothing)
    ids = torch.randint(0, len(CHARS), (2, 32))
    with torch.no_grad():
        assert not torch.allclose(adapted(ids), base(ids))
        with adapters_disabled(adapted) as count:
            assert count == 6 and torch.equal(adapted(ids), base(ids))
        assert not torch.allclose(adapted(ids), base(ids))  # switched back on


def test_lora_dpo_trains_from_zero_rewards_and_exports_to_peft(hf_base, tmp_path):
    """A LoRA DPO run: rewards start at exactly 0 (the reference is the same model, adapters off), the held-out
    accuracy and the logged numbers are there, and the peft export gives the run's log-probabilities."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from scaletrain.infer.load import load_run

    run = tmp_path / "run"
    assert main(_finetune(hf_base, run, **{"train.eval_interval": 6, "finetune.lora_targets": "q,k,v,o,up,down",
                                           "finetune.beta": 0.5})) == 0
    records = _records(run)
    first_eval = next(r for r in records if "val_reward_accuracy" in r)
    assert first_eval["val_reward_margin"] == 0.0 and first_eval["val_reward_chosen"] == 0.0
    steps = [r for r in records if "reward_margin" in r]
    assert len(steps) == 6 and steps[-1]["reward_margin"] > 0 and not (run / "reference_logps.pt").exists()
    assert steps[-1]["loss"] < steps[0]["loss"]
    assert main(["report", str(run), "--out", str(tmp_path / "report.html")]) == 0
    page = (tmp_path / "report.html").read_text()
    for plot in ("plot-rewards", "plot-reward-accuracy"):  # with the run's curves, not the empty note
        start = page.index(f'"{plot}",')
        chunk = page[start:page.index("Plotly.newPlot", start)]
        assert '"name":"run: ' in chunk and '"y":[' in chunk and "no preference objective" not in chunk, plot
    out = tmp_path / "export"  # the base's folder, and the peft adapter in out/adapter
    assert main(["export", "--run", str(run), "--out", str(out)]) == 0
    ci, ct, ri, rt = pair_rows(read_preferences(FIXTURE, CharTokenizer(CHARS), SEQ), SEQ)
    inputs, targets = torch.cat([ci, ri]), torch.cat([ct, rt])
    _, model, _, _ = load_run(run)
    hf = transformers.LlamaForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32)
    peft_model = peft.PeftModel.from_pretrained(hf, str(out / "adapter")).eval()
    with torch.no_grad():
        ours = sequence_logps(model.eval()(inputs), targets)[0]
        theirs = sequence_logps(peft_model(input_ids=inputs).logits, targets)[0]
        assert torch.allclose(ours, theirs, rtol=0, atol=1e-4), (ours - theirs).abs().max()
        with peft_model.disable_adapter():  # peft's reference is ours: the base
            base = sequence_logps(peft_model(input_ids=inputs).logits, targets)[0]
    assert not torch.allclose(ours, base, atol=1e-3)


def test_full_dpo_stores_the_reference_and_resumes_bitwise(hf_base, tmp_path, capsys):
    """Full fine-tuning: the reference log-probs are computed once, stored in the run folder and read back on
    the resume (not recomputed from the trained weights); stop at 3 + resume to 6 == 6 straight, bitwise."""
    from scaletrain.infer.load import load_run

    extra = {"finetune.method": "full", "train.eval_interval": 3, "checkpoint.interval": 3}
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(_finetune(hf_base, straight, **extra)) == 0
    assert main(_finetune(hf_base, resumed, **extra, **{"train.stop_at_step": 3})) == 0
    stored = torch.load(resumed / "reference_logps.pt", weights_only=True)
    assert len(stored["keys"]) == 24  # 12 pairs x (chosen, rejected)
    capsys.readouterr()
    assert main(_finetune(hf_base, resumed, **extra) + ["--resume"]) == 0
    assert f"24 log-probabilities read from {resumed / 'reference_logps.pt'}" in capsys.readouterr().out
    a = [r for r in _records(straight) if "reward_margin" in r]
    b = [r for r in _records(resumed) if "reward_margin" in r]
    assert [r["loss"] for r in a] == [r["loss"] for r in b] and [r["reward_margin"] for r in a] == \
        [r["reward_margin"] for r in b]
    # step 1: the policy is the base; the stored reference equals it up to rounding: ties, not wins
    assert (a[0]["reward_accuracy"], a[0]["reward_ties"]) == (0.0, 1.0), a[0]
    _, x, _, _ = load_run(straight)
    _, y, _, _ = load_run(resumed)
    for (name, p), (_, q) in zip(x.named_parameters(), y.named_parameters()):
        assert torch.equal(p, q), name
    # ``scaletrain eval`` scores the objective with the stored reference: the val loss training recorded
    capsys.readouterr()
    assert main(["eval", "--run", str(resumed), "--batches", "1000"]) == 0
    last = [r for r in _records(resumed) if "val_loss" in r][-1]
    assert f"val loss {last['val_loss']:.4f}" in capsys.readouterr().out


def test_gradient_accumulation_equals_the_larger_batch(hf_base, tmp_path):
    """DPO's loss is a mean over pairs: 2 micro-batches of 2 pairs == 1 of 4, step for step."""
    one = tmp_path / "one"
    two = tmp_path / "two"
    assert main(_finetune(hf_base, one, **{"train.batch_size": 4, "train.steps": 4})) == 0
    assert main(_finetune(hf_base, two, **{"train.batch_size": 2, "train.grad_accum_steps": 2,
                                           "train.steps": 4})) == 0
    a = [r for r in _records(one) if "loss" in r]
    b = [r for r in _records(two) if "loss" in r]
    assert np.allclose([r["loss"] for r in a], [r["loss"] for r in b], rtol=1e-5)
    assert np.allclose([r["reward_accuracy"] for r in a], [r["reward_accuracy"] for r in b])


class _CopyReference:
    """A frozen second copy of the base as DPO's reference: what the trainer avoids, measured for comparison."""

    def __init__(self, model):
        self.model = model

    def __call__(self, inputs, targets):
        with torch.no_grad():
            return sequence_logps(self.model(inputs), targets)[0]


@pytest.mark.parametrize("reference", ["adapters", "copy", "precomputed"])
def test_planner_preference_memory_matches_measured(hf_base, tmp_path, reference, capsys):
    """The planner's DPO step memory vs the live tensor bytes of the trainer's step (10%): LoRA with the
    reference through disabled adapters, LoRA with a frozen copy of the base, full with precomputed log-probs."""
    from scaletrain.config import DataConfig, FinetuneConfig, JobConfig, OptimConfig, ParallelConfig, TrainConfig
    from scaletrain.finetune import resolve_finetune
    from scaletrain.finetune.base import open_base
    from scaletrain.parallel import ParallelDims
    from scaletrain.plan.finetune import preference_memory
    from scaletrain.plan.measure import LiveTensorBytes, measure_step, resident_extras
    from scaletrain.plan.workload import Plan, Workload
    from scaletrain.train.step import StepOptions, build_parallel_training, training_step

    pairs, seq = 4, SEQ
    ft = FinetuneConfig(source=str(hf_base), method="full" if reference == "precomputed" else "lora",
                        lora_targets=["q", "v"], objective="dpo", preferences=str(FIXTURE))
    cfg = resolve_finetune(JobConfig(data=DataConfig(seq_len=seq), optim=OptimConfig(),
                                     train=TrainConfig(seed=0, run_dir=str(tmp_path / "run")), finetune=ft))
    model = cfg.model
    tracker = LiveTensorBytes().__enter__()
    pm, optimizer = build_parallel_training(cfg, ParallelDims.from_config(ParallelConfig(), 1), torch.device("cpu"))
    if reference == "copy":
        copy = build_model(model, seed=0)
        copy.load_state_dict(open_base(str(hf_base)).state(), strict=False)
        pm.preference.reference = _CopyReference(copy.requires_grad_(False).eval())
    ci, ct, ri, rt = pair_rows(read_preferences(FIXTURE, CharTokenizer(CHARS), seq)[:pairs], seq)
    micro = [(torch.cat([ci, ri]), torch.cat([ct, rt]), None)]
    measured = measure_step(lambda: training_step(pm, optimizer, iter(micro), 1, StepOptions(grad_clip=1.0)).loss,
                            tracker, steps=1)["peak_bytes"]
    workload = Workload(model=model, seq_len=seq, global_batch=pairs, train_tokens=pairs * seq)
    est = preference_memory(workload, Plan(micro_batch=pairs), ft, "cpu", reference=reference)
    predicted = est["tensor_total"] + resident_extras(model, 2 * pairs, seq)
    with capsys.disabled():
        print(f"\nDPO {ft.method} reference={reference}: measured {measured / 2**20:.2f} MiB, predicted "
              f"{predicted / 2**20:.2f} MiB ({predicted / measured - 1:+.1%})", end="")
    assert abs(predicted / measured - 1) < 0.10, (predicted, measured)


# -- a family base and its chat template ---------------------------------------------------------------------
SHARED = Path(__file__).resolve().parents[3] / "shared" / "data" / "tokenizers"


@pytest.mark.skipif(not (SHARED / "qwen3" / "tokenizer.json").is_file(), reason="../shared/data/tokenizers absent")
def test_qwen3_template_scores_the_completion_and_its_end_token(tmp_path):
    """With Qwen3's own chat template the chosen row is apply_chat_template's ids of the conversation ending in
    the chosen answer, and its targets are that answer's turn (the empty think block, the answer, <|im_end|>)."""
    from scaletrain.data.tokenizer import load_tokenizer

    tok = load_tokenizer(SHARED / "qwen3" / "tokenizer.json")
    hf = tok.transformers_tokenizer()
    line = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                         {"role": "user", "content": "Who goes there?"}], "chosen": "A friend.", "rejected": "Nobody."}
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps(line) + "\n")
    ((ids, target), (rids, rtarget)), = read_preferences(path, tok, 128, chat_template="base")
    conversation = line["messages"] + [{"role": "assistant", "content": "A friend."}]
    assert ids.tolist() == list(hf.apply_chat_template(conversation, tokenize=True, return_dict=True)["input_ids"])
    assert hf.decode(ids[target]) == "<think>\n\n</think>\n\nA friend.<|im_end|>"
    assert hf.decode(rids[rtarget]) == "<think>\n\n</think>\n\nNobody.<|im_end|>"


def test_dpo_on_a_qwen3_family_base_with_its_chat_template(tmp_path):
    """A Qwen3-layout base (q/k norms) with the ChatML fixture tokenizer, pairs rendered in its chat template:
    DPO with LoRA trains (the reward margin grows)."""
    import shutil

    transformers = pytest.importorskip("transformers")
    fixtures = Path(__file__).parents[1] / "fixtures"
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**json.loads((fixtures / "families" / "qwen3.json").read_text()))
    base = tmp_path / "qwen3"
    transformers.AutoModelForCausalLM.from_config(config).float().save_pretrained(base)
    for file in (fixtures / "chatml_tokenizer").iterdir():
        shutil.copy(file, base / file.name)
    run = tmp_path / "run"
    assert main(_finetune(base, run, **{"data.seq_len": 96, "finetune.chat_template": "base",
                                        "finetune.beta": 0.5, "optim.lr": 0.02})) == 0
    steps = [r for r in _records(run) if "reward_margin" in r]
    assert len(steps) == 6 and steps[-1]["reward_margin"] > steps[0]["reward_margin"]


@pytest.mark.parametrize("method", ["dora", "qlora"])
def test_dpo_reference_is_the_adapter_free_model_for_dora_and_qlora(hf_base, tmp_path, method):
    """DoRA and QLoRA (4-bit base) too: before training every held-out reward is exactly 0 (the reference is the
    same model with its adapters off), and the rewards move once the adapters train."""
    if method == "qlora":
        pytest.importorskip("torchao")
    extra = {"finetune.method": "lora", "finetune.dora": "true"} if method == "dora" else {"finetune.method": "qlora"}
    run = tmp_path / "run"
    assert main(_finetune(hf_base, run, **{**extra, "train.steps": 3, "train.eval_interval": 3})) == 0
    evals = [r for r in _records(run) if "val_reward_margin" in r]
    assert evals[0]["val_reward_chosen"] == 0.0 and evals[0]["val_reward_rejected"] == 0.0
    assert evals[-1]["val_reward_chosen"] != 0.0


def test_kill9_during_full_dpo_then_resume_is_bitwise_with_the_stored_reference(tmp_path):
    """kill -9 in the middle of a full-fine-tuning DPO run, then --resume: the reference log-probs are read back
    from the run folder (the same bytes) and the run equals the one never interrupted, bitwise."""
    import random

    from helpers.faults import assert_same_run, kill9_after_step, run_ok, write_config
    from scaletrain.checkpoint.export import export_hf

    steps = 24
    model = ModelConfig(vocab_size=len(CHARS), dim=64, n_layers=4, n_heads=4, ffn_hidden_dim=128, max_seq_len=64)
    export_hf(build_model(model, seed=0), model, CharTokenizer(CHARS), tmp_path / "base")
    config = write_config(tmp_path, steps, 4)  # its [model] is the base's shape
    args = ["finetune", "--from", str(tmp_path / "base"), "--config", str(config), "--finetune.method=full",
            "--finetune.objective=dpo", f"--finetune.preferences={FIXTURE}", f"--data.seq_len={SEQ}",
            "--data.val_fraction=0.25", "--train.batch_size=2", "--optim.lr=1e-3"]
    reference, run = tmp_path / "straight", tmp_path / "run"
    run_ok([*args, f"--train.run_dir={reference}"])
    kill_at = random.Random(0).randint(6, steps - 8)
    kill9_after_step(args, run, kill_at, steps)
    stored = (run / "reference_logps.pt").read_bytes()
    out = run_ok([*args, f"--train.run_dir={run}", "--resume"])
    assert "resumed from" in out and "24 log-probabilities read from" in out
    assert (run / "reference_logps.pt").read_bytes() == stored == (reference / "reference_logps.pt").read_bytes()
    assert_same_run(reference, run)  # per-step losses and every final tensor, bitwise
