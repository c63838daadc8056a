"""A base's own tokenizer and chat template (data/tokenizer.py HFTokenizer, data/chat.py, data/instructions.py):
ids equal to transformers' ``apply_chat_template``, the loss on the assistant turns only, the template rule.

The real Qwen3 and Llama 3.1 tokenizers live in ../shared (absent on a fresh clone: those tests skip); the
self-made ChatML tokenizer in tests/fixtures/chatml_tokenizer (a 384-token byte-level BPE, its template in
chat_template.jinja) always runs.
"""

from __future__ import annotations

import io
import json
import shutil
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import torch

from scaletrain.cli import main
from scaletrain.data.chat import encode_conversation, uses_base_template
from scaletrain.data.instructions import chat_prompt, preview, read_instructions, render_prompt, stop_ids
from scaletrain.data.tokenizer import DataError, HFTokenizer, load_tokenizer

transformers = pytest.importorskip("transformers")

FIXTURE = Path(__file__).parents[1] / "fixtures" / "chatml_tokenizer"
SHARED = Path(__file__).resolve().parents[3] / "shared" / "data" / "tokenizers"
needs_shared = pytest.mark.skipif(not (SHARED / "qwen3" / "tokenizer.json").is_file(),
                                  reason="../shared/data/tokenizers not present (fresh clone)")


def _ids(encoded) -> list[int]:
    """``apply_chat_template(tokenize=True)``'s ids: a list in transformers 4, a BatchEncoding in 5."""
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def _target_runs(ids: list[int], target: list[bool], hf) -> list[str]:
    """The text of each maximal run of target tokens."""
    runs, run = [], []
    for token, is_target in zip(ids + [None], target + [False]):
        if is_target:
            run.append(token)
        elif run:
            runs.append(hf.decode(run, clean_up_tokenization_spaces=False))
            run = []
    return runs


def _conversations() -> list[list[dict]]:
    """20 conversations: system prompts, multi-turn, unicode, empty-ish and padded contents, a reasoning block."""
    s = {"role": "system", "content": "You are a terse assistant."}

    def u(text):
        return {"role": "user", "content": text}

    def a(text):
        return {"role": "assistant", "content": text}

    return [
        [u("Hi"), a("Hello.")],
        [s, u("What is 2+2?"), a("4")],
        [u("Name a colour."), a("Blue."), u("Another?"), a("Green.")],
        [s, u("Translate 'cat' to French."), a("chat"), u("And to German?"), a("Katze"), u("Thanks"),
         a("You're welcome!")],
        [u("Écris en français."), a("Voilà, c'est écrit : « bonjour » — très simple.")],
        [u("日本語で挨拶して"), a("こんにちは！元気ですか？")],
        [u("Emoji?"), a("Sure 🙂👍🏽 — done.")],
        [u("Arabic please"), a("مرحبا بالعالم")],
        [u("Say nothing."), a("")],
        [u("Just a space."), a(" ")],
        [u("A newline."), a("\n")],
        [u(""), a("You sent an empty message.")],
        [u("Pad me"), a("  padded on both sides  ")],
        [u("Code?"), a("```python\ndef f(x):\n    return x * 2\n```")],
        [s, u("Lines"), a("one\ntwo\n\nthree")],
        [u("Think first."), a("<think>\nThe user wants a number.\n</think>\n\n42")],
        [u("Q1"), a("<think>\nearlier reasoning\n</think>\n\nA1"), u("Q2"), a("A2")],
        [u("Numbers: 3.14159, 2.71828"), a("Pi and e; their sum is 5.85987.")],
        [s, u("Tabs\tand\tspaces"), a("Noted:\ttabs kept.")],
        [u("Long"), a(" ".join(f"word{i}" for i in range(60)))],
    ]


def _qwen3_expected(messages: list[dict]) -> list[str]:
    """What Qwen3's template makes the model produce per assistant turn (an independent reading of the template):
    turns after the last user message get a <think> block (empty unless the content brings one), earlier ones
    lose their reasoning; each ends with <|im_end|>."""
    last_query = max(i for i, m in enumerate(messages) if m["role"] == "user")
    out = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        content, reasoning = m["content"], ""
        if "</think>" in content:
            reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
            content = content.split("</think>")[-1].lstrip("\n")
        if i > last_query and (i == len(messages) - 1 or reasoning):
            out.append("<think>\n" + reasoning.strip("\n") + "\n</think>\n\n" + content.lstrip("\n") + "<|im_end|>")
        else:
            out.append(content + "<|im_end|>")
    return out


def _llama31_expected(messages: list[dict]) -> list[str]:
    """Llama 3.1's template trims each content and ends a turn with <|eot_id|>."""
    return [m["content"].strip() + "<|eot_id|>" for m in messages if m["role"] == "assistant"]


def _chatml_expected(messages: list[dict]) -> list[str]:
    return [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]


@cache
def _tokenizer(folder: Path) -> HFTokenizer:
    """Each real tokenizer loaded once for the module (a second or two each)."""
    return load_tokenizer(folder / "tokenizer.json")


def _check_family(folder: Path, expected) -> None:
    tokenizer = _tokenizer(folder)
    assert isinstance(tokenizer, HFTokenizer) and tokenizer.has_chat_template
    hf = tokenizer.transformers_tokenizer()
    for messages in _conversations():
        ids, target = encode_conversation(messages, hf)
        assert ids == _ids(hf.apply_chat_template(messages, tokenize=True)), messages
        assert _target_runs(ids, target, hf) == expected(messages), messages


@needs_shared
@pytest.mark.parametrize("family, expected", [("qwen3", _qwen3_expected), ("llama3_1", _llama31_expected)])
def test_real_templates_give_transformers_ids_and_mask_the_assistant_turns(family, expected):
    _check_family(SHARED / family, expected)


def test_chatml_fixture_gives_transformers_ids_and_masks_the_assistant_turns():
    _check_family(FIXTURE, _chatml_expected)


@needs_shared
@pytest.mark.parametrize("family", ["qwen3", "llama3_1"])
def test_special_tokens_are_the_folders_own(family):
    """BOS/EOS as transformers reads them, and encoding as transformers encodes (Llama 3 adds its BOS)."""
    tokenizer = _tokenizer(SHARED / family)
    hf = tokenizer.transformers_tokenizer()
    assert (tokenizer.eos_id, tokenizer.bos_id) == (hf.eos_token_id, hf.bos_token_id)
    for text in ["Hello world", "  héllo\n\nwörld 日本語 🙂", "<|im_start|>user\nhi<|im_end|>"]:
        assert tokenizer.encode(text) == hf(text)["input_ids"]
    assert tokenizer.prefix_ids() == ([hf.bos_token_id] if family == "llama3_1" else [])


@needs_shared
@pytest.mark.parametrize("family, ends", [("qwen3", ["<|im_end|>", "<|endoftext|>"]),
                                          ("llama3_1", ["<|eot_id|>", "<|end_of_text|>"])])
def test_generation_stops_at_every_end_of_turn_of_the_family(family, ends):
    """The template's end of turn first (also each folder's eos_token), then the family's other ends: Llama 3's
    <|end_of_text|> (this vocabulary has no <|eom_id|>), Qwen's <|endoftext|> (issue 49: generation stopped at
    the first only)."""
    hf = _tokenizer(SHARED / family).transformers_tokenizer()
    assert stop_ids(SHARED / family) == hf.convert_tokens_to_ids(ends)
    assert stop_ids(SHARED / family, chat_template="plain") == hf.convert_tokens_to_ids(ends)


@needs_shared
def test_plain_template_puts_one_bos_first_with_llama3(tmp_path):
    """The plain template encodes an example in pieces: Llama 3's BOS (its post-processor's) comes once, first."""
    tokenizer = _tokenizer(SHARED / "llama3_1")
    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps({"prompt": "Hi", "response": "Hello."}) + "\n")
    (ids, target), = read_instructions(data, tokenizer, chat_template="plain")
    assert ids[0] == tokenizer.bos_id and (ids == tokenizer.bos_id).sum() == 1
    answer = ids[target].tolist()
    assert tokenizer.decode(answer) == "Hello." and answer[-1] == tokenizer.eos_id  # then the folder's EOS


def test_fixture_special_tokens_and_template_file():
    tokenizer = load_tokenizer(FIXTURE / "tokenizer.json")
    hf = tokenizer.transformers_tokenizer()
    assert tokenizer.eos_id == hf.eos_token_id == hf.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.bos_id is None and tokenizer.prefix_ids() == []
    assert "chat_template" not in json.loads((FIXTURE / "tokenizer_config.json").read_text())  # in the .jinja file
    assert hf.chat_template == (FIXTURE / "chat_template.jinja").read_text()


def _without_template(tmp_path) -> Path:
    folder = tmp_path / "no_template"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FIXTURE / name, folder / name)
    return folder


def test_template_rule(tmp_path):
    with_template = load_tokenizer(FIXTURE / "tokenizer.json")
    without = load_tokenizer(_without_template(tmp_path) / "tokenizer.json")
    assert uses_base_template(with_template, "auto") and uses_base_template(with_template, "base")
    assert not uses_base_template(with_template, "plain")
    assert not uses_base_template(without, "auto") and not uses_base_template(without, "plain")
    with pytest.raises(DataError, match=r"finetune.chat_template = 'base' but .*no_template/tokenizer_config.json "
                                        r"has no chat_template"):
        uses_base_template(without, "base")


def test_prompt_response_lines_are_user_assistant_turns_in_the_template(tmp_path):
    data = tmp_path / "mixed.jsonl"
    data.write_text(json.dumps({"prompt": "Who?", "response": "Romeo."}) + "\n"
                    + json.dumps({"messages": [{"role": "user", "content": "Who?"},
                                               {"role": "assistant", "content": "Romeo."}]}) + "\n")
    tokenizer = load_tokenizer(FIXTURE / "tokenizer.json")
    (ids_a, target_a), (ids_b, target_b) = read_instructions(data, tokenizer)
    assert np.array_equal(ids_a, ids_b) and np.array_equal(target_a, target_b)
    hf = tokenizer.transformers_tokenizer()
    assert hf.decode(ids_a[target_a].tolist()) == "Romeo.<|im_end|>"
    plain_ids, plain_target = read_instructions(data, tokenizer, chat_template="plain")[0]
    assert tokenizer.decode(plain_ids.tolist()).startswith("Instruction:\nWho?")
    answer = plain_ids[plain_target].tolist()
    assert tokenizer.decode(answer) == "Romeo." and answer[-1] == tokenizer.eos_id  # the folder's EOS ends it


def test_render_prompt_is_the_training_template(tmp_path):
    messages = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hello there"}]
    hf = load_tokenizer(FIXTURE / "tokenizer.json").transformers_tokenizer()
    want = _ids(hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    assert render_prompt(messages, FIXTURE) == want
    assert hf.decode(want).endswith("<|im_start|>assistant\n")
    assert render_prompt(messages, FIXTURE, add_generation_prompt=False) == _ids(
        hf.apply_chat_template(messages, tokenize=True))
    plain = load_tokenizer(FIXTURE / "tokenizer.json")
    assert render_prompt(messages, FIXTURE, chat_template="plain") == chat_prompt(messages, plain)
    no_template = _without_template(tmp_path)
    assert render_prompt(messages, no_template) == chat_prompt(messages, plain)  # auto: ours
    with pytest.raises(DataError, match="has no chat_template"):
        render_prompt(messages, no_template, chat_template="base")


def test_stop_ids_follow_the_template(tmp_path):
    """A template whose turns close with a token other than the EOS (as Gemma's <end_of_turn>): both stop."""
    folder = tmp_path / "eos_apart"
    shutil.copytree(FIXTURE, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|endoftext|>"}))
    hf = load_tokenizer(folder / "tokenizer.json").transformers_tokenizer()
    end, eos = hf.convert_tokens_to_ids("<|im_end|>"), hf.convert_tokens_to_ids("<|endoftext|>")
    assert stop_ids(folder) == [end, eos]
    assert stop_ids(folder, chat_template="plain") == [eos, end]  # the vocabulary's other end too


def test_preview_brackets_the_targets(tmp_path):
    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"},
                                             {"role": "assistant", "content": "Hello."}]}) + "\n")
    assert preview(FIXTURE, data) == ("--- example 1 ---\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
                                      "[Hello.<|im_end|>]\n")


# -- end to end: a fine-tune on messages with a base that has a chat template ---------------------------------

@pytest.fixture(scope="module")
def chatml_base(tmp_path_factory):
    """A tiny random Llama exported as a Hugging Face folder, with the ChatML fixture as its tokenizer."""
    from helpers.tiny import tiny_chatml_base

    return tiny_chatml_base(tmp_path_factory.mktemp("chatml_base"))


def _finetune(base: Path, run: Path, tiny, data: Path, **extra) -> list[str]:
    over = tiny(run, **{"train.steps": 6, "finetune.instructions": str(data), "data.seq_len": 64,
                        "data.val_fraction": 0.2, "optim.lr": 0.01, "train.eval_interval": 6, **extra})
    for key in [k for k in over if k.startswith("model.")]:
        over.pop(key)  # the model comes from the base
    return ["finetune", "--from", str(base)] + [f"--{k}={v}" for k, v in over.items()]


def test_finetune_on_messages_with_the_bases_template(chatml_base, tmp_path, tiny, capsys):
    data = tmp_path / "chat.jsonl"
    turns = [("Who speaks first?", "The citizen."), ("What do they want?", "Corn at their own rates."),
             ("Whom do they blame?", "Caius Marcius."), ("Is it agreed?", "Agreed, agreed."),
             ("Where are we?", "In Rome, a street.")]
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                     {"role": "assistant", "content": a}]}) + "\n"
                            for q, a in turns * 2))
    run = tmp_path / "run"
    assert main(_finetune(chatml_base, run, tiny, data)) == 0
    losses = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("val_loss" in r and np.isfinite(r["val_loss"]) for r in losses)
    # the run keeps its base's tokenizer files, so generation renders prompts in the same template
    assert (run / "chat_template.jinja").read_text() == (FIXTURE / "chat_template.jinja").read_text()
    messages = [{"role": "user", "content": "Who speaks first?"}]
    assert render_prompt(messages, run) == render_prompt(messages, chatml_base)
    # asking for the base's template with a base that has none: one line, exit 2
    (chatml_base / "chat_template.jinja").rename(tmp_path / "moved.jinja")
    try:
        capsys.readouterr()
        assert main(_finetune(chatml_base, tmp_path / "refused", tiny, data,
                              **{"finetune.chat_template": "base"})) == 2
        err = capsys.readouterr().err.strip()
        assert "finetune.chat_template = 'base' but" in err and "tokenizer_config.json has no chat_template" in err
        assert len(err.splitlines()) == 1
    finally:
        (tmp_path / "moved.jinja").rename(chatml_base / "chat_template.jinja")


def test_chat_and_generate_render_in_the_runs_template(chatml_base, tmp_path, tiny, capsys):
    """A run fine-tuned with its base's template talks in it: ``chat`` and a ``messages`` line of ``generate
    --prompts-file`` render the conversation as training did and stop at the template's end of turn."""
    from scaletrain.infer.chat import Chat, conversation_format
    from scaletrain.infer.load import load_run
    from scaletrain.model.generate import Sampling

    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Question {i}?"},
                                                     {"role": "assistant", "content": f"Answer {i}."}]}) + "\n"
                            for i in range(10)))
    run = tmp_path / "run"
    assert main(_finetune(chatml_base, run, tiny, data)) == 0
    cfg, model, tokenizer, _ = load_run(run)
    fmt = conversation_format(run, tokenizer, cfg.finetune.chat_template)
    render, ends = fmt.render, fmt.stop_ids
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Question 3?"}]
    hf = _tokenizer(FIXTURE).transformers_tokenizer()
    expected = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert render(messages) == _ids(expected)
    assert ends[0] == hf.convert_tokens_to_ids("<|im_end|>") and tokenizer.eos_id in ends
    chat = Chat(model, tokenizer, cfg.data.seq_len, Sampling(temperature=0.0), 8, [], torch.Generator(),
                system="Be brief.", conversation=fmt)
    chat.history.append({"role": "user", "content": "Question 3?"})
    assert chat.prompt_ids(io.StringIO()) == _ids(expected)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"messages": messages}) + "\n" + json.dumps({"prompt": "Question"}) + "\n")
    capsys.readouterr()
    assert main(["generate", "--run", str(run), "--prompts-file", str(prompts), "--max-tokens", "6",
                 "--temperature", "0"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [sorted(r) for r in lines] == [["completion", "messages"], ["completion", "prompt"]]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user"}]}) + "\n")
    assert main(["generate", "--run", str(run), "--prompts-file", str(bad)]) == 2
    assert f"{bad}:1: message 1 must be {{'role': system|user|assistant, 'content': str}}" in capsys.readouterr().err


# -- the Hub's layouts: Alpaca and ShareGPT (data/layouts.py) ------------------------------------------------
LAYOUTS = Path(__file__).parents[1] / "fixtures"


def _same_examples(a: list, b: list) -> bool:
    return len(a) == len(b) and all(np.array_equal(x[0], y[0]) and np.array_equal(x[1], y[1]) for x, y in zip(a, b))


@pytest.mark.parametrize("chat_template", ["auto", "plain"])
def test_alpaca_lines_are_prompt_response_pairs_with_the_input_after_the_instruction(tmp_path, chat_template):
    tokenizer = load_tokenizer(FIXTURE / "tokenizer.json")
    lines = [json.loads(line) for line in (LAYOUTS / "alpaca.jsonl").read_text().splitlines()]
    ours = tmp_path / "ours.jsonl"
    ours.write_text("".join(json.dumps({"prompt": f"{r['instruction']}\n\n{r['input']}" if r.get("input")
                                        else r["instruction"], "response": r["output"]}) + "\n" for r in lines))
    alpaca = read_instructions(LAYOUTS / "alpaca.jsonl", tokenizer, chat_template)
    assert _same_examples(alpaca, read_instructions(ours, tokenizer, chat_template))
    ids, target = alpaca[1]  # "input": "Romeo, Juliet, Hamlet, Tybalt"
    text = tokenizer.transformers_tokenizer().decode(ids.tolist())
    assert "Identify the odd one out.\n\nRomeo, Juliet, Hamlet, Tybalt" in text
    assert tokenizer.transformers_tokenizer().decode(ids[target].tolist()).startswith("Hamlet: the other three")


def test_sharegpt_lines_are_messages_with_human_and_gpt_as_user_and_assistant(tmp_path):
    tokenizer = load_tokenizer(FIXTURE / "tokenizer.json")
    role = {"human": "user", "gpt": "assistant", "system": "system"}
    lines = [json.loads(line) for line in (LAYOUTS / "sharegpt.jsonl").read_text().splitlines()]
    ours = tmp_path / "ours.jsonl"
    ours.write_text("".join(json.dumps({"messages": [{"role": role[t["from"]], "content": t["value"]}
                                                     for t in r["conversations"]]}) + "\n" for r in lines))
    sharegpt = read_instructions(LAYOUTS / "sharegpt.jsonl", tokenizer)
    assert len(sharegpt) == 3 and _same_examples(sharegpt, read_instructions(ours, tokenizer))
    ids, target = sharegpt[1]  # a system turn and two gpt answers
    hf = tokenizer.transformers_tokenizer()
    assert _target_runs(ids.tolist(), target.tolist(), hf) == ["To hear him speak.<|im_end|>",
                                                               "Speak, speak.<|im_end|>"]


@pytest.mark.parametrize("line, message", [
    ({"conversations": [{"from": "human", "value": "Hi"}, {"from": "tool", "value": "x"}]},
     ":2: conversation turn 2 must be {'from': system|human|gpt, 'value': str}"),
    ({"conversations": [{"from": "human", "value": "Hi"}]}, ":2: 'conversations' has no gpt turn to learn from"),
    ({"instruction": "Hi", "input": 3, "output": "Yes."}, ":2: Alpaca's 'input' must be a string (got int)"),
    ({"question": "Hi", "answer": "Yes."}, ":2: needs string fields 'prompt' and 'response', a 'messages' list"),
])
def test_a_bad_hub_layout_line_is_one_line_naming_it(tmp_path, line, message):
    bad = tmp_path / "bad.jsonl"
    first = ({"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Yes."}]}
             if "conversations" in line else {"instruction": "Hi", "output": "Yes."})
    bad.write_text(json.dumps(first) + "\n" + json.dumps(line) + "\n")
    with pytest.raises(DataError) as err:
        read_instructions(bad, load_tokenizer(FIXTURE / "tokenizer.json"))
    assert str(err.value).startswith(f"{bad}{message}"), str(err.value)
    if "question" in line:
        assert "(fields: question, answer)" in str(err.value)


def test_a_file_that_mixes_layouts_is_refused_naming_the_first_odd_line(tmp_path):
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text((LAYOUTS / "alpaca.jsonl").read_text() + (LAYOUTS / "sharegpt.jsonl").read_text())
    with pytest.raises(DataError, match=rf"^{mixed}:5: a line in the ShareGPT layout, but the file's first example "
                                        rf"\({mixed}:1\) is in the Alpaca layout; one file holds one layout"):
        read_instructions(mixed, load_tokenizer(FIXTURE / "tokenizer.json"))


def test_instruction_jsonl_with_a_bom_or_not_utf8_reads_as_prepare_reads_it(tmp_path):
    tokenizer = load_tokenizer(FIXTURE / "tokenizer.json")
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"prompt": "Caf\u00e9?", "response": "Oui."}, ensure_ascii=False) + "\n")
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())  # what Windows editors write
    assert _same_examples(read_instructions(bom, tokenizer), read_instructions(plain, tokenizer))
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(b"\n" + plain.read_text().encode("latin-1"))
    with pytest.raises(DataError, match=rf"^{latin1}:2: not UTF-8 at byte 16 of the file; it reads as Windows-1252 "
                                        r"\(Latin-1\) text: convert it: iconv -f CP1252 -t UTF-8"):
        read_instructions(latin1, tokenizer)
    utf16 = tmp_path / "utf16.jsonl"
    utf16.write_bytes(plain.read_text().encode("utf-16"))
    with pytest.raises(DataError, match=rf"^finetune.instructions: {utf16}: UTF-16 text, not UTF-8; convert it"):
        read_instructions(utf16, tokenizer)
