"""Every family's GGUF run by a real llama.cpp (llama-cpp-python): greedy tokens and logits equal to ours.

    pip install llama-cpp-python   # builds llama.cpp from source (~15 minutes; .ci/run does not install it)
    python benchmarks/gguf_families.py [--out benchmarks/results/gguf_families.json]

For each family with a llama.cpp layout (``model/family/``: llama, SmolLM2 (a llama), mistral, qwen2, qwen3, gemma3,
phi3, smollm3) and our own run's shape with a character vocabulary: a tiny random-weight model (the family's shrunk
published config, ``tests/fixtures/families/``, 64 wide), its output rows scaled up so that greedy decoding has
clear winners (q8_0's rounding should not decide a near-tie), the family's real tokenizer (Qwen3's for qwen2 and
qwen3, Llama 3.1's for the others: ``../shared/data/tokenizers``), exported with ``export_gguf`` at f32, f16 and
q8_0. llama.cpp loads each file and generates 32 tokens greedily after the same prompt ids as ours
(``model.generate``, KV cache); the table reports whether the 32 tokens are equal (and from where they differ),
the largest |logit difference| over the prompt's last position, whether llama.cpp's tokenizer encodes the prompt
to our ids, and whether the file's chat template is the one the run was trained in and llama-cpp-python chats with
it (``chat_format``: ``chat_template.default``, or its own handler for a template it recognizes, ``llama-3``).
A q8_0 row whose tokens differ reports our top-two logit gap where they first do (a near-tie there is rounding,
not a different computation).

What the plain prompt with special tokens off cannot show is checked too, on the f32 file: a two-turn chat rendered
in the file's template (transformers' ``apply_chat_template``) encodes in llama.cpp, special tokens parsed, to
our tokenizer's ids (``chat_tokens_match``); Qwen3's added ``<think>`` / ``</think>`` / ``<tool_call>`` are one
token each in llama.cpp (``added_tokens_whole``: written NORMAL they were split into pieces); every id our
generation stops at (``data.instructions.stop_ids``: the template's end of turn and the EOS) is an
end-of-generation token for llama.cpp and its eot is the template's (``end_of_turn``); and llama.cpp's n_ctx_train
is the context the model was built for (``context_length``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from launch import OUT_HELP, default_out, write_result  # benchmarks/launch.py (the script's folder is on sys.path)

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "families"
TOKENIZERS = ROOT.parent / "shared" / "data" / "tokenizers"
WORK = ROOT / "benchmarks" / "out" / "gguf_families"
PROMPT, NEW, CONTEXT, OUTPUT_SCALE = "The quick brown fox jumps over the lazy dog. Then", 32, 128, 30.0
# fixture -> the real tokenizer it is paired with
ROWS = {"llama": "llama3_1", "smollm2": "llama3_1", "mistral": "llama3_1", "qwen2": "qwen3", "qwen3": "qwen3",
        "gemma3_text": "llama3_1", "phi3": "llama3_1", "smollm3": "llama3_1", "ours": "char"}
DTYPES = ("f32", "f16", "q8_0")


def model_config(row: str, vocab: int):
    """The row's ModelConfig: the fixture's, at our context and the tokenizer's vocabulary, in what llama.cpp
    computes (plain rotary where the fixture scales it with llama3's rule, Gemma 3's query scale = head_dim,
    Phi-3 without its 12-position window: llama.cpp refuses none of these silently, the export would refuse)."""
    from scaletrain.model.config import ModelConfig
    from scaletrain.model.families import model_config_from_hf

    if row == "ours":
        return ModelConfig(vocab_size=vocab, max_seq_len=CONTEXT, n_kv_heads=2)
    cfg = model_config_from_hf(json.loads((FIXTURES / f"{row}.json").read_text()), row, max_seq_len=CONTEXT)
    changes = dict(vocab_size=vocab)
    if cfg.rope_scaling not in ("none", "linear"):
        changes.update(rope_scaling="none")
    if cfg.query_pre_attn_scalar:
        changes.update(query_pre_attn_scalar=0.0)
    if cfg.family == "phi3":
        changes.update(sliding_window=0)
    return dataclasses.replace(cfg, **changes)


def tokenizer_for(kind: str):
    from scaletrain.data.tokenizer import CharTokenizer, load_tokenizer

    if kind == "char":
        text = (ROOT / "src" / "scaletrain" / "assets" / "tinyshakespeare").glob("*")
        return CharTokenizer(sorted(set("".join(p.read_text(errors="ignore") for p in text if p.is_file()))))
    return load_tokenizer(TOKENIZERS / kind / "tokenizer.json")


def tiny_model(cfg):
    import torch

    from scaletrain.model import build_model

    model = build_model(cfg, seed=0).eval()
    with torch.no_grad():
        head = model.tok_embeddings.weight if cfg.tie_embeddings else model.output.weight
        head.mul_(OUTPUT_SCALE)
        for name, p in model.named_parameters():  # norms and biases off their init, as a trained model's
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def llama_cpp_row(path: Path, prompt: list[int], text: str, ours_logits, template: str) -> dict:
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=CONTEXT, n_threads=1, n_batch=CONTEXT, logits_all=True, verbose=False)
    llm.eval(prompt)
    theirs = llm.scores[len(prompt) - 1][: ours_logits.shape[0]]
    tokens = []
    for token in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
        tokens.append(int(token))
        if len(tokens) == NEW:
            break
    return {"tokens": tokens, "max_logit_diff": float(abs(theirs - ours_logits).max()),
            "tokenizer_matches": llm.tokenize(text.encode(), add_bos=True, special=False) == prompt,
            "chat_template_in_file": llm.metadata.get("tokenizer.chat_template") == template,
            "chat_format": llm.chat_format}


ADDED = ("<think>", "</think>", "<tool_call>")
CHAT = [{"role": "user", "content": "Who is there?"}, {"role": "assistant", "content": "Nay, answer me."},
        {"role": "user", "content": "Long live the king!"}]


def special_checks(path: Path, tok) -> dict:
    """The f32 file's special tokens and chat text in llama.cpp against ours (module docstring)."""
    import llama_cpp
    from llama_cpp import Llama

    from scaletrain.data.instructions import stop_ids
    from scaletrain.data.tokenizer import HFTokenizer

    llm = Llama(model_path=str(path), n_ctx=CONTEXT, n_threads=1, verbose=False)
    vocab = llm._model.vocab  # llama.cpp's vocabulary handle (llama_vocab_is_eog takes it)
    out = {"context_length": llm._model.n_ctx_train() == CONTEXT}
    if not isinstance(tok, HFTokenizer):  # a character vocabulary: no special token but the end of text
        out["end_of_turn"] = bool(llama_cpp.llama_vocab_is_eog(vocab, llm.token_eos()))
        return out
    text = tok.transformers_tokenizer().apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    ours = tok.tok.encode(text, add_special_tokens=False).ids
    out["chat_tokens_match"] = llm.tokenize(text.encode(), add_bos=False, special=True) == ours
    added = [t for t in ADDED if tok.tok.token_to_id(t) is not None]
    if added:
        out["added_tokens_whole"] = all(llm.tokenize(t.encode(), add_bos=False, special=False) ==
                                        [tok.tok.token_to_id(t)] for t in added)
    stops = stop_ids(tok.folder)
    out["end_of_turn"] = llm._model.token_eot() == stops[0] and all(
        bool(llama_cpp.llama_vocab_is_eog(vocab, i)) for i in stops)
    return out


def margin_at(model, prompt: list[int], ours: list[int], index: int | None, vocab: int) -> float | None:
    """Our top-two logit gap where llama.cpp's greedy tokens first differ (a near-tie: q8_0 may pick either)."""
    import torch

    if index is None:
        return None
    with torch.no_grad():
        best = model(torch.tensor([prompt + ours[:index]]))[0, -1, :vocab].topk(2).values
    return round(float(best[0] - best[1]), 5)


def run_row(row: str) -> dict:
    import torch

    from scaletrain.checkpoint.gguf import chat_template, export_gguf
    from scaletrain.model.generate import generate

    tok = tokenizer_for(ROWS[row])
    cfg = model_config(row, tok.vocab_size + (1 if ROWS[row] == "char" else 0))  # char: a row for end-of-text
    model = tiny_model(cfg)
    prompt = tok.encode(PROMPT)
    with torch.no_grad():
        ours_logits = model(torch.tensor([prompt]))[0, -1, : tok.vocab_size].float().numpy()
    ours = generate(model, prompt, NEW, max_seq_len=CONTEXT, temperature=0.0, vocab_limit=tok.vocab_size)
    template = chat_template(tok, "auto")
    out = {}
    for dtype in DTYPES:
        path = WORK / f"{row}-{dtype}.gguf"
        path.unlink(missing_ok=True)
        export_gguf(model, cfg, tok, path, dtype, context=CONTEXT)
        got = llama_cpp_row(path, prompt, PROMPT, ours_logits, template)
        first = next((i for i, (a, b) in enumerate(zip(ours, got["tokens"])) if a != b), None)
        out[dtype] = {"tokens_equal": first is None and len(got["tokens"]) == NEW,
                      "first_difference": first, "our_top2_gap_there": margin_at(model, prompt, ours, first,
                                                                                 tok.vocab_size),
                      "max_logit_diff": round(got["max_logit_diff"], 5), "tokenizer_matches": got["tokenizer_matches"],
                      # llama-cpp-python chats with the file's template: its own handler for one it recognizes
                      # (llama-3), else the template itself (chat_template.default)
                      "chat_template_used": got["chat_template_in_file"] and got["chat_format"] is not None,
                      "chat_format": got["chat_format"], "bytes": path.stat().st_size}
        if dtype == "f32":
            out[dtype]["special"] = special_checks(path, tok)
        path.unlink()
        print(f"{row:<12} {dtype:<5} tokens equal {out[dtype]['tokens_equal']!s:<5} max |logit diff| "
              f"{out[dtype]['max_logit_diff']:.4f} chat template used {out[dtype]['chat_template_used']}"
              + "".join(f" {k} {v}" for k, v in out[dtype].get("special", {}).items()), flush=True)
    return {"family": cfg.family, "tokenizer": ROWS[row], "vocab": tok.vocab_size, "dtypes": out}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=default_out("gguf_families.json"),
                        help=OUT_HELP.format(name="gguf_families.json"))
    parser.add_argument("--rows", nargs="*", default=list(ROWS), choices=list(ROWS))
    args = parser.parse_args()
    try:
        import llama_cpp
    except ImportError:
        print("needs llama-cpp-python: pip install llama-cpp-python (builds llama.cpp from source)", file=sys.stderr)
        return 1
    if not (TOKENIZERS / "qwen3" / "tokenizer.json").is_file():
        print(f"needs the real tokenizers in {TOKENIZERS}", file=sys.stderr)
        return 1
    import torch

    torch.set_num_threads(1)
    WORK.mkdir(parents=True, exist_ok=True)
    rows = {row: run_row(row) for row in args.rows}
    write_result(args.out, {"llama_cpp_python": llama_cpp.__version__, "torch": torch.__version__,
                            "new_tokens": NEW, "prompt": PROMPT, "rows": rows}, indent=2)
    print(f"wrote {args.out}")
    special = [v for r in rows.values() for v in r["dtypes"]["f32"].get("special", {}).values()]
    return 0 if all(d["tokens_equal"] for r in rows.values() for d in r["dtypes"].values()) and all(special) else 1


if __name__ == "__main__":
    sys.exit(main())
