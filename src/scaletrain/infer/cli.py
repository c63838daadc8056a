"""``scaletrain generate`` (one prompt, or a JSONL file of them in batches) and ``scaletrain chat``.

Both read any run folder through ``checkpoint.run.load_run`` (trained, fine-tuned with adapters, pruned,
quantized) and generate with the KV cache (``model/generate.py``) within the context the run was trained on
(``data.seq_len``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from scaletrain.checkpoint.run import load_run
from scaletrain.data.tokenizer import DataError
from scaletrain.files import guarded_write
from scaletrain.infer.chat import Chat, Render, conversation_format
from scaletrain.infer.text import StreamPrinter
from scaletrain.model.generate import Sampling, cut_at_stop, generate_batch, stop_at_strings, stream
from scaletrain.options import ConfigError


def add_sampling_arguments(p: argparse.ArgumentParser, temperature: float, top_k: int) -> None:
    p.add_argument("--run", required=True, help="the run folder (train.run_dir)")
    p.add_argument("--max-tokens", type=int, default=200, help="tokens to generate (an answer, in chat)")
    p.add_argument("--temperature", type=float, default=temperature, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=top_k, help="sample among the k most likely tokens; 0 = all")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass; 1 = off")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divide the (positive) logits of tokens already in the text by this; 1 = off")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end the text at this string (not included); repeat for several")
    p.add_argument("--seed", type=int, default=0)


def sampling_of(args: argparse.Namespace) -> Sampling:
    if args.max_tokens < 0 or args.temperature < 0 or not 0 < args.top_p <= 1 or args.top_k < 0 \
            or args.repetition_penalty <= 0:
        raise ConfigError("--max-tokens, --temperature and --top-k must be >= 0, --top-p in (0, 1] and "
                          "--repetition-penalty > 0")
    if any(not s for s in args.stop):
        raise ConfigError("--stop: a stop string must not be empty")
    return Sampling(args.temperature, args.top_k, args.top_p, args.repetition_penalty)


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Continue a prompt with a run's model (KV cache; past the trained context the window "
                     "slides). --prompts-file: a JSONL file of {\"prompt\": ...} lines, generated in batches "
                     "(left-padded) into --out, each line with its \"completion\" added.")
    add_sampling_arguments(p, temperature=0.8, top_k=200)
    p.add_argument("--prompt", default="\n", help="text to continue")
    p.add_argument("--stream", action="store_true", help="print the tokens as they come")
    p.add_argument("--prompts-file", help="JSONL, one {\"prompt\": TEXT, ...} a line (other fields are kept)")
    p.add_argument("--out", help="--prompts-file: the JSONL to write (default: print the completions)")
    p.add_argument("--batch-size", type=int, default=8, help="--prompts-file: prompts generated together")
    p.add_argument("--no-cache", action="store_true",
                   help="re-run the whole context at every token (the slow reference; for comparisons)")


def run_generate(args: argparse.Namespace) -> int:
    sampling = sampling_of(args)
    if args.batch_size < 1:
        raise ConfigError("--batch-size must be >= 1")
    if args.out and not args.prompts_file:
        raise ConfigError("--out goes with --prompts-file")
    cfg, model, tokenizer, _ = load_run(args.run)
    kw = dict(max_seq_len=cfg.data.seq_len, sampling=sampling, stop_id=tokenizer.eos_id,
              vocab_limit=tokenizer.vocab_size, use_cache=not args.no_cache,
              stop=stop_at_strings(tokenizer.decode, args.stop) if args.stop else None)
    if args.prompts_file:
        fmt = conversation_format(args.run, tokenizer, cfg.finetune.chat_template)
        return _generate_file(args, model, tokenizer, {**kw, "stop_id": fmt.stop_ids}, fmt.render)
    prompt = tokenizer.encode(args.prompt)
    if not prompt:
        raise ConfigError("--prompt must not be empty")
    generator = torch.Generator().manual_seed(args.seed)
    if args.stream:
        sys.stdout.write(args.prompt)
        printer = StreamPrinter(tokenizer.decode, args.stop, sys.stdout)
        for step in stream(model, [prompt], args.max_tokens, generator=generator, **kw):
            for _, token in step:
                printer.add(token)
        printer.finish()
        print()
        return 0
    new = generate_batch(model, [prompt], args.max_tokens, generator=generator, **kw)[0]
    print(args.prompt + cut_at_stop(tokenizer.decode(new), args.stop))
    return 0


def read_prompts(path: str) -> list[dict]:
    """The lines of a prompts file: {"prompt": text} (continued as it is) or {"messages": [{"role", "content"},
    ...]} (a conversation, rendered in the run's chat template); a bad line is one DataError naming it."""
    file = Path(path)
    if not file.is_file():
        raise DataError(f"--prompts-file: file not found: {file}")
    records = []
    for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict) and "messages" in record and "prompt" not in record:
            messages = record["messages"]
            if not (isinstance(messages, list) and messages and all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in messages)):
                raise DataError(f"{file}:{number}: \"messages\" must be a non-empty list of {{\"role\", "
                                f"\"content\"}} objects with string values")
        elif not isinstance(record, dict) or not isinstance(record.get("prompt"), str) or not record["prompt"]:
            raise DataError(f"{file}:{number}: needs a JSON object with a non-empty string field \"prompt\" or a "
                            f"\"messages\" list")
        records.append(record)
    if not records:
        raise DataError(f"{file}: no prompts")
    return records


def _generate_file(args, model, tokenizer, kw, render: Render) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    records = read_prompts(args.prompts_file)
    prompts = [tokenizer.encode(r["prompt"]) if "prompt" in r else render(r["messages"]) for r in records]
    for number, ids in enumerate(prompts, 1):  # named by their place in the file, before any is generated
        if not ids or len(ids) > kw["max_seq_len"]:
            raise ConfigError(f"{args.prompts_file}: prompt {number} is {len(ids)} tokens; it must be 1 to "
                              f"{kw['max_seq_len']} (the model's context, data.seq_len)")
    generator = torch.Generator().manual_seed(args.seed)
    columns = (TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True)) as bar:
        task = bar.add_task("prompts", total=len(records))
        for start in range(0, len(records), args.batch_size):
            batch = prompts[start:start + args.batch_size]
            for offset, new in enumerate(generate_batch(model, batch, args.max_tokens, generator=generator, **kw)):
                records[start + offset]["completion"] = cut_at_stop(tokenizer.decode(new), args.stop)
            bar.advance(task, len(batch))
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    if not args.out:
        sys.stdout.write(lines)
        return 0
    out = Path(args.out)
    with guarded_write(f"the completions ({out})", out, cleanup=(out,)):
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(lines, encoding="utf-8")
    print(f"wrote {len(records)} completions to {out}")
    return 0


def add_chat_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Talk to a run's model in the terminal, in the instruction template it was fine-tuned with "
                     "(data/instructions.py). Commands: /reset (forget the conversation), /system TEXT (set the "
                     "system message), /exit (or end of input). The oldest turns are dropped, with a note, to keep "
                     "the conversation within the trained context (data.seq_len).")
    add_sampling_arguments(p, temperature=0.7, top_k=50)
    p.set_defaults(max_tokens=128)
    p.add_argument("--system", default="", help="the system message to start with")


def run_chat(args: argparse.Namespace) -> int:
    sampling = sampling_of(args)
    cfg, model, tokenizer, _ = load_run(args.run)
    chat = Chat(model, tokenizer, cfg.data.seq_len, sampling, args.max_tokens, args.stop,
                torch.Generator().manual_seed(args.seed), system=args.system,
                conversation=conversation_format(args.run, tokenizer, cfg.finetune.chat_template))
    chat.loop(sys.stdin, sys.stdout)
    return 0
