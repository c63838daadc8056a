"""`scaletrain export`: a run's latest checkpoint as a Hugging Face folder of its family's class (a LoRA run: the
base and a peft adapter beside it, or merged) or one GGUF file, written whole under the target's one-writer lock."""

from __future__ import annotations

import argparse
from pathlib import Path

from scaletrain.config import ConfigError


def add_export_arguments(p: argparse.ArgumentParser) -> None:
    """`scaletrain export`'s flags."""
    p.add_argument("--run", required=True, help="the run folder (train.run_dir)")
    p.add_argument("--format", default="hf", choices=["hf", "gguf"],
                   help="hf: config.json + model.safetensors + tokenizer; gguf: one file for llama.cpp / Ollama "
                        "(tokenizer and chat template inside; needs scaletrain[gguf])")
    p.add_argument("--out", help="output folder (default: <run>/export-hf), or file for gguf (<run>/model.gguf)")
    p.add_argument("--dtype", default=None, choices=["f32", "f16", "q8_0"],
                   help="gguf: the weights' type (default f32; norms stay f32); the Hugging Face export writes f32 "
                        "only")
    p.add_argument("--merge", action="store_true",
                   help="a LoRA/QLoRA fine-tune: fold the adapters into the weights and write one plain folder "
                        "(default for an adapter run: the base's folder plus a peft adapter in <out>/adapter). "
                        "QLoRA: the merged weights are the NF4-rounded base + adapter (what the run trained), "
                        "the default folder holds the original base + adapter; their logits differ: merge to get "
                        "what was trained, keep the adapter to stay on the original")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier export in --out (its adapter/ too, or the GGUF file); without it, that "
                        "is refused")




def run_export(args: argparse.Namespace) -> int:
    from scaletrain.core.writer_lock import one_writer

    if args.format == "hf" and args.dtype not in (None, "f32"):  # it would be written f32 all the same
        raise ConfigError(f"--dtype {args.dtype} is for --format gguf; the Hugging Face export writes float32 "
                          f"(cast it when loading: from_pretrained(..., dtype=torch.float16)), or export --format "
                          f"gguf --dtype {args.dtype}")
    args.dtype = args.dtype or "f32"

    # One writer per target (train's run-folder lock): a second export into the same --out is refused naming the
    # first. The lock file sits beside the target, which the export replaces as a whole, and goes with the lock; a
    # target refused outright is refused before it is made, and checked again under the lock (a concurrent export).
    target = Path(args.out or Path(args.run) / ("model.gguf" if args.format == "gguf" else "export-hf"))
    _check_export_target(args, target)
    with one_writer(target.parent, f"--out {target}", "choose another --out", name=f".{target.name}.lock",
                    remove=True):
        _check_export_target(args, target)
        return _export(args)


def _check_export_target(args: argparse.Namespace, out: Path) -> None:
    """Refuse, before the run is loaded, an --out that would lose a file or folder (without --overwrite)."""
    if args.format == "gguf":  # one file
        from scaletrain.checkpoint.gguf import gguf_target

        gguf_target(out, args.overwrite)
    # a folder of other files: export_hf refuses it
    if args.format == "hf" and (out / "config.json").is_file() and not args.overwrite:
        held = "an earlier export" + (" and its adapter/" if (out / "adapter").is_dir() else "")
        raise ConfigError(f"--out {out} holds {held}; pass --overwrite to replace it, or choose a new folder")


def _export(args: argparse.Namespace) -> int:
    from scaletrain.checkpoint.export import export_hf, hf_base_folder
    from scaletrain.finetune.export import base_model, is_plain, merge_adapters, save_peft_adapter
    from scaletrain.finetune.method_table import method_entry
    from scaletrain.infer.load import load_run  # any run folder; a quantized one is refused in one line
    from scaletrain.model.family import family

    # experts: written by the families whose entry has them (hf: qwen3_moe, mixtral, olmoe; gguf: their llama.cpp
    # architectures), refused in one line by the others (checkpoint/gguf.py check_exportable, model/families.py)
    cfg, model, tokenizer, ckpt = load_run(args.run, quantized_ok=False)
    method = method_entry(cfg.finetune.method)
    if method.quantized_base:  # the two exports are not the same model: say which one this is
        print("QLoRA: " + ("--merge writes the NF4-rounded base + adapter, what the run trained (without --merge: "
                           "the original base + adapter, whose logits differ)" if args.merge else
                           "the original (unrounded) base + the adapter trained on its NF4-rounded copy; "
                           "--merge gives what the run trained (logits differ)"), flush=True)
    if args.merge:
        model = merge_adapters(model, cfg)
    if args.format == "gguf":
        from scaletrain.checkpoint.gguf import export_gguf, trained_context

        out = export_gguf(model, cfg.model, tokenizer, args.out or Path(args.run) / "model.gguf", args.dtype,
                          name=Path(args.run).resolve().name, template=cfg.finetune.chat_template,
                          context=trained_context(cfg, hf_base_folder(args.run, cfg) is not None))
        print(f"exported {ckpt.name} to {out} ({args.dtype}, {out.stat().st_size / 1e6:.2f} MB; run it with "
              f"llama.cpp: llama-cli -m {out}, or Ollama: see docs/inference.md)")
        return 0
    out = Path(args.out or Path(args.run) / "export-hf")
    base, family_class = hf_base_folder(args.run, cfg), family(cfg.model.family).hf_class
    if is_plain(model):
        export_hf(model, cfg.model, tokenizer, out, base)
        merged = " with the adapters merged" if cfg.finetune.source and not method.trains_base else ""
        print(f"exported {ckpt.name}{merged} to {out} (load with transformers.{family_class}.from_pretrained)")
        return 0
    export_hf(base_model(cfg), cfg.model, tokenizer, out, base)  # the base, unchanged, and the adapter beside it
    adapter = save_peft_adapter(model, cfg, out / "adapter")
    print(f"exported the base to {out} and the {cfg.finetune.method} adapter of {ckpt.name} to {adapter} (load with "
          f"peft.PeftModel.from_pretrained({family_class}.from_pretrained({str(out)!r}), {str(adapter)!r}))")
    return 0
