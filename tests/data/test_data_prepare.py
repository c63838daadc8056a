"""prepare end to end: shards that decode back to the cleaned documents, the report, resuming,
atomic writes, bad input that must stop the run, the CLI, parallel = sequential, FIM."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from scaletrain.data import prepare as prepare_mod
from scaletrain.data.augment import FIM_TOKENS
from scaletrain.data.clean import clean_text
from scaletrain.data.cli import main as cli_main
from scaletrain.data.prepare import prepare, prepare_text
from scaletrain.data.prepare_config import CleanConfig, PrepareConfig
from scaletrain.data.report import Report
from scaletrain.data.shards import ShardWriter, read_manifest, verify_checksums
from scaletrain.data.tokenizer import DataError, load_tokenizer

FIXTURES = Path(__file__).parents[1] / "fixtures"


def _corpus(tmp_path: Path) -> Path:
    corpus = tmp_path / "corpus"
    shutil.copytree(FIXTURES / "gutenberg", corpus / "gutenberg", ignore=shutil.ignore_patterns("*.json"))
    shutil.copytree(FIXTURES / "shakespeare", corpus / "shakespeare")
    return corpus


def _config(corpus: Path, out: Path, **tokenizer) -> PrepareConfig:
    cfg = PrepareConfig(workers=1)
    cfg.source.paths = [str(corpus)]
    cfg.tokenizer.vocab_size = tokenizer.get("vocab_size", 400)
    cfg.tokenizer.kind = tokenizer.get("kind", "bpe")
    cfg.split.val_fraction = 0.2
    cfg.output.dir = str(out)
    return cfg


def _documents(out: Path, split: str) -> list[str]:
    """Decode a split's shards back into documents, using the document index."""
    m = read_manifest(out)
    tok = load_tokenizer(out / "tokenizer.json")
    ids = np.concatenate([np.fromfile(out / s["file"], dtype=m["dtype"]) for s in m["splits"][split]["shards"]])
    ends = np.fromfile(out / m["splits"][split]["doc_index"]["file"], dtype="<u8")
    docs, start = [], 0
    for end in ends:
        doc = ids[start:end]
        assert doc[-1] == m["eos_id"] and (doc[:-1] != m["eos_id"]).all()
        docs.append(tok.decode(doc[:-1].tolist()))
        start = int(end)
    assert start == len(ids)
    return docs


def test_end_to_end_bpe(tmp_path):
    corpus, out = _corpus(tmp_path), tmp_path / "out"
    report = Report()
    manifest = prepare(_config(corpus, out), report)
    assert manifest["dtype"] == "<u2" and manifest["vocab_size"] == 400
    assert manifest["tokenizer"]["sha256"] and manifest["split"]["by"] == "document"
    # Folio excerpts go as near duplicates of the modern ones (modern sorts first)
    assert report.removed["dedup"]["near duplicate"][0] == 4
    docs = _documents(out, "train") + _documents(out, "val")
    assert len(docs) == 6 + 4 == manifest["splits"]["train"]["documents"] + manifest["splits"]["val"]["documents"]
    expected = {clean_text(p.read_text(encoding="utf-8"), CleanConfig())[0]
                for p in (corpus / "gutenberg").glob("*.txt")}
    expected |= {p.read_text() for p in (corpus / "shakespeare").glob("*_gut.txt")}
    assert set(docs) == expected  # byte-level BPE round-trips the cleaned text exactly
    rep = json.loads((out / "report.json").read_text())
    assert rep["documents_in"] == 14 and rep["tokens_out"] == sum(s["tokens"] for s in manifest["splits"].values())
    assert rep["modified"]["gutenberg_header_removed"] == 5 and rep["bytes_per_token"] > 1
    assert len(rep["near_duplicate_clusters"]) == 4
    assert sorted(Path(n).name for n in rep["removed_documents"]["dedup: near duplicate"]) == \
        sorted(p.name for p in (corpus / "shakespeare").glob("*_f.txt"))
    assert verify_checksums(out) == 5  # 2 shards, 2 doc indexes, the tokenizer


def test_resume_reuses_pass1_and_up_to_date(tmp_path, capsys):
    corpus, out = _corpus(tmp_path), tmp_path / "out"
    prepare(_config(corpus, out))
    logs: list[str] = []
    m2 = prepare(_config(corpus, out, vocab_size=300), log=logs.append)
    assert any("reusing" in line for line in logs) and m2["vocab_size"] == 300
    logs.clear()
    prepare(_config(corpus, out, vocab_size=300), log=logs.append)
    assert any("up to date" in line for line in logs)
    (corpus / "gutenberg" / "new.txt").write_text("A new book. " * 100)  # a changed input reruns pass 1
    logs.clear()
    m3 = prepare(_config(corpus, out, vocab_size=300), log=logs.append)
    assert not any("reusing" in line for line in logs)
    assert m3["stats"]["documents_in"] == 15


def test_interrupted_write_leaves_no_manifest(tmp_path, monkeypatch):
    corpus, out = _corpus(tmp_path), tmp_path / "out"
    prepare(_config(corpus, out))
    calls = {"n": 0}
    original = ShardWriter.add

    def crash(self, ids, end_of_document=True):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # the user pressed Ctrl-C mid-write
        return original(self, ids, end_of_document)

    monkeypatch.setattr(ShardWriter, "add", crash)
    with pytest.raises(KeyboardInterrupt):
        prepare(_config(corpus, out, vocab_size=300))
    assert not (out / "manifest.json").exists()  # the old one is gone, the new one never written
    with pytest.raises(DataError, match="no manifest"):
        read_manifest(out)
    monkeypatch.setattr(ShardWriter, "add", original)
    m = prepare(_config(corpus, out, vocab_size=300))
    assert m["vocab_size"] == 300 and verify_checksums(out) == 5
    assert not list(out.glob("*.tmp"))


def test_runs_that_must_stop(tmp_path):
    corpus, out = _corpus(tmp_path), tmp_path / "out"
    cfg = _config(corpus, out)
    cfg.filter.min_chars = 10_000_000
    with pytest.raises(DataError, match="no document left"):
        prepare(cfg)
    # a tokenizer whose vocabulary does not fit uint16 shards
    from tokenizers import Tokenizer, models, pre_tokenizers

    big = Tokenizer(models.WordLevel({f"w{i}": i for i in range(70_000)} | {"[UNK]": 70_000}, unk_token="[UNK]"))
    big.pre_tokenizer = pre_tokenizers.Whitespace()
    big.save(str(tmp_path / "big.json"))
    cfg = _config(corpus, out, kind=str(tmp_path / "big.json"))
    cfg.output.dtype = "uint16"
    with pytest.raises(DataError, match="70,001 tokens does not fit uint16"):
        prepare(cfg)
    cfg.output.dtype = "auto"
    assert prepare(cfg)["dtype"] == "<u4"


def test_checksum_mismatch_is_reported(tmp_path, capsys):
    corpus, out = _corpus(tmp_path), tmp_path / "out"
    prepare(_config(corpus, out))
    shard = out / read_manifest(out)["splits"]["train"]["shards"][0]["file"]
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match=f"{shard}: checksum does not match"):
        verify_checksums(out)
    assert cli_main(["--verify", str(out)]) == 2
    assert "checksum does not match" in capsys.readouterr().err


def test_cli_minimal_and_config_forms(tmp_path, capsys):
    corpus = _corpus(tmp_path)
    assert cli_main([str(corpus / "gutenberg"), "--out", str(tmp_path / "a"), "--tokenizer", "bpe",
                     "--vocab-size", "320", "--val-fraction", "0.2", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "near duplicate" not in out and "train (out)" in out and "MB/s" in out
    assert read_manifest(tmp_path / "a")["vocab_size"] == 320
    toml = tmp_path / "data.toml"
    toml.write_text(f'workers = 1\n[source]\npaths = ["{corpus}"]\n[tokenizer]\nvocab_size = 300\n'
                    f'[output]\ndir = "{tmp_path / "b"}"\n')
    assert cli_main(["--config", str(toml), "--dedup.threshold=0.95", "--split.val_fraction=0.3"]) == 0
    m = read_manifest(tmp_path / "b")
    assert m["config"]["dedup"]["threshold"] == 0.95 and m["split"]["val_fraction"] == 0.3
    assert "near duplicate" not in capsys.readouterr().out  # 0.95: the excerpts are not that similar
    assert cli_main(["--config", str(toml), "--dedup.threshold=2"]) == 2
    assert "dedup.threshold must be <= 1" in capsys.readouterr().err
    assert cli_main(["--config", str(toml), "--print-config"]) == 0
    assert "[dedup]" in capsys.readouterr().out


def test_trainer_path_matches_nanogpt_split(tmp_path, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "zstandard", None)  # the optional dependency is absent
    text = "".join(f"line {i}: the quick brown fox\n" for i in range(500))
    (tmp_path / "input.txt").write_text(text)
    m = prepare_text(str(tmp_path / "input.txt"), tmp_path / "out", tokenizer="char", val_fraction=0.1)
    cut = int(len(text) * 0.9)
    assert m["splits"]["train"]["tokens"] == cut and m["splits"]["val"]["tokens"] == len(text) - cut
    assert m["split"]["by"] == "tail" and m["eos_id"] is None


def test_parallel_equals_sequential(tmp_path, monkeypatch):
    corpus = _corpus(tmp_path)
    sequential = prepare(_config(corpus, tmp_path / "seq"))
    monkeypatch.setattr(prepare_mod, "POOL_MIN_BYTES", 0)  # use the pool on this small input, one document a task
    monkeypatch.setattr(prepare_mod, "BATCH_DOCS", 1)
    cfg = _config(corpus, tmp_path / "par")
    cfg.workers, cfg.tokenizer.encode_workers, cfg.tokenizer.batch_mb = 2, 2, 0.05
    parallel = prepare(cfg)
    for split in ("train", "val"):
        assert [s["sha256"] for s in parallel["splits"][split]["shards"]] == \
               [s["sha256"] for s in sequential["splits"][split]["shards"]]


def test_fim_and_literal_special_tokens(tmp_path):
    corpus = tmp_path / "c"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"{i}.txt").write_text(f"Document {i} says <|eos|> and <|fim_prefix|> as plain text. " * 20)
    cfg = _config(corpus, tmp_path / "out")
    cfg.filter.max_dup_ngram_fraction = []  # these toy documents repeat themselves on purpose
    cfg.filter.max_top_ngram_fraction = []
    cfg.filter.max_dup_line_char_fraction = 1.0
    cfg.augment.fim_rate = 1.0
    m = prepare(cfg)
    tok = load_tokenizer(tmp_path / "out" / "tokenizer.json")
    fim_ids = {tok.tok.token_to_id(t) for t in FIM_TOKENS}
    for split in ("train", "val"):
        ids = np.concatenate([np.fromfile(tmp_path / "out" / s["file"], dtype=m["dtype"])
                              for s in m["splits"][split]["shards"]])
        assert (ids == m["eos_id"]).sum() == m["splits"][split]["documents"]  # typed "<|eos|>" stays text
        n_fim = np.isin(ids, list(fim_ids)).sum()
        assert n_fim == (3 * m["splits"][split]["documents"] if split == "train" else 0)


@pytest.mark.parametrize("recipe", sorted((Path(__file__).resolve().parents[2] / "configs" / "data").glob("*.toml")),
                         ids=lambda p: p.name)
def test_shipped_data_recipes_load(recipe):
    from scaletrain.config import load_config
    from scaletrain.data.prepare_config import validate

    cfg = load_config(recipe, cls=PrepareConfig)
    validate(cfg)
    assert cfg.source.paths and cfg.output.dir


def test_encode_pieces_are_exact(tmp_path, monkeypatch):
    """Long documents are encoded in pieces (bounded memory); the ids must equal one whole-text encode."""
    from scaletrain.data import encode

    corpus, out = _corpus(tmp_path), tmp_path / "out"
    prepare(_config(corpus, out))
    tok = load_tokenizer(out / "tokenizer.json")
    texts = [p.read_text(encoding="utf-8") for p in sorted(corpus.rglob("*.txt"))]
    texts.append("<|eos|> typed \n\n\n  a  b\n \nc" * 50 + "x" * 3000)  # odd runs; a stretch with no cut point
    encoder = encode.Encoder(tok, np.dtype("<u2"))  # (sets encode_special_tokens: "<|eos|>" is text)
    assert encoder.cuttable
    whole = [np.array(e.ids, dtype="<u2") for e in tok.tok.encode_batch_fast(texts)]
    monkeypatch.setattr(encode, "CUT_CHARS", 300)
    monkeypatch.setattr(encode, "CALL_CHARS", 2000)
    assert sum(len(encode.cut_text(t, 300)) for t in texts) > 10 * len(texts)  # really cut
    assert all("".join(encode.cut_text(t, 300)) == t for t in texts)
    pieces = encoder.encode_texts(texts)
    assert all(np.array_equal(a, b) for a, b in zip(whole, pieces, strict=True))


def test_corrupt_shard_is_refused_at_loader_start_and_verified_once(tmp_path, monkeypatch):
    """A shard corrupted to the same size is refused when a loader opens the dataset (read_manifest),
    naming the file; an unchanged dataset is not hashed again, a rewritten file is."""
    import re

    from scaletrain.data import shards
    from scaletrain.data.loader import TokenLoader

    corpus, out = _corpus(tmp_path), tmp_path / "out"
    prepare(_config(corpus, out))
    hashed: list[str] = []
    real_sha256 = shards.file_sha256
    monkeypatch.setattr(shards, "file_sha256", lambda f: hashed.append(Path(f).name) or real_sha256(f))
    TokenLoader(str(out), "train", 16, 2, prefetch=0).close()
    assert hashed == []  # prepare stamped the files it wrote: nothing to read again
    shard = out / read_manifest(out)["splits"]["train"]["shards"][0]["file"]
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF
    shard.write_bytes(bytes(data))  # same size, so the size check alone would pass
    with pytest.raises(DataError, match=f"^{re.escape(str(shard))}: checksum does not match the manifest"):
        TokenLoader(str(out), "train", 16, 2, prefetch=0)
    assert hashed == [shard.name]  # only the changed file was read
    assert cli_main(["--verify", str(out)]) == 2
    data[10] ^= 0xFF
    shard.write_bytes(bytes(data))  # repaired
    hashed.clear()
    read_manifest(out)
    read_manifest(out)
    assert hashed == [shard.name]  # hashed once, then remembered by (size, mtime)


def test_char_level_hf_tokenizer_with_unknown_characters(tmp_path, capsys):
    """A character-level Hugging Face tokenizer.json that lacks a character of the text: a WordLevel model
    whose unk_token is missing from its vocabulary used to crash `scaletrain prepare` with the tokenizers
    library's raw exception, and a BPE without unk_token dropped the character silently. Both are one line
    naming the file and the character, exit 2; with an unk_token the character maps to it, as the tokenizer
    defines."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    corpus = _corpus(tmp_path)
    text = "".join(p.read_text(encoding="utf-8") for p in sorted((corpus / "shakespeare").rglob("*.txt")))
    vocab = {c: i for i, c in enumerate(sorted(set(text) - {"!"}))}
    word_level = Tokenizer(models.WordLevel(dict(vocab), unk_token="[UNK]"))  # [UNK] is not in the vocabulary
    word_level.pre_tokenizer = pre_tokenizers.Split("", "isolated")  # one token a character
    word_level.save(str(tmp_path / "wordlevel.json"))
    Tokenizer(models.BPE(dict(vocab), [])).save(str(tmp_path / "bpe.json"))
    Tokenizer(models.BPE({**vocab, "[UNK]": len(vocab)}, [], unk_token="[UNK]")).save(str(tmp_path / "unk.json"))
    for name, says in (("wordlevel", "cannot encode the character '!'"), ("bpe", "would be dropped silently")):
        assert cli_main([str(corpus / "shakespeare"), "--out", str(tmp_path / name), "--tokenizer",
                         str(tmp_path / f"{name}.json"), "--workers", "1"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"{name}.json" in err and says in err, err
    assert cli_main([str(corpus / "shakespeare"), "--out", str(tmp_path / "unk"), "--tokenizer",
                     str(tmp_path / "unk.json"), "--workers", "1"]) == 0
    assert read_manifest(tmp_path / "unk")["vocab_size"] == len(vocab) + 1


def test_a_hugging_face_tokenizer_folders_special_tokens_are_part_of_the_fingerprint(tmp_path):
    """Prepared data of a Hugging Face tokenizer ends each document with the folder's EOS: a changed
    tokenizer_config.json (another EOS) must not reuse data prepared with the old one."""
    import shutil

    from scaletrain.data.prepare import fingerprints
    from scaletrain.data.prepare_config import minimal_config

    folder = tmp_path / "tok"
    shutil.copytree(FIXTURES / "chatml_tokenizer", folder)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("Some text.\n", encoding="utf-8")
    cfg = minimal_config(str(corpus), str(tmp_path / "out"), tokenizer=str(folder / "tokenizer.json"))
    before = fingerprints(cfg)
    config = folder / "tokenizer_config.json"
    config.write_text(config.read_text(encoding="utf-8").replace('"eos_token"', '"eos_token_was"', 1), encoding="utf-8")
    after = fingerprints(cfg)
    assert before[0] == after[0] and before[1] != after[1]  # cleaning reused, tokens redone


# one bad input each: what it becomes in ``prepare``'s one line (the stage or filter, what to change), and the
# report that line names exists
BAD_INPUTS = {
    "empty.txt": (b"", r"1 document in; 1 empty file \(.*empty.txt: empty"),
    "binary.txt": (b"\x00\x01\x02 binary \x00" * 20, r"1 binary file \(.*binary.txt: looks binary"),
    "utf16.txt": ("Plain words saved as Unicode by a Windows editor.\n".encode("utf-16"),
                  r"1 UTF-16 file \(.*utf16.txt: UTF-16 text, not UTF-8; convert it: iconv -f UTF-16 -t UTF-8"),
    "one-line.txt": (b"one short line\n", r"1 dropped by filter.min_chars \(fewer than 200 characters after "
                                          r"cleaning\): lower filter.min_chars \(0 = off\)"),
    "latin1.txt": ("Caf\u00e9 cr\u00e8me, \u00e0 la fran\u00e7aise.\n".encode("latin-1"),
                   r"filter.min_chars .*latin1.txt:1: not valid UTF-8 at byte 3; it reads as Windows-1252 \(Latin-1\) "
                   r"text: convert it: iconv -f CP1252 -t UTF-8"),
    "records.jsonl": (b'{"title": "a", "body": "b"}\n', r"1 without a 'text' field \(.*records.jsonl:1: no 'text' "
                                                        r"field \(fields: title, body\).*set source.text_field"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_an_input_that_leaves_nothing_says_which_stage_dropped_it_and_the_report_exists(tmp_path, name, capsys):
    raw, expected = BAD_INPUTS[name]
    (tmp_path / name).write_bytes(raw)
    out = tmp_path / "out"
    assert cli_main([str(tmp_path / name), "--out", str(out), "--workers", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("DataError: no document left")
    assert re.search(expected, err), err
    assert err.endswith(f"see {out / 'report.json'}")
    assert json.loads((out / "report.json").read_text())["documents_in"] == 1


def test_a_vocabulary_smaller_than_asked_is_said_and_recorded(tmp_path, capsys):
    corpus = _corpus(tmp_path)
    assert cli_main([str(corpus / "shakespeare"), "--out", str(tmp_path / "a"), "--tokenizer", "bpe",
                     "--vocab-size", "70001", "--val-fraction", "0.2", "--workers", "1"]) == 0
    printed = capsys.readouterr().out
    manifest = read_manifest(tmp_path / "a")
    n = manifest["vocab_size"]
    assert n < 70001 and manifest["tokenizer"]["vocab_size_asked"] == 70001
    said = f"tokenizer.vocab_size = 70,001 asked, but the corpus supports only {n:,} tokens"
    assert said in printed and f"(vocab {n:,} of 70,001 asked" in printed
    assert said in json.loads((tmp_path / "a" / "report.json").read_text())["messages"]["vocab_smaller_than_asked"][0]


def test_a_char_vocabulary_that_lacks_the_texts_characters_names_the_document(tmp_path):
    from scaletrain.data.tokenizer import CharTokenizer

    CharTokenizer(list("abc \n")).save(tmp_path / "abc.json")
    (tmp_path / "ok.txt").write_text("abc cab\n")
    (tmp_path / "xyz.txt").write_text("xyz zyx\n")
    cfg = _config(tmp_path / "xyz.txt", tmp_path / "out", kind=str(tmp_path / "abc.json"))
    cfg.source.paths = [str(tmp_path / "ok.txt"), str(tmp_path / "xyz.txt")]
    cfg.filter.min_chars, cfg.split.by = 0, "tail"
    with pytest.raises(DataError, match=rf"^{tmp_path / 'xyz.txt'}: characters not in the char vocabulary .*'x' x2.*"
                                        r"1 of 2 document\(s\)"):
        prepare(cfg)


def test_the_trainers_jsonl_without_a_text_field_names_its_fields_and_the_flags(tmp_path):
    alpaca = FIXTURES / "alpaca.jsonl"
    with pytest.raises(DataError) as info:
        prepare_text(str(alpaca), tmp_path / "data")
    message = str(info.value)
    assert "4 without a 'text' field" in message and "fields: instruction, input, output" in message
    assert f"finetune.instructions={alpaca}" in message and "set data.text_field" in message
    report = tmp_path / "data" / "report.json"
    assert message.endswith(f"see {report}") and report.is_file()
    manifest = prepare_text(str(alpaca), tmp_path / "outputs", text_field="output", val_fraction=0.25)
    assert manifest["splits"]["train"]["documents"] == 3  # data.text_field: one field of each line as its text
