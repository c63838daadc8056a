"""lm-evaluation-harness: a run as an lm-eval LM gives the numbers of lm-eval's own ``hf`` backend on the run's
Hugging Face export (per-sample log-likelihoods within 1e-4, the same accuracies and generations), for every kind
of run; ``eval --tasks`` prints each score with its settings; gutenberg-cloze is built from the held-out text.

The tasks are local YAMLs over local JSONL (tests/fixtures/harness: multiple choice, generate_until and a rolling
log-likelihood), so nothing needs the network."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scaletrain.cli import main
from scaletrain.infer.load import load_run

lm_eval = pytest.importorskip("lm_eval")
transformers = pytest.importorskip("transformers")

from lm_eval import evaluator  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from scaletrain.evaluation.cloze import (  # noqa: E402
    CHOICES,
    NEIGHBOURHOOD,
    PASSAGE_SENTENCES,
    build_items,
    split_sentences,
)
from scaletrain.evaluation.lm_eval_model import ScaletrainLM  # noqa: E402
from scaletrain.evaluation.tasks import task_manager  # noqa: E402

FIXTURES = Path(__file__).parents[1] / "fixtures" / "harness"
ALL_TASKS = ["tiny-choices", "tiny-answers", "tiny-passages"]
BPE = {"data.tokenizer": "bpe", "data.vocab_size": 300}


def _train(run: Path, tiny, **extra) -> Path:
    over = tiny(run, **{"train.steps": 60, **extra})
    assert main(["train"] + [f"--{k}={v}" for k, v in over.items()]) == 0
    return run


def _export(run: Path, out: Path, *flags: str) -> Path:
    assert main(["export", "--run", str(run), "--out", str(out), *flags]) == 0
    return out


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory):
    from helpers.tiny import tiny_overrides

    return _train(tmp_path_factory.mktemp("bpe") / "run", tiny_overrides, **BPE)


@pytest.fixture
def in_fixtures(monkeypatch):
    """The fixture YAMLs name their JSONL relative to the repository root (as docs/evaluation.md runs them), which
    lm-eval (``datasets``) reads from the working folder."""
    monkeypatch.chdir(FIXTURES.parents[2])


def _evaluate(lm, tasks: list[str]) -> dict:
    manager = task_manager(TaskManager, [str(FIXTURES)], tasks)
    return evaluator.simple_evaluate(model=lm, tasks=tasks, task_manager=manager,
                                     log_samples=True, bootstrap_iters=0, verbosity="ERROR")


def assert_matches_hf_backend(run: Path, export: Path, tasks: list[str], texts: list[str], **hf_args) -> dict:
    """Our LM on ``run`` against lm-eval's hf backend on ``export``: the tokenizer loads in transformers and
    encodes as ours; every sample's responses (log-likelihoods within 1e-4, greedy flags, generations) and every
    metric agree. Returns our results."""
    cfg, model, tok, _ = load_run(run)
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(export))
    for text in texts:
        assert hf_tok(text)["input_ids"] == tok.encode(text), text
    ours = _evaluate(ScaletrainLM(model, tok, cfg.model.max_seq_len, batch_size=3), tasks)
    theirs = _evaluate(HFLM(pretrained=str(export), device="cpu", dtype="float32", batch_size=3, **hf_args), tasks)
    for task in tasks:
        assert len(ours["samples"][task]) == len(theirs["samples"][task]) > 0
        for a, b in zip(ours["samples"][task], theirs["samples"][task]):
            for mine, hers in zip(a["resps"], b["resps"]):
                if isinstance(mine[0], str):  # generate_until: the same text
                    assert mine == hers, task
                elif isinstance(mine[0], tuple):  # (log-likelihood, greedy)
                    assert mine[0][0] == pytest.approx(hers[0][0], abs=1e-4) and mine[0][1] == hers[0][1], task
                else:  # rolling: one log-likelihood
                    assert mine[0] == pytest.approx(hers[0], abs=1e-4), task
        for metric, value in theirs["results"][task].items():
            if metric.startswith(("acc", "exact_match")) and "stderr" not in metric:
                assert ours["results"][task][metric] == value, (task, metric)
    return ours


TEXTS = ["ROMEO:\nBut soft, what light through yonder window breaks?", "KING HENRY:\nOnce more unto the breach"]


def test_pretrained_bpe_run_matches_the_hf_backend(bpe_run, tmp_path, in_fixtures):
    """Multiple choice (contexts longer than the 32-token window: truncated from the left as the hf backend
    does), generate_until (greedy, stop at a newline or the EOS) and loglikelihood_rolling (wikitext's kind)."""
    ours = assert_matches_hf_backend(bpe_run, _export(bpe_run, tmp_path / "hf"), ALL_TASKS, TEXTS)
    cfg, _, tok, _ = load_run(bpe_run)
    longest = max(len(tok.encode(json.loads(line)["context"])) for line in (FIXTURES / "choices.jsonl").open())
    assert longest > cfg.model.max_seq_len  # the truncation rule was exercised
    # the model learned something: a generation that is not empty for some prompt
    assert any(s["resps"][0][0] for s in ours["samples"]["tiny-answers"])


def test_char_run_matches_the_hf_backend(tmp_path, tiny, in_fixtures):
    """A char tokenizer (no special tokens) exports a tokenizer transformers loads; multiple choice agrees. The hf
    backend itself cannot start on a tokenizer without BOS and EOS (it decodes its prefix token even where a
    context is given): it is given one, which only a text scored without context would read."""
    run = _train(tmp_path / "char", tiny, **{"train.steps": 20})
    assert_matches_hf_backend(run, _export(run, tmp_path / "hf"), ["tiny-choices"], TEXTS, prefix_token_id=0)


def _finetune(base: Path, run: Path, tiny, method: str) -> Path:
    over = {k: v for k, v in tiny(run, **{"train.steps": 8, "finetune.method": method}).items()
            if not k.startswith("model.")}
    assert main(["finetune", "--from", str(base)] + [f"--{k}={v}" for k, v in over.items()]) == 0
    return run


@pytest.mark.parametrize("method", ["lora", pytest.param("qlora", marks=pytest.mark.slow)])
def test_adapter_run_matches_its_merged_export(bpe_run, tmp_path, tiny, in_fixtures, method):
    """A fine-tune with unmerged adapters (LoRA; QLoRA over its NF4 base) scores as the export of what it trained
    (``export --merge``) does under the hf backend."""
    if method == "qlora":
        pytest.importorskip("torchao")
    run = _finetune(bpe_run, tmp_path / method, tiny, method)
    assert_matches_hf_backend(run, _export(run, tmp_path / "hf", "--merge"), ["tiny-choices", "tiny-answers"], TEXTS)


@pytest.fixture(scope="module")
def chatml_base(tmp_path_factory):
    """A tiny random Llama as a Hugging Face folder with the ChatML fixture tokenizer and its chat template."""
    from helpers.tiny import tiny_chatml_base

    return tiny_chatml_base(tmp_path_factory.mktemp("chatml_base"))


def test_chat_template_matches_the_hf_backend(chatml_base, tmp_path, tiny, in_fixtures):
    """--apply-chat-template: a LoRA fine-tune of a base with a chat template renders the few-shot conversation in
    it (transformers' apply_chat_template, the last answer continued) and scores as the hf backend does."""
    run = _finetune(chatml_base, tmp_path / "lora", tiny, "lora")
    export = _export(run, tmp_path / "hf", "--merge")
    cfg, model, tok, _ = load_run(run)
    ours = ScaletrainLM(model, tok, cfg.model.max_seq_len, batch_size=3)
    history = [{"role": "user", "content": "Who speaks?"}, {"role": "assistant", "content": "The citizen"}]
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(export))
    assert ours.apply_chat_template(history, add_generation_prompt=False) == hf_tok.apply_chat_template(
        history, tokenize=False, continue_final_message=True)
    assert "<|im_start|>assistant" in ours.apply_chat_template(history[:1])
    tasks = ["tiny-choices", "tiny-answers"]
    results = []
    for lm in (ours, HFLM(pretrained=str(export), device="cpu", dtype="float32", batch_size=3)):
        results.append(evaluator.simple_evaluate(
            model=lm, tasks=tasks, task_manager=task_manager(TaskManager, [str(FIXTURES)], tasks), num_fewshot=1,
            apply_chat_template=True, log_samples=True, bootstrap_iters=0, verbosity="ERROR"))
    for task in tasks:
        for a, b in zip(results[0]["samples"][task], results[1]["samples"][task]):
            assert a["arguments"] == b["arguments"] and "<|im_start|>" in str(a["arguments"][0][0])
            for mine, hers in zip(a["resps"], b["resps"]):
                assert mine[0] == hers[0] if isinstance(mine[0], str) else \
                    mine[0][0] == pytest.approx(hers[0][0], abs=1e-4)


@pytest.mark.slow
def test_pruned_run_matches_its_export(bpe_run, tmp_path, in_fixtures):
    out = tmp_path / "wanda"
    assert main(["compress", "--run", str(bpe_run), "--out", str(out), "--prune", "wanda", "--pattern", "2:4",
                 "--calibration-sequences", "8"]) == 0
    assert_matches_hf_backend(out, _export(out, tmp_path / "hf"), ["tiny-choices", "tiny-answers"], TEXTS)


def test_quantized_run_scores_its_own_quantized_model(bpe_run, tmp_path, in_fixtures):
    """A quantized run has no HF export (torchao tensors): its log-likelihoods are its own model's, each request
    computed alone here (no batching, no padding), and differ from the unquantized run's."""
    pytest.importorskip("torchao")
    out = tmp_path / "int8"
    assert main(["compress", "--run", str(bpe_run), "--out", str(out), "--quantize", "int8-weight"]) == 0
    cfg, model, tok, _ = load_run(out)
    lm = ScaletrainLM(model, tok, cfg.model.max_seq_len, batch_size=4)
    samples = _evaluate(lm, ["tiny-choices"])["samples"]["tiny-choices"]
    dense = _evaluate(ScaletrainLM(*load_run(bpe_run)[1:3], cfg.model.max_seq_len), ["tiny-choices"])
    pairs = []
    for sample, dense_sample in zip(samples, dense["samples"]["tiny-choices"]):
        for (context, continuation), resp, dense_resp in zip(sample["arguments"], sample["resps"],
                                                             dense_sample["resps"]):
            ctx, cont = lm._encode_pair(context, continuation)
            ids = torch.tensor([(ctx + cont)[-(lm.max_length + 1):]])
            with torch.no_grad():
                logprobs = model(ids[:, :-1])[0, -len(cont):, :tok.vocab_size].float().log_softmax(-1)
            assert resp[0][0] == pytest.approx(float(logprobs.gather(1, ids[0, -len(cont):, None]).sum()), abs=1e-4)
            pairs.append((resp[0][0], dense_resp[0][0]))
    # int8 rounding moves these tiny (32-wide) blocks' log-likelihoods by ~1e-5 to 1e-3, about what batching moves
    # them: one sum in 32 was seen to land on the dense value bit for bit, so "each differs" was a coin toss. An
    # unquantized model (a no-op quantization) would make every pair equal.
    assert sum(q != d for q, d in pairs) >= 0.8 * len(pairs), pairs


def test_eval_tasks_prints_scores_with_their_settings(bpe_run, tmp_path, in_fixtures, capsys):
    out = tmp_path / "scores.json"
    assert main(["eval", "--run", str(bpe_run), "--tasks", "tiny-choices,tiny-answers", "--include-path",
                 str(FIXTURES), "--limit", "3", "--num-fewshot", "1", "--json", str(out), "--log-samples"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    # --log-samples (lm-eval's --log_samples): each sample's requests and responses, beside --json
    samples = [json.loads(line) for line in (tmp_path / "scores.samples.jsonl").read_text().splitlines()]
    assert f"wrote 6 samples' requests and responses to {tmp_path / 'scores.samples.jsonl'}" in lines
    by_task = {task: [s for s in samples if s["task"] == task] for task in ("tiny-choices", "tiny-answers")}
    assert [s["doc_id"] for s in by_task["tiny-choices"]] == [0, 1, 2] and len(by_task["tiny-answers"]) == 3
    for sample in by_task["tiny-choices"]:  # (log-likelihood, greedy) for each of the four choices
        (loglikelihoods, _greedy) = zip(*(response[0] for response in sample["resps"]))
        assert len(loglikelihoods) == 4 and all(ll < 0 for ll in loglikelihoods)
        assert sample["acc"] == float(loglikelihoods.index(max(loglikelihoods)) == sample["target"])
    assert all(isinstance(s["resps"][0][0], str) and "exact_match" in s for s in by_task["tiny-answers"])
    choices = next(line for line in lines if line.startswith("tiny-choices: "))
    assert "acc " in choices and "acc_norm (per character) " in choices
    assert "(1-shot, limit 3: 3 of 8 samples)" in choices
    answers = next(line for line in lines if line.startswith("tiny-answers: "))
    assert "exact_match " in answers and "(1-shot, limit 3: 3 of 4 samples)" in answers
    report = json.loads(out.read_text())
    task = report["tasks"]["tiny-choices"]
    assert task["num_fewshot"] == 1 and task["limit"] == 3 and task["samples"] == 3
    assert 0 <= task["metrics"]["acc"] <= 1 and "acc_norm" in task["metrics"]
    assert task["metrics"]["acc"] == pytest.approx(sum(s["acc"] for s in by_task["tiny-choices"]) / 3)
    assert report["checkpoint"] and report["lm_eval_version"]
    assert report["samples_file"] == str(tmp_path / "scores.samples.jsonl")


def _refused(capsys, *argv: str) -> str:
    capsys.readouterr()
    assert main(["eval", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_bad_task_arguments_are_one_line(bpe_run, tmp_path, tiny, in_fixtures, capsys):
    run = ["--run", str(bpe_run), "--include-path", str(FIXTURES)]
    err = _refused(capsys, *run, "--tasks", "tiny-choice")
    assert "unknown task 'tiny-choice'" in err and "did you mean tiny-choices" in err
    assert "--limit must be >= 1" in _refused(capsys, *run, "--tasks", "tiny-choices", "--limit", "0")
    assert "--num-fewshot must be >= 0" in _refused(capsys, *run, "--tasks", "tiny-choices", "--num-fewshot", "-1")
    assert "only with --tasks" in _refused(capsys, "--run", str(bpe_run), "--limit", "3")  # else silently ignored
    assert "give one or the other" in _refused(capsys, *run, "--tasks", "tiny-choices", "--text", "x.txt")
    assert "--log-samples: give it a file" in _refused(capsys, *run, "--tasks", "tiny-choices", "--log-samples")
    assert "only with --tasks" in _refused(capsys, "--run", str(bpe_run), "--log-samples", "s.jsonl")
    char = _train(tmp_path / "char", tiny, **{"train.steps": 2})
    err = _refused(capsys, "--run", str(char), "--include-path", str(FIXTURES), "--tasks", "tiny-answers")
    assert "no end-of-text token" in err and "generate_until" in err
    err = _refused(capsys, "--run", str(char), "--include-path", str(FIXTURES), "--tasks", "tiny-passages")
    assert "neither a BOS nor an EOS" in err
    assert "--apply-chat-template" in _refused(capsys, *run, "--tasks", "tiny-choices", "--apply-chat-template")
    # gutenberg-cloze's answers (up to 100 characters) do not fit this char model's 32-token window
    err = _refused(capsys, "--run", str(char), "--tasks", "gutenberg-cloze", "--limit", "5")
    assert "longer than the model's context of 32" in err


def test_a_task_that_needs_the_network_is_refused_offline(bpe_run):
    """arc_easy's data comes from the Hugging Face Hub; with the Hub unreachable (HF_ENDPOINT on a closed port,
    so this holds on a machine with network too) the command says so and names the local route, at once."""
    env = {**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(bpe_run.parent / "hf-home")}
    done = subprocess.run([sys.executable, "-m", "scaletrain", "eval", "--run", str(bpe_run), "--tasks", "arc_easy",
                           "--limit", "2"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    err = done.stderr.strip().splitlines()[-1]
    assert "no network" in err and "--include-path" in err, done.stderr[-2000:]


# -- gutenberg-cloze ------------------------------------------------------------------------------------------

def test_sentences_split_at_ends_and_blank_lines():
    text = "ROMEO:\nBut soft, what light\nthrough yonder window breaks? It is the east.\n\nJULIET:\nAy me!"
    assert split_sentences(text) == ["ROMEO: But soft, what light through yonder window breaks?", "It is the east.",
                                     "JULIET: Ay me!"]


def test_cloze_items_are_deterministic_and_not_given_away_by_length():
    text = (Path(__file__).resolve().parents[2] / "src/scaletrain/assets/tinyshakespeare/input.txt").read_text()
    texts = [text[:40000], text[40000:80000]]
    items = build_items(texts, max_items=200)
    assert items == build_items(texts, max_items=200) and len(items) == 200
    documents = [split_sentences(t) for t in texts]
    where = {s: (d, i) for d, sentences in enumerate(documents) for i, s in enumerate(sentences)}
    labels = [item["label"] for item in items]
    assert set(labels) == set(range(CHOICES)) and max(labels.count(k) for k in range(CHOICES)) < 70
    for item in items:
        answer = item["choices"][item["label"]]
        d, i = where[answer]
        # the answer is the sentence that follows the passage in its document
        passage = " ".join(documents[d][i - PASSAGE_SENTENCES:i])
        assert item["passage"] == passage or any(
            " ".join(ds[j - PASSAGE_SENTENCES:j]) == item["passage"] and ds[j] == answer
            for ds in documents for j in range(PASSAGE_SENTENCES, len(ds)))
        others = [c for k, c in enumerate(item["choices"]) if k != item["label"]]
        assert len(set(others)) == CHOICES - 1 and answer not in others
        for other in others:
            od, oi = where[other]
            assert od != d or abs(oi - i) > NEIGHBOURHOOD
            assert abs(len(other) - len(answer)) <= max(3, 0.25 * len(answer))  # next to it in length
    # length gives nothing away: the answer is the shortest (what a model that only counts characters would pick)
    # and the longest about a quarter of the time each
    for pick in (min, max):
        right = sum(pick(range(CHOICES), key=lambda k: (len(item["choices"][k]), random.random())) == item["label"]
                    for item in items for _ in range(20)) / (20 * len(items))
        assert 0.15 < right < 0.35, (pick, right)


def test_gutenberg_cloze_runs_through_lm_eval(tmp_path, tiny, capsys):
    """Built from the run's val split into its data folder once, then scored by lm-eval's evaluator."""
    run = _train(tmp_path / "char", tiny, **{"train.steps": 20, "model.max_seq_len": 128})
    argv = ["eval", "--run", str(run), "--tasks", "gutenberg-cloze", "--limit", "20"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "gutenberg-cloze: built " in out
    line = next(line for line in out.splitlines() if line.startswith("gutenberg-cloze: acc "))
    assert "(0-shot, limit 20: 20 of " in line
    items = [json.loads(row) for row in
             (Path(str(run) + "-data") / "gutenberg-cloze" / "gutenberg-cloze.jsonl").read_text().splitlines()]
    assert len(items) > 100 and all(len(item["choices"]) == CHOICES for item in items)
    assert main(argv) == 0
    assert "built" not in capsys.readouterr().out  # cached


# -- a local task YAML that is wrong: one line naming the YAML or the data file, exit 2 ---------------------------

@pytest.fixture(scope="module")
def char_run(tmp_path_factory):
    from helpers.tiny import tiny_overrides

    return _train(tmp_path_factory.mktemp("char") / "run", tiny_overrides, **{"train.steps": 2})


CHOICES_YAML = (FIXTURES / "tiny-choices.yaml").read_text()
CHOICES_DATA = (FIXTURES / "choices.jsonl").read_text()


@pytest.mark.parametrize("case, expect", [
    ("missing data", "data file {folder}/absent.jsonl not found (dataset_kwargs.data_files"),
    ("undefined field", "a template (doc_to_text / doc_to_target / doc_to_choice) fails: 'contxt' is undefined (its "
                        "rows have: context, choices, label)"),
    ("bad row", "{folder}/data.jsonl:9: not JSON"),
    ("label out of range", "--tasks tiny-choices: sample 1 (row 2 of its data): label 7 is not one of its 4 choices"),
    ("too many shots", "--num-fewshot 8: tiny-choices has 7 few-shot example(s) (its own samples, less the one "
                       "scored); give at most 7"),
    ("broken yaml", "--include-path: {folder}/tiny-choices.yaml is not valid YAML at line 3, column 1"),
    ("latin-1 yaml", "--include-path: {folder}/tiny-choices.yaml is not UTF-8 (byte "),
])
def test_a_bad_local_task_is_one_line(char_run, tmp_path, capsys, case, expect):
    """Before: FileNotFoundError, jinja's UndefinedError, DatasetGenerationError, IndexError and ValueError
    tracebacks, and a YAML lm-eval could not read reported as an unknown task."""
    folder = tmp_path / "tasks"
    folder.mkdir()
    data, yaml_text, flags = CHOICES_DATA, CHOICES_YAML, []
    if case == "undefined field":
        yaml_text = yaml_text.replace("{{context}}", "{{contxt}}")
    elif case == "bad row":
        data += "{bad\n"
    elif case == "label out of range":
        lines = data.splitlines(keepends=True)
        data = lines[0] + lines[1].replace('"label": 0', '"label": 7') + "".join(lines[2:])
    elif case == "too many shots":
        flags = ["--num-fewshot", "8"]  # 8 samples: each has the 7 others
    elif case == "broken yaml":
        yaml_text = "task: [unclosed\n" + yaml_text
    name = "absent.jsonl" if case == "missing data" else "data.jsonl"
    yaml_text = yaml_text.replace("tests/fixtures/harness/choices.jsonl", str(folder / name))
    (folder / "data.jsonl").write_text(data)
    raw = yaml_text.replace("# A multiple", "# caf\xe9: a multiple")
    (folder / "tiny-choices.yaml").write_bytes(raw.encode("latin-1" if case == "latin-1 yaml" else "utf-8"))
    err = _refused(capsys, "--run", str(char_run), "--tasks", "tiny-choices", "--include-path", str(folder), *flags)
    assert expect.format(folder=folder) in err, err


def test_local_tasks_skip_the_built_in_index():
    """Tasks all in --include-path are indexed from it alone (lm-eval's own ~14,700 files take seconds); a
    built-in name beside them still finds lm-eval's whole index."""
    local = task_manager(TaskManager, [str(FIXTURES)], ["tiny-choices", "tiny-answers"])
    assert set(local.all_tasks) == set(ALL_TASKS)
    mixed = task_manager(TaskManager, [str(FIXTURES)], ["tiny-choices", "arc_easy"])
    assert {"tiny-choices", "arc_easy"} <= set(mixed.all_tasks)
