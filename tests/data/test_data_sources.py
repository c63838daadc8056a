"""Sources: every format, compression, folder globs, and each kind of bad input counted and named."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma

import pytest

from scaletrain.data.prepare_config import SourceConfig
from scaletrain.data.report import Report
from scaletrain.data.sources import iter_documents
from scaletrain.data.tokenizer import DataError


def _read(paths, **kw):
    report = Report()
    docs = list(iter_documents(SourceConfig(paths=[str(p) for p in paths], **kw), report))
    return docs, report


def test_folder_recursive_with_globs_and_compression(tmp_path):
    import zstandard

    (tmp_path / "sub" / "deeper").mkdir(parents=True)
    (tmp_path / "a.txt").write_text("plain text")
    (tmp_path / "sub" / "b.txt.gz").write_bytes(gzip.compress(b"gzip text"))
    (tmp_path / "sub" / "deeper" / "c.txt.zst").write_bytes(zstandard.ZstdCompressor().compress(b"zstd text"))
    (tmp_path / "sub" / "d.txt.xz").write_bytes(lzma.compress(b"xz text"))
    (tmp_path / "sub" / "e.txt.bz2").write_bytes(bz2.compress(b"bz2 text"))
    (tmp_path / "skip_me.txt").write_text("excluded")
    (tmp_path / "image.png").write_bytes(b"\x89PNG....")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "x.txt").write_text("hidden")
    docs, report = _read([tmp_path], exclude=["skip_*"])
    assert sorted(d.text for d in docs) == ["bz2 text", "gzip text", "plain text", "xz text", "zstd text"]
    assert report.documents_in == 5 and not report.issues
    # nothing silently dropped: the files the globs left out are counted and named (hidden ones are not)
    skipped = report.to_dict()["skipped_files"]
    assert skipped == {"not included (source.include)": {"files": 1, "bytes": 8},
                       "excluded (source.exclude)": {"files": 1, "bytes": 8}}
    assert report.removed_examples["skipped: not included (source.include)"] == [str(tmp_path / "image.png")]
    assert "skipped, not included (source.include): 1 files" in report.table()


def test_jsonl_bad_lines_are_counted_with_file_and_line(tmp_path):
    f = tmp_path / "data.jsonl"
    f.write_text('{"text": "one"}\n\n{"body": "no text field"}\nnot json at all\n{"text": 5}\n{"text": "two"}\n')
    docs, report = _read([f])
    assert [d.text for d in docs] == ["one", "two"]
    assert docs[1].source == f"{f}:6"
    assert report.issues == {"missing_text_field": 2, "bad_json_line": 1}
    assert any(m.startswith(f"{f}:4: not valid JSON") for m in report.messages["bad_json_line"])
    assert any(m.startswith(f"{f}:3: no 'text' field") for m in report.messages["missing_text_field"])
    assert report.removed_total()[0] == 3


def test_json_and_custom_field(tmp_path):
    f = tmp_path / "data.json"
    f.write_text(json.dumps({"rows": [{"content": "alpha"}, {"content": "beta"}]}))
    docs, _ = _read([f], text_field="content")
    assert [d.text for d in docs] == ["alpha", "beta"]


def test_parquet_and_saved_hf_dataset(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({"text": ["p1", "p2", None], "id": [1, 2, 3]})
    pq.write_table(table, tmp_path / "t.parquet")
    docs, report = _read([tmp_path / "t.parquet"])
    assert [d.text for d in docs] == ["p1", "p2"] and report.issues["missing_text_field"] == 1
    # the layout Dataset.save_to_disk writes: Arrow IPC stream files listed in state.json
    ds = tmp_path / "saved"
    ds.mkdir()
    with pa.ipc.new_stream(str(ds / "data-00000-of-00001.arrow"), table.schema) as w:
        w.write_table(table)
    (ds / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    docs, _ = _read([ds])
    assert [d.text for d in docs] == ["p1", "p2"]
    docs, report = _read([tmp_path / "t.parquet"], text_field="body")
    assert docs == [] and report.issues["missing_text_field"] == 1


def test_binary_empty_and_non_utf8(tmp_path):
    (tmp_path / "bin.txt").write_bytes(b"abc\x00\x01\x02" * 10)
    (tmp_path / "empty.txt").write_bytes(b"  \n")
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9 ok\nna\u00efve".encode("latin-1"))
    docs, report = _read([tmp_path])
    assert [d.text for d in docs] == ["caf\ufffd ok\nna\ufffdve"]
    assert report.issues == {"binary_file": 1, "empty_file": 1, "not_utf8_replaced": 1}
    assert f"{tmp_path / 'latin1.txt'}:1: not valid UTF-8 at byte 3; it reads as Windows-1252 (Latin-1) text: " \
           f"convert it: iconv -f CP1252 -t UTF-8 {tmp_path / 'latin1.txt'} > {tmp_path / 'latin1-utf8.txt'}" \
           in report.messages["not_utf8_replaced"][0]
    docs, report = _read([tmp_path / "latin1.txt"], encoding_errors="skip")
    assert docs == [] and report.removed["source"]["not UTF-8"][0] == 1
    with pytest.raises(DataError, match="latin1.txt:1: not valid UTF-8"):
        _read([tmp_path / "latin1.txt"], encoding_errors="fail")


def test_truncated_compressed_file_is_counted_not_fatal(tmp_path):
    (tmp_path / "bad.txt.gz").write_bytes(gzip.compress(b"x" * 1000)[:20])
    (tmp_path / "good.txt").write_text("fine")
    docs, report = _read([tmp_path])
    assert [d.text for d in docs] == ["fine"] and report.issues["unreadable_file"] == 1


def test_large_file_is_split_at_blank_lines(tmp_path):
    paragraphs = [f"paragraph {i} " * 20 for i in range(50)]
    (tmp_path / "big.txt").write_text("\n\n".join(paragraphs))
    docs, _ = _read([tmp_path / "big.txt"], max_document_mb=0.002)
    assert len(docs) > 5 and "".join(d.text for d in docs) == "\n\n".join(paragraphs)
    assert all(d.text.endswith("\n\n") or d is docs[-1] for d in docs)


def test_missing_path_and_hf_without_datasets(tmp_path, monkeypatch):
    with pytest.raises(DataError, match="data path not found"):
        _read([tmp_path / "nope"])
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # never touch the network in tests
    try:
        import datasets  # noqa: F401
    except ImportError:
        with pytest.raises(DataError, match="datasets"):
            _read(["hf:some/dataset"])
    else:
        with pytest.raises(DataError, match="offline"):
            _read(["hf:scaletrain-test/does-not-exist"])


def test_json_array_streams_and_bad_json_is_named(tmp_path, monkeypatch):
    from scaletrain.data import sources

    monkeypatch.setattr(sources, "JSON_CHUNK", 7)  # records, strings and numbers cut by chunk boundaries
    f = tmp_path / "big.json"
    records = [{"text": f"record {i} " + "é" * i, "n": 12345.678} for i in range(50)] + [{"no": "text"}, 5]
    f.write_text(" \n" + json.dumps(records, ensure_ascii=False, indent=1))
    docs, report = _read([f])
    assert [d.text for d in docs] == [r["text"] for r in records[:50]]
    assert docs[3].source == f"{f}[3]" and report.issues == {"missing_text_field": 2}
    # streaming: never more than one record (plus a chunk) held, so a record over the limit is named
    bad = tmp_path / "bad.json"
    bad.write_text('[{"text": "kept"}, {"text": "broken" ]')
    docs, report = _read([bad])
    assert [d.text for d in docs] == ["kept"] and report.issues == {"bad_json_file": 1}
    assert report.messages["bad_json_file"][0].startswith(f"{bad}[1]: ")
    bad.write_text(json.dumps([{"text": "kept"}, {"text": "x" * 2000}]))
    docs, report = _read([bad], max_document_mb=0.001)
    assert [d.text for d in docs] == ["kept"]
    assert report.messages["bad_json_file"][0].startswith(f"{bad}[1]: not valid JSON, or an element over 0.001 MB")
    huge = tmp_path / "huge.json"
    huge.write_text(json.dumps({"rows": [{"text": "x" * 2000}]}))
    docs, report = _read([huge], max_document_mb=0.001)
    assert docs == [] and "store the records as a top-level array or as .jsonl" in report.messages["bad_json_file"][0]


def test_hf_name_loads_through_datasets_and_offline_never_hangs(tmp_path, monkeypatch):
    """``hf:NAME`` goes through datasets.load_dataset: here a local data folder (what load_dataset does
    with a path) with a missing text field counted, not dropped silently. Then a hub name with the real
    network of this machine (none to the hub in CI): the probe decides within seconds, and the error is
    one line naming the source - never a hang."""
    import time

    pytest.importorskip("datasets")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no user cache is read or written
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")            # let the probe decide (restored afterwards)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "train.jsonl").write_text(json.dumps({"text": "first document"}) + "\n"
                                        + json.dumps({"body": "no text field"}) + "\n"
                                        + json.dumps({"text": "third document"}) + "\n")
    docs, report = _read([f"hf:{folder}"])
    assert [d.text for d in docs] == ["first document", "third document"]
    assert docs[0].source == f"hf:{folder}[0]"
    assert report.documents_in == 3 and sum(report.issues.values()) == 1

    t0 = time.perf_counter()
    with pytest.raises(DataError, match="hf:scaletrain-test/does-not-exist: cannot load"):
        _read(["hf:scaletrain-test/does-not-exist"])
    assert time.perf_counter() - t0 < 60


@pytest.mark.parametrize("encoding,variant", [("utf-16", "UTF-16"), ("utf-16-le", "UTF-16LE"),
                                              ("utf-16-be", "UTF-16BE")])
def test_a_utf16_file_is_named_utf16_with_the_command_that_converts_it(tmp_path, encoding, variant):
    """Windows' "Unicode" text: NUL every other byte made it "look binary". Now prepare (skipped, counted) and
    `eval --text` (refused, exit 2) say it is UTF-16 and how to convert it, in the words of one reader."""
    from scaletrain.data.prepare import read_text_file

    book = tmp_path / "book.txt"
    book.write_bytes("It was a dark and stormy night.\nThe end.\n".encode(encoding))
    (tmp_path / "ok.txt").write_text("plain UTF-8 text\n")
    docs, report = _read([tmp_path])
    advice = (f"{book}: {variant} text, not UTF-8; convert it: iconv -f {variant} -t UTF-8 {book} > "
              f"{tmp_path}/book-utf8.txt")
    assert [d.text for d in docs] == ["plain UTF-8 text\n"] and report.issues == {"utf16_file": 1}
    assert report.messages["utf16_file"] == [advice + "; skipped"]
    with pytest.raises(DataError) as exc:
        read_text_file(book)
    assert str(exc.value) == advice
    assert read_text_file(tmp_path / "ok.txt") == "plain UTF-8 text\n"


def test_a_utf16_or_bom_jsonl_is_read_or_named_and_a_missing_field_names_the_fields(tmp_path):
    lines = json.dumps({"text": "one"}) + "\n" + json.dumps({"instruction": "Hi", "output": "Yes."}) + "\n"
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + lines.encode())
    docs, report = _read([tmp_path / "bom.jsonl"])
    assert [d.text for d in docs] == ["one"]
    assert report.messages["missing_text_field"] == [
        f"{tmp_path / 'bom.jsonl'}:2: no 'text' field (fields: instruction, output: instruction data in the Alpaca "
        f"layout, which finetune.instructions={tmp_path / 'bom.jsonl'} reads); record skipped (to read another field "
        f"as the text, set source.text_field)"]
    (tmp_path / "utf16.jsonl").write_bytes(lines.encode("utf-16-le"))
    docs, report = _read([tmp_path / "utf16.jsonl"])
    assert docs == [] and report.issues == {"utf16_file": 1}  # not two lines of bad JSON
    assert "UTF-16LE text, not UTF-8; convert it: iconv -f UTF-16LE" in report.messages["utf16_file"][0]
