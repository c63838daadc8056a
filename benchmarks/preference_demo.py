"""DPO on a CPU in minutes: teach a small model, trained on a few books, to prefer each book's true
continuation over a passage from another book.

    python benchmarks/preference_demo.py [--books DIR] [--out benchmarks/results/preference_demo.json]

1. A base: a character-level model (dim 128, 4 blocks) pretrained on the books (``--base-steps``).
2. Preference pairs built from the same books (``--pairs``): the prompt is ``--context`` characters of a
   book, ``chosen`` the ``--completion`` characters that truly follow, ``rejected`` as many characters from a
   random place in another book. ``data.val_fraction`` (0.2) of the pairs are held out.
3. ``scaletrain finetune --finetune.objective=dpo`` with LoRA (the reference is the base: the same model with
   its adapters switched off) for ``--steps`` steps.

Recorded, on the held-out pairs: DPO's reward accuracy and margin before (step 0: every reward is 0) and after;
how often the model's own log-probability ranks the true continuation first, for the base and the tuned
model; the mean log-probability of the true and of the other book's continuations, before and after.

The default books are the excerpts bundled with the tests (``tests/fixtures/gutenberg``, 60 KB: the run takes a
few minutes on one core); ``--books ../shared/data/gutenberg-raw-sample`` uses the whole books.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from launch import write_result  # benchmarks/launch.py (the script's folder is on sys.path)

ROOT = Path(__file__).resolve().parents[1]
BASE = ["--model.dim=128", "--model.n_layers=4", "--model.n_heads=4", "--model.ffn_hidden_dim=384",
        "--model.max_seq_len=128", "--data.seq_len=128"]
QUIET = ["--logging.progress=off", "--logging.tensorboard=false", "--train.sample_tokens=0", "--train.precision=fp32"]


def run(*args: str) -> None:
    """One ``scaletrain`` command in its own process; its last lines on failure."""
    done = subprocess.run([sys.executable, "-m", "scaletrain.cli", *args], capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"scaletrain {args[0]} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")


def book_texts(folder: Path) -> dict[str, str]:
    """The books' texts (every .txt file of ``folder``), whitespace runs collapsed to one space so that a
    continuation is judged on words, not on line breaks."""
    books = {p.stem: " ".join(p.read_text(encoding="utf-8", errors="replace").split())
             for p in sorted(folder.glob("*.txt"))}
    if len(books) < 2:
        sys.exit(f"{folder}: needs at least two .txt books (rejected continuations come from another book)")
    return books


def shuffled_words(text: str, rng: random.Random) -> str:
    """``text`` with its words in another order (the same characters, a corrupted continuation)."""
    words = text.split(" ")
    for _ in range(10):
        rng.shuffle(words)
        if " ".join(words) != text:
            break
    return " ".join(words)


def build_pairs(books: dict[str, str], count: int, context: int, completion: int, seed: int,
                alphabet: set[str], rejected_kind: str = "other") -> list[dict]:
    """``count`` pairs: a book's passage, its true continuation (chosen), and as rejected another book's passage
    (``rejected_kind`` 'other') or the true continuation's words shuffled ('shuffled'); passages with a
    character outside ``alphabet`` (the base's vocabulary: prepare's cleaning dropped the Gutenberg headers and
    their '*') are drawn again."""
    rng = random.Random(seed)
    names = list(books)
    pairs = []
    while len(pairs) < count:
        name = rng.choice(names)
        text = books[name]
        start = rng.randrange(0, len(text) - context - completion)
        other = books[rng.choice([n for n in names if n != name])]
        at = rng.randrange(0, len(other) - completion)
        chosen = text[start + context:start + context + completion]
        rejected = other[at:at + completion] if rejected_kind == "other" else shuffled_words(chosen, rng)
        if chosen != rejected and set(text[start:start + context] + chosen + rejected) <= alphabet:
            pairs.append({"prompt": text[start:start + context], "chosen": chosen, "rejected": rejected})
    return pairs


def held_out_logps(run_dir: Path, pairs_file: Path, seq_len: int, seed: int, adapters: bool) -> dict:
    """On the held-out pairs (the split the run evaluates): how often log p(true) > log p(other), and the mean
    log-probability of each, under the run's model (``adapters=False``: its base, adapters switched off)."""
    from scaletrain.data.preferences import pair_rows, preference_splits
    from scaletrain.data.tokenizer import load_tokenizer
    from scaletrain.finetune.lora import adapters_disabled
    from scaletrain.finetune.preference import sequence_logps
    from scaletrain.infer.load import load_run

    _, model, _, _ = load_run(run_dir)
    _, val = preference_splits(pairs_file, load_tokenizer(run_dir / "tokenizer.json"), seq_len, 0.2, seed)
    ci, ct, ri, rt = pair_rows(val, seq_len)
    with torch.no_grad():
        model.eval()
        if adapters:
            chosen, rejected = sequence_logps(model(ci), ct)[0], sequence_logps(model(ri), rt)[0]
        else:
            with adapters_disabled(model):
                chosen, rejected = sequence_logps(model(ci), ct)[0], sequence_logps(model(ri), rt)[0]
    return {"pairs": len(val), "prefers_true": float((chosen > rejected).float().mean()),
            "logp_true": float(chosen.mean()), "logp_other": float(rejected.mean())}


def train_base(work: Path, books: dict[str, str], args: argparse.Namespace) -> None:
    """The character-level base, pretrained on the books as they are (their .txt files alone, copied to
    ``work/books``: the line breaks stay, so the vocabulary has the newline the chat template writes)."""
    books_dir = work / "books"
    books_dir.mkdir(parents=True)
    for path in sorted(Path(args.books).glob("*.txt")):
        shutil.copy(path, books_dir / path.name)
    print(f"1/3 base: {args.base_steps} steps on {len(books)} books", flush=True)
    run("train", f"--data.path={books_dir}", f"--data.cache_dir={work / 'data'}", f"--train.run_dir={work / 'base'}",
        f"--train.steps={args.base_steps}", "--train.batch_size=16", "--optim.lr=3e-3", "--train.eval_interval=0",
        f"--train.seed={args.seed}", *BASE, *QUIET)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--books", default=str(ROOT / "tests/fixtures/gutenberg"))
    parser.add_argument("--work", default=str(ROOT / "benchmarks/out/preference_demo"))
    parser.add_argument("--base-steps", type=int, default=300)
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--pairs", type=int, default=400)
    parser.add_argument("--context", type=int, default=48)
    parser.add_argument("--completion", type=int, default=40)
    parser.add_argument("--rejected", choices=("other", "shuffled"), default="other",
                        help="rejected = another book's passage, or the true continuation with its words shuffled")
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/preference_demo.json"))
    args = parser.parse_args()
    work = Path(args.work)
    books = book_texts(Path(args.books))
    # The base is kept for a rerun with the same books and steps (the DPO run and the pairs are redone).
    stamp = json.dumps({"books": args.books, "base_steps": args.base_steps, "seed": args.seed, "raw": True})
    if not (work / "base" / "checkpoints").is_dir() or not (work / "base.stamp").is_file() \
            or (work / "base.stamp").read_text() != stamp:
        shutil.rmtree(work, ignore_errors=True)
        train_base(work, books, args)
        (work / "base.stamp").write_text(stamp)
    else:
        print(f"1/3 base: reusing {work / 'base'}", flush=True)
    shutil.rmtree(work / "dpo", ignore_errors=True)
    pairs_file = work / "pairs.jsonl"
    from scaletrain.data.tokenizer import load_tokenizer

    alphabet = set(load_tokenizer(work / "base" / "tokenizer.json").chars)
    pairs = build_pairs(books, args.pairs, args.context, args.completion, args.seed, alphabet, args.rejected)
    pairs_file.write_text("".join(json.dumps(p) + "\n" for p in pairs), encoding="utf-8")
    print(f"2/3 {len(pairs)} pairs (true continuation vs {args.rejected}) in {pairs_file}", flush=True)

    print(f"3/3 DPO with LoRA: {args.steps} steps", flush=True)
    dpo = work / "dpo"
    run("finetune", "--from", str(work / "base"), f"--finetune.preferences={pairs_file}", "--finetune.objective=dpo",
        "--finetune.method=lora", "--finetune.lora_targets=q,k,v,o,gate,up,down", f"--finetune.beta={args.beta}",
        f"--train.steps={args.steps}", "--train.batch_size=8", f"--optim.lr={args.lr}", "--data.seq_len=128",
        "--data.val_fraction=0.2", f"--train.eval_interval={args.steps}", "--train.eval_batches=1000",
        f"--train.seed={args.seed}", f"--train.run_dir={dpo}", *QUIET)

    lines = (dpo / "metrics.jsonl").read_text().splitlines()
    evals = [json.loads(line) for line in lines if "val_reward_margin" in line]
    before, after = evals[0], evals[-1]
    result = {
        "books": sorted(books), "pairs": len(pairs), "rejected": args.rejected, "base_steps": args.base_steps,
        "dpo_steps": args.steps,
        "beta": args.beta, "lr": args.lr,
        "reward_accuracy": {"before": before["val_reward_accuracy"], "after": after["val_reward_accuracy"]},
        "reward_margin": {"before": before["val_reward_margin"], "after": after["val_reward_margin"]},
        "base": held_out_logps(dpo, pairs_file, 128, args.seed, adapters=False),
        "dpo": held_out_logps(dpo, pairs_file, 128, args.seed, adapters=True),
    }
    result["logp_true_change"] = result["dpo"]["logp_true"] - result["base"]["logp_true"]
    result["logp_other_change"] = result["dpo"]["logp_other"] - result["base"]["logp_other"]
    write_result(args.out, result)
    print(f"held-out pairs: {result['base']['pairs']}")
    print(f"DPO reward accuracy   {before['val_reward_accuracy']:.3f} -> {after['val_reward_accuracy']:.3f} "
          f"(margin {before['val_reward_margin']:.3f} -> {after['val_reward_margin']:.3f})")
    print(f"prefers true (log p)  base {result['base']['prefers_true']:.3f} -> DPO {result['dpo']['prefers_true']:.3f}")
    print(f"log p(true)           {result['base']['logp_true']:.2f} -> {result['dpo']['logp_true']:.2f} "
          f"(change {result['logp_true_change']:+.2f}); log p(other) change {result['logp_other_change']:+.2f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
