"""`scaletrain compress`: prune and/or quantize a run into a new run folder, or `--report` a table of the
original and its compressed variants (quality, size, decode speed). docs/compression.md."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from scaletrain.compress import prune as unstructured
from scaletrain.compress import structured
from scaletrain.compress.quantize import GROUP_SIZES, METHODS, quantize_model
from scaletrain.compress.run import load_run, load_source, state_bytes, write_run
from scaletrain.config import ConfigError


def add_compress_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", help="the run folder to compress (train.run_dir of a run, or a merged fine-tune)")
    p.add_argument("--out", help="the new run folder to write (must not exist or be empty)")
    p.add_argument("--prune", choices=unstructured.METHODS, help="unstructured or 2:4 pruning by magnitude |W| or "
                                                                 "Wanda |W| x ||X||")
    p.add_argument("--sparsity", type=float, default=0.5, help="--prune: fraction of block weights set to zero, "
                                                               "in (0, 1)")
    p.add_argument("--pattern", choices=("unstructured", "2:4"), default="unstructured",
                   help="--prune: any weights, or 2 of every 4 consecutive inputs (50%%)")
    p.add_argument("--scope", choices=unstructured.SCOPES, default="layer",
                   help="--prune unstructured: compare within each layer (Wanda: each output row) or globally")
    p.add_argument("--one-pass", action="store_true",
                   help="--prune wanda: take every layer's input norms from one forward pass of the dense model "
                        "instead of block by block on the pruned earlier blocks' outputs (the default, as the "
                        "paper's code)")
    p.add_argument("--mlp-fraction", type=float, default=0.0,
                   help="structured: share of SwiGLU neurons removed in every block, in [0, 1)")
    p.add_argument("--head-fraction", type=float, default=0.0,
                   help="structured: share of attention heads removed in every block, as whole KV groups (a KV "
                        "head with its query heads), in [0, 1); must be a whole number of groups")
    p.add_argument("--drop-blocks", type=int, default=0, help="structured: whole blocks removed (lowest influence)")
    p.add_argument("--quantize", choices=METHODS, help="post-training quantization of the block Linears (torchao), "
                                                       "after any pruning")
    p.add_argument("--group-size", type=int, default=128, help=f"int4: weights per scale, one of {GROUP_SIZES}")
    p.add_argument("--calibration-sequences", type=int, default=64,
                   help="calibration set: this many sequences of data.seq_len tokens")
    p.add_argument("--calibration-text", help="a UTF-8 text file to calibrate on instead of the run's training data")
    p.add_argument("--report", nargs="+", metavar="RUN",
                   help="instead: one table of these run folders (the original first): val perplexity, size, "
                        "decode tokens/s")
    p.add_argument("--batches", type=int, default=8, help="--report: validation batches scored")
    p.add_argument("--decode-tokens", type=int, default=64, help="--report: tokens generated (batch 1) for speed")
    p.add_argument("--json", help="--report: also write the table as JSON here")


def calibration_batches(cfg, tokenizer, sequences: int, text: str | None, batch_size: int = 8) -> list[torch.Tensor]:
    """``sequences`` windows of data.seq_len tokens from the start of the run's training split (or ``text``)."""
    from scaletrain.data.loader import TokenStream
    from scaletrain.train.trainer import prepare_data

    if sequences < 1:
        raise ConfigError(f"--calibration-sequences {sequences}: must be >= 1")
    seq = cfg.data.seq_len
    if text:
        path = Path(text)
        if not path.is_file():
            raise ConfigError(f"--calibration-text {text}: not a file")
        ids = torch.tensor(tokenizer.encode(path.read_text(encoding="utf-8")), dtype=torch.long)
    else:
        stream = TokenStream(str(prepare_data(cfg)), "train")
        ids = torch.from_numpy(stream.read(0, min(stream.total, sequences * seq)).astype("int64"))
    n = min(sequences, ids.numel() // seq)
    if n < 1:
        raise ConfigError(f"the calibration text has {ids.numel()} tokens, fewer than one sequence of {seq}")
    rows = ids[:n * seq].view(n, seq)
    return list(rows.split(batch_size))


def run_compress(args: argparse.Namespace) -> int:
    if args.report:
        return report(args)
    if not args.run or not args.out:
        raise ConfigError("compress needs --run RUN and --out FOLDER (or --report RUN ...)")
    structural = bool(args.mlp_fraction or args.drop_blocks or args.head_fraction)
    if not (args.prune or args.quantize or structural):
        raise ConfigError("nothing to do: give --prune, --mlp-fraction / --head-fraction / --drop-blocks and/or "
                          "--quantize")
    if args.prune and args.pattern == "unstructured":
        unstructured.check_sparsity(args.sparsity)
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):  # before any work (write_run checks again)
        raise ConfigError(f"--out {out}: exists and is not empty; choose a new folder")
    torch.manual_seed(0)
    cfg, model, tokenizer, ckpt = load_source(args.run)
    if structural:  # bad input before any work
        structured.plan_sizes(cfg.model, args.mlp_fraction, args.drop_blocks)
        structured.plan_heads(cfg.model, args.head_fraction)
    model_cfg, record, source_bytes = cfg.model, {}, state_bytes(model)
    needs_data = args.prune == "wanda" or structural
    calib = calibration_batches(cfg, tokenizer, args.calibration_sequences, args.calibration_text) \
        if needs_data else None
    if calib is not None:
        record["calibration"] = {"sequences": sum(b.shape[0] for b in calib), "seq_len": cfg.data.seq_len,
                                 "source": args.calibration_text or "training split"}
    if structural:
        model, model_cfg, record["structured"] = structured.prune_structured(
            model, structured.importance(model, calib), args.mlp_fraction, args.drop_blocks, args.head_fraction)
        rec = record["structured"]
        print(f"structured: SwiGLU {rec['ffn_hidden_dim'][0]} -> {model_cfg.ffn_hidden_dim} neurons, attention "
              f"{rec['n_heads'][0]} -> {rec['n_heads'][1]} heads ({rec['n_kv_heads'][0]} -> {rec['n_kv_heads'][1]} "
              f"KV groups, width {rec['head_dim']}), {cfg.model.n_layers} -> {model_cfg.n_layers} blocks; parameters "
              f"{record['structured']['parameters'][0]:,} -> {record['structured']['parameters'][1]:,}")
    if args.prune:
        record["prune"] = unstructured.prune(model, args.prune, args.sparsity, args.scope, args.pattern, calib,
                                                   sequential=not args.one_pass)
        print(f"pruned {args.prune} {args.pattern}: {100 * record['prune']['sparsity']:.1f}% of the block weights "
              f"are zero (masks applied to dense weights: no speed-up on dense kernels)")
    if args.quantize:
        note = quantize_model(model, args.quantize, args.group_size)
        record["quantize"] = {"method": args.quantize, "group_size": args.group_size, "note": note}
        print(f"quantized: {note}")
    out = write_run(args.out, args.run, cfg, model_cfg, model, record, quantized=bool(args.quantize))
    print(f"wrote {out} ({state_bytes(model) / 1e6:.2f} MB of weights; {args.run} {ckpt.name}: "
          f"{source_bytes / 1e6:.2f} MB); read it with `scaletrain eval --run {out}`")
    return 0


@torch.no_grad()
def decode_tokens_per_second(model, cfg, tokenizer, tokens: int, prompt: list[int]) -> float:
    """Greedy decoding at batch 1 through ``model.generate.generate`` (what `scaletrain generate` runs: with the KV
    cache)."""
    from scaletrain.model.generate import generate

    generate(model, prompt, 4, max_seq_len=cfg.data.seq_len, temperature=0.0, vocab_limit=tokenizer.vocab_size)
    t0 = time.perf_counter()
    new = generate(model, prompt, tokens, max_seq_len=cfg.data.seq_len, temperature=0.0,
                   vocab_limit=tokenizer.vocab_size)
    return len(new) / (time.perf_counter() - t0)


def measure(run: str, batches: int, decode_tokens: int) -> dict:
    """Validation loss / perplexity (first ``batches`` batches), saved weight bytes, decode tokens/s."""
    from scaletrain.data.loader import TokenStream
    from scaletrain.model.generate import decode_report
    from scaletrain.train.evaluate import perplexity, token_loss
    from scaletrain.train.trainer import prepare_data

    cfg, model, tokenizer, _ = load_run(run)
    stream = TokenStream(str(prepare_data(cfg)), "val")
    n = min(stream.total, batches * cfg.train.batch_size * cfg.data.seq_len + 1)
    tokens = torch.from_numpy(stream.read(0, n).astype("int64"))
    loss, count = token_loss(model, tokens, cfg.data.seq_len, cfg.train.batch_size, vocab_limit=tokenizer.vocab_size)
    prompt = tokens[:8].tolist()
    speed = decode_tokens_per_second(model, cfg, tokenizer, decode_tokens, prompt) if decode_tokens else 0.0
    # prefill and decode tokens/s with the KV cache at batch 1 and 8 (random prompts of 8 tokens), into --json
    rates = decode_report(model, tokenizer.vocab_size, len(prompt), decode_tokens, cfg.data.seq_len) \
        if decode_tokens else {}
    record = Path(run) / "compress.json"
    what = json.loads(record.read_text()) if record.is_file() else {}
    label = ", ".join(filter(None, [
        f"{what['prune']['method']} {what['prune']['pattern']}" if "prune" in what else "",
        "structured" if "structured" in what else "", what["quantize"]["method"] if "quantize" in what else ""]))
    return {"run": str(run), "variant": label or "original", "val_loss": loss, "val_perplexity": perplexity(loss),
            "tokens_scored": count, "bytes": state_bytes(model), "decode_tokens_per_s": speed, **rates}


def report(args: argparse.Namespace) -> int:
    rows = [measure(run, args.batches, args.decode_tokens) for run in args.report]
    base = rows[0]
    print(f"{'run':<36} {'variant':<24} {'val ppl':>9} {'d ppl':>8} {'MB':>8} {'size':>6} {'decode tok/s':>12} "
          f"{'speed':>6}")
    for r in rows:
        r["perplexity_change"] = r["val_perplexity"] / base["val_perplexity"] - 1
        r["size_ratio"] = r["bytes"] / base["bytes"]
        r["speed_ratio"] = r["decode_tokens_per_s"] / base["decode_tokens_per_s"] if base["decode_tokens_per_s"] \
            else 0.0
        print(f"{Path(r['run']).name[:36]:<36} {r['variant'][:24]:<24} {r['val_perplexity']:>9.2f} "
              f"{100 * r['perplexity_change']:>+7.1f}% {r['bytes'] / 1e6:>8.2f} {r['size_ratio']:>5.2f}x "
              f"{r['decode_tokens_per_s']:>12.1f} {r['speed_ratio']:>5.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0
