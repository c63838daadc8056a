"""One quality table over run folders, in the field's units (docs/evaluation.md): for each run, the validation
loss and bits per byte training's evaluation computes, and the standard perplexity of a text (default WikiText-2's
validation split: token perplexity, word-level perplexity, bits per byte) with the relative difference of
transformers on the run's Hugging Face export scoring the same windows.

    python benchmarks/evaluation_table.py RUN [RUN ...] [--text builtin:wikitext-2] [--batches N] [--out FILE]

Every number comes from `scaletrain eval --json` (one process per call, so each run is measured as a user
would measure it); this script only runs it and lays the numbers out. A quantized run has no Hugging Face
export: its check column says so. ``--batches N`` scores only the first N x train.batch_size windows of the
text (a quick look; the documented table scores all of it).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from launch import OUT_HELP, default_out, write_result  # benchmarks/launch.py (the script's folder is on sys.path)

COLUMNS = [("run", "{:<28}"), ("val loss", "{:>8.4f}"), ("val bpb", "{:>8.4f}"), ("token ppl", "{:>10.2f}"),
           ("word ppl", "{:>10.2f}"), ("text bpb", "{:>8.4f}"), ("transformers", "{:>12}")]


def eval_json(args: list[str]) -> dict:
    """``scaletrain eval ARGS --json F`` in its own process; its JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "eval.json"
        proc = subprocess.run([sys.executable, "-m", "scaletrain.cli", "eval", *args, "--json", str(out)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"scaletrain eval {' '.join(args)} failed: {proc.stderr.strip()[-2000:]}")
        return json.loads(out.read_text())


def is_quantized(run: Path) -> bool:
    """A `compress --quantize` run (compress.json records it): transformers cannot load its torchao weights."""
    record = run / "compress.json"
    return record.is_file() and "quantize" in json.loads(record.read_text())


def measure(run: Path, text: str, batches: int | None) -> dict:
    """One run's row: ``eval`` on its validation split, then on ``text`` (with the transformers check)."""
    val = eval_json(["--run", str(run)])
    quantized = is_quantized(run)
    text_args = ["--run", str(run), "--text", text] + (["--batches", str(batches)] if batches else [])
    scored = eval_json(text_args + ([] if quantized else ["--check-transformers"]))
    check = scored.get("transformers_check")
    return {"run": str(run), "val_loss": val["loss"], "val_bpb": val["bpb"], "val_tokens": val["tokens"],
            "val_bytes": val["bytes"], "val_windows": val["windows"], "text": text,
            "token_perplexity": scored["perplexity"], "word_perplexity": scored["word_perplexity"],
            "text_bpb": scored["bpb"], "text_tokens": scored["tokens"], "text_bytes": scored["bytes"],
            "text_words": scored["words"], "text_windows": scored["windows"], "context": scored["context"],
            "stride": scored["stride"], "skipped_characters": scored["skipped_characters"],
            "transformers_relative_difference": check["relative_difference"] if check else None,
            "transformers_check": "done" if check else "not possible: quantized (no Hugging Face export)"}


def table(rows: list[dict]) -> str:
    """The rows as the plain-text table the script prints."""
    head = "  ".join(fmt.replace(".4f", "").replace(".2f", "").format(name) for name, fmt in COLUMNS)
    lines = [head]
    for r in rows:
        diff = f"{r['transformers_relative_difference']:.1e}" if r["transformers_relative_difference"] is not None \
            else "n/a"
        values = [Path(r["run"]).name[:28], r["val_loss"], r["val_bpb"], r["token_perplexity"], r["word_perplexity"],
                  r["text_bpb"], diff]
        lines.append("  ".join(fmt.format(v) for (_, fmt), v in zip(COLUMNS, values)))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (train.run_dir)")
    parser.add_argument("--text", default="builtin:wikitext-2", help="the text of the perplexity columns")
    parser.add_argument("--batches", type=int, default=None, help="score only the text's first N batches of windows")
    parser.add_argument("--out", default=default_out("evaluation_table.json"),
                        help=OUT_HELP.format(name="evaluation_table.json"))
    args = parser.parse_args()
    rows = []
    for run in args.runs:
        rows.append(measure(run, args.text, args.batches))
        print(f"measured {run}", file=sys.stderr, flush=True)
    print(table(rows))
    first = rows[0]
    print(f"text: {args.text}, {first['context']} tokens of context, stride {first['stride']}; transformers = the "
          f"largest relative difference of its token ppl, word ppl and bpb on the run's export")
    write_result(args.out, {"text": args.text, "batches": args.batches, "rows": rows})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
