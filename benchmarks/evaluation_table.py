"""One quality table over run folders, in the field's units (docs/evaluation.md): for each run, the validation
loss and bits per byte training's evaluation computes, and the standard perplexity of a text (default WikiText-2's
validation split: token perplexity, word-level perplexity, bits per byte) with the relative difference of
transformers on the run's Hugging Face export scoring the same windows; then gutenberg-cloze's accuracy
(`eval --tasks gutenberg-cloze`, built from the run's own held-out split) with lm-eval's own `hf` backend on the
same export scoring the same task (its accuracy, and the largest difference of a per-choice log-likelihood).

    python benchmarks/evaluation_table.py RUN [RUN ...] [--text builtin:wikitext-2] [--batches N] [--no-cloze]
                                          [--out FILE]

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
           ("word ppl", "{:>10.2f}"), ("text bpb", "{:>8.4f}"), ("transformers", "{:>12}"), ("cloze acc", "{:>9}"),
           ("hf acc", "{:>7}"), ("hf max |dLL|", "{:>12}")]


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


def cloze(run: Path, quantized: bool) -> dict:
    """gutenberg-cloze through ``eval --tasks``; then, unless quantized, lm-eval's ``hf`` backend on the run's
    export (merged adapters) on the same task folder: its accuracy and per-choice log-likelihood differences."""
    ours = eval_json(["--run", str(run), "--tasks", "gutenberg-cloze"])["tasks"]["gutenberg-cloze"]
    row = {"cloze_acc": ours["metrics"]["acc"], "cloze_acc_norm": ours["metrics"].get("acc_norm"),
           "cloze_items": ours["samples"], "hf_cloze_acc": None, "hf_max_loglikelihood_difference": None}
    if quantized:
        return row
    import torch  # the oracle: lm-eval's hf backend on the export (the scores it gives, not ours)
    from lm_eval import evaluator
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from scaletrain.evaluation.lm_eval_model import ScaletrainLM
    from scaletrain.evaluation.tasks import cloze_folder
    from scaletrain.infer.load import load_run

    torch.manual_seed(0)
    cfg, model, tok, _ = load_run(str(run))
    folder = cloze_folder(cfg, say=lambda _: None)
    with tempfile.TemporaryDirectory() as tmp:
        merge = ["--merge"] if cfg.finetune.method in ("lora", "qlora", "dora") else []
        subprocess.run([sys.executable, "-m", "scaletrain.cli", "export", "--run", str(run), "--out", tmp, *merge],
                       check=True, capture_output=True)
        # A char tokenizer has no BOS / EOS: lm-eval needs a prefix id for an empty context only (none here).
        prefix = {} if tok.bos_id is not None or tok.eos_id is not None else {"prefix_token_id": 0}
        hf = HFLM(pretrained=tmp, device="cpu", dtype="float32", batch_size=8, **prefix)
        manager = TaskManager(include_path=str(folder))
        theirs = evaluator.simple_evaluate(model=hf, tasks=["gutenberg-cloze"], task_manager=manager)
    mine = evaluator.simple_evaluate(model=ScaletrainLM(model, tok, cfg.model.max_seq_len, batch_size=8),
                                     tasks=["gutenberg-cloze"], task_manager=TaskManager(include_path=str(folder)))
    diffs = [abs(a[0][0] - b[0][0]) for x, y in zip(mine["samples"]["gutenberg-cloze"],
                                                   theirs["samples"]["gutenberg-cloze"])
             for a, b in zip(x["resps"], y["resps"])]
    row["hf_cloze_acc"] = theirs["results"]["gutenberg-cloze"]["acc,none"]
    row["hf_max_loglikelihood_difference"] = max(diffs)
    return row


def table(rows: list[dict]) -> str:
    """The rows as the plain-text table the script prints."""
    head = "  ".join(fmt.replace(".4f", "").replace(".2f", "").format(name) for name, fmt in COLUMNS)
    lines = [head]
    for r in rows:
        diff = f"{r['transformers_relative_difference']:.1e}" if r["transformers_relative_difference"] is not None \
            else "n/a"
        def pct(key: str) -> str:
            return f"{100 * r[key]:.1f}%" if r.get(key) is not None else "n/a"

        dll = f"{r['hf_max_loglikelihood_difference']:.1e}" if r.get("hf_max_loglikelihood_difference") is not None \
            else "n/a"
        values = [Path(r["run"]).name[:28], r["val_loss"], r["val_bpb"], r["token_perplexity"], r["word_perplexity"],
                  r["text_bpb"], diff, pct("cloze_acc"), pct("hf_cloze_acc"), dll]
        lines.append("  ".join(fmt.format(v) for (_, fmt), v in zip(COLUMNS, values)))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (train.run_dir)")
    parser.add_argument("--text", default="builtin:wikitext-2", help="the text of the perplexity columns")
    parser.add_argument("--batches", type=int, default=None, help="score only the text's first N batches of windows")
    parser.add_argument("--no-cloze", action="store_true", help="leave out the gutenberg-cloze columns")
    parser.add_argument("--out", default=default_out("evaluation_table.json"),
                        help=OUT_HELP.format(name="evaluation_table.json"))
    args = parser.parse_args()
    rows = []
    for run in args.runs:
        row = measure(run, args.text, args.batches)
        if not args.no_cloze:
            row.update(cloze(run, is_quantized(run)))
        rows.append(row)
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
