"""Prove it on a GPU: one prepared check of every GPU path of scaletrain (issue 27, docs/gpu.md).

    PYTHONPATH=src python scripts/gpu_check.py --out gpu-check          # every check, in order (<= 8.5 min, H100)
    PYTHONPATH=src python scripts/gpu_check.py --out gpu-check --only fp8,lora-qlora
    PYTHONPATH=src python scripts/gpu_check.py --out gpu-check --only decode-compiled   # not in the full run
    PYTHONPATH=src python scripts/gpu_check.py --out gpu-check --only qlora-compiled    # not in the full run
    PYTHONPATH=src python scripts/gpu_check.py --out gpu-check --only moe               # not in the full run
    PYTHONPATH=src python scripts/gpu_check.py --out gpu-check --dry-run   # the rehearsal on a CPU (tests)

Each check runs in its own process (``--child NAME``) with its own time limit, through the project's own
entry points (``python -m scaletrain.cli train / finetune / plan`` and the Python APIs those commands call),
and writes ``<out>/<name>/result.json``; a check that fails, hangs or crashes is recorded and the next one
runs. One table row is printed per check as it finishes, and ``<out>/gpu_check.json`` holds the machine
(nvidia-smi, torch, CUDA, device) and one entry per check. ``--dry-run`` runs every check's set-up on the CPU
with tiny shapes (what cannot run on a CPU is skipped with the reason), so the GPU minutes go to measuring.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
TOTAL_BUDGET_S = 520  # the whole run on one H100: the lent machine's 15 minutes hold its start, this and a short rerun
# The rehearsal takes ~80 s of CPU time, but on 2 cores shared with other people's jobs its wall time has been
# 3-10x that: its limits are this much longer.
DRY_SLOWDOWN = 5
DRY_TOTAL_S = 3000
TINY_MODEL = {"model.dim": 64, "model.n_layers": 2, "model.n_heads": 2, "model.n_kv_heads": 0,
              "model.ffn_hidden_dim": 128, "model.max_seq_len": 64, "model.tie_embeddings": "false"}


class Skip(Exception):
    """The check cannot run here; the message says why."""


class Failed(Exception):
    """The check ran and something is wrong; the message says what, in one line."""


@dataclass
class Ctx:
    """What a check gets: its own folder, the mode, and helpers to run the project's commands."""

    folder: Path
    dry: bool
    hardware: str  # the planner's catalog name for this device (h100-sxm, h100-pcie, h200)

    @property
    def device(self) -> str:
        return "cpu" if self.dry else "cuda"

    def run(self, cmd: list[str], name: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        """Run ``cmd`` with ``PYTHONPATH=src``; its output goes to ``<folder>/<name>.log``; a non-zero exit is
        ``Failed`` with the last meaningful line (``check``)."""
        log = self.folder / f"{name}.log"
        timeout *= DRY_SLOWDOWN if self.dry else 1
        with open(log, "w") as f:
            proc = subprocess.run(cmd, env=child_env(self.dry), stdout=f, stderr=subprocess.STDOUT, text=True,
                                  timeout=timeout, cwd=ROOT)
        if check and proc.returncode != 0:
            raise Failed(f"{name} exited {proc.returncode}: {last_line(log.read_text())} (log: {log})")
        proc.stdout = log.read_text()
        return proc


def child_env(dry: bool) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH", "")]))
    env.setdefault("SCALETRAIN_CACHE", str(ROOT / "runs" / ".gpu-check-cache"))
    if dry:  # tiny models on 2 shared cores: one thread each is fastest
        env.setdefault("OMP_NUM_THREADS", "1")
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def last_line(text: str) -> str:
    """The line that says what went wrong: the last error-looking line, else the last non-empty one."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if "Error" in line or "error:" in line or "Exception" in line:
            return line[:300]
    return lines[-1][:300] if lines else "(no output)"


def scaletrain(*args: str) -> list[str]:
    return [sys.executable, "-m", "scaletrain.cli", *args]


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", *args]


def flags(overrides: dict) -> list[str]:
    return [f"--{k}={v}" for k, v in overrides.items()]


def metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def last_step_record(run: Path) -> dict:
    """The last logged training record (its step_ms / tokens/s are the median of the last log window, so the
    compile of step 1 does not count)."""
    rows = [r for r in metrics(run) if "tokens_per_second" in r]
    if not rows:
        raise Failed(f"{run}/metrics.jsonl has no step record")
    return rows[-1]


def final_val_loss(run: Path) -> float | None:
    rows = [r["val_loss"] for r in metrics(run) if "val_loss" in r]
    return rows[-1] if rows else None


# -- pretraining: gpt2-124m as the planner plans it -----------------------------------------------------
GPT2_SEQ, GPT2_STEPS = 1024, 50
MICRO_BATCHES = (64, 32, 16, 8, 4, 2, 1)


def plan_gpt2(ctx: Ctx, model: dict | None = None) -> tuple[Path, dict]:
    """``scaletrain plan`` for gpt2-124m (with ``model``'s fields over it, e.g. its experts) on one device of this
    kind at the largest micro-batch it says fits (no recomputation, no accumulation): the emitted job TOML and that
    plan."""
    toml, doc = ctx.folder / "plan.toml", ctx.folder / "plan.json"
    for micro_batch in MICRO_BATCHES:
        proc = ctx.run(scaletrain("plan", "--model.preset=gpt2-124m", *flags(model or {}), "--hardware",
                                  f"{ctx.hardware}:1",
                                  f"--data.seq_len={GPT2_SEQ}", "--global-batch", str(micro_batch), "--micro-batch",
                                  str(micro_batch), "--parallel.activation_checkpointing=none", "--tokens", "100M",
                                  "--json", str(doc), "--emit", str(toml)),
                       f"plan-mb{micro_batch}", timeout=120, check=False)
        if proc.returncode == 0:
            return toml, json.loads(doc.read_text())["plans"][0]
    raise Failed(f"the planner says no micro-batch of gpt2-124m {flags(model or {})} fits one {ctx.hardware}")


def gpt2_overrides(ctx: Ctx, run: Path, **extra) -> dict:
    """The training flags of every gpt2 run: BPE on the bundled Tiny Shakespeare (8192 tokens, the model's
    50304 rows masked beyond them), no checkpoints, one evaluation at the end. A dry run shrinks the model."""
    out = {"train.run_dir": run, "train.steps": GPT2_STEPS, "train.device": ctx.device, "data.path":
           "builtin:tinyshakespeare", "data.tokenizer": "bpe", "data.vocab_size": 8192,
           "data.cache_dir": ctx.folder.parent / "data-bpe8192", "train.eval_interval": 0, "train.eval_batches": 4,
           "train.sample_tokens": 0, "checkpoint.enabled": "false", "logging.progress": "plain",
           "logging.tensorboard": "false", "logging.log_interval": 10, "schedule.warmup_steps": 10}
    if ctx.dry:
        out.update(TINY_MODEL, **{"data.vocab_size": 512, "data.cache_dir": ctx.folder.parent / "data-bpe512",
                                  "data.seq_len": 64, "train.batch_size": 2, "train.grad_accum_steps": 1,
                                  "train.steps": 3, "train.eval_batches": 1, "logging.log_interval": 1,
                                  "model.vocab_size": 0, "schedule.warmup_steps": 1})
    out.update(extra)
    return out


def train_numbers(ctx: Ctx, run: Path) -> dict:
    """tokens/s, MFU (the trainer's, against its measured matmul peak, and against the datasheet's dense
    bf16 peak of the planner's catalog), peak memory, losses."""
    from scaletrain.config import load_config
    from scaletrain.hardware.catalog import CATALOG
    from scaletrain.model.presets import flops_per_token
    from scaletrain.train.metrics import mfu

    cfg = load_config(run / "config.toml")
    rec = last_step_record(run)
    datasheet = CATALOG[ctx.hardware].peak_flops["bf16"]
    # flops_per_token counts the matmuls a token runs: of a mixture of experts the router and its top-k experts
    return {"tokens_per_second": round(rec["tokens_per_second"], 1), "step_ms": round(rec["step_ms"], 2),
            "mfu_vs_measured_peak": round(rec["mfu"], 4),
            "mfu_vs_datasheet_bf16": round(mfu(flops_per_token(cfg.model, cfg.data.seq_len),
                                               rec["tokens_per_second"], datasheet), 4),
            "peak_memory_mib": round(rec["peak_memory_mb"], 1), "train_loss": rec["loss"],
            "val_loss": final_val_loss(run), "micro_batch": cfg.train.batch_size,
            "grad_accum_steps": cfg.train.grad_accum_steps,
            "cuda_max_reserved_mib": round(rec["cuda_max_reserved_mb"], 1) if "cuda_max_reserved_mb" in rec else None}


def gpt2_check(ctx: Ctx, name: str, model: dict | None = None, **extra) -> dict:
    """Plan gpt2-124m (``model``'s fields over it), train the emitted job for 50 steps with ``extra`` flags, set
    the two side by side."""
    toml, best = plan_gpt2(ctx, model)
    run = ctx.folder / "run"
    ctx.run(scaletrain("train", "--config", str(toml), *flags(gpt2_overrides(ctx, run, **extra))), name, timeout=900)
    got = train_numbers(ctx, run)
    # Peak memory is the allocator's max allocated tensor bytes: set beside the plan's tensors, before its
    # allocator margin and runtime reserve (both in predicted_total_mib).
    predicted = {"plan": best["label"], "predicted_tokens_per_second": round(best["time"]["tokens_per_second"], 1),
                 "predicted_step_ms": round(1000 * best["time"]["step"], 2),
                 "predicted_mfu": round(best["time"]["mfu"], 4),
                 "predicted_tensor_mib": round(best["memory"]["tensor_total"] / 2**20, 1),
                 "predicted_total_mib": round(best["memory"]["total"] / 2**20, 1)}
    got.update(predicted)
    if not ctx.dry:
        got["measured_over_predicted_tokens_per_second"] = round(got["tokens_per_second"]
                                                                 / predicted["predicted_tokens_per_second"], 3)
        got["measured_over_predicted_memory"] = round(got["peak_memory_mib"] / predicted["predicted_tensor_mib"], 3)
    return got


# The profiled window of the compiled row: steps 28-30, clear of the compile and of the last log window (41-50)
# whose median gives its tokens/s; no memory history (recording every allocation slows every step).
PROFILE_WINDOW = {"profile.enabled": "true", "profile.wait": 25, "profile.warmup": 2, "profile.active": 3,
                  "profile.memory_snapshot": "false"}
DRY_PROFILE_WINDOW = {**PROFILE_WINDOW, "profile.wait": 0, "profile.warmup": 1, "profile.active": 1}


def profile_breakdown(run: Path) -> dict | None:
    """train/profile.py's breakdown of the run's profiled steps (kernel time against launch gaps, kernels by kind,
    the attention backend, the optimizer, syncs per step), or None when the run wrote none."""
    path = run / "profile" / "breakdown_rank0.json"
    return json.loads(path.read_text()) if path.is_file() else None


def check_train_bf16_compile(ctx: Ctx) -> dict:
    if ctx.dry:  # a cold inductor compile costs ~20 s on this CPU: the dry run trains eagerly
        out = gpt2_check(ctx, "train", **{"train.precision": "bf16", "train.compile": "false"}, **DRY_PROFILE_WINDOW)
        out = {**out, "note": "dry run: compile off (cold compile ~20 s on a CPU); the profile has no kernels"}
    else:
        out = gpt2_check(ctx, "train", **{"train.precision": "bf16", "train.compile": "true"}, **PROFILE_WINDOW)
    out["profile"] = profile_breakdown(ctx.folder / "run")
    if out["profile"] is None:
        raise Failed("the profiled steps wrote no breakdown (run/profile/breakdown_rank0.json)")
    return out


def check_train_bf16_eager(ctx: Ctx) -> dict:
    return gpt2_check(ctx, "train", **{"train.precision": "bf16", "train.compile": "false"})


def check_train_fp16(ctx: Ctx) -> dict:
    """fp16 autocast with the gradient scaler: the loss stays finite and the scaler skips few updates."""
    if ctx.dry:  # the trainer refuses fp16 on a CPU (check that first), then rehearse the rest in bf16
        refused = ctx.run(scaletrain("train", *flags(gpt2_overrides(ctx, ctx.folder / "refused",
                                                                      **{"train.precision": "fp16"}))),
                          "refused", timeout=120, check=False)
        if refused.returncode != 2 or "fp16 needs a GPU" not in refused.stdout:
            raise Failed(f"fp16 on a CPU was not refused in one line: {last_line(refused.stdout)}")
        out = gpt2_check(ctx, "train", **{"train.precision": "bf16", "train.compile": "false"})
        return {**out, "note": "dry run: fp16 refused on the CPU as it should be; the rest ran in bf16"}
    out = gpt2_check(ctx, "train", **{"train.precision": "fp16", "train.compile": "false"})
    skipped = sum(r.get("skipped_update", 0) for r in metrics(ctx.folder / "run"))
    if out["val_loss"] is None or out["val_loss"] != out["val_loss"]:
        raise Failed(f"fp16: no finite validation loss ({out['val_loss']})")
    return {**out, "skipped_updates_logged": skipped}


# -- mixture of experts: gpt2-124m's active parameters in 8 experts top-2 (issue 51) -----------------------
# Over gpt2-124m: every block's SwiGLU (2048 wide) becomes 8 experts of 1024, 2 a token (the same active width):
# 293.5M parameters, 123.7M active (the dense model's and the router's), ~3.5 GiB of bf16 weights and AdamW state.
MOE_MODEL = {"model.moe_experts": 8, "model.moe_top_k": 2, "model.moe_hidden_dim": 1024}
DRY_MOE_MODEL = {"model.moe_experts": 4, "model.moe_hidden_dim": 64}  # over TINY_MODEL: widths of 16-byte multiples


def grouped_gemm_path(model_cfg, device: str) -> bool:
    """Whether the run's experts ran as ``torch._grouped_mm`` (model/moe.py's own rule, asked with the run's
    shapes in bf16 on this device), not as the sorted-token loop."""
    import torch

    from scaletrain.model.moe import grouped_mm_fits
    from scaletrain.model.presets import expert_hidden_dim

    e, d, h = model_cfg.moe_experts, model_cfg.dim, expert_hidden_dim(model_cfg)
    x, w1, w2 = (torch.empty(*shape, dtype=torch.bfloat16, device=device) for shape in ((1, d), (e, h, d), (e, d, h)))
    return grouped_mm_fits(x, w1, w2)


def check_moe(ctx: Ctx) -> dict:
    """An MoE of gpt2-124m's active parameters as the planner plans it (the largest micro-batch it says fits one
    device), trained 50 steps in bf16, compiled, its experts as grouped GEMMs: tokens/s, MFU of the active FLOPs and
    the measured step beside the planner's; the expert load of the last log window. The dry run trains a tiny MoE
    eagerly (its grouped GEMM in bf16 on the CPU)."""
    from scaletrain.config import load_config
    from scaletrain.model.presets import active_params, flops_per_token, num_params

    compile_ = "false" if ctx.dry else "true"
    out = gpt2_check(ctx, "train", MOE_MODEL, **{"train.precision": "bf16", "train.compile": compile_},
                     **(DRY_MOE_MODEL if ctx.dry else {}))
    run = ctx.folder / "run"
    cfg, rec = load_config(run / "config.toml"), last_step_record(run)
    out.update(parameters=num_params(cfg.model), active_parameters=active_params(cfg.model),
               active_flops_per_token=flops_per_token(cfg.model, cfg.data.seq_len),  # the MFU's numerator
               experts=cfg.model.moe_experts, top_k=cfg.model.moe_top_k, expert_hidden_dim=cfg.model.moe_hidden_dim,
               grouped_gemm=grouped_gemm_path(cfg.model, ctx.device),
               max_mean_load=rec.get("moe_max_mean_load"),
               dropped_tokens=sum(v for k, v in rec.items() if k.startswith("moe_dropped_tokens/")))
    if not ctx.dry:
        out["measured_over_predicted_step_ms"] = round(out["step_ms"] / out["predicted_step_ms"], 3)
    if not out["grouped_gemm"]:
        raise Failed(f"the experts ran as the sorted-token loop, not grouped GEMMs ({ctx.device}, bf16, "
                     f"{cfg.model.dim} x {cfg.model.moe_hidden_dim})")
    if ctx.dry:
        out["note"] = "dry run: a tiny MoE, eager, on the CPU (the MFU's datasheet and the plan are the GPU's)"
    return out


# -- side by side: nanoGPT's loop on the same card, shape and batch ----------------------------------------
NANOGPT = ROOT / "benchmarks" / "nanogpt_reference.py"
NANOGPT_SKIP = 10  # steps left out of its timing (the compile), as the trainer's record leaves out all but the last
# log window


def prepared_folder(cache: Path) -> Path:
    """The token folder our gpt2 runs prepared under ``cache`` (data.cache_dir: one subfolder per corpus and
    tokenizer, with its manifest.json)."""
    found = sorted(cache.rglob("manifest.json"))
    if not found:
        raise Failed(f"no prepared token folder under {cache} (the train run prepares it)")
    return found[0].parent


def ours_for_side_by_side(ctx: Ctx) -> dict:
    """Our compiled bf16 row: train-bf16-compile's numbers when it ran ok in this call (the same card, minutes
    earlier), else that check run here."""
    earlier = ctx.folder.parent / "train-bf16-compile" / "result.json"
    if earlier.is_file():
        result = json.loads(earlier.read_text())
        if result["status"] == "ok":
            return {**result["numbers"], "source": "train-bf16-compile"}
    return {**check_train_bf16_compile(ctx), "source": "this check"}


def check_nanogpt_side_by_side(ctx: Ctx) -> dict:
    """benchmarks/nanogpt_reference.py --speed (nanoGPT's GPU loop: bf16 autocast, torch.compile, fused AdamW)
    at gpt2-124m's shape (12 x 12 x 768, 1024 tokens, 50304-row vocabulary) on our run's tokens and micro-batch:
    tokens/s, MFU against the datasheet and peak memory of both, and ours over nanoGPT's."""
    from scaletrain.hardware.catalog import CATALOG

    ours = ours_for_side_by_side(ctx)
    data = prepared_folder(ctx.folder.parent / ("data-bpe512" if ctx.dry else "data-bpe8192"))
    shape = ["--n-layer", "2", "--n-head", "2", "--n-embd", "64", "--block-size", "64", "--vocab-size", "512",
             "--max-iters", "4", "--skip", "1", "--no-compile", "--device", "cpu"] if ctx.dry else \
        ["--block-size", str(GPT2_SEQ), "--vocab-size", "50304", "--max-iters", str(GPT2_STEPS), "--skip",
         str(NANOGPT_SKIP), "--device", "cuda"]
    proc = ctx.run([sys.executable, str(NANOGPT), "--config", "gpt2", "--speed", "--data", str(data), "--dtype",
                    "bf16", "--batch-size", str(ours["micro_batch"]), *shape], "nanogpt", timeout=300)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines or "tokens_per_second" not in lines[-1]:
        raise Failed(f"nanogpt_reference.py --speed printed no result: {last_line(proc.stdout)}")
    ref = lines[-1]
    fpt = ref["flops_per_token"]  # our count for our gpt2-124m: SwiGLU 3 x 768 x 2048 = GELU's 2 x 768 x 3072
    datasheet = CATALOG[ctx.hardware].peak_flops["bf16"]
    out = {"ours_tokens_per_second": ours["tokens_per_second"], "nanogpt_tokens_per_second": ref["tokens_per_second"],
           "ours_over_nanogpt": round(ours["tokens_per_second"] / ref["tokens_per_second"], 3),
           "ours_mfu_vs_datasheet_bf16": ours["mfu_vs_datasheet_bf16"],
           "nanogpt_mfu_vs_datasheet_bf16": round(ref["tokens_per_second"] * fpt / datasheet, 4),
           "ours_peak_memory_mib": ours["peak_memory_mib"], "nanogpt_peak_memory_mib": ref["peak_memory_mib"],
           "micro_batch": ours["micro_batch"], "ours_from": ours["source"], "nanogpt_step_ms": ref["step_ms"],
           "nanogpt_timed_steps": ref["timed_steps"], "nanogpt_loss": ref["loss"], "ours_train_loss":
           ours["train_loss"], "nanogpt_parameters": ref["parameters"],
           "flops_per_token": fpt}
    if ctx.dry:
        out["note"] = "dry run: both sides tiny, eager, on the CPU (the MFU's datasheet is the GPU's: meaningless)"
    return out


# -- fp8 vs bf16 ------------------------------------------------------------------------------------------
# Block Linears of at least 1024 in both dimensions: the ones train/fp8.py converts (gpt2-124m's 768-wide
# ones would stay bf16, and the comparison would be bf16 against itself).
FP8_MODEL = {"model.dim": 2048, "model.n_layers": 4, "model.n_heads": 16, "model.n_kv_heads": 0,
             "model.ffn_hidden_dim": 5632, "model.vocab_size": 50304, "model.tie_embeddings": "false",
             "model.max_seq_len": 1024, "data.seq_len": 1024, "train.batch_size": 8, "train.grad_accum_steps": 1}


def check_fp8(ctx: Ctx) -> dict:
    """The same job in bf16 and in fp8 (torchao Float8Linear), both compiled: step time, loss within 1%."""
    from scaletrain.config import ModelConfig, build, load_config

    shape = {} if ctx.dry else FP8_MODEL
    compile_ = "false" if ctx.dry else "true"
    rows = {}
    for precision in ("bf16", "fp8"):
        run = ctx.folder / precision
        if ctx.dry and precision == "fp8":
            refused = ctx.run(scaletrain("train", *flags(gpt2_overrides(ctx, run, **{"train.precision": "fp8"}))),
                              "fp8", timeout=120, check=False)
            if refused.returncode != 2 or "fp8 needs an NVIDIA GPU" not in refused.stdout:
                raise Failed(f"fp8 on a CPU was not refused in one line: {last_line(refused.stdout)}")
            gpu_shape = build(ModelConfig, {k[6:]: v for k, v in FP8_MODEL.items() if k.startswith("model.")})
            raise Skip(f"fp8 needs a GPU with fp8 tensor cores (sm89+); refused on the CPU in one line as it should "
                       f"be; the bf16 half ran ({rows['bf16']['step_ms']} ms/step); the GPU shape converts "
                       f"{fp8_linear_count(gpu_shape)} Linears")
        ctx.run(scaletrain("train", *flags(gpt2_overrides(ctx, run, **shape, **{"train.precision": precision,
                                                                                "train.compile": compile_}))),
                precision, timeout=900)
        rows[precision] = train_numbers(ctx, run)
    bf16, fp8 = rows["bf16"], rows["fp8"]
    speedup = bf16["step_ms"] / fp8["step_ms"]
    loss_change = fp8["train_loss"] / bf16["train_loss"] - 1
    out = {"bf16_step_ms": bf16["step_ms"], "fp8_step_ms": fp8["step_ms"], "fp8_speedup": round(speedup, 3),
           "bf16_loss": bf16["train_loss"], "fp8_loss": fp8["train_loss"], "loss_change": round(loss_change, 5),
           "bf16_val_loss": bf16["val_loss"], "fp8_val_loss": fp8["val_loss"],
           "fp8_peak_memory_mib": fp8["peak_memory_mib"], "bf16_peak_memory_mib": bf16["peak_memory_mib"]}
    out["fp8_linears"] = fp8_linear_count(load_config(ctx.folder / "fp8" / "config.toml").model)
    if not out["fp8_linears"]:
        raise Failed("no block Linear is large enough for Float8Linear: the fp8 run was bf16")
    # Quality: the validation loss (the mean over the eval windows; the last train loss is one batch's, and
    # moved by +-1.2% between runs of the same recipe) may not be worse in fp8 than in bf16 by more than 1%. A
    # lower fp8 loss is no defect: the first H100 run had -0.94% train / -0.19% val, the second -1.21% train.
    val_change = fp8["val_loss"] / bf16["val_loss"] - 1
    out["val_loss_change"] = round(val_change, 5)
    if val_change > 0.01:
        raise Failed(f"fp8 validation loss after {GPT2_STEPS} steps {fp8['val_loss']:.4f} vs bf16 "
                     f"{bf16['val_loss']:.4f} ({100 * val_change:+.2f}%, limit +1%); train loss "
                     f"{100 * loss_change:+.2f}%")
    return out


def fp8_linear_count(model_cfg) -> int:
    """How many Linears the trainer's converter (train/fp8.py's filter) turns into Float8Linear for this
    model (the trainer does not log the count)."""
    import torch

    from scaletrain.model import Transformer
    from scaletrain.train.fp8 import fp8_filter

    with torch.device("meta"):
        model = Transformer(model_cfg)
    keep = fp8_filter()
    return sum(keep(m, name) for name, m in model.named_modules())


# -- torchrun: kill -9 and --resume, bitwise ---------------------------------------------------------------
RESUME_JOB = {"model.preset": "small", "model.vocab_size": 0, "data.seq_len": 256, "train.batch_size": 8,
              "train.steps": 150, "checkpoint.interval": 50, "checkpoint.keep_last": 2, "train.eval_interval": 0,
              "train.eval_batches": 2, "train.sample_tokens": 0, "logging.log_interval": 1,
              "logging.progress": "off", "logging.tensorboard": "false", "train.precision": "bf16", "train.seed": 7,
              "schedule.warmup_steps": 10}


def resume_job(ctx: Ctx, run: Path) -> list[str]:
    job = dict(RESUME_JOB, **{"train.run_dir": run, "train.device": ctx.device,
                              "data.cache_dir": ctx.folder / "data"})
    if ctx.dry:
        job.update(TINY_MODEL, **{"model.preset": "", "data.seq_len": 64, "train.batch_size": 4, "train.steps": 100,
                                  "checkpoint.interval": 10})  # ~4 s of steps: time for the kill to land
    return torchrun("-m", "scaletrain.cli", "train", *flags(job))


def last_logged_step(run: Path) -> int:
    try:
        return max((r.get("step", 0) for r in metrics(run)), default=0)
    except (json.JSONDecodeError, OSError):  # a line being written
        return 0


def kill_at(ctx: Ctx, run: Path, step: int, limit: float) -> int:
    """Start the job under torchrun, ``kill -9`` its whole process group once ``step`` is logged."""
    log = open(ctx.folder / "killed.log", "w")
    proc = subprocess.Popen(resume_job(ctx, run), env=child_env(ctx.dry), stdout=log, stderr=subprocess.STDOUT,
                            cwd=ROOT, start_new_session=True)
    (ctx.folder / "victim.pgid").write_text(str(proc.pid))  # for the driver, should this check be killed
    deadline = time.monotonic() + limit
    while last_logged_step(run) < step:
        if proc.poll() is not None:
            raise Failed(f"the run to be killed ended first (exit {proc.returncode}): "
                         f"{last_line((ctx.folder / 'killed.log').read_text())}")
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise Failed(f"the run to be killed did not reach step {step} in {limit:.0f} s")
        time.sleep(0.003)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    if "done:" in (ctx.folder / "killed.log").read_text():
        raise Failed(f"the kill landed after the run had finished (this machine polled too slowly to catch step "
                     f"{step}); nothing was tested")
    return last_logged_step(run)


def same_run(a: Path, b: Path) -> tuple[int, int, int]:
    """(steps whose loss differs, final tensors that differ, the first differing step or 0) of two runs."""
    import torch

    from scaletrain.infer.load import load_run

    la = {r["step"]: r["loss"] for r in metrics(a) if "loss" in r}
    lb = {r["step"]: r["loss"] for r in metrics(b) if "loss" in r}  # a re-logged step keeps the resumed value
    if sorted(la) != sorted(lb):
        raise Failed(f"the resumed run logged steps {min(lb, default=0)}-{max(lb, default=0)}, the reference "
                     f"{min(la, default=0)}-{max(la, default=0)}")
    differ = sorted(s for s in la if la[s] != lb[s])
    wa, wb = load_run(a)[1].state_dict(), load_run(b)[1].state_dict()
    tensors = sum(not torch.equal(wa[k], wb[k]) for k in wa)
    return len(differ), tensors, differ[0] if differ else 0


def check_resume_kill9(ctx: Ctx) -> dict:
    """torchrun --nproc-per-node 1: an uninterrupted run, and one killed with SIGKILL after its first checkpoint
    then ``--resume``d; every logged loss and every final weight must be equal."""
    reference, resumed = ctx.folder / "reference", ctx.folder / "resumed"
    interval = int(RESUME_JOB["checkpoint.interval"] if not ctx.dry else 10)
    t0 = time.monotonic()
    ctx.run(resume_job(ctx, reference), "reference", timeout=600)
    reference_s = time.monotonic() - t0
    killed_at = kill_at(ctx, resumed, interval + interval // 2, limit=300)
    ctx.run(resume_job(ctx, resumed) + ["--resume"], "resume", timeout=600)
    if "resumed from" not in (ctx.folder / "resume.log").read_text():
        raise Failed("the --resume run did not say 'resumed from' a checkpoint")
    losses, tensors, first = same_run(reference, resumed)
    out = {"killed_at_step": killed_at, "steps": len([r for r in metrics(reference) if "loss" in r]),
           "losses_differing": losses, "tensors_differing": tensors, "reference_run_s": round(reference_s, 1)}
    if losses or tensors:
        # Steps before the kill ran from scratch in both runs: a difference there is the GPU's nondeterminism
        # (atomics in some backward kernels), not the resume.
        cause = "nondeterministic kernels (before the kill)" if first <= killed_at else "the resume"
        raise Failed(f"not bitwise: {losses} step losses and {tensors} final tensors differ, first at step {first} "
                     f"(killed at step {killed_at}): {cause}")
    return out


# -- FSDP2 and DDP over NCCL, one rank ----------------------------------------------------------------------
def check_nccl_fsdp_ddp(ctx: Ctx) -> dict:
    """One rank under torchrun: with a world of 1 the trainer makes no process group (parallel/distributed.py),
    so the worker builds one (NCCL on a GPU) and applies parallel/fsdp.py's apply_fsdp and parallel/ddp.py's
    apply_ddp to the model; 5 AdamW steps each must match the unwrapped model."""
    result = ctx.folder / "worker.json"
    ctx.run(torchrun(str(Path(__file__).resolve()), "--worker", "nccl", "--out", str(result),
                     *(["--dry-run"] if ctx.dry else [])), "torchrun", timeout=300)
    out = json.loads(result.read_text())
    worst = max(out["max_relative_loss_difference"].values())
    if worst > 1e-3:
        raise Failed(f"losses differ from the unwrapped model by up to {worst:.2e} relative: "
                     f"{out['max_relative_loss_difference']}")
    return out


def nccl_worker(out: Path, dry: bool) -> None:
    """Under torchrun (1 rank): plain vs FSDP2 vs DDP, the same seeded model and batches."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from scaletrain.config import ModelConfig, OptimConfig
    from scaletrain.model import build_model
    from scaletrain.parallel.ddp import apply_ddp
    from scaletrain.parallel.fsdp import apply_fsdp
    from scaletrain.train.loss import cross_entropy
    from scaletrain.train.optimizer import build_optimizer

    device = torch.device("cpu" if dry else "cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if dry else "nccl", device_id=device if device.type == "cuda" else None)
    mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("dp_shard",))
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=2, ffn_hidden_dim=128, vocab_size=256, max_seq_len=64) if dry else \
        ModelConfig(dim=512, n_layers=6, n_heads=8, n_kv_heads=4, ffn_hidden_dim=1408, vocab_size=8192,
                    max_seq_len=512)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, cfg.vocab_size, (4, cfg.max_seq_len + 1), generator=gen) for _ in range(5)]
    losses = {}
    for layout in ("plain", "fsdp", "ddp"):
        model = build_model(cfg, device, seed=0)
        wrapped = {"plain": lambda m: m, "fsdp": lambda m: apply_fsdp(m, mesh, reshard_after_forward=True),
                   "ddp": lambda m: apply_ddp(m, dist.group.WORLD, device)}[layout](model)
        optimizer = build_optimizer(model, OptimConfig(lr=1e-3), device)
        losses[layout] = []
        for batch in batches:
            batch = batch.to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = cross_entropy(wrapped(batch[:, :-1]), batch[:, 1:])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses[layout].append(float(loss))
    ref = losses["plain"]
    diff = {k: max(abs(a - b) / abs(b) for a, b in zip(v, ref)) for k, v in losses.items() if k != "plain"}
    out.write_text(json.dumps({"backend": dist.get_backend(), "world_size": dist.get_world_size(),
                               "losses": losses, "max_relative_loss_difference": diff}))
    dist.barrier()
    dist.destroy_process_group()


# -- fine-tuning: LoRA and QLoRA on a ~1B-shaped base -------------------------------------------------------
# Llama 3.2 1B's blocks (16 x 2048, GQA 32/8, SwiGLU 8192) with the 8192-token BPE of the bundled text as the
# vocabulary (an exported base keeps its tokenizer's rows): ~0.99B parameters.
BASE_1B = {"preset": "llama-1b", "vocab_size": 8192}
FT_SEQ, FT_BATCH, FT_STEPS = 1024, 4, 15
# LoRA's profiled steps 6-8: clear of the compile and of the last log window (11-15) its tokens/s comes from; the
# breakdown says where the base step's time goes (the planner predicted it 1.8x fast: docs/gpu.md)
FT_PROFILE = {"profile.enabled": "true", "profile.wait": 4, "profile.warmup": 1, "profile.active": 3,
              "profile.memory_snapshot": "false"}


def make_base(ctx: Ctx, folder: Path) -> dict:
    """A random ~1B base as a Hugging Face folder (what ``finetune --from`` reads), via scaletrain's export."""
    import torch

    from scaletrain.checkpoint.export import export_hf
    from scaletrain.config import ModelConfig, build
    from scaletrain.data.prepare import read_text_file
    from scaletrain.data.sources import resolve_source
    from scaletrain.data.tokenizer import BPETokenizer
    from scaletrain.model import build_model, num_params
    from scaletrain.model.presets import PRESETS

    vocab = 512 if ctx.dry else BASE_1B["vocab_size"]
    fields = {"preset": "", **{k.split(".")[1]: v for k, v in TINY_MODEL.items()}, "tie_embeddings": True} \
        if ctx.dry else {"preset": BASE_1B["preset"]}
    cfg = build(ModelConfig, {**fields, "vocab_size": vocab}, presets=PRESETS)
    text = read_text_file(resolve_source("builtin:tinyshakespeare"))
    tokenizer = BPETokenizer.train([text], vocab_size=vocab)
    model = build_model(cfg, ctx.device, seed=0).to("cpu", torch.bfloat16)  # initialised on the GPU: faster
    export_hf(model, cfg, tokenizer, folder)
    return {"parameters": num_params(cfg), "vocab_size": vocab, "dim": cfg.dim, "n_layers": cfg.n_layers}


def finetune_step(ctx: Ctx, base: Path, name: str, method: str, extra: dict, seq: int, batch: int,
                  steps: int) -> dict:
    """``scaletrain finetune --from base`` for ``steps`` steps into ``<folder>/<name>`` (bf16, no checkpoints, no
    eval): its last logged step record (the median of the last log window, clear of the first step's compiles)."""
    run = ctx.folder / name
    job = {"finetune.method": method, "train.run_dir": run, "train.device": ctx.device, "train.steps": steps,
           "data.path": "builtin:tinyshakespeare", "data.seq_len": seq, "data.cache_dir": ctx.folder / "data",
           "train.batch_size": batch, "train.eval_interval": 0, "train.eval_batches": 1,
           "train.sample_tokens": 0, "checkpoint.enabled": "false", "logging.progress": "plain",
           "logging.tensorboard": "false", "logging.log_interval": 1 if ctx.dry else 5,
           "train.precision": "bf16", "optim.lr": 1e-4, **extra}
    ctx.run(scaletrain("finetune", "--from", str(base), *flags(job)), name, timeout=600)
    return last_step_record(run)


def finetune_prediction(ctx: Ctx, name: str, method: str, vocab: int, seq: int, batch: int,
                        extra: tuple[str, ...] = ()) -> dict:
    """``scaletrain plan --method`` for the ~1B base (the dry run: the tiny base's config) at ``batch`` x ``seq``."""
    plan_json = ctx.folder / f"plan-{name}.json"
    model = ["--model.preset=llama-1b"] if not ctx.dry else ["--config", str(ctx.folder / name / "config.toml")]
    ctx.run(scaletrain("plan", *model, f"--model.vocab_size={vocab}", f"--finetune.method={method}", "--hardware",
                       f"{ctx.hardware}:1", f"--data.seq_len={seq}", "--micro-batch", str(batch), "--global-batch",
                       str(batch), "--train.precision=bf16", "--json", str(plan_json), *extra),
            f"plan-{name}", timeout=120, check=False)  # exit 2 = does not fit: still a prediction
    return json.loads(plan_json.read_text())["finetune"]


def check_lora_qlora(ctx: Ctx) -> dict:
    """``scaletrain finetune`` with LoRA and with QLoRA (NF4 base, torchao's eager dequantization: the row's history
    and its planner fit; the compiled one is ``qlora-compiled``'s) for a few steps; each peak memory and tokens/s
    beside ``scaletrain plan --method`` for the same model, micro-batch and sequence."""
    base = ctx.folder / "base-hf"
    out = {"base": make_base(ctx, base)}
    (base / "base.json").write_text(json.dumps(out["base"]))  # for qlora-compiled's reuse in the same call
    seq, batch, steps = (64, 2, 2) if ctx.dry else (FT_SEQ, FT_BATCH, FT_STEPS)
    for method in ("lora", "qlora"):
        extra = {"finetune.qlora_compile": "false"} if method == "qlora" else \
            {**FT_PROFILE, **({"profile.wait": 0, "profile.warmup": 0, "profile.active": 1} if ctx.dry else {})}
        measured = finetune_step(ctx, base, method, method, extra, seq, batch, steps)
        predicted = finetune_prediction(ctx, method, method, out["base"]["vocab_size"], seq, batch,
                                        ("--finetune.qlora_compile=false",) if method == "qlora" else ())
        out[method] = {"peak_memory_mib": round(measured["peak_memory_mb"], 1),
                       "predicted_tensor_mib": round(predicted["tensor_total"] / 2**20, 1),
                       "predicted_per_device_mib": round(predicted["per_device_bytes"] / 2**20, 1),
                       "tokens_per_second": round(measured["tokens_per_second"], 1),
                       "predicted_tokens_per_second": round(predicted["tokens_per_second"], 1),
                       "loss": measured["loss"]}
        if method == "lora":
            out[method]["profile"] = profile_breakdown(ctx.folder / method)
        if not ctx.dry:
            out[method]["memory_error"] = round(out[method]["predicted_tensor_mib"]
                                                / out[method]["peak_memory_mib"] - 1, 3)
    if not ctx.dry and out["qlora"]["peak_memory_mib"] >= out["lora"]["peak_memory_mib"]:
        raise Failed(f"QLoRA's peak {out['qlora']['peak_memory_mib']} MiB is not below LoRA's "
                     f"{out['lora']['peak_memory_mib']} MiB (the NF4 base should be ~4x smaller)")
    return out


# Issue 38's target for QLoRA's speed on a GPU: at least 0.6x LoRA's tokens/s (the eager path measured 0.41x).
QLORA_SPEED_TARGET = 0.6


def fitted_dequant_bytes(ctx: Ctx, vocab: int, lora_tokens_per_second: float, qlora_tokens_per_second: float,
                         tokens: int) -> float:
    """Bytes of traffic a weight and pass that the measured (QLoRA - LoRA) step gap implies, as
    ``plan/finetune.py``'s ``GPU_NF4_*DEQUANT_BYTES_PER_WEIGHT`` charge it: two dequantizations of every 4-bit
    projection a micro-batch, at the catalog's memory bandwidth. What the planner's compiled rate is refitted to."""
    from scaletrain.config import ModelConfig, build
    from scaletrain.hardware.catalog import CATALOG
    from scaletrain.model.presets import PRESETS
    from scaletrain.plan.memory import projection_shapes

    cfg = build(ModelConfig, {"preset": "llama-1b", "vocab_size": vocab}, presets=PRESETS) if not ctx.dry else \
        build(ModelConfig, {"preset": "", **{k.split(".")[1]: v for k, v in TINY_MODEL.items()}, "vocab_size": vocab},
              presets=PRESETS)
    projections = cfg.n_layers * sum(i * o for i, o in projection_shapes(cfg).values())
    gap = tokens / qlora_tokens_per_second - tokens / lora_tokens_per_second
    return gap * CATALOG[ctx.hardware].memory_bandwidth / (2 * projections)


def check_qlora_compiled(ctx: Ctx) -> dict:
    """LoRA, QLoRA with torchao's eager dequantization and QLoRA with the compiled one (finetune.qlora_compile) on the
    ~1B base of ``lora-qlora``, side by side: tokens/s, QLoRA's over LoRA's against issue 38's 0.6x, the losses (the
    compiled dequantization is bitwise torchao's: the same losses), the planner's predictions and the dequantization
    bytes a weight the measured gaps imply (the refit of ``GPU_NF4_COMPILED_DEQUANT_BYTES_PER_WEIGHT``)."""
    base = ctx.folder.parent / "lora-qlora" / "base-hf"  # the same base when lora-qlora ran in this call
    out = {"base": json.loads((base / "base.json").read_text()) if (base / "base.json").is_file() else None}
    if out["base"] is None:
        base = ctx.folder / "base-hf"
        out["base"] = make_base(ctx, base)
        (base / "base.json").write_text(json.dumps(out["base"]))
    seq, batch, steps = (64, 2, 2) if ctx.dry else (FT_SEQ, FT_BATCH, FT_STEPS)
    vocab = out["base"]["vocab_size"]
    runs = {"lora": ("lora", {}, ()), "qlora_eager": ("qlora", {"finetune.qlora_compile": "false"},
                                                      ("--finetune.qlora_compile=false",)),
            "qlora_compiled": ("qlora", {"finetune.qlora_compile": "true"}, ("--finetune.qlora_compile=true",))}
    for name, (method, extra, plan_flags) in runs.items():
        measured = finetune_step(ctx, base, name, method, extra, seq, batch, steps)
        predicted = finetune_prediction(ctx, name, method, vocab, seq, batch, plan_flags)
        out[name] = {"tokens_per_second": round(measured["tokens_per_second"], 1),
                     "predicted_tokens_per_second": round(predicted["tokens_per_second"], 1),
                     "peak_memory_mib": round(measured["peak_memory_mb"], 1), "loss": measured["loss"]}
    lora = out["lora"]["tokens_per_second"]
    for name in ("qlora_eager", "qlora_compiled"):
        out[f"{name}_over_lora"] = round(out[name]["tokens_per_second"] / lora, 3)
        out[name]["fitted_dequant_bytes_per_weight"] = round(fitted_dequant_bytes(
            ctx, vocab, lora, out[name]["tokens_per_second"], seq * batch), 1)
    out["compiled_over_eager"] = round(out["qlora_compiled"]["tokens_per_second"]
                                       / out["qlora_eager"]["tokens_per_second"], 3)
    out["target_over_lora"] = QLORA_SPEED_TARGET
    out["meets_target"] = out["qlora_compiled_over_lora"] >= QLORA_SPEED_TARGET
    out["loss_difference"] = abs(out["qlora_compiled"]["loss"] - out["qlora_eager"]["loss"])
    if ctx.dry:
        out["note"] = "dry run: tiny model on the CPU (inductor's C++, not Triton); the ratios measure nothing"
    elif out["loss_difference"] > 1e-2 * abs(out["qlora_eager"]["loss"]):  # the same weights, data and seeds
        raise Failed(f"the compiled QLoRA run's loss {out['qlora_compiled']['loss']} is not the eager run's "
                     f"{out['qlora_eager']['loss']}")
    elif out["compiled_over_eager"] <= 1.0:
        raise Failed(f"the compiled dequantization is not faster: {out['qlora_compiled']['tokens_per_second']} "
                     f"against eager's {out['qlora_eager']['tokens_per_second']} tokens/s")
    return out


# -- inference: torchao weight-only quantization, 2:4 sparsity ----------------------------------------------
def decode_speed(model, cfg, vocab: int, tokens: int, decoder=None) -> float:
    """Greedy decoding tokens/s at batch 1 through ``scaletrain.model.generate`` (what `scaletrain generate` runs):
    today's eager step over the KV cache (model/cache.py), or with ``decoder`` the compiled one (model/decode.py:
    static cache, ``torch.compile`` mode="reduce-overhead", a CUDA graph a step; `generate --compile`). A warm-up
    generation of the same shape first (it compiles and captures the graph), so this times the steps only."""
    import torch

    from scaletrain.model.generate import generate

    prompt = list(range(1, 17))
    kw = dict(max_seq_len=cfg.max_seq_len, temperature=0.0, vocab_limit=vocab, decoder=decoder)
    generate(model, prompt, tokens, **kw)  # warm-up: the compile and the graph capture of this shape
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    new = generate(model, prompt, tokens, **kw)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return len(new) / (time.perf_counter() - t0)


def check_quant_decode(ctx: Ctx) -> dict:
    """bf16 vs torchao int8 / int4 weight-only (``compress/quantize.quantize_model``, as `scaletrain compress
    --quantize` applies it) decode tokens/s on a ~1B-shaped model (random weights: speed, not quality)."""
    import torch

    from scaletrain.compress.quantize import quantize_model
    from scaletrain.config import ModelConfig, build
    from scaletrain.model import build_model
    from scaletrain.model.presets import PRESETS

    fields = {k.split(".")[1]: v for k, v in TINY_MODEL.items()} if ctx.dry else {"preset": "llama-1b"}
    cfg = build(ModelConfig, {**fields, "vocab_size": 512 if ctx.dry else 32768, "max_seq_len": 256},
                presets=PRESETS)
    tokens = 8 if ctx.dry else 64
    out, notes = {}, {}
    for method in ("bf16", "int8-weight", "int4-weight"):
        model = build_model(cfg, ctx.device, seed=0).to(torch.bfloat16).eval()
        if method != "bf16":
            notes[method] = quantize_model(model, method, group_size=128 if not ctx.dry else 32, device=ctx.device)
        out[f"{method}_tokens_per_second"] = round(decode_speed(model, cfg, cfg.vocab_size, tokens), 2)
        del model
    for method in ("int8-weight", "int4-weight"):
        out[f"{method}_speedup"] = round(out[f"{method}_tokens_per_second"] / out["bf16_tokens_per_second"], 3)
    out["notes"] = notes
    out["kv_cache"] = "model/cache.py's KV cache (generate's default), eager: no compiled decode step"
    return out


def check_decode_compiled(ctx: Ctx) -> dict:
    """The compiled decode (model/decode.py, `generate --compile`) at batch 1 on quant-decode's ~1B-shaped model, bf16
    and torchao int8 / int4 weight-only, each beside today's eager decode (issue 38: bf16 at >= 30% of the
    bandwidth limit), and the fraction of
    the limit: memory bandwidth (hardware/catalog.py) / the bytes of the weights (compress/run.state_bytes: the stored
    form, quantized tensors included), the tokens/s a step that reads every weight once a token cannot beat."""
    import torch

    from scaletrain.compress.quantize import quantize_model
    from scaletrain.compress.run import state_bytes
    from scaletrain.config import ModelConfig, build
    from scaletrain.hardware.catalog import CATALOG
    from scaletrain.model import build_model
    from scaletrain.model.decode import StaticDecoder
    from scaletrain.model.presets import PRESETS

    fields = {k.split(".")[1]: v for k, v in TINY_MODEL.items()} if ctx.dry else {"preset": "llama-1b"}
    cfg = build(ModelConfig, {**fields, "vocab_size": 512 if ctx.dry else 32768, "max_seq_len": 256},
                presets=PRESETS)
    tokens = 8 if ctx.dry else 64
    bandwidth = CATALOG[ctx.hardware].memory_bandwidth
    out, notes = {"memory_bandwidth_bytes_per_second": bandwidth}, {}
    for method in ("bf16", "int8-weight", "int4-weight"):
        model = build_model(cfg, ctx.device, seed=0).to(torch.bfloat16).eval()
        if method != "bf16":
            notes[method] = quantize_model(model, method, group_size=128 if not ctx.dry else 32, device=ctx.device)
        weight_bytes = state_bytes(model)
        limit = bandwidth / weight_bytes  # tokens/s
        eager = decode_speed(model, cfg, cfg.vocab_size, tokens)
        started = time.perf_counter()
        decoder = StaticDecoder(model)  # mode="reduce-overhead" on CUDA
        compiled = decode_speed(model, cfg, cfg.vocab_size, tokens, decoder)
        out[f"{method}_eager_tokens_per_second"] = round(eager, 2)
        out[f"{method}_tokens_per_second"] = round(compiled, 2)
        out[f"{method}_compile_and_measure_seconds"] = round(time.perf_counter() - started, 1)
        out[f"{method}_weight_bytes"] = weight_bytes
        out[f"{method}_bandwidth_limit_tokens_per_second"] = round(limit, 1)
        out[f"{method}_fraction_of_bandwidth_limit"] = round(compiled / limit, 3)
        out[f"{method}_compiled_over_eager"] = round(compiled / eager, 2)
        del model, decoder
    for method in ("int8-weight", "int4-weight"):
        out[f"{method}_speedup"] = round(out[f"{method}_tokens_per_second"] / out["bf16_tokens_per_second"], 3)
    out["notes"] = notes
    out["decode"] = ("compiled: model/decode.py's static KV cache and torch.compile'd one-token step (mode="
                     "'reduce-overhead' on CUDA: a CUDA graph a step), `generate --compile`; eager: model/cache.py's "
                     "KV cache, generate's default")
    if not ctx.dry and out["bf16_fraction_of_bandwidth_limit"] < 0.3:
        out["target_missed"] = (f"bf16 decode at {out['bf16_fraction_of_bandwidth_limit']:.0%} of the bandwidth "
                                f"limit, below issue 38's 30%")
    return out


SPARSE_SHAPE = (8192, 4096, 16384)  # tokens, in_features, out_features: a large SwiGLU projection


def check_sparse_2of4(ctx: Ctx) -> dict:
    """A Llama block pruned 2:4 by ``compress/prune.prune``, its Linears swapped for torchao's semi-structured
    sparse kernels by ``use_sparse_kernels`` (what `scaletrain compress --prune ... --pattern 2:4` runs load
    with): the up projection's forward vs the dense one at a large shape, bf16."""
    import torch

    from scaletrain.compress.prune import prune, use_sparse_kernels
    from scaletrain.config import ModelConfig
    from scaletrain.model import build_model

    tokens, dim, hidden = (64, 64, 128) if ctx.dry else SPARSE_SHAPE
    cfg = ModelConfig(dim=dim, n_layers=1, n_heads=dim // 64 or 1, ffn_hidden_dim=hidden, vocab_size=256,
                      max_seq_len=64)
    model = build_model(cfg, ctx.device, seed=0).to(torch.bfloat16).eval()
    record = prune(model, "magnitude", pattern="2:4")
    linear = model.layers["0"].feed_forward.w1
    x = torch.randn(tokens, dim, device=ctx.device, dtype=torch.bfloat16)
    with torch.no_grad():
        dense_out = linear(x)
        dense_ms = time_ms(lambda: linear(x), ctx.device)
        swapped = use_sparse_kernels(model, ctx.device)
        if not swapped:
            raise Skip(f"2:4 pruning ran (sparsity {record['sparsity']:.3f}); the sparse kernels need a CUDA GPU "
                       f"(sm80+), so use_sparse_kernels swapped nothing here")
        linear = model.layers["0"].feed_forward.w1
        sparse_out = linear(x)
        sparse_ms = time_ms(lambda: linear(x), ctx.device)
    error = float((sparse_out.float() - dense_out.float()).norm() / dense_out.float().norm())
    out = {"shape_tokens_in_out": [tokens, dim, hidden], "linears_swapped": swapped, "dense_ms": round(dense_ms, 4),
           "sparse_ms": round(sparse_ms, 4), "speedup": round(dense_ms / sparse_ms, 3),
           "relative_output_difference": round(error, 5), "sparsity": record["sparsity"]}
    if error > 1e-2:
        raise Failed(f"the sparse Linear's output differs from the masked dense one by {error:.2e} (relative)")
    return out


def time_ms(fn: Callable[[], object], device: str, reps: int = 20) -> float:
    import torch

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    for _ in range(3):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return 1000 * (time.perf_counter() - t0) / reps


# -- monitoring: NVML samples, profiler trace, memory snapshot -----------------------------------------------
def check_monitor_profile(ctx: Ctx) -> dict:
    """A short run with the resource monitor and the profiler on: NVML readings in monitor/rank0.jsonl, a
    Chrome trace with CUDA kernels, and the allocator's memory snapshot."""
    run = ctx.folder / "run"
    job = gpt2_overrides(ctx, run, **{"model.preset": "small", "model.vocab_size": 0, "data.seq_len": 512,
                                      "train.batch_size": 8, "train.grad_accum_steps": 1, "train.steps": 30,
                                      "train.precision": "bf16", "monitor.interval": 0.2, "profile.enabled": "true",
                                      "profile.wait": 3, "profile.warmup": 1, "profile.active": 3})
    if ctx.dry:
        job.update({**TINY_MODEL, "model.preset": "", "data.seq_len": 64, "train.steps": 6, "profile.wait": 1})
    ctx.run(scaletrain("train", *flags(job)), "train", timeout=300)
    samples = [json.loads(line) for line in (run / "monitor" / "rank0.jsonl").read_text().splitlines() if line]
    nvml = [s for s in samples if "gpu_util_percent" in s]
    trace = json.loads((run / "profile" / "rank0.pt.trace.json").read_text())
    events = trace.get("traceEvents", [])
    kernels = [e for e in events if e.get("cat") == "kernel"]
    out = {"monitor_samples": len(samples), "nvml_samples": len(nvml), "trace_events": len(events),
           "trace_kernels": len(kernels)}
    if nvml:
        out["gpu_power_w_max"] = max(s.get("gpu_power_w", 0) for s in nvml)
        out["gpu_util_percent_max"] = max(s["gpu_util_percent"] for s in nvml)
    snapshot = run / "profile" / "memory_snapshot_rank0.pickle"
    if snapshot.is_file():
        with open(snapshot, "rb") as f:
            out["snapshot_segments"] = len(pickle.load(f).get("segments", []))
    problems = [what for what, bad in (("no monitor samples", not samples), ("no trace events", not events),
                                       ("no NVML samples", not ctx.dry and not nvml),
                                       ("no CUDA kernels in the trace", not ctx.dry and not kernels),
                                       ("no memory snapshot", not ctx.dry and not snapshot.is_file())) if bad]
    if problems:
        raise Failed("; ".join(problems))
    out["profile"] = profile_breakdown(run)
    if ctx.dry:
        out["note"] = "dry run: CPU samples and trace only (NVML, kernels and the memory snapshot need CUDA)"
    return out


def check_serve(ctx: Ctx) -> dict:
    """``scaletrain serve --device cuda`` under benchmarks/serve.py's load: 1, 8, 32 and 64 concurrent streaming
    ``openai`` clients (continuous batching, 64 slots), their time to first token, inter-token latency and total
    tokens/s, and no errors (issue 53)."""
    out_json = ctx.folder / "serve.json"
    ctx.run([sys.executable, str(ROOT / "benchmarks" / "serve.py"), "--device", ctx.device, "--work", str(ctx.folder),
             "--seconds", "3" if ctx.dry else "15", "--soak", "0", "--concurrency",
             "1,8" if ctx.dry else "1,8,32,64", "--label", "gpu_check", "--out", str(out_json)], "serve", timeout=240)
    result = json.loads(out_json.read_text())
    out = {"throughput_8_over_1": result["throughput_8_over_1"]}
    for row in result["rows"]:  # clients8.tokens_per_second, ... (the table reads dotted keys as nested ones)
        out[f"clients{row['clients']}"] = {key: row[key] for key in ("tokens_per_second", "ttft_ms_p50",
                                                                     "inter_token_ms_p50", "errors")}
    errors = sum(row["errors"] for row in result["rows"])
    if errors:
        raise Failed(f"{errors} requests failed: {result['rows'][0]['error_examples'] or result['rows']}")
    if ctx.dry:
        out["note"] = "dry run: 1 and 8 clients for 3 s on the CPU"
    return out


# -- the driver ----------------------------------------------------------------------------------------------
@dataclass
class Check:
    name: str
    budget_s: int  # the time limit on one H100 (the dry run has its own, below)
    fn: Callable[[Ctx], dict]
    keys: tuple[str, ...]  # the numbers its table row shows (all of them are in gpu_check.json)
    dry_budget_s: int = 600
    expected_s: int = 0  # what it took on the last H100 run (benchmarks/results/gpu_check.json), or an estimate
    full_run: bool = True  # in the run without --only on a GPU (False: only when --only names it; dry runs: all)


PRETRAIN_KEYS = ("tokens_per_second", "predicted_tokens_per_second", "mfu_vs_datasheet_bf16", "peak_memory_mib",
                 "predicted_tensor_mib", "micro_batch")
PROFILE_KEYS = ("profile.launch_gap_share", "profile.kernel_ms", "profile.gpu_span_ms", "profile.syncs_per_step",
                "profile.top_attention_kernels")
CHECKS = [
    Check("train-bf16-compile", 150, check_train_bf16_compile, PRETRAIN_KEYS + PROFILE_KEYS, expected_s=95),
    Check("nanogpt-side-by-side", 75, check_nanogpt_side_by_side,
          ("ours_tokens_per_second", "nanogpt_tokens_per_second", "ours_over_nanogpt", "ours_mfu_vs_datasheet_bf16",
           "nanogpt_mfu_vs_datasheet_bf16", "ours_peak_memory_mib", "nanogpt_peak_memory_mib"), expected_s=60),
    Check("train-bf16-eager", 60, check_train_bf16_eager, PRETRAIN_KEYS, expected_s=34),
    Check("train-fp16", 60, check_train_fp16, ("tokens_per_second", "val_loss", "skipped_updates_logged",
                                               "peak_memory_mib"), expected_s=36),
    # An estimate (not yet run on a GPU): a cold compile of the MoE blocks and 50 steps; its own call, `--only moe`.
    Check("moe", 200, check_moe, ("tokens_per_second", "mfu_vs_datasheet_bf16", "predicted_mfu", "step_ms",
                                  "predicted_step_ms", "measured_over_predicted_step_ms", "parameters",
                                  "active_parameters", "grouped_gemm", "max_mean_load", "micro_batch"),
          expected_s=120, full_run=False),
    Check("fp8", 170, check_fp8, ("bf16_step_ms", "fp8_step_ms", "fp8_speedup", "val_loss_change", "fp8_linears"),
          expected_s=124),
    Check("resume-kill9", 90, check_resume_kill9, ("killed_at_step", "steps", "losses_differing",
                                                   "tensors_differing"), expected_s=45),
    Check("nccl-fsdp-ddp", 60, check_nccl_fsdp_ddp, ("backend", "max_relative_loss_difference"), expected_s=16),
    Check("lora-qlora", 150, check_lora_qlora, ("lora.peak_memory_mib", "lora.predicted_tensor_mib",
                                                "qlora.peak_memory_mib", "qlora.predicted_tensor_mib",
                                                "lora.tokens_per_second", "qlora.tokens_per_second"), expected_s=58),
    # Three fine-tunes of the 1B base, one with cold compiles of its 4 weight shapes (an estimate: not yet run on a
    # GPU): its own call, `--only qlora-compiled` (or `--only lora-qlora,qlora-compiled`, which reuses the base).
    Check("qlora-compiled", 240, check_qlora_compiled,
          ("lora.tokens_per_second", "qlora_eager.tokens_per_second", "qlora_compiled.tokens_per_second",
           "qlora_eager_over_lora", "qlora_compiled_over_lora", "target_over_lora", "meets_target",
           "qlora_compiled.fitted_dequant_bytes_per_weight"), expected_s=100, full_run=False),
    Check("quant-decode", 90, check_quant_decode, ("bf16_tokens_per_second", "int8-weight_speedup",
                                                   "int4-weight_speedup"), expected_s=17),
    # Three cold compiles of a 1B model (an estimate: not yet run on a GPU) do not fit the full run's 520 s beside
    # the rest: its own call, `--only decode-compiled` (the dry run rehearses it with every check).
    Check("decode-compiled", 240, check_decode_compiled,
          ("bf16_tokens_per_second", "bf16_fraction_of_bandwidth_limit", "bf16_eager_tokens_per_second",
           "int8-weight_tokens_per_second", "int4-weight_tokens_per_second"), expected_s=150, full_run=False),
    Check("sparse-2of4", 45, check_sparse_2of4, ("dense_ms", "sparse_ms", "speedup", "relative_output_difference"),
          expected_s=10),
    Check("monitor-profile", 60, check_monitor_profile, ("monitor_samples", "nvml_samples", "trace_kernels",
                                                         "snapshot_segments"), expected_s=15),
    # A trained run, a server and four minute-long load levels (an estimate: not yet run on a GPU): its own call,
    # `--only serve`.
    Check("serve", 150, check_serve, ("clients1.tokens_per_second", "clients8.tokens_per_second",
                                      "clients64.tokens_per_second", "throughput_8_over_1", "clients8.ttft_ms_p50"),
          expected_s=110, full_run=False),
]


def hardware_name(device_name: str) -> str:
    """The planner's catalog entry for a CUDA device name (hardware/catalog.py)."""
    name = device_name.lower()
    if "h200" in name:
        return "h200"
    if "h100" in name:
        return "h100-pcie" if "pcie" in name else "h100-sxm"
    return "h100-sxm"  # the dry run (and an unknown card: the numbers then say which it is not)


def machine(dry: bool) -> dict:
    """nvidia-smi, Python, torch, CUDA and the device, probed in a child process (the driver keeps no CUDA
    context, so every check has the whole GPU)."""
    probe = ("import json, sys, torch; c = torch.cuda.is_available();"
             " print(json.dumps({'python': sys.version.split()[0], 'torch': torch.__version__,"
             " 'cuda': torch.version.cuda, 'cuda_available': c,"
             " 'device_name': torch.cuda.get_device_name(0) if c else 'cpu',"
             " 'capability': list(torch.cuda.get_device_capability(0)) if c else None}))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=child_env(dry))
    out = json.loads(proc.stdout) if proc.returncode == 0 else {"probe_error": last_line(proc.stderr)}
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        out["nvidia_smi"] = smi.stdout.strip() or last_line(smi.stderr)
    except (OSError, subprocess.TimeoutExpired) as exc:
        out["nvidia_smi"] = f"unavailable ({exc.__class__.__name__})"
    for package in ("torchao", "transformers", "peft", "pynvml"):
        found = subprocess.run([sys.executable, "-c", f"import importlib.metadata as m; print(m.version("
                                f"{'nvidia-ml-py' if package == 'pynvml' else package!r}))"],
                               capture_output=True, text=True)
        out[package] = found.stdout.strip() if found.returncode == 0 else None
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    out["commit"] = commit.stdout.strip() if commit.returncode == 0 else None
    out["hardware"] = hardware_name(out.get("device_name", ""))
    return out


def run_child(name: str, out: Path, dry: bool, hardware: str) -> int:
    """One check, in this process: its result (status, reason, numbers) into <out>/<name>/result.json."""
    check = next(c for c in CHECKS if c.name == name)
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    try:
        numbers, status, reason = check.fn(Ctx(folder, dry, hardware)), "ok", ""
    except Skip as exc:
        numbers, status, reason = {}, "skipped", str(exc)
    except Failed as exc:
        numbers, status, reason = {}, "failed", str(exc)
    except subprocess.TimeoutExpired as exc:
        numbers, status, reason = {}, "failed", f"a command timed out after {exc.timeout:.0f} s: {exc.cmd[3:6]}"
    except Exception as exc:  # a bug in the check or in scaletrain: the traceback goes to the log
        traceback.print_exc()
        numbers, status, reason = {}, "failed", f"{type(exc).__name__}: {exc}"[:400]
    (folder / "result.json").write_text(json.dumps({"status": status, "reason": reason, "numbers": numbers},
                                                   indent=1, default=str))
    return 0


def run_one(check: Check, out: Path, dry: bool, hardware: str, limit: float) -> dict:
    """The check in its own process group, killed (SIGKILL, the whole group) at ``limit`` seconds."""
    folder = out / check.name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "result.json").unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", check.name, "--out", str(out),
           "--hardware", hardware, *(["--dry-run"] if dry else [])]
    t0 = time.monotonic()
    with open(folder / "check.log", "w") as log:
        proc = subprocess.Popen(cmd, env=child_env(dry), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                start_new_session=True)
        try:
            proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            for group in folder.glob("*.pgid"):  # a process group the check started on its own (kill_at)
                try:
                    os.killpg(int(group.read_text()), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
    seconds = round(time.monotonic() - t0, 1)
    result_file = folder / "result.json"
    if result_file.is_file():
        result = json.loads(result_file.read_text())
    elif seconds >= limit:
        result = {"status": "failed", "reason": f"timed out after {limit:.0f} s (killed)", "numbers": {}}
    else:
        text = (folder / "check.log").read_text()
        result = {"status": "failed", "reason": f"exit {proc.returncode}: {last_line(text)}", "numbers": {}}
    return {"name": check.name, **result, "seconds": seconds, "limit_s": round(limit), "folder": str(folder)}


def key_numbers(numbers: dict, keys: tuple[str, ...]) -> str:
    """``keys`` of ``numbers`` (``a.b`` reaches into a nested dict) as one line; missing ones are left out."""
    parts = []
    for key in keys:
        value: object = numbers
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if value is not None:
            parts.append(f"{key}={value}")
    return ", ".join(parts)


def print_row(entry: dict, keys: tuple[str, ...]) -> None:
    """name, status, seconds, then the reason (failed / skipped) and the key numbers."""
    tail = " | ".join(filter(None, [entry["reason"], key_numbers(entry["numbers"], keys)]))
    print(f"{entry['name']:<20} {entry['status']:<8} {entry['seconds']:>6.1f}s  {tail}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu-check", help="folder for gpu_check.json and each check's runs and logs")
    parser.add_argument("--only", default="", help="NAME[,NAME]: run only these checks (names: "
                                                   + ", ".join(c.name for c in CHECKS) + ")")
    parser.add_argument("--dry-run", action="store_true", help="every check's set-up on the CPU, tiny shapes")
    parser.add_argument("--total-s", type=float, default=0,
                        help=f"the whole run's time limit, a check gets at most what is left (default "
                             f"{TOTAL_BUDGET_S} s, {DRY_TOTAL_S} s for --dry-run)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--hardware", default="h100-sxm", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    args.total_s = args.total_s or (DRY_TOTAL_S if args.dry_run else TOTAL_BUDGET_S)
    if args.worker:
        nccl_worker(out, args.dry_run)
        return 0
    if args.child:
        return run_child(args.child, out, args.dry_run, args.hardware)
    wanted = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in {c.name for c in CHECKS}]
    if unknown:
        parser.error(f"--only: unknown check(s) {', '.join(unknown)}; known: {', '.join(c.name for c in CHECKS)}")
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    host = machine(args.dry_run)
    if not args.dry_run and not host.get("cuda_available"):
        print(f"no CUDA device ({host.get('probe_error') or host.get('device_name')}); use --dry-run on a CPU",
              file=sys.stderr)
        return 2
    print(f"{host.get('device_name')} | torch {host.get('torch')} CUDA {host.get('cuda')} | torchao "
          f"{host.get('torchao')} | planner hardware {host['hardware']}" + (" | DRY RUN on the CPU" if args.dry_run
                                                                              else ""), flush=True)
    print(f"{'check':<20} {'status':<8} {'time':>7}  reason | key numbers", flush=True)
    chosen = [c for c in CHECKS if c.name in wanted or (not wanted and (c.full_run or args.dry_run))]
    expected = sum(c.expected_s for c in chosen)
    print(f"expected on one H100: {expected} s for {len(chosen)} checks (the last run's times, the new ones "
          f"estimated) of the run's {args.total_s:.0f} s cap" + ("" if expected <= args.total_s else
                                                                 " - OVER: trim steps or use --only"), flush=True)
    entries = []
    for check in chosen:
        left = args.total_s - (time.monotonic() - started)
        if left < 10:
            entry = {"name": check.name, "status": "skipped", "reason": f"the run's {args.total_s:.0f} s are spent",
                     "numbers": {}, "seconds": 0.0, "limit_s": 0, "folder": ""}
        else:
            limit = min(check.dry_budget_s if args.dry_run else check.budget_s, left)
            entry = run_one(check, out, args.dry_run, host["hardware"], limit)
        entries.append(entry)
        print_row(entry, check.keys)
    doc = {"dry_run": args.dry_run, "machine": host, "total_seconds": round(time.monotonic() - started, 1),
           "expected_h100_seconds": expected,
           "checks": entries}
    (out / "gpu_check.json").write_text(json.dumps(doc, indent=1, default=str))
    counts = {s: sum(e["status"] == s for e in entries) for s in ("ok", "failed", "skipped")}
    print(f"{counts['ok']} ok, {counts['failed']} failed, {counts['skipped']} skipped in {doc['total_seconds']} s; "
          f"wrote {out / 'gpu_check.json'}", flush=True)
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
