"""`scaletrain compress`: prune and/or quantize a run into a new run folder, or `--report` a table of the
original and its compressed variants (quality, size, decode speed). docs/compression.md."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import scaletrain.finetune.run  # noqa: F401  registers the "finetuned" kind: a LoRA run is merged, then compressed
from scaletrain.checkpoint.run import load_run, run_kind
from scaletrain.compress import prune as unstructured
from scaletrain.compress import structured
from scaletrain.compress.quantize import (
    AUTO_GROUP_SIZE,
    CPU_GROUP_SIZES,
    GROUP_SIZES,
    METHODS,
    block_input_widths,
    quantize_model,
    resolve_group_size,
)
from scaletrain.compress.run import check_output, state_bytes, write_run  # with the pruned / quantized kinds
from scaletrain.config import ConfigError, add_job_field_arguments, override_job, overrides_from_args
from scaletrain.core.files import check_output_path, write_file
from scaletrain.model.generate import decode_report, generate
from scaletrain.model.moe import refuse_moe

DEFAULT_SPARSITY = 0.5
# The run's job fields `compress` reads, each a --section.field flag over the run's saved config (the one flag
# vocabulary), for this command only: the compressed run keeps the source's job. data.seq_len: the calibration
# sequences' length (and --report's windows); train.batch_size, train.eval_batches (--batches' default) and
# train.precision: how --report scores each run's val split.
COMPRESS_JOB_FIELDS = ("data.seq_len", "train.batch_size", "train.eval_batches", "train.precision")


def add_compress_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", help="the run folder to compress (train.run_dir of a run, or a merged fine-tune)")
    p.add_argument("--out", help="the new run folder to write (must not exist or be empty)")
    p.add_argument("--prune", choices=unstructured.METHODS, help="unstructured or 2:4 pruning by magnitude |W| or "
                                                                 "Wanda |W| x ||X||")
    p.add_argument("--sparsity", type=float, default=None,
                   help="--prune unstructured: fraction of block weights set to zero, in (0, 1); default 0.5, said "
                        "in the output when it is not given (2:4 is always 0.5)")
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
    p.add_argument("--group-size", type=int, default=0,
                   help=f"int4: weights per scale, one of {', '.join(map(str, CPU_GROUP_SIZES))} (a GPU: "
                        f"{', '.join(map(str, GROUP_SIZES))}); default 0 = auto: {AUTO_GROUP_SIZE} where it divides "
                        f"the input width of every block Linear, else the largest smaller size that does (16 for the "
                        f"micro preset, whose SwiGLU is 688 wide), said in the output")
    p.add_argument("--calibration-sequences", type=int, default=64,
                   help="calibration set: this many sequences of data.seq_len tokens")
    p.add_argument("--calibration-text", help="a UTF-8 text file to calibrate on instead of the run's training data")
    p.add_argument("--report", nargs="+", metavar="RUN",
                   help="instead: one table of these run folders (the original first): val perplexity, size, "
                        "decode tokens/s")
    p.add_argument("--batches", type=int, default=None,
                   help="--report: validation batches scored, evenly spread over the val split as training's eval "
                        "spreads them (default: the run's train.eval_batches, the windows its val_loss was on)")
    p.add_argument("--decode-tokens", type=int, default=64, help="--report: tokens generated (batch 1) for speed; "
                                                                 "0 = no speed columns")
    p.add_argument("--rounds", type=int, default=3,
                   help="--report: decode timings per run, interleaved across the runs (medians; a machine busy "
                        "with other jobs is said)")
    p.add_argument("--json", help="--report: also write the table as JSON here")
    add_job_field_arguments(p, COMPRESS_JOB_FIELDS, "the run's job fields (override its saved config for this "
                                                    "command; the compressed run keeps the source's)")


def load_source(run_dir: str | Path) -> tuple:
    """The run to compress, as one plain model (config, model, tokenizer, checkpoint): a LoRA / QLoRA fine-tune has
    its adapters merged in (what ``export --merge`` writes; said in one line); prompt and prefix tuning are refused
    (nothing to merge), and so is a run already quantized."""
    from scaletrain.finetune.export import is_plain, merge_adapters
    from scaletrain.finetune.method_table import method_entry

    cfg, model, tokenizer, ckpt = load_run(run_dir)
    if run_kind(Path(run_dir), cfg) == "quantized":
        raise ConfigError(f"--run {run_dir}: is already quantized; compress the run it came from")
    if not is_plain(model):
        method, entry = cfg.finetune.method, method_entry(cfg.finetune.method)
        if entry.virtual_tokens:
            raise ConfigError(f"--run {run_dir}: is a {method}-tuning run, whose virtual tokens are inputs, not "
                              f"weights: compress its base ({cfg.finetune.source}) instead")
        model = merge_adapters(model, cfg)
        rounded = " (the NF4-rounded base, as `export --merge`)" if entry.quantized_base else ""
        print(f"merged the {method} adapters of {run_dir} into its base{rounded} before compressing", flush=True)
    return cfg, model, tokenizer, ckpt


def calibration_batches(cfg, tokenizer, sequences: int, text: str | None, batch_size: int = 8) -> list[torch.Tensor]:
    """``sequences`` windows of data.seq_len tokens from the start of the run's training split (or ``text``)."""
    from scaletrain.data.loader import TokenStream
    from scaletrain.data.prepare import read_text_file
    from scaletrain.data.run_data import prepare_data
    from scaletrain.data.tokenizer import describe_skipped, encode_known

    if sequences < 1:
        raise ConfigError(f"--calibration-sequences {sequences}: must be >= 1")
    seq = cfg.data.seq_len
    if text:
        path = Path(text)
        if not path.is_file():
            raise ConfigError(f"--calibration-text {text}: not a file")
        ids, unknown = encode_known(tokenizer, read_text_file(path))  # not UTF-8: one DataError line naming it
        if unknown:
            print(describe_skipped(unknown), flush=True)
        ids = torch.tensor(ids, dtype=torch.long)
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
    check_read_fields(args, calibrates=args.prune == "wanda" or structural)
    if args.prune and args.pattern == "unstructured":
        if args.sparsity is None:
            args.sparsity = DEFAULT_SPARSITY
            print(f"--sparsity not given: pruning {100 * DEFAULT_SPARSITY:.0f}% of the block weights (the default)")
        unstructured.check_sparsity(args.sparsity)
    elif args.prune and args.sparsity not in (None, 0.5):
        raise ConfigError(f"--sparsity {args.sparsity} with --pattern 2:4: the pattern fixes the sparsity at 50%; "
                          f"drop --sparsity")
    from scaletrain.core.writer_lock import one_writer  # train's one-writer lock, beside --out

    out = Path(args.out)
    with one_writer(out.parent, f"--out {out}", "choose another --out", name=f".{out.name}.lock", remove=True):
        return _compress(args, structural)


def check_read_fields(args: argparse.Namespace, calibrates: bool) -> None:
    """A job field given to a compression that would not read it (it would be ignored): one line. Compressing
    reads data.seq_len only to calibrate (Wanda, structured pruning); the others are --report's."""
    for key in overrides_from_args(args):
        if key != "data.seq_len":
            raise ConfigError(f"--{key} sets how --report scores each run's val split; drop it or use --report")
        if not calibrates:
            raise ConfigError("--data.seq_len sets the calibration sequences' length, read by --prune wanda and "
                              "structured pruning only; drop it")


def _compress(args: argparse.Namespace, structural: bool) -> int:
    torch.manual_seed(0)
    cfg, model, tokenizer, ckpt = load_source(args.run)
    refuse_moe(cfg.model, "scaletrain compress")  # pruning and quantization read nn.Linear feed-forwards
    if structural:  # bad input before any work
        structured.plan_sizes(cfg.model, args.mlp_fraction, args.drop_blocks)
        structured.plan_heads(cfg.model, args.head_fraction)
    elif args.quantize == "int4-weight":
        resolve_group_size(args.group_size, block_input_widths(model))
    job = override_job(cfg, overrides_from_args(args))  # what this command reads; the new run keeps cfg
    check_output(args.out)  # a path that cannot be written, before any work
    model_cfg, record, source_bytes = cfg.model, {}, state_bytes(model)
    needs_data = args.prune == "wanda" or structural
    calib = calibration_batches(job, tokenizer, args.calibration_sequences, args.calibration_text) \
        if needs_data else None
    if calib is not None:
        record["calibration"] = {"sequences": sum(b.shape[0] for b in calib), "seq_len": job.data.seq_len,
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
        group = resolve_group_size(args.group_size, block_input_widths(model))[0] \
            if args.quantize == "int4-weight" else 0
        note = quantize_model(model, args.quantize, args.group_size)
        record["quantize"] = {"method": args.quantize, "group_size": group, "note": note}
        print(f"quantized: {note}")
    out = write_run(args.out, args.run, cfg, model_cfg, model, record, quantized=bool(args.quantize))
    print(f"wrote {out} ({state_bytes(model) / 1e6:.2f} MB of weights; {args.run} {ckpt.name}: "
          f"{source_bytes / 1e6:.2f} MB); read it with `scaletrain eval --run {out}`")
    return 0


@torch.no_grad()
def decode_sample(model, cfg, tokenizer, tokens: int, prompt: list[int]) -> tuple[int, float, float]:
    """One greedy decode at batch 1 through ``model.generate.generate`` (what `scaletrain generate` runs: with the
    KV cache): (tokens generated, wall seconds, this process's CPU seconds over all its threads)."""
    wall, cpu = time.perf_counter(), time.process_time()
    new = generate(model, prompt, tokens, max_seq_len=cfg.data.seq_len, temperature=0.0,
                   vocab_limit=tokenizer.vocab_size)
    return len(new), time.perf_counter() - wall, time.process_time() - cpu


# Below this share of one core (process CPU seconds per wall second, median over the samples) the process
# mostly waited for other jobs: its wall-clock speeds say more about the machine than about the variants.
BUSY_CPU_SHARE = 0.5


def decode_speeds(samples: dict) -> tuple[dict, dict, str]:
    """From interleaved ``samples`` (per variant, one (tokens, wall s, CPU s) per round, rounds in the same
    order for every variant): (median tokens/s per variant, median per-round speed ratio to the first
    variant, a 'machine busy' note or ""). The ratio of each round compares variants timed seconds apart, so a
    load that comes and goes shifts both sides alike; its median drops the rounds a spike hit."""
    import statistics

    names = list(samples)
    rates = {n: statistics.median(t / w for t, w, _ in samples[n]) for n in names}
    base = samples[names[0]]
    ratios = {n: statistics.median((t / w) / (bt / bw) for (t, w, _), (bt, bw, _) in zip(samples[n], base))
              for n in names}
    share = statistics.median(c / w for n in names for _, w, c in samples[n] if w > 0)
    busy = "" if share >= BUSY_CPU_SHARE else (
        f"machine busy: this process got {share:.2f} of a core while decoding (CPU time / wall time); the speeds "
        f"are the machine's load more than the variants': re-run on a quiet machine (or with fewer threads)")
    return rates, ratios, busy


def measure(run: str, batches: int | None, overrides: dict[str, str]) -> tuple[dict, tuple]:
    """Validation loss / perplexity (``score_run``: training's eval windows, ``batches`` of them or the run's
    train.eval_batches) and saved weight bytes of ``run``; and what its decode timing needs (model, config,
    tokenizer, prompt: the val split's first 8 tokens). ``overrides``: the command line's job fields, over the
    run's own."""
    from scaletrain.data.loader import TokenStream
    from scaletrain.data.run_data import prepare_data
    from scaletrain.train.evaluate import perplexity, score_run

    saved, model, tokenizer, _ = load_run(run)
    cfg = override_job(saved, overrides)
    score = score_run(cfg, model, tokenizer, batches, trained=saved)
    prompt = TokenStream(str(prepare_data(cfg)), "val").read(0, 8).astype("int64").tolist()
    loss, count = score.loss, score.windows * cfg.data.seq_len
    record = Path(run) / "compress.json"
    what = json.loads(record.read_text()) if record.is_file() else {}
    label = ", ".join(filter(None, [
        f"{what['prune']['method']} {what['prune']['pattern']}" if "prune" in what else "",
        "structured" if "structured" in what else "", what["quantize"]["method"] if "quantize" in what else ""]))
    row = {"run": str(run), "variant": label or "original", "val_loss": loss, "val_perplexity": perplexity(loss),
           "val_bpb": score.score.bpb, "tokens_scored": count, "bytes": state_bytes(model)}
    row["scored"] = score.windows_text
    return row, (model, cfg, tokenizer, prompt)


def report(args: argparse.Namespace) -> int:
    if args.rounds < 1:
        raise ConfigError(f"--rounds {args.rounds}: must be >= 1")
    if args.json:  # before the measurements, not after them
        check_output_path(args.json, f"--json {args.json}")
    measured = [measure(run, args.batches, overrides_from_args(args)) for run in args.report]
    rows = [row for row, _ in measured]
    busy = ""
    if args.decode_tokens:
        # Interleaved: every round times each variant once, the order reversed every other round, so no variant
        # always runs first (warm caches) or last; one warm-up decode each first.
        timings = [timing for _, timing in measured]
        samples: dict[int, list] = {i: [] for i in range(len(rows))}
        for model, cfg, tokenizer, prompt in timings:
            decode_sample(model, cfg, tokenizer, 4, prompt)
        for r in range(args.rounds):
            for i in (range(len(rows)) if r % 2 == 0 else reversed(range(len(rows)))):
                model, cfg, tokenizer, prompt = timings[i]
                samples[i].append(decode_sample(model, cfg, tokenizer, args.decode_tokens, prompt))
        rates, ratios, busy = decode_speeds(samples)
        # prefill and decode tokens/s with the KV cache at batch 1 and 8 (random prompts of 8 tokens), into --json
        for row, (model, cfg, tokenizer, prompt) in zip(rows, timings):
            row.update(decode_report(model, tokenizer.vocab_size, len(prompt), args.decode_tokens, cfg.data.seq_len))
    base = rows[0]
    print(f"{'run':<36} {'variant':<24} {'val ppl':>9} {'d ppl':>8} {'val bpb':>8} {'MB':>8} {'size':>6} "
          f"{'decode tok/s':>12} {'speed':>6}")
    for i, r in enumerate(rows):
        r["perplexity_change"] = r["val_perplexity"] / base["val_perplexity"] - 1
        r["size_ratio"] = r["bytes"] / base["bytes"]
        r["decode_tokens_per_s"] = rates[i] if args.decode_tokens else 0.0
        r["speed_ratio"] = ratios[i] if args.decode_tokens else 0.0
        r["machine_busy"] = bool(busy)
        print(f"{Path(r['run']).name[:36]:<36} {r['variant'][:24]:<24} {r['val_perplexity']:>9.2f} "
              f"{100 * r['perplexity_change']:>+7.1f}% {r['val_bpb']:>8.4f} {r['bytes'] / 1e6:>8.2f} "
              f"{r['size_ratio']:>5.2f}x "
              f"{r['decode_tokens_per_s']:>12.1f} {r['speed_ratio']:>5.2f}x")
    if args.decode_tokens:
        print(f"decode: medians of {args.rounds} interleaved round(s) of {args.decode_tokens} tokens at batch 1 on "
              f"{torch.get_num_threads()} thread(s); speed = the median of each round's ratio to the first run"
              + (f"; {busy}" if busy else ""))
    for scored in dict.fromkeys(r.pop("scored") for r in rows):  # said once when every run had the same windows
        print(f"val ppl: {scored}")
    if args.json:
        write_file(args.json, json.dumps(rows, indent=2), f"the table {args.json}")
    return 0
