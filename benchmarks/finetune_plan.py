"""The planner's fine-tuning memory (scaletrain.plan.finetune) against the exact peak of live tensor bytes of the
trainer's own fine-tuning step (build_parallel_training + training_step, the LiveTensorBytes tracker of
scaletrain.plan.measure), for full, LoRA, QLoRA, prompt tuning and DoRA. Target: within 10%. And the planner's
fine-tuning step time (scaletrain.plan.finetune.finetune_step_time, with the reference CPU's calibration: what
`scaletrain plan --hardware cpu` uses) against the median process CPU time of the same step on one thread
(the clock the calibration was measured with, so other people's jobs on the shared cores do not count).
Target: within 25%. The preference rows (``dpo_lora``, ``dpo_full``, ``simpo_lora``, ``orpo_full``, ``dpo_qlora``:
BATCH // 2 pairs, so the same four rows) check ``preference_memory`` and ``preference_step_time`` the same way, DPO's
reference through the disabled adapters (LoRA / QLoRA) or precomputed (full).

    python benchmarks/finetune_plan.py [--out benchmarks/results/finetune_plan.json]

The base is a random Llama of the fine-tuning benchmark's shape (dim 256, 6 layers, BPE 2048) exported to a
temporary Hugging Face folder; each method runs in a fresh process. Needs no ../shared.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile

from launch import OUT_HELP, default_out, write_result  # benchmarks/launch.py (the script's folder is on sys.path)

MODEL = {"vocab_size": 2048, "dim": 256, "n_layers": 6, "n_heads": 4, "ffn_hidden_dim": 688, "max_seq_len": 160}
# The ``moe_*`` rows' base: a Mixtral of the same shape with every feed-forward 8 experts (top-2) of width 128
MOE_MODEL = {**MODEL, "family": "mixtral", "moe_experts": 8, "moe_top_k": 2, "moe_hidden_dim": 128}
BATCH, SEQ = 4, 128
METHODS = {"full": {}, "lora": {"lora_rank": 8, "lora_targets": ["q", "k", "v", "o"]},
           "lora_all_r16": {"lora_rank": 16, "lora_targets": ["q", "k", "v", "o", "gate", "up", "down"]},
           "qlora": {"lora_rank": 8, "lora_targets": ["q", "k", "v", "o"]}, "prompt": {"virtual_tokens": 16},
           "dora": {"lora_rank": 8, "lora_targets": ["q", "k", "v", "o"], "dora": True},
           "moe_lora": {"lora_rank": 8, "lora_targets": ["q", "v", "gate", "up", "down", "router"]},
           "moe_qlora": {"lora_rank": 8, "lora_targets": ["q", "v", "gate", "up", "down", "router"]}}
# finetune.objective rows: name -> (method, objective); LoRA / QLoRA with METHODS["lora"]'s adapters
PREFERENCE = {"dpo_lora": ("lora", "dpo"), "dpo_full": ("full", "dpo"), "simpo_lora": ("lora", "simpo"),
              "orpo_full": ("full", "orpo"), "dpo_qlora": ("qlora", "dpo")}


def measure(name: str, base: str) -> dict:
    import torch

    from scaletrain.config import FinetuneConfig, JobConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig
    from scaletrain.finetune.preference import PrecomputedReference, PreferenceObjective
    from scaletrain.parallel import ParallelDims
    from scaletrain.plan.finetune import finetune_memory, finetune_step_time, preference_memory, preference_step_time
    from scaletrain.plan.hardware_spec import parse_hardware
    from scaletrain.plan.measure import LiveTensorBytes, measure_step, resident_extras
    from scaletrain.plan.workload import Plan, Workload
    from scaletrain.train.step import StepOptions, build_parallel_training, training_step

    if name in PREFERENCE:
        method, objective = PREFERENCE[name]
        ft = FinetuneConfig(source=base, method=method, objective=objective,
                            **(METHODS["lora"] if method != "full" else {}))
    else:
        method = "qlora" if name in ("qlora", "moe_qlora") else "prompt" if name == "prompt" \
            else "full" if name == "full" else "lora"
        ft = FinetuneConfig(source=base, method=method, **METHODS[name])
    pairs = BATCH // 2 if ft.objective != "sft" else 0
    model = ModelConfig(**(MOE_MODEL if name.startswith("moe_") else MODEL))
    # built as an SFT fine-tune; the preference objective is installed below on this benchmark's own pairs (the
    # trainer's would read finetune.preferences)
    cfg = JobConfig(model=model, optim=OptimConfig(), train=TrainConfig(seed=0),
                    finetune=dataclasses.replace(ft, objective="sft"))
    torch.set_num_threads(1)
    tracker = LiveTensorBytes().__enter__()
    dims = ParallelDims.from_config(ParallelConfig(), 1)
    pm, optimizer = build_parallel_training(cfg, dims, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    inputs = torch.randint(0, model.vocab_size, (BATCH, SEQ), generator=gen)
    targets = torch.randint(0, model.vocab_size, (BATCH, SEQ), generator=gen)
    if pairs:  # chosen rows then rejected rows, the first quarter of each a prompt (not scored)
        targets[:, :SEQ // 4] = -100
        reference = None
        if ft.objective == "dpo" and method == "full":  # the trainer's one pass before training
            reference = PrecomputedReference.build(pm.modules[0], list(zip(inputs, targets)), BATCH,
                                                   torch.device("cpu"), pm.vocab_limit, True)
        PreferenceObjective(pm, ft, reference)
    micro = [(inputs, targets, None)]
    measured = measure_step(lambda: training_step(pm, optimizer, iter(micro), 1, StepOptions(grad_clip=1.0)).loss,
                            tracker, steps=7)
    if pairs:  # the planner counts pairs: micro-batch and global batch
        workload = Workload(model=model, seq_len=SEQ, global_batch=pairs, train_tokens=BATCH * SEQ)
        predicted = preference_memory(workload, Plan(micro_batch=pairs), ft, "cpu")
        step_s = preference_step_time(workload, Plan(micro_batch=pairs), parse_hardware("cpu"), ft)["step_seconds"]
    else:
        workload = Workload(model=model, seq_len=SEQ, global_batch=BATCH, train_tokens=BATCH * SEQ)
        predicted = finetune_memory(workload, Plan(micro_batch=BATCH), dataclasses.replace(ft), "cpu")
        step_s = finetune_step_time(workload, Plan(micro_batch=BATCH), parse_hardware("cpu"), ft)["step_seconds"]
    predicted_bytes = predicted["tensor_total"] + resident_extras(model, BATCH, SEQ)
    return {"method": name, "predicted_bytes": predicted_bytes, "measured_peak_bytes": measured["peak_bytes"],
            "memory_error": predicted_bytes / measured["peak_bytes"] - 1, "peak_phase": predicted["peak_phase"],
            "trainable_parameters": predicted["trainable_parameters"], "measured_step_s": measured["step_s"],
            "measured_step_cpu_s": measured["step_cpu_s"], "predicted_step_s": step_s,
            "time_error": step_s / measured["step_cpu_s"] - 1}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # child: METHOD BASE
    parser.add_argument("--only", default="", help="rows, comma-separated (default: all: "
                        + ", ".join([*METHODS, *PREFERENCE]) + ")")
    parser.add_argument("--out", default=default_out("finetune_plan.json"),
                        help=OUT_HELP.format(name="finetune_plan.json"))
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(*args.one)))
        return 0
    from scaletrain.checkpoint.export import export_hf
    from scaletrain.config import ModelConfig
    from scaletrain.data.tokenizer import BPETokenizer
    from scaletrain.model import build_model

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        from tokenizers import Tokenizer, models

        vocab = {f"t{i}": i for i in range(MODEL["vocab_size"])}
        tok = BPETokenizer(Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0")))
        export_hf(build_model(ModelConfig(**MODEL), seed=0), ModelConfig(**MODEL), tok, tmp)
        moe_base = f"{tmp}/moe"
        for name in [n.strip() for n in args.only.split(",") if n.strip()] or [*METHODS, *PREFERENCE]:
            if name.startswith("moe_") and not os.path.isdir(moe_base):
                export_hf(build_model(ModelConfig(**MOE_MODEL), seed=0), ModelConfig(**MOE_MODEL), tok, moe_base)
            base = moe_base if name.startswith("moe_") else tmp
            proc = subprocess.run([sys.executable, __file__, "--one", name, base], capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(proc.stderr[-3000:])
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            r = rows[-1]
            print(f"{name:13s} predicted {r['predicted_bytes'] / 2**20:7.1f} MiB, measured "
                  f"{r['measured_peak_bytes'] / 2**20:.1f} MiB  error {100 * r['memory_error']:+5.1f}%  step predicted "
                  f"{r['predicted_step_s'] * 1e3:6.1f} ms  measured {r['measured_step_cpu_s'] * 1e3:6.1f} ms  "
                  f"error {100 * r['time_error']:+5.1f}%", flush=True)
    result = {"model": MODEL, "moe_model": MOE_MODEL, "batch": BATCH, "pairs": BATCH // 2, "seq_len": SEQ, "rows": rows,
              "max_abs_memory_error": max(abs(r["memory_error"]) for r in rows),
              "max_abs_time_error": max(abs(r["time_error"]) for r in rows)}
    write_result(args.out, result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
