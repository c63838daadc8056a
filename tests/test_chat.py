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
from scaletrain.checkpoint.run import load_run
from scaletrain.cli import main


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
    (["--repetition-penalty", "0"], "--repetition-penalty > 0"),
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
