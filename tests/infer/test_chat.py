"""`scaletrain generate` (stream, stop strings, prompts file) and `scaletrain chat` driven through a pipe, on a
tiny trained run; bad input is one line and exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from helpers.tiny import tiny_overrides
from helpers.waits import CEILING_S
from scaletrain.cli import main
from scaletrain.infer.load import load_run


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run = tmp_path_factory.mktemp("chat") / "run"
    overrides = tiny_overrides(run, **{"train.steps": 10, "model.max_seq_len": 64, "data.seq_len": 64})
    assert main(["train"] + [f"--{k}={v}" for k, v in overrides.items()]) == 0
    return run


def test_generate_stream_equals_batch_and_stops(run, capsys):
    base = ["generate", "--run", str(run), "--prompt", "ROMEO:", "--max-tokens", "40", "--temperature", "0"]
    assert main(base) == 0
    plain = capsys.readouterr().out
    assert main(base + ["--stream"]) == 0
    assert capsys.readouterr().out == plain
    stop = plain[len("ROMEO:") + 10:len("ROMEO:") + 12]
    assert main(base + ["--stream", "--stop", stop]) == 0
    streamed = capsys.readouterr().out
    assert main(base + ["--stop", stop]) == 0
    assert capsys.readouterr().out == streamed
    assert streamed.rstrip("\n") == plain[:plain.index(stop, len("ROMEO:"))]


def test_prompts_file_batched_equals_each_alone(run, tmp_path, capsys):
    prompts = ["ROMEO:", "A", "JULIET: what light", "KING"]
    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps({"prompt": p, "id": i}) + "\n" for i, p in enumerate(prompts)))
    out = tmp_path / "out" / "completions.jsonl"
    argv = ["generate", "--run", str(run), "--max-tokens", "25", "--temperature", "0"]
    assert main(argv + ["--prompts-file", str(src), "--out", str(out), "--batch-size", "3"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == [0, 1, 2, 3]
    capsys.readouterr()
    for row in rows:
        assert main(argv + ["--prompt", row["prompt"]]) == 0
        assert capsys.readouterr().out == row["prompt"] + row["completion"] + "\n"


def test_chat_through_a_pipe(run):
    script = ("hello there\nhow are you today, tell me everything you know\n/reset\n/system be brief\nagain\n"
              "/exit\nnot read\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "scaletrain", "chat", "--run", str(run), "--max-tokens", "24",
                           "--temperature", "0"], input=script, capture_output=True, text=True, env=env,
                          timeout=CEILING_S)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "(dropped the 1 oldest turn to stay within the model's 64-token context)" in out
    assert out.index("(dropped") < out.index("(conversation reset)") < out.index("(system message set)")
    assert len(out.splitlines()) >= 3 + 3  # three notes and three answers (each ends its line; may be empty)
    assert proc.stderr == ""


@pytest.mark.parametrize("argv,message", [
    (["--prompt", "x" * 65], "longer than the model's context of 64 tokens"),
    (["--stop", ""], "--stop: a stop string must not be empty"),
    (["--repetition-penalty", "0"], "--repetition-penalty must be a finite number > 0"),
    (["--temperature", "nan"], "--temperature must be a finite number >= 0 (0 = greedy) (got nan)"),
    (["--temperature", "inf"], "--temperature must be a finite number >= 0"),
    (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
    (["--top-k", "-1"], "--top-k must be a finite number >= 0"),
    (["--top-p", "1.5"], "--top-p must be a finite number in (0, 1]"),
    (["--top-p", "nan"], "--top-p must be a finite number in (0, 1]"),
    (["--repetition-penalty", "nan"], "--repetition-penalty must be a finite number > 0"),
    # 16 x the 64-token context: past it each token is a whole window's forward (it ran for hours, silently)
    (["--max-tokens", "1000000000"], "--max-tokens 1,000,000,000 is more than 16 x the model's context of 64"),
])
def test_bad_generate_input_is_one_line(run, argv, message, capsys):
    assert main(["generate", "--run", str(run)] + argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_a_too_long_prompt_in_a_prompts_file_is_named(run, tmp_path, capsys):
    src = tmp_path / "prompts.jsonl"
    src.write_text(json.dumps({"prompt": "ROMEO:"}) + "\n" + json.dumps({"prompt": "x" * 65}) + "\n")
    assert main(["generate", "--run", str(run), "--prompts-file", str(src), "--out", str(tmp_path / "o.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "prompt 2 is 65 tokens; it must be 1 to 64" in err and err.count("\n") == 1
    assert not (tmp_path / "o.jsonl").exists()


def test_the_plain_template_of_a_run_without_an_eos_ends_answers_at_a_blank_line(run):
    """The run's own format (what `scaletrain chat` passes) keeps the plain template's end text: a char tokenizer
    has no EOS, so "\\n\\n" ends an answer, as with no format given."""
    from scaletrain.infer.chat import Chat, conversation_format
    from scaletrain.model.generate import Sampling

    cfg, model, tokenizer, _ = load_run(run)
    fmt = conversation_format(run, tokenizer, cfg.finetune.chat_template)
    assert tokenizer.eos_id is None and (fmt.stop_ids, fmt.stop_texts) == ([], ["\n\n"])
    args = (model, tokenizer, cfg.data.seq_len, Sampling(temperature=0.0), 8, ["STOP"], torch.Generator())
    assert Chat(*args, conversation=fmt).stops == Chat(*args).stops == ["STOP", "\n\n"]


def test_chat_refuses_a_nan_temperature_in_one_line(run, capsys):
    assert main(["chat", "--run", str(run), "--temperature", "nan"]) == 2
    err = capsys.readouterr().err
    assert "--temperature must be a finite number >= 0" in err and err.count("\n") == 1


@pytest.mark.parametrize("line,message", [
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "message 1 has role 'wizard'; it must be one of system, "
                                                          "user, assistant"),
    ({"messages": [{"role": "user", "content": 3}]}, "message 1 must be {'role'"),
])
def test_a_prompts_file_message_of_unknown_role_is_refused_as_finetune_refuses_it(run, tmp_path, capsys, line,
                                                                                   message):
    """Before, a "wizard" message was dropped and only the assistant header generated from (exit 0)."""
    src = tmp_path / "prompts.jsonl"
    src.write_text(json.dumps({"prompt": "A"}) + "\n" + json.dumps(line) + "\n")
    assert main(["generate", "--run", str(run), "--prompts-file", str(src)]) == 2
    err = capsys.readouterr().err
    assert f"{src}:2: {message}" in err and err.count("\n") == 1
    from scaletrain.data.instructions import _conversation  # fine-tuning's reader: the same rule, the same words
    from scaletrain.data.tokenizer import DataError
    with pytest.raises(DataError, match="has role 'wizard'" if "wizard" in message else "must be"):
        _conversation({"messages": line["messages"] + [{"role": "assistant", "content": "x"}]}, "f.jsonl:2")


def test_prompt_beside_a_prompts_file_is_refused(run, tmp_path, capsys):
    src = tmp_path / "prompts.jsonl"
    src.write_text(json.dumps({"prompt": "A"}) + "\n")
    assert main(["generate", "--run", str(run), "--prompts-file", str(src), "--prompt", "ROMEO"]) == 2
    err = capsys.readouterr().err
    assert "--prompt and --prompts-file are two sources of prompts: give one" in err and err.count("\n") == 1


@pytest.mark.parametrize("content,message", [
    (b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)), "looks binary (NUL bytes or a binary signature)"),
    ('{"prompt": "A"}\n'.encode("utf-16"), "UTF-16 text, not UTF-8; convert it: iconv -f UTF-16 -t UTF-8"),
    (b'{"prompt": "caf\xe9"}\n', "not UTF-8 at byte 15; it reads as Windows-1252 (Latin-1) text: convert it: "
                                 "iconv -f CP1252 -t UTF-8"),
])
def test_a_prompts_file_that_is_not_utf8_text_is_one_line(run, tmp_path, capsys, content, message):
    src = tmp_path / "prompts.jsonl"
    src.write_bytes(content)
    assert main(["generate", "--run", str(run), "--prompts-file", str(src)]) == 2
    err = capsys.readouterr().err
    assert f"{src}: {message}" in err and err.count("\n") == 1


def test_generate_stops_at_the_context_unless_told_to_slide(run, capsys):
    """By default every token is one cached step: generation ends when prompt + new tokens fill the context (64),
    and says so; --slide goes on past it (each token a whole window's forward)."""
    argv = ["generate", "--run", str(run), "--prompt", "ROMEO:", "--max-tokens", "100", "--temperature", "0"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert len(out) == 64 + 1 + 1  # the whole context (6 prompt + 59 new characters), and the newline
    assert err.strip() == "(stopped at the model's 64-token context: 6 prompt + 59 new tokens; --slide goes on past it)"
    assert main(argv + ["--slide"]) == 0
    slid, err = capsys.readouterr()
    assert len(slid) == 6 + 100 + 1 and slid.startswith(out.rstrip("\n")) and err == ""


def test_chat_refuses_bytes_that_are_not_utf8_with_a_bpe_tokenizer():
    """Bytes that are not UTF-8 reach chat as surrogates (stdin's surrogateescape); a BPE tokenizer raised a
    TypeError on them. Now the message is not sent, in one line, and the conversation goes on."""
    import io

    from scaletrain.config import ModelConfig
    from scaletrain.data.tokenizer import BPETokenizer
    from scaletrain.infer.chat import Chat
    from scaletrain.model import build_model
    from scaletrain.model.generate import Sampling

    tokenizer = BPETokenizer.train(["User: hello there\n\nAssistant: hi\n\n"] * 4, vocab_size=300)
    model = build_model(ModelConfig(vocab_size=tokenizer.vocab_size, dim=16, n_layers=1, n_heads=2,
                                    ffn_hidden_dim=32, max_seq_len=64), seed=0)
    chat = Chat(model, tokenizer, 64, Sampling(temperature=0.0), 4, [], torch.Generator())
    out = io.StringIO()
    chat.loop(io.StringIO("caf\udce9 au lait\nhello\n"), out)
    lines = out.getvalue().splitlines()
    assert lines[0] == "(not sent: the message is not UTF-8 text (byte 0xe9))"
    assert [m["role"] for m in chat.history] == ["user", "assistant"] and chat.history[0]["content"] == "hello"


def test_chat_with_the_compiled_decode_answers_as_eager_with_one_cache_for_every_turn(run, monkeypatch, capsys):
    """`chat --compile`: a static cache of the whole context, so the growing conversation keeps one cache shape
    (one compiled step) and the greedy answers are eager's."""
    import io

    from scaletrain.infer.chat import Chat
    from scaletrain.infer.cli import compiled_decoder
    from scaletrain.model.generate import Sampling

    cfg, model, tokenizer, _ = load_run(run)
    decoder = compiled_decoder(model, str(run), capacity=cfg.data.seq_len)
    answers = {}
    for name, dec in (("eager", None), ("compiled", decoder)):
        chat = Chat(model, tokenizer, cfg.data.seq_len, Sampling(temperature=0.0), 12, [], torch.Generator(),
                    decoder=dec)
        answers[name] = [chat.answer(text, io.StringIO()) for text in ("hello", "and you", "tell me more")]
    assert answers["compiled"] == answers["eager"]
    assert list(decoder._caches) == [(1, cfg.data.seq_len)]  # every turn reused the one cache shape
    # the command line: `chat --compile` answers what plain `chat` answers
    outputs = []
    for flags in ([], ["--compile"]):
        monkeypatch.setattr(sys, "stdin", io.StringIO("hello\nand you\n"))
        assert main(["chat", "--run", str(run), "--temperature", "0", "--max-tokens", "12", *flags]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and outputs[0].strip()
