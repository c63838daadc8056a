"""Bits per byte and sliding-window perplexity (docs/evaluation.md): the byte count of every kind of tokenizer,
the windows of the Hugging Face perplexity guide, training's val_bpb equal to `scaletrain eval`'s and to a direct
per-token computation, WikiText-2's word count, the same numbers from transformers on the export (a BPE run and a
char run), and bad text input refused in one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from scaletrain.cli import main
from scaletrain.data.loader import eval_batches
from scaletrain.data.run_data import data_cache_dir
from scaletrain.data.sources import resolve_source
from scaletrain.data.tokenizer import BPETokenizer, CharTokenizer, load_tokenizer, token_byte_lengths
from scaletrain.infer.load import load_run
from scaletrain.train.evaluate import sliding_window_nll, sliding_windows, wikitext_words

ROOT = Path(__file__).resolve().parents[2]
SHAKESPEARE = (ROOT / "src/scaletrain/assets/tinyshakespeare/input.txt").read_text(encoding="utf-8")
UNICODE = "Ça va? «Très» bien — 日本語, emoji 🙂, ‘quotes’ and e\u0301 (combining).\n"


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


# -- bytes per token ---------------------------------------------------------------------------------------------

def test_token_bytes_sum_to_the_utf8_bytes_of_the_text():
    """Summing the table over a text's ids gives its UTF-8 length: char tokens, and byte-level BPE tokens that
    hold parts of a character (the 4-byte emoji, the 3-byte CJK) and that a one-by-one decode would miscount."""
    text = SHAKESPEARE[:20000] + UNICODE * 3
    char = CharTokenizer.train([text])
    assert token_byte_lengths(char)[char.encode(text)].sum() == len(text.encode("utf-8"))
    bpe = BPETokenizer.train([SHAKESPEARE[:200000], UNICODE], vocab_size=400)
    ids = bpe.encode(text)
    assert token_byte_lengths(bpe)[ids].sum() == len(text.encode("utf-8"))
    partial = [i for i in set(ids) if "\ufffd" in bpe.decode([i])]  # tokens that are parts of a character
    assert partial and all(token_byte_lengths(bpe)[i] >= 1 for i in partial)


def test_special_tokens_have_no_bytes(tmp_path):
    """BOS/EOS/pad stand for no text: 0 bytes (what the end-of-text token appended after each document
    costs in nats is counted, its bytes are not: docs/evaluation.md)."""
    bpe = BPETokenizer.train([SHAKESPEARE[:50000]], vocab_size=300)
    table = token_byte_lengths(bpe)
    assert table[bpe.eos_id] == table[bpe.bos_id] == 0
    assert (table[[i for i in range(bpe.vocab_size) if i not in (0, 1, 2)]] >= 1).all()
    bpe.save(tmp_path / "tokenizer.json")  # reloaded from the file, as a run reads it: the same table
    assert (token_byte_lengths(load_tokenizer(tmp_path / "tokenizer.json")) == table).all()


# -- windows -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n, context, stride", [(100, 16, 8), (100, 16, 16), (100, 16, 5), (10, 16, 8), (17, 16, 8),
                                                (18, 16, 8), (2, 4, 1)])
def test_every_token_but_the_first_is_scored_once_with_the_most_context(n, context, stride):
    scored = []
    for begin, end, first in sliding_windows(n, context, stride):
        assert end - begin <= context + 1 and begin < first <= end
        scored += [(p, p - begin) for p in range(first, end)]  # (target position, tokens of context it sees)
    assert [p for p, _ in scored] == list(range(1, n))
    # Once the first window is passed, a target sees at least context - stride + 1 tokens; never more than context.
    assert all(min(p, context - stride + 1) <= seen <= context for p, seen in scored)


def test_sliding_window_nll_is_each_targets_loss_under_its_own_context():
    """A brute-force reference: each target scored by its own forward over exactly the tokens its window gives it."""
    from scaletrain.config import ModelConfig
    from scaletrain.model import build_model

    model = build_model(ModelConfig(vocab_size=20, dim=16, n_layers=1, n_heads=2, ffn_hidden_dim=32,
                                    max_seq_len=16), seed=0).eval()
    tokens = torch.randint(0, 20, (40,), generator=torch.Generator().manual_seed(0))
    nll, count, windows = sliding_window_nll(model, tokens, context=12, stride=5, batch_size=3)
    expected = 0.0
    with torch.no_grad():
        for begin, end, first in sliding_windows(40, 12, 5):
            for p in range(first, end):
                logits = model(tokens[begin:p].unsqueeze(0))[0, -1]
                expected += float(F.cross_entropy(logits, tokens[p]))
    assert count == 39 and windows == len(sliding_windows(40, 12, 5)) == 7  # 6 full, 1 short: two batch shapes
    assert nll == pytest.approx(expected, rel=1e-5)


def test_wikitext2_word_count_is_merity_et_al():
    """The classic count (whitespace tokens + one <eos> per line): 217,646 for the validation split, 245,569
    for the test split, as in Merity et al. 2016, Table 1."""
    valid = resolve_source("builtin:wikitext-2").read_text(encoding="utf-8")
    assert wikitext_words(valid) == 217_646
    assert wikitext_words(resolve_source("builtin:wikitext-2-test").read_text(encoding="utf-8")) == 245_569
    assert wikitext_words("a b\n\nc") == 6  # "a b <eos>", "<eos>", "c <eos>"


# -- training's val_bpb, eval's, and a direct computation --------------------------------------------------------

@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory):
    """A tiny BPE run (300 tokens) trained a few steps: a BPE token is several bytes, so bpb is not loss / ln 2."""
    from helpers.tiny import tiny_overrides

    run = tmp_path_factory.mktemp("bpe") / "run"
    over = tiny_overrides(run, **{"train.steps": 6, "train.eval_batches": 3, "data.tokenizer": "bpe",
                                  "data.vocab_size": 300})
    assert main(["train"] + [f"--{k}={v}" for k, v in over.items()]) == 0
    return run


@pytest.fixture(scope="module")
def char_run(tmp_path_factory):
    from helpers.tiny import tiny_overrides

    run = tmp_path_factory.mktemp("char") / "run"
    assert main(["train"] + [f"--{k}={v}" for k, v in tiny_overrides(run, **{"train.steps": 6}).items()]) == 0
    return run


def direct_val_bpb(run: Path) -> tuple[float, int]:
    """Training's validation windows scored token by token: summed NLL / ln 2 / the bytes of the decoded targets
    (the text they stand for), and the token count."""
    cfg, model, tokenizer, _ = load_run(run)
    data_dir = data_cache_dir(cfg)
    assert (data_dir / "manifest.json").is_file()
    nll, text_bytes, tokens = 0.0, 0, 0
    with torch.no_grad():
        for inputs, targets in eval_batches(str(data_dir), "val", cfg.data.seq_len, cfg.train.batch_size,
                                            cfg.train.eval_batches):
            logits = model(inputs)[..., :tokenizer.vocab_size]
            nll += float(F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum"))
            text_bytes += sum(len(tokenizer.decode(row.tolist()).encode("utf-8")) for row in targets)
            tokens += targets.numel()
    return nll / math.log(2) / text_bytes, tokens


def test_val_bpb_recorded_by_training_is_evals_and_the_direct_one(bpe_run, tmp_path, capsys):
    recorded = [r for r in records(bpe_run) if "val_bpb" in r][-1]
    capsys.readouterr()
    assert main(["eval", "--run", str(bpe_run), "--json", str(tmp_path / "out" / "val.json")]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert f"bpb {recorded['val_bpb']:.4f} over 3 batches x 4 x 32 tokens" in line, line
    out = json.loads((tmp_path / "out" / "val.json").read_text())
    assert out["bpb"] == recorded["val_bpb"] and out["loss"] == recorded["val_loss"]  # one definition, same floats
    assert out["tokens"] == 3 * 4 * 32 and out["windows"] == 12 and out["settings"]["batches"] == 3
    direct, tokens = direct_val_bpb(bpe_run)
    assert out["tokens"] == tokens and out["bpb"] == pytest.approx(direct, rel=1e-5)
    assert out["bytes"] > 1.2 * out["tokens"]  # 44 merges: many tokens are two bytes or more
    assert out["bpb"] == pytest.approx(out["nll_nats"] / math.log(2) / out["bytes"], rel=1e-12)
    assert out["bpb"] < 0.9 * out["token_mean_loss"] / math.log(2)  # not the loss in bits: fewer bits a byte


def test_char_val_bpb_is_loss_over_ln2_on_ascii(char_run):
    """Tiny Shakespeare is ASCII: one byte a character, so a char model's bpb is its token loss in bits."""
    last = [r for r in records(char_run) if "val_bpb" in r][-1]
    assert last["val_bpb"] == pytest.approx(last["val_loss"] / math.log(2), rel=1e-6)


# -- standard perplexity: eval --text, and transformers on the export ---------------------------------------------

def eval_text(run: Path, out: Path, *extra: str) -> dict:
    assert main(["eval", "--run", str(run), "--text", "builtin:wikitext-2", "--batches", "3", "--check-transformers",
                 "--json", str(out), *extra]) == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("kind", ["bpe", "char"])
def test_wikitext_perplexity_equals_transformers_on_the_export(kind, bpe_run, char_run, tmp_path):
    """The same windows through transformers' model on `scaletrain export`'s folder (the guide's loop, its own
    forward) give the same token perplexity, word perplexity and bpb to 1e-4; the char tokenizer exports too."""
    run = bpe_run if kind == "bpe" else char_run
    out = eval_text(run, tmp_path / "wt.json")
    check = out["transformers_check"]
    assert check["relative_difference"] < 1e-4, check
    assert check["tokens"] == out["tokens"] == 3 * 4 * 16 + 16  # 12 windows: 32 targets, then 16 each
    assert out["settings"]["context"] == 32 and out["settings"]["stride"] == 16
    assert out["word_perplexity"] > out["perplexity"] > 1 and out["bpb"] > 0
    cfg, _, tokenizer, _ = load_run(run)
    if kind == "bpe":  # no character skipped: the bytes are the text's, less the first token's
        text = resolve_source("builtin:wikitext-2").read_text(encoding="utf-8")
        ids = tokenizer.encode(text)[:out["tokens"] + 1]
        assert out["bytes"] == len(tokenizer.decode(ids).encode("utf-8")) - len(tokenizer.decode(ids[:1]).encode())
        assert out["skipped_characters"] == 0
    else:
        assert out["skipped_characters"] > 0  # '<unk>' brackets and '@' are not Shakespeare's
        assert out["bytes"] == out["tokens"]  # Tiny Shakespeare's characters are ASCII


def test_stride_and_context_change_the_windows(bpe_run, tmp_path):
    """A shorter stride gives each token more context (more windows, a lower loss on a trained model is not
    guaranteed for 6 steps, so only the counts are checked) and --context bounds it."""
    out = eval_text(bpe_run, tmp_path / "a.json", "--stride", "8", "--context", "24")
    assert out["settings"]["context"] == 24 and out["settings"]["stride"] == 8
    assert out["tokens"] == 24 + (3 * 4 - 1) * 8 and out["windows"] == 12
    assert out["transformers_check"]["relative_difference"] < 1e-4


# -- bad input: one line, exit 2 ----------------------------------------------------------------------------------

@pytest.mark.parametrize("case, expect", [
    ("empty", "the file is empty"),
    ("utf16", "UTF-16 text, not UTF-8; convert it"),
    ("latin1", "not UTF-8 at byte"),
    ("missing", "file not found"),
    ("folder", "file not found (a folder"),
    ("out_of_vocabulary", "1 token(s) left to score, fewer than 2 (a context and a target): 3 characters not in "
                          "the tokenizer's vocabulary (e.g. '日' x1, '本' x1, '語' x1) were skipped"),
])
def test_bad_text_files_are_one_line(case, expect, char_run, tmp_path, capsys):
    path = tmp_path / f"{case}.txt"
    if case == "empty":
        path.write_text(" \n\n")
    elif case == "out_of_vocabulary":  # a char vocabulary learnt from Shakespeare: only the newline is known
        path.write_text("日本語\n")
    elif case == "utf16":
        path.write_bytes("Some text in UTF-16.\n".encode("utf-16"))
    elif case == "latin1":
        path.write_bytes("caf\xe9 cr\xe8me\n".encode("latin-1"))
    elif case == "folder":
        path.mkdir()
    capsys.readouterr()
    assert main(["eval", "--run", str(char_run), "--text", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expect in err and str(path) in err, err


@pytest.mark.parametrize("flags, expect", [
    (["--stride", "0"], "--stride 0: must be between 1 and the context (32 tokens)"),
    (["--stride", "33"], "--stride 33: must be between 1 and the context (32 tokens)"),
    (["--stride", "-4"], "--stride -4"),
    (["--context", "33"], "--context 33: must be between 1 and the model's model.max_seq_len (32)"),
    (["--context", "0"], "--context 0: must be between 1 and the model's model.max_seq_len (32)"),
    (["--batches", "-3"], "--batches -3: must be >= 0 (0 scores every window"),
])
def test_bad_windows_are_one_line(flags, expect, char_run, capsys):
    """Each refused in one line, never scored with other settings (`--context 0` read as the default before)."""
    capsys.readouterr()
    assert main(["eval", "--run", str(char_run), "--text", "builtin:wikitext-2", *flags]) == 2
    out, err = capsys.readouterr()
    assert len(err.strip().splitlines()) == 1 and expect in err and "bpb" not in out, err


@pytest.mark.parametrize("flags, expect", [(["--stride", "8"], "--stride applies to --text"),
                                           (["--context", "0"], "--context applies to --text"),
                                           (["--batches", "-3"], "--batches -3: must be >= 0")])
def test_window_flags_without_text_are_refused(flags, expect, char_run, capsys):
    """The val split: a flag it would ignore, or a negative count it read as every window, is refused."""
    capsys.readouterr()
    assert main(["eval", "--run", str(char_run), *flags]) == 2
    out, err = capsys.readouterr()
    assert expect in err and err.count("\n") == 1 and "loss" not in out
