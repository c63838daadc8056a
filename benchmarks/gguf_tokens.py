"""Trained runs' GGUF exports read by llama.cpp itself: special tokens, chat text, token types, padding, context,
end of turn and greedy tokens, against what scaletrain reads and generates.

    python -m venv ../llvenv && ../llvenv/bin/pip install llama-cpp-python==0.3.36   # its own interpreter
    python benchmarks/gguf_tokens.py [--out benchmarks/results/gguf_tokens.json] [--before]
    python benchmarks/gguf_tokens.py --families qwen3_moe olmoe mixtral --new 32 --q8_0 \
        --out benchmarks/results/gguf_moe_tokens.json   # the MoE families

Three tiny trained runs (cached under benchmarks/out/gguf_tokens/): a Qwen3-family base (the fixture's shrunk
config, tests/fixtures/families/qwen3.json) with the real Qwen3 tokenizer (../shared/data/tokenizers) fine-tuned
on short chats in its own template (``<think>`` block, ``<|im_end|>``), the same with Llama 3.1's shape and
tokenizer (header ids, ``<|eot_id|>``), and a character-vocabulary run trained on Tiny Shakespeare at
data.seq_len 64 under model.max_seq_len 128. Each is exported with ``scaletrain export --format gguf`` at f32; a
subprocess under llama-cpp-python's interpreter ($LLAMA_CPP_PYTHON, else this one when it imports llama_cpp, else
../llvenv/bin/python: our package never depends on it) loads the file (KV cache in f32, ``type_k``/``type_v``,
so greedy decoding is not decided by f16 cache rounding) and reports what llama.cpp reads; this side compares.
One row a family x check, pass/fail and both values:

- ``tokenize_special``: texts with special tokens and chat-template text (``<think>`` one token, a conversation
  rendered by transformers' ``apply_chat_template`` with ``<|im_start|>``... parsed) encode to our ids;
- ``token_types``: llama.cpp's attribute of each added / special token is the type convert_hf_to_gguf.py writes;
- ``padding_id``, ``context_length`` (n_ctx_train: the context the run trained on), ``end_of_turn`` (llama.cpp's
  eot is the template's and every id our generation stops at is an end-of-generation token for it);
- ``chat_template``: the file's ``tokenizer.chat_template`` (llama.cpp's metadata) is the one the run trained in;
- ``greedy``: llama.cpp's greedy tokens after a few prompts equal scaletrain's ``Session.generate``;
  ``greedy_no_stop``: all ``--new`` of them, on through an end of turn (a chat-tuned run ends its turns early);
- ``chat_stops``: a chat completion (``create_completion`` over the rendered chat) gives our answer and stops where
  ours stops (the template's end of turn), finish_reason "stop";
- ``no_lock_left``: no ``.NAME.gguf.lock`` left beside the export;
- ``greedy_q8_0`` (``--q8_0``): the same greedy tokens (no stop) from the ``--dtype q8_0`` export; where they
  differ, the first difference and the gap between our two best logits there (8-bit rounding flips only near-ties).

The MoE families (``--families qwen3_moe olmoe mixtral``): the fixture's shrunk config (Qwen3-MoE's with every
layer sparse, as llama.cpp's qwen3moe has it) at the Qwen3 tokenizer, fine-tuned (full, experts included) on the
same chats in Qwen3's template: a random base's greedy text is not degenerate, but it never ends a turn, so the
chat check needs the fine-tune. Mixtral is written as llama.cpp's llama with experts.

``--before`` runs the same checks on the exporter before the fixes (``git show 7347daa:src/scaletrain/checkpoint/
gguf.py`` loaded as a module; its export called as the command called it: the config's context, no lock check)
and writes gguf_tokens_before.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOKENIZERS = ROOT.parent / "shared" / "data" / "tokenizers"
FIXTURES = ROOT / "tests" / "fixtures" / "families"
WORK = ROOT / "benchmarks" / "out" / "gguf_tokens"
BEFORE_COMMIT = "7347daa"
NEW, BASE_CONTEXT = 24, 128
FAMILIES = {"qwen3": ("qwen3", "qwen3"), "llama3_1": ("llama", "llama3_1"), "char": ("ours", "char")}
MOE_FAMILIES = {"qwen3_moe": ("qwen3_moe", "qwen3"), "olmoe": ("olmoe", "qwen3"), "mixtral": ("mixtral", "qwen3")}
FIXTURE_CHANGES = {"qwen3_moe": dict(moe_layers=[0, 1, 2])}  # llama.cpp's qwen3moe has experts in every layer
CHATS = [("Who is there?", "Nay, answer me."), ("Long live the king!", "Bernardo?"), ("Say it in few words.",
                                                                                   "Speak, speak.")]
ADDED = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|im_start|>", "<|im_end|>",
         "<|endoftext|>", "<|begin_of_text|>", "<|eot_id|>", "<|end_of_text|>", "<|start_header_id|>")
TEXTS = ["<think>", "</think>\n\n", "a<think>b</think>c", "<tool_call>{}</tool_call>", "<|im_start|>user\nHi<|im_end|>",
         "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>", "The quick brown fox. Then"]
PROMPTS = ["ROMEO:\nWhat light", "First Citizen:\nBefore we", "Who is there?"]
LLAMA_TYPES = {"normal": 4, "unknown": 2, "control": 8, "user_defined": 16, "byte": 32}  # LLAMA_TOKEN_ATTR_*
GGUF_TYPES = {1: "normal", 2: "unknown", 3: "control", 4: "user_defined", 5: "unused", 6: "byte"}  # gguf.TokenType


# -- llama.cpp's side (runs under the llama-cpp-python interpreter: imports nothing of ours) --------------------
def probe(spec: dict) -> dict:
    """What llama.cpp reads from the file ``spec["path"]``: tokenizations, attributes, pad / eot / eog ids,
    n_ctx_train, greedy tokens after each prompt and the chat completion."""
    import llama_cpp

    if spec.get("no_repack"):  # llama.cpp's weights as stored, not repacked for the CPU (see --q8_0's help)
        import llama_cpp.llama_cpp as raw

        defaults = raw.llama_model_default_params

        def stored_weights():
            params = defaults()
            params.use_extra_bufts = False
            return params

        raw.llama_model_default_params = stored_weights  # what Llama() starts its model parameters from
    f32 = llama_cpp.GGML_TYPE_F32
    llm = llama_cpp.Llama(model_path=spec["path"], n_ctx=spec["n_ctx"], n_batch=spec["n_ctx"], n_threads=1,
                          type_k=f32, type_v=f32, verbose=False)
    vocab = llm._model.vocab

    def attribute(token: int) -> str:
        attr = int(llama_cpp.llama_vocab_get_attr(vocab, token))
        return next((name for name, bit in LLAMA_TYPES.items() if attr & bit), f"attr {attr}")

    def greedy(ids: list[int], n: int, stop: bool = True) -> list[int]:
        out = []
        for token in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            if stop and llama_cpp.llama_vocab_is_eog(vocab, token) or len(out) == n:
                break
            out.append(int(token))
        return out

    chat = llm.create_completion(spec["chat_ids"], max_tokens=spec["new"], temperature=0.0, top_k=1, top_p=1.0,
                                 repeat_penalty=1.0)
    return {"tokenize": [llm.tokenize(t.encode(), add_bos=False, special=True) for t in spec["texts"]],
            "tokenize_plain": [llm.tokenize(t.encode(), add_bos=False, special=False) for t in spec["texts"]],
            "types": {str(i): attribute(i) for i in spec["type_ids"]},
            "pad": int(llama_cpp.llama_vocab_pad(vocab)), "eot": int(llm._model.token_eot()),
            "eos": int(llm.token_eos()), "eog": {str(i): bool(llama_cpp.llama_vocab_is_eog(vocab, i))
                                                 for i in spec["stop_ids"]},
            "n_ctx_train": int(llm._model.n_ctx_train()),
            "greedy": [greedy(ids, spec["new"]) for ids in spec["prompt_ids"]],
            "greedy_no_stop": [greedy(ids, spec["new"], stop=False) for ids in spec["prompt_ids"]],
            "chat_text": chat["choices"][0]["text"], "chat_finish": chat["choices"][0]["finish_reason"],
            "chat_template": llm.metadata.get("tokenizer.chat_template"),
            "llama_cpp_python": llama_cpp.__version__}


def llama_cpp_python() -> str | None:
    """The interpreter that imports llama_cpp: $LLAMA_CPP_PYTHON, else this one, else the virtual environment
    ``llvenv`` beside the checkout (``../llvenv``, where ``../shared`` is: kept apart so that our environment never
    depends on llama-cpp-python); None when none does."""
    candidates = [os.environ.get("LLAMA_CPP_PYTHON", ""), sys.executable,
                  str(ROOT.parent / "llvenv" / "bin" / "python")]
    for python in filter(None, candidates):
        if Path(python).is_file() and subprocess.run([python, "-c", "import llama_cpp"],
                                                     capture_output=True).returncode == 0:
            return python
    return None


def run_probe(python: str, spec: dict, work: Path) -> dict:
    spec_file, out_file = work / "spec.json", work / "probe.json"
    spec_file.write_text(json.dumps(spec))
    subprocess.run([python, __file__, "--probe", str(spec_file), str(out_file)], check=True)
    return json.loads(out_file.read_text())


# -- scaletrain's side ------------------------------------------------------------------------------------------
def scaletrain(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "scaletrain", *args], check=True, cwd=ROOT,
                   env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")},
                   stdout=subprocess.DEVNULL)


COMMON = {"logging.progress": "off", "logging.tensorboard": "false", "train.eval_interval": "0",
          "train.sample_tokens": "0", "checkpoint.interval": "0", "train.precision": "fp32"}


def family_base(fixture: str, tokenizer: str, folder: Path) -> None:
    """A Hugging Face folder: the fixture's shrunk config at the tokenizer's vocabulary (random weights, 128
    positions, plain rotary), the real tokenizer files beside it."""
    import dataclasses

    from scaletrain.checkpoint.export import export_hf
    from scaletrain.data.tokenizer import load_tokenizer
    from scaletrain.model import build_model
    from scaletrain.model.families import model_config_from_hf

    tok = load_tokenizer(TOKENIZERS / tokenizer / "tokenizer.json")
    cfg = model_config_from_hf(json.loads((FIXTURES / f"{fixture}.json").read_text()), fixture,
                               max_seq_len=BASE_CONTEXT)
    cfg = dataclasses.replace(cfg, vocab_size=tok.vocab_size, rope_scaling="none", **FIXTURE_CHANGES.get(fixture, {}))
    export_hf(build_model(cfg, seed=0), cfg, tok, folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZERS / tokenizer / name, folder / name)


def trained_run(name: str, work: Path) -> Path:
    """The family's tiny trained run (made once under ``work``)."""
    run = work / f"{name}-run"
    if (run / "checkpoints").is_dir():
        return run
    fixture, tokenizer = {**FAMILIES, **MOE_FAMILIES}[name]
    common = {**COMMON, "train.run_dir": str(run), "data.cache_dir": str(work / f"{name}-data")}
    if tokenizer == "char":
        over = {"model.dim": "64", "model.n_layers": "2", "model.n_heads": "4", "model.n_kv_heads": "2",
                "model.ffn_hidden_dim": "128", "model.max_seq_len": "128", "data.seq_len": "64",
                "train.batch_size": "8", "train.steps": "150", **common}
        scaletrain("train", *[f"--{k}={v}" for k, v in over.items()])
        return run
    base = work / f"{name}-base"
    if not (base / "config.json").is_file():
        family_base(fixture, tokenizer, base)
    chats = work / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                      {"role": "assistant", "content": a}]}) + "\n"
                             for _ in range(8) for q, a in CHATS))
    over = {"finetune.method": "full", "finetune.instructions": str(chats), "finetune.chat_template": "base",
            "data.seq_len": "64", "train.batch_size": "4", "train.steps": "120", "optim.lr": "0.003",
            "schedule.warmup_steps": "4", "data.val_fraction": "0.1", **common}
    scaletrain("finetune", "--from", str(base), *[f"--{k}={v}" for k, v in over.items()])
    return run


def export(run: Path, out: Path, before: bool, dtype: str = "f32") -> None:
    """``scaletrain export --format gguf`` (after the fixes) or the 7347daa exporter called as its command did."""
    out.unlink(missing_ok=True)
    if not before:
        scaletrain("export", "--run", str(run), "--format", "gguf", "--out", str(out), "--dtype", dtype)
        return
    import importlib.util

    from scaletrain.infer.load import load_run

    source = subprocess.run(["git", "show", f"{BEFORE_COMMIT}:src/scaletrain/checkpoint/gguf.py"], cwd=ROOT,
                            check=True, capture_output=True, text=True).stdout
    module_file = out.parent / "gguf_before.py"
    module_file.write_text(source.replace("from scaletrain.files import", "from scaletrain.core.files import"))
    spec = importlib.util.spec_from_file_location("gguf_before", module_file)
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    cfg, model, tokenizer, _ = load_run(run)
    old.export_gguf(model, cfg.model, tokenizer, out, "f32", name=run.name, template=cfg.finetune.chat_template)


def ours(run: Path, new: int = NEW) -> dict:
    """What scaletrain reads and generates for the run: ids, types the converter writes, pad, context, stops."""
    import torch

    from scaletrain.checkpoint.export import hf_base_folder
    from scaletrain.checkpoint.gguf import _vocabulary, chat_template, special_token_ids, trained_context
    from scaletrain.data.tokenizer import HFTokenizer
    from scaletrain.infer.load import load_run
    from scaletrain.infer.session import Session

    torch.set_num_threads(1)
    session = Session.from_run(run)
    cfg, tok = load_run(run)[0], session.tokenizer
    hf = isinstance(tok, HFTokenizer)
    texts = TEXTS + ([] if not hf else [tok.transformers_tokenizer().apply_chat_template(
        [{"role": "user", "content": q}, {"role": "assistant", "content": a}], tokenize=False) for q, a in CHATS[:2]])
    if not hf:  # a character vocabulary: only its characters can be typed
        texts = [t for t in texts if all(c in tok.chars for c in t)]
    encode = (lambda t: tok.tok.encode(t, add_special_tokens=False).ids) if hf else tok.encode
    rows = min(cfg.model.vocab_size, tok.vocab_size) + int(not hf and tok.eos_id is None)
    ids = {t: tok.tok.token_to_id(t) for t in ADDED} if hf else {}
    type_ids = sorted({i for i in ids.values() if i is not None} | {encode("a")[0]})
    _, types, _ = _vocabulary(tok, rows)
    chat = session.render([{"role": "user", "content": CHATS[0][0]}])
    # plain text, and (in a template) the other chats' questions: answers the run learnt, ending at its end of turn
    prompts = [encode(p) for p in PROMPTS] + [session.render([{"role": "user", "content": q}]) for q, _ in CHATS[1:]]

    def generate(prompt: list[int]) -> list[int]:
        return session.generate([prompt], new)[0]

    def no_stop(prompt: list[int]) -> list[int]:  # all ``new`` tokens, through an end of turn
        from scaletrain.model.generate import generate as model_generate

        return model_generate(session.model, prompt, new, max_seq_len=session.context, temperature=0.0)

    def top_two_gap(prompt: list[int]) -> float:  # our two best logits' gap after ``prompt``
        with torch.no_grad():
            best = session.model(torch.tensor([prompt]))[0, -1].topk(2).values
        return float(best[0] - best[1])

    chat_answer = generate(chat)
    specials = special_token_ids(tok, rows, cfg.finetune.chat_template)
    return {"texts": texts, "ids": [encode(t) for t in texts], "type_ids": type_ids,
            "types": {str(i): GGUF_TYPES[types[i]] for i in type_ids},
            "pad": specials.get("pad", -1), "stop_ids": session.stop_ids,
            "eot": specials.get("eot", -1), "eos": specials.get("eos", -1),
            "context": trained_context(cfg, hf_base_folder(run, cfg) is not None),
            "prompt_ids": prompts, "greedy": [generate(p) for p in prompts], "chat_ids": chat,
            "greedy_no_stop": [no_stop(p) for p in prompts],
            "chat_answer": chat_answer, "chat_text": tok.decode(chat_answer),
            "chat_stopped": len(chat_answer) < new, "added_names": {str(i): t for t, i in ids.items() if i is not None},
            "top_two_gap": top_two_gap, "chat_template": chat_template(tok, cfg.finetune.chat_template)}


def q8_0_row(name: str, mine: dict, theirs: dict) -> dict:
    """The q8_0 export's greedy tokens against ours: equal, or the first difference and our top-two logit gap."""
    differences = []
    for prompt, a, b in zip(mine["prompt_ids"], mine["greedy_no_stop"], theirs["greedy_no_stop"]):
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a),
                                                                                                      len(b)))
        if first is not None:
            differences.append({"prompt": len(differences), "first_difference": first, "ours": a[first:first + 3],
                                "llama_cpp": b[first:first + 3],
                                "our_top_two_gap": round(mine["top_two_gap"](prompt + a[:first]), 4)})
    return {"family": name, "check": "greedy_q8_0", "pass": not differences, "scaletrain": mine["greedy_no_stop"],
            "llama_cpp": differences or "all equal"}


def checks(name: str, mine: dict, theirs: dict, lock_left: bool | None) -> list[dict]:
    """One row a check: pass and both values."""
    def row(check: str, passed: bool, scaletrain, llama_cpp) -> dict:
        return {"family": name, "check": check, "pass": bool(passed), "scaletrain": scaletrain, "llama_cpp": llama_cpp}

    names = mine["added_names"]
    differ = [{"text": t, "ours": a, "llama_cpp": b} for t, a, b in zip(mine["texts"], mine["ids"], theirs["tokenize"])
              if a != b]
    think = next((i for i, t in enumerate(mine["texts"]) if t == "<think>"), None)
    rows = [row("tokenize_special", not differ, f"{len(mine['texts'])} texts",
                differ or f"{len(mine['texts'])} texts equal")]
    if think is not None:  # typed text with special tokens off: a USER_DEFINED token still matches whole
        rows.append(row("think_one_token_plain", theirs["tokenize_plain"][think] == mine["ids"][think],
                        mine["ids"][think], theirs["tokenize_plain"][think]))
    type_diff = {names.get(i, i): [mine["types"][i], theirs["types"][i]] for i in mine["types"]
                 if mine["types"][i] != theirs["types"][i]}
    rows += [row("token_types", not type_diff, {names.get(i, i): v for i, v in mine["types"].items()},
                 type_diff or "all equal"),
             # -1: none, where the tokenizer names none (Llama 3.1's: the converter writes none either)
             row("padding_id", mine["pad"] == theirs["pad"], mine["pad"], theirs["pad"]),
             row("context_length", mine["context"] == theirs["n_ctx_train"], mine["context"], theirs["n_ctx_train"]),
             # no token ends our turn (a character run's "\n\n" text does): llama.cpp may name none or take its
             # EOS (the added end-of-text token, which it finds by its text) for one
             row("end_of_turn", all(theirs["eog"].values()) and (
                 mine["eot"] == theirs["eot"] or mine["eot"] < 0 and theirs["eot"] in (-1, theirs["eos"])),
                 {"eot": mine["eot"], "stop_ids": mine["stop_ids"]}, {"eot": theirs["eot"], "eog": theirs["eog"]}),
             row("greedy", mine["greedy"] == theirs["greedy"], mine["greedy"], theirs["greedy"]),
             # every prompt's full ``--new`` tokens, on through an end of turn (a chat-tuned run ends early)
             row("greedy_no_stop", mine["greedy_no_stop"] == theirs["greedy_no_stop"], mine["greedy_no_stop"],
                 theirs["greedy_no_stop"]),
             # the template the run was trained in, as llama.cpp reads it from the file's metadata
             row("chat_template", theirs["chat_template"] == mine["chat_template"],
                 f"{len(mine['chat_template'])} characters", "equal" if theirs["chat_template"] ==
                 mine["chat_template"] else theirs["chat_template"]),
             row("chat_stops", theirs["chat_text"] == mine["chat_text"]
                 and (theirs["chat_finish"] == "stop") == mine["chat_stopped"],
                 {"text": mine["chat_text"], "stopped": mine["chat_stopped"]},
                 {"text": theirs["chat_text"], "finish_reason": theirs["chat_finish"]}),
             ]
    if lock_left is not None:  # the command's (--before calls the old export function, not the command)
        rows.append(row("no_lock_left", not lock_left, "no lock", "lock left" if lock_left else "no lock"))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="result JSON (default benchmarks/results/gguf_tokens.json, "
                                                    "gguf_tokens_before.json with --before)")
    parser.add_argument("--before", action="store_true", help=f"the exporter at {BEFORE_COMMIT} (before the fixes)")
    parser.add_argument("--work", default=str(WORK), help="where the runs are made (kept: reused next time)")
    parser.add_argument("--families", nargs="*", default=list(FAMILIES), choices=[*FAMILIES, *MOE_FAMILIES])
    parser.add_argument("--new", type=int, default=NEW, help="tokens generated a prompt")
    parser.add_argument("--q8_0", action="store_true",
                        help="also the q8_0 export's greedy tokens (greedy_q8_0), llama.cpp's weights as stored "
                             "(use_extra_bufts off: its CPU repacking of q8_0 segfaults in llama-cpp-python 0.3.36's "
                             "build on an AVX-512/AMX host, a dense model's too)")
    parser.add_argument("--probe", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:  # llama.cpp's side, under its interpreter
        Path(args.probe[1]).write_text(json.dumps(probe(json.loads(Path(args.probe[0]).read_text()))))
        return 0
    from launch import default_out, write_result  # benchmarks/launch.py (the script's folder is on sys.path)

    python = llama_cpp_python()
    if python is None:
        print("needs llama-cpp-python in some interpreter: set LLAMA_CPP_PYTHON (python -m venv V && "
              "V/bin/pip install llama-cpp-python)", file=sys.stderr)
        return 1
    if not (TOKENIZERS / "qwen3" / "tokenizer.json").is_file() and set(args.families) - {"char"}:
        print(f"needs the real tokenizers in {TOKENIZERS}", file=sys.stderr)
        return 1
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    rows, version = [], None
    for name in args.families:
        run = trained_run(name, work)
        out = work / ("before" if args.before else "after") / f"{name}.gguf"
        out.parent.mkdir(parents=True, exist_ok=True)
        export(run, out, args.before)
        lock_left = None if args.before else (out.parent / f".{out.name}.lock").exists()
        mine = ours(run, args.new)
        spec = {"path": str(out), "n_ctx": BASE_CONTEXT, "new": args.new, "texts": mine["texts"],
                "type_ids": [int(i) for i in mine["types"]], "stop_ids": mine["stop_ids"],
                "prompt_ids": mine["prompt_ids"], "chat_ids": mine["chat_ids"]}
        theirs = run_probe(python, spec, out.parent)
        version = theirs["llama_cpp_python"]
        found = checks(name, mine, theirs, lock_left)
        if args.q8_0:
            export(run, out, args.before, "q8_0")
            found.append(q8_0_row(name, mine, run_probe(python, {**spec, "no_repack": True}, out.parent)))
        for r in found:
            rows.append(r)
            print(f"{name:<9} {r['check']:<22} {'pass' if r['pass'] else 'FAIL'}", flush=True)
        out.unlink()
    name = "gguf_tokens_before.json" if args.before else "gguf_tokens.json"
    result = {"llama_cpp_python": version, "exporter": f"{BEFORE_COMMIT} (before the fixes)" if args.before
              else "this checkout", "new_tokens": args.new, "kv_cache": "f32",
              **({"q8_0_weights": "as stored (use_extra_bufts off)"} if args.q8_0 else {}),
              "passed": sum(r["pass"] for r in rows),
              "checks": len(rows), "rows": rows}
    write_result(args.out or default_out(name), result, indent=2)
    print(f"{result['passed']} of {result['checks']} checks pass; wrote {args.out or default_out(name)}")
    return 0 if result["passed"] == result["checks"] else 1


if __name__ == "__main__":
    sys.exit(main())
