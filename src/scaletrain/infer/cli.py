"""``scaletrain generate`` (one prompt, or a JSONL file of them in batches) and ``scaletrain chat``.

Both read any run folder as a ``Session`` (``infer/session.py``, over ``checkpoint.run.load_run``: trained,
fine-tuned with adapters, pruned, quantized) and generate with the KV cache (``model/generate.py``) within the
context the run was trained on (``data.seq_len``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from scaletrain.core.files import check_output_path, write_file
from scaletrain.core.options import ConfigError
from scaletrain.data.instructions import check_messages
from scaletrain.data.sources import decode_text_file
from scaletrain.data.tokenizer import DataError
from scaletrain.infer.chat import Chat
from scaletrain.infer.session import SAMPLING_DEFAULTS, Session, compiled_decoder
from scaletrain.infer.text import StreamPrinter
from scaletrain.model.generate import Sampling, cut_at_stop

__all__ = ["compiled_decoder"]  # (kept importable here: tests and scripts reach it as infer.cli's)


def add_sampling_arguments(p: argparse.ArgumentParser, command: str) -> None:
    """The sampling flags, their defaults ``SAMPLING_DEFAULTS[command]`` (one place for every command's)."""
    defaults = SAMPLING_DEFAULTS[command]
    p.add_argument("--run", required=True, help="the run folder (train.run_dir)")
    p.add_argument("--max-tokens", type=int, default=200, help="tokens to generate (an answer, in chat)")
    p.add_argument("--temperature", type=float, default=defaults.temperature, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=defaults.top_k,
                   help="sample among the k most likely tokens; 0 = all")
    p.add_argument("--top-p", type=float, default=defaults.top_p, help="nucleus sampling mass; 1 = off")
    p.add_argument("--repetition-penalty", type=float, default=defaults.repetition_penalty,
                   help="divide the (positive) logits of tokens already in the text by this; 1 = off")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end the text at this string (not included); repeat for several")
    p.add_argument("--seed", type=int, default=0)


# The most tokens one `generate` may ask for, in contexts: the model reads only its last context of tokens, so
# text past it is a window sliding over its own output (--slide), each token a whole window's forward. Sixteen
# windows are far more text than any continuation stays coherent for, and bound the run (a mistyped 1e9 ran on
# for hours without a word).
MAX_CONTEXTS = 16
LONG_GENERATION = 256  # tokens: past this many a progress bar on stderr says how far it is


def sampling_of(args: argparse.Namespace) -> Sampling:
    """The sampling flags checked (``Sampling.check``: NaN, infinity and out-of-range values are one line)."""
    if args.max_tokens < 0:
        raise ConfigError(f"--max-tokens must be >= 0 (got {args.max_tokens})")
    if any(not s for s in args.stop):
        raise ConfigError("--stop: a stop string must not be empty")
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.repetition_penalty)
    sampling.check()
    return sampling


def check_max_tokens(max_tokens: int, context: int) -> None:
    """Refuse more tokens than ``MAX_CONTEXTS`` contexts (see there why)."""
    if max_tokens > MAX_CONTEXTS * context:
        raise ConfigError(f"--max-tokens {max_tokens:,} is more than {MAX_CONTEXTS} x the model's context of "
                          f"{context:,} tokens ({MAX_CONTEXTS * context:,}): past its context the model reads only "
                          f"its last {context:,} tokens and each new one costs a whole window's forward; ask for at "
                          f"most {MAX_CONTEXTS * context:,}")


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Continue a prompt with a run's model (KV cache), up to the context it was trained on "
                     "(data.seq_len; --slide goes on past it, a sliding window). --prompts-file: a JSONL file of "
                     "{\"prompt\": ...} lines, generated in batches (left-padded) into --out, each line with its "
                     "\"completion\" added.")
    add_sampling_arguments(p, "generate")
    p.add_argument("--prompt", default=None, help="text to continue (default: a newline)")
    p.add_argument("--slide", action="store_true",
                   help="go on past the model's context: each new token then re-reads the last data.seq_len tokens "
                        "(a whole window's forward per token; without it generation stops at the context)")
    p.add_argument("--stream", action="store_true", help="print the tokens as they come")
    p.add_argument("--prompts-file", help="JSONL, one {\"prompt\": TEXT, ...} a line (other fields are kept)")
    p.add_argument("--out", help="--prompts-file: the JSONL to write (default: print the completions)")
    p.add_argument("--batch-size", type=int, default=8, help="--prompts-file: prompts generated together")
    p.add_argument("--no-cache", action="store_true",
                   help="re-run the whole context at every token (the slow reference; for comparisons)")
    p.add_argument("--compile", action="store_true",
                   help="decode with a static KV cache and a torch.compile'd one-token step (CUDA graphs on a GPU); "
                        "the same greedy tokens; compiling costs seconds to a minute once per batch shape, so it pays "
                        "for long generations and on GPUs (docs/inference.md)")


def run_generate(args: argparse.Namespace) -> int:
    sampling = sampling_of(args)
    if args.batch_size < 1:
        raise ConfigError("--batch-size must be >= 1")
    if args.out and not args.prompts_file:
        raise ConfigError("--out goes with --prompts-file")
    if args.out:  # before the model loads and generates
        check_output_path(args.out, f"--out {args.out}")
    if args.prompt is not None and args.prompts_file:
        raise ConfigError("--prompt and --prompts-file are two sources of prompts: give one (put the prompt in the "
                          "file as a {\"prompt\": ...} line)")
    if args.compile and args.no_cache:
        raise ConfigError("--compile decodes with a (static) KV cache; --no-cache has none: give one of them")
    records = read_prompts(args.prompts_file) if args.prompts_file else None  # before the model loads
    session = Session.from_run(args.run, compile=args.compile)
    check_max_tokens(args.max_tokens, session.context)
    kw = dict(sampling=sampling, stops=args.stop, use_cache=not args.no_cache, slide=args.slide)
    if records is not None:
        return _generate_file(args, records, session, kw)
    text = "\n" if args.prompt is None else args.prompt
    prompt = session.tokenizer.encode(text)
    if not prompt:
        raise ConfigError("--prompt must not be empty")
    generator = torch.Generator().manual_seed(args.seed)
    steps = session.stream([prompt], args.max_tokens, generator=generator, **kw)
    new: list[int] = []
    if args.stream:
        sys.stdout.write(text)
        printer = StreamPrinter(session.tokenizer.decode, args.stop, sys.stdout)
        for step in steps:
            for _, token in step:
                new.append(token)
                printer.add(token)
        printer.finish()
        print()
    else:
        with token_progress(args.max_tokens) as advance:
            for step in steps:
                new += [token for _, token in step]
                advance()
        print(text + cut_at_stop(session.tokenizer.decode(new), args.stop))
    context_note(len(prompt), len(new), args, session.context)
    return 0


@contextmanager
def token_progress(total: int) -> Iterator[Callable[[], None]]:
    """A progress bar on stderr for a generation of more than ``LONG_GENERATION`` tokens (it may end sooner,
    at a stop token or the context); yields the function that counts one step."""
    if total <= LONG_GENERATION:
        yield lambda: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TextColumn("tokens"),
               TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("tokens", total=total)
        yield lambda: bar.advance(task)


def context_note(prompt_tokens: int, new_tokens: int, args: argparse.Namespace, context: int) -> None:
    """One line on stderr when generation stopped at the model's context before --max-tokens."""
    if not args.slide and new_tokens < args.max_tokens and prompt_tokens + new_tokens > context:
        print(f"(stopped at the model's {context}-token context: {prompt_tokens} prompt + {new_tokens} new tokens; "
              f"--slide goes on past it)", file=sys.stderr)


def read_prompts(path: str) -> list[dict]:
    """The lines of a prompts file: {"prompt": text} (continued as it is) or {"messages": [{"role", "content"},
    ...]} (a conversation, rendered in the run's chat template; ``check_messages``, fine-tuning's rule); a bad
    line, or a file that is not UTF-8 text, is one DataError naming it."""
    file = Path(path)
    if not file.is_file():
        raise DataError(f"--prompts-file: file not found: {file}")
    text = decode_text_file(file.read_bytes(), file, "a prompts file is UTF-8 JSONL")
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict) and "messages" in record and "prompt" not in record:
            check_messages(record["messages"], f"{file}:{number}")
        elif not isinstance(record, dict) or not isinstance(record.get("prompt"), str) or not record["prompt"]:
            raise DataError(f"{file}:{number}: needs a JSON object with a non-empty string field \"prompt\" or a "
                            f"\"messages\" list")
        records.append(record)
    if not records:
        raise DataError(f"{file}: no prompts")
    return records


def _generate_file(args, records: list[dict], session: Session, kw: dict) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    prompts = [session.tokenizer.encode(r["prompt"]) if "prompt" in r else session.render(r["messages"])
               for r in records]
    for number, ids in enumerate(prompts, 1):  # named by their place in the file, before any is generated
        if not ids or len(ids) > session.context:
            raise ConfigError(f"{args.prompts_file}: prompt {number} is {len(ids)} tokens; it must be 1 to "
                              f"{session.context} (the model's context, data.seq_len)")
    generator = torch.Generator().manual_seed(args.seed)
    columns = (TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True)) as bar:
        task = bar.add_task("prompts", total=len(records))
        for start in range(0, len(records), args.batch_size):
            batch = prompts[start:start + args.batch_size]
            for offset, new in enumerate(session.generate(batch, args.max_tokens, generator=generator, **kw)):
                records[start + offset]["completion"] = cut_at_stop(session.tokenizer.decode(new), args.stop)
            bar.advance(task, len(batch))
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    if not args.out:
        sys.stdout.write(lines)
        return 0
    out = Path(args.out)
    write_file(out, lines, f"the completions ({out})")
    print(f"wrote {len(records)} completions to {out}")
    return 0


def add_chat_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Talk to a run's model in the terminal, in the instruction template it was fine-tuned with "
                     "(data/instructions.py). Commands: /reset (forget the conversation), /system TEXT (set the "
                     "system message), /exit (or end of input). The oldest turns are dropped, with a note, to keep "
                     "the conversation within the trained context (data.seq_len).")
    add_sampling_arguments(p, "chat")
    p.set_defaults(max_tokens=128)
    p.add_argument("--system", default="", help="the system message to start with")
    p.add_argument("--compile", action="store_true",
                   help="answer with a static KV cache of the whole context and a torch.compile'd one-token step "
                        "(CUDA graphs on a GPU): one compile (seconds to a minute) before the first answer, the same "
                        "greedy tokens, faster answers after it (docs/inference.md)")


def run_chat(args: argparse.Namespace) -> int:
    sampling = sampling_of(args)
    session = Session.from_run(args.run)
    if args.compile:  # after the model is read: the decoder's capacity is the run's whole context
        session.decoder = compiled_decoder(session.model, args.run, capacity=session.context)
    if hasattr(sys.stdin, "reconfigure"):  # bytes that are not UTF-8 reach Chat as surrogates, refused there
        sys.stdin.reconfigure(errors="surrogateescape")
    chat = Chat.over(session, sampling, args.max_tokens, args.stop, torch.Generator().manual_seed(args.seed),
                     system=args.system)
    chat.loop(sys.stdin, sys.stdout)
    return 0
