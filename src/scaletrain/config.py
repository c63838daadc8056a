"""The typed config tree: dataclasses whose field docs become ``--help``.

Precedence is CLI > TOML > model preset > defaults, where a preset counts in the layer that names it:
explicit fields of the same or a higher layer win over a preset, and ``--model.preset`` on the command line
wins over the TOML's model fields it sets (``_cli_presets``). Every component receives only its own section
(``ModelConfig`` for the model, ``OptimConfig`` for the optimizer, ...).

The machinery here is generic (any dataclass tree of scalar/list fields) so other commands, such as
``scaletrain prepare --config data.toml``, reuse it for their own trees.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scaletrain.core.options import ConfigError, opt
from scaletrain.model.config import DEFAULT_CONTEXT, ModelConfig, head_width
from scaletrain.model.moe import check_moe
from scaletrain.model.presets import PRESETS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib


# --------------------------------------------------------------------------------------------------
# The training job's tree
# --------------------------------------------------------------------------------------------------


@dataclass
class DataConfig:
    path: str = opt("builtin:tinyshakespeare",
                    "prepared dataset folder (with manifest.json), or a raw text file/folder that is "
                    "prepared on the fly, or builtin:tinyshakespeare (bundled)")
    tokenizer: str = opt("char", "when preparing raw text: 'char', 'bpe' (byte-level BPE trained on "
                                  "the text) or a path to a tokenizer.json")
    vocab_size: int = opt(2048, "BPE vocabulary size when the tokenizer is trained here", ge=260)
    val_fraction: float = opt(0.1, "fraction of the text held out for validation", ge=0.0, lt=1.0)
    text_field: str = opt("text", "when preparing a .jsonl/.json/.parquet file: the field holding the text "
                                  "(instruction data is read with finetune.instructions instead)")
    seq_len: int = opt(DEFAULT_CONTEXT, "tokens per training sequence (context length)", ge=1)
    cache_dir: str = opt("", "where raw text is prepared; empty = <train.run_dir>/data")
    shuffle: bool = opt(True, "shuffle sequences each epoch (deterministic in train.seed and the epoch)")
    document_attention: bool = opt(False, "confine attention to each packed document (a block-causal mask "
                                          "from the document boundaries) instead of across the whole "
                                          "window; not with parallel.pp or parallel.cp")


@dataclass
class OptimConfig:
    name: str = opt("adamw", "an entry of the optimizer table (train/optimizer.py: OPTIMIZERS; checked with the job): "
                             "adamw, or muon: Muon (torch.optim.Muon: orthogonalized momentum, one state buffer) on "
                             "the blocks' weight matrices and AdamW on embeddings, head, norms and biases "
                             "(docs/training.md)")
    lr: float = opt(1e-3, "peak learning rate", gt=0)
    weight_decay: float = opt(0.1, "decoupled weight decay for matrices, AdamW's and Muon's (norms, biases and "
                                    "embeddings get none)", ge=0)
    beta1: float = opt(0.9, "AdamW beta1", ge=0, lt=1)
    beta2: float = opt(0.99, "AdamW beta2 (0.99 suits small data; large runs use 0.95)", ge=0, lt=1)
    eps: float = opt(1e-8, "AdamW epsilon", gt=0)
    grad_clip: float = opt(1.0, "clip the global gradient norm to this; 0 = no clipping", ge=0)
    implementation: str = opt("auto", "AdamW kernel: auto (fused when every trainable parameter is on the CPU or "
                                      "the GPU in a float dtype, which also skips a non-finite step on the device; "
                                      "else foreach), fused, foreach, loop",
                              choices=("auto", "fused", "foreach", "loop"))
    muon_lr: float = opt(0.0, "muon: peak learning rate of the Muon matrices (the schedule scales it with optim.lr); "
                              "0 = optim.lr, right with muon_adjust_lr = match_rms_adamw (Moonlight); Keller "
                              "Jordan's recipe is 0.02 with original", ge=0)
    muon_adjust_lr: str = opt("match_rms_adamw", "muon: per-matrix lr by shape, torch.optim.Muon's adjust_lr_fn: "
                                                 "match_rms_adamw (0.2 sqrt(max(rows, cols)): updates of AdamW's "
                                                 "RMS, so AdamW's lr and weight decay carry over; Liu et al. 2025) "
                                                 "or original (sqrt(max(1, rows/cols)); Keller Jordan)",
                              choices=("match_rms_adamw", "original"))
    muon_momentum: float = opt(0.95, "muon: momentum (Nesterov) of the Muon matrices", ge=0, lt=1)
    muon_adapters: bool = opt(False, "muon with finetune.method = lora/qlora: Muon also on the adapters' lora_A and "
                                     "lora_B matrices (else they train with AdamW: a LoRA fine-tune then has no "
                                     "Muon matrix at all); measured in docs/finetuning.md")


@dataclass
class ScheduleConfig:
    name: str = opt("cosine", "learning-rate schedule after warmup: cosine, wsd (warmup-stable-decay), "
                              "linear or constant", choices=("cosine", "wsd", "linear", "constant"))
    warmup_steps: int = opt(100, "linear warmup from 0 to optim.lr over this many steps", ge=0)
    decay_steps: int = opt(0, "step at which the decay reaches min_lr; 0 = train.steps", ge=0)
    min_lr: float = opt(-1.0, "learning rate at the end of the decay; -1 = a tenth of optim.lr (so a low "
                              "fine-tuning rate decays too, never climbs)", ge=-1)
    wsd_decay_fraction: float = opt(0.2, "wsd: fraction of the steps spent in the final decay", gt=0, le=1)


@dataclass
class TrainConfig:
    steps: int = opt(1500, "optimizer steps to train", ge=1)
    batch_size: int = opt(16, "sequences per micro-batch (per data-parallel rank)", ge=1)
    grad_accum_steps: int = opt(1, "micro-batches accumulated per optimizer step", ge=1)
    seed: int = opt(1337, "seed for init, data order and sampling")
    device: str = opt("auto", "auto (cuda when available, else cpu), cpu or cuda", choices=("auto", "cpu", "cuda"))
    precision: str = opt("auto", "auto (bf16 on a GPU that supports it; on a CPU bf16 when its bf16 matmuls "
                                 "measure >= 1.5x fp32's, else fp32), fp32, bf16 or fp16 "
                                 "(autocast; fp16 uses a gradient scaler), or fp8 (GPU sm89+: torchao Float8Linear for "
                                 "the large block Linears, bf16 elsewhere; docs/compression.md)",
                         choices=("auto", "fp32", "bf16", "fp16", "fp8"))
    compile: str = opt("auto", "torch.compile the model: true, false, or auto = only when this run's steps repay the "
                               "compile (always on a GPU; on a CPU from this machine's measurements: "
                               "train/compile_choice.py)", choices=("auto", "true", "false"))
    compile_mode: str = opt("default", "torch.compile's mode when compiling: default; max-autotune-no-cudagraphs "
                                       "(inductor tries several kernels per matmul and fusion and keeps the "
                                       "fastest: a longer compile); reduce-overhead (CUDA graphs: one launch per "
                                       "graph, a GPU and a whole-model compile only; docs/gpu.md)",
                            choices=("default", "max-autotune-no-cudagraphs", "reduce-overhead"))
    threads: int = opt(0, "CPU threads for torch; 0 = torch's default (or OMP_NUM_THREADS), fewer when other "
                          "processes hold cores they need, checked at the start and when steps run far beyond "
                          "the estimate, and back once those cores are free again (train/contention.py); N pins "
                          "the count", ge=0)
    loss_chunk_rows: int = opt(-1, "the next-token loss by chunks of this many positions, so the whole logits tensor "
                                   "(tokens x vocabulary) never exists in forward or backward (model/loss.py, "
                                   "docs/training.md); -1 = auto: chunks of 32 MB of fp32 logits when a batch's "
                                   "logits pass that; 0 = off (the whole logits, as before); not with parallel.tp, "
                                   "parallel.pp, the deepspeed engine or a teacher (they keep the whole logits)",
                               ge=-1)
    eval_interval: int = opt(250, "evaluate val loss every N steps (and at the end); 0 = only at the end", ge=0)
    eval_batches: int = opt(20, "batches per evaluation", ge=1)
    sample_tokens: int = opt(200, "tokens of text sampled at each evaluation; 0 = none", ge=0)
    sample_prompt: str = opt("\n", "prompt for those samples")
    run_dir: str = opt("runs/default", "folder for checkpoints, metrics and the resolved config")
    resume: bool = opt(False, "continue from the latest checkpoint in run_dir")
    overwrite: bool = opt(False, "start afresh in a run_dir that holds an earlier run's checkpoints: delete them "
                                 "(its logs are moved to <run_dir>/replaced-<time>/); without it such a start is "
                                 "refused")
    stop_at_step: int = opt(0, "evaluate, save and stop at this step (the schedule still follows steps); "
                               "0 = run to the end", ge=0)
    rollback_after: int = opt(3, "NaN/Inf guard: a step whose loss or gradient norm is not finite is skipped; after "
                                 "this many in a row, reload the last checkpoint and skip that data; "
                                 "0 = never roll back",
                              ge=0)


@dataclass
class CheckpointConfig:
    interval: int = opt(500, "save every N steps (and always at the end); 0 = only at the end", ge=0)
    keep_last: int = opt(2, "newest checkpoints to keep (older ones are deleted unless keep_every keeps them)", ge=1)
    keep_every: int = opt(0, "also keep, forever, every checkpoint whose step is a multiple of this; 0 = none", ge=0)
    enabled: bool = opt(True, "write checkpoints at all")
    async_save: bool = opt(False, "stage to CPU memory and write in a background thread, so training goes on "
                                  "while the files are written (one save in flight at a time)")
    grace_seconds: float = opt(90.0, "preemption (SIGTERM/SIGUSR1/trigger file): time allowed for the final "
                                     "step and checkpoint; a warning says when the last save took longer", gt=0)
    trigger_file: str = opt("", "preempt (checkpoint and exit with status 75) when this file appears, e.g. "
                                "written by a cloud spot-notice watcher; empty = none")


@dataclass
class LoggingConfig:
    log_interval: int = opt(10, "print and record metrics every N steps", ge=1)
    progress: str = opt("auto", "auto (a bar on a terminal, plain lines otherwise), bar, plain or off",
                        choices=("auto", "bar", "plain", "off"))
    tensorboard: bool = opt(True, "write TensorBoard events when tensorboard is installed")


@dataclass
class MonitorConfig:
    """The resource sampler (train/monitor.py): a background thread, off the training loop."""

    enabled: bool = opt(True, "sample process/system CPU and memory (psutil) and, on GPUs, utilisation, memory, "
                              "power and temperature (NVML) in a background thread; written to "
                              "<run_dir>/monitor/rank<N>.jsonl and, averaged over each log window, to metrics.jsonl")
    interval: float = opt(1.0, "seconds between two samples", gt=0)


@dataclass
class ProfileConfig:
    """torch.profiler over a window of steps (train/profile.py)."""

    enabled: bool = opt(False, "profile steps wait+1 .. wait+warmup+active with torch.profiler: Chrome traces per "
                               "rank under <run_dir>/profile/ and a printed table of the top operators by self time")
    wait: int = opt(5, "steps to skip before profiling (the first steps compile and warm caches)", ge=0)
    warmup: int = opt(2, "steps traced but discarded (the profiler's own start-up)", ge=0)
    active: int = opt(3, "steps recorded into the trace", ge=1)
    top: int = opt(15, "rows of the top-operator table", ge=1)
    record_shapes: bool = opt(False, "record input shapes of each operator (bigger traces)")
    memory_snapshot: bool = opt(True, "on CUDA: record allocator history over the window and dump a memory "
                                      "snapshot (also on out-of-memory) to <run_dir>/profile/")


@dataclass
class PredictionConfig:
    """What `scaletrain plan --emit` predicted for this job; `scaletrain report` sets it beside the measurement."""

    plan: str = opt("", "the plan's label and hardware; empty = the job did not come from a plan")
    step_seconds: float = opt(0.0, "predicted seconds per optimizer step; 0 = none", ge=0)
    memory_bytes: float = opt(0.0, "predicted peak memory per device in bytes; 0 = none", ge=0)
    tokens_per_second: float = opt(0.0, "predicted tokens/s of the whole job; 0 = none", ge=0)


@dataclass
class ParallelConfig:
    """How the job is split over ranks. Degrees multiply to the world size (see docs/parallelism.md)."""

    dp_replicate: int = opt(1, "replicated data-parallel degree (DDP, or HSDP's replicate dim); -1 = the ranks "
                               "left over by the other degrees", ge=-1)
    dp_shard: int = opt(1, "sharded data-parallel degree (FSDP2); -1 = the ranks left over", ge=-1)
    tp: int = opt(1, "tensor-parallel degree (heads and MLP columns split across ranks)", ge=1)
    pp: int = opt(1, "pipeline-parallel degree (blocks split into stages)", ge=1)
    cp: int = opt(1, "context-parallel degree (sequence split; GPU only)", ge=1)
    ep: int = opt(1, "expert-parallel degree of a mixture of experts (model.moe_experts), borrowed from the "
                     "data-parallel ranks (torchtitan's dp2ep: no mesh dimension of its own): each expert lives "
                     "on one of ep ranks, tokens travel to it by all-to-all; must divide dp_shard (FSDP2, which shards "
                     "each expert over the dp_shard / ep others) or equal dp_replicate (DDP); 1 = every rank holds "
                     "every expert",
                  ge=1)
    zero_stage: int = opt(-1, "-1 = auto (3 with dp_shard > 1, else 0); 0 plain DDP, 1 ZeroRedundancyOptimizer "
                              "over DDP, 2 FSDP2 keeping params after forward, 3 FSDP2 resharding after forward",
                          ge=-1, le=3)
    sequence_parallel: bool = opt(True, "with tp > 1, also shard norms/activations along the sequence")
    pp_schedule: str = opt("1f1b", "pipeline schedule", choices=("gpipe", "1f1b", "interleaved_1f1b"))
    pp_microbatches: int = opt(0, "micro-batches per pipeline step; 0 = 2 x pp", ge=0)
    pp_virtual_stages: int = opt(1, "model chunks per pipeline rank (interleaved_1f1b needs >= 2)", ge=1)
    activation_checkpointing: str = opt("none", "recompute activations in backward: none, selective (every "
                                                "ac_every-th block) or full (every block)",
                                        choices=("none", "selective", "full"))
    ac_every: int = opt(2, "selective activation checkpointing wraps every k-th block", ge=1)
    param_dtype: str = opt("fp32", "FSDP2 mixed precision: dtype of gathered params (gradients reduce in fp32)",
                           choices=("fp32", "bf16"))
    cpu_offload: bool = opt(False, "FSDP2: keep sharded params, grads and optimizer states on the CPU")
    low_comm: str = opt("none", "low-communication data parallelism over dp ranks: none, local_sgd or diloco",
                        choices=("none", "local_sgd", "diloco"))
    sync_every: int = opt(16, "local_sgd / diloco: inner steps between synchronisations (H)", ge=1)
    outer_lr: float = opt(0.7, "diloco: outer Nesterov learning rate", gt=0)
    outer_momentum: float = opt(0.9, "diloco: outer Nesterov momentum", ge=0, lt=1)
    engine: str = opt("native", "native (DDP, ZeroRedundancyOptimizer, FSDP2, TP, PP) or deepspeed "
                                "(deepspeed.initialize with ZeRO stage parallel.zero_stage, data parallel only; "
                                "needs the extra scaletrain[deepspeed]; see the [deepspeed] section)",
                      choices=("native", "deepspeed"))
    balance: str = opt("none", "none (every data-parallel rank takes the same micro-batches) or throughput (ranks "
                               "time their micro-batches and take a share of the step's micro-batches in "
                               "proportion to their speed; the gradient stays the uniform-batch one; "
                               "docs/tuning.md)", choices=("none", "throughput"))
    balance_interval: int = opt(10, "balance = throughput: steps between two re-measurements of the ranks' speeds",
                                ge=1)
    collective_timeout_seconds: float = opt(600.0, "seconds a rank waits in a collective (and in the process group's "
                                                   "set-up) for the other ranks before it fails with an error: "
                                                   "bounds the hang when a peer dies without closing its "
                                                   "connections (a lost node) or stops answering; must exceed the "
                                                   "longest wait of one rank for another (rank 0 preparing the "
                                                   "data, a synchronous checkpoint, a cold torch.compile)", gt=0)


@dataclass
class BatchConfig:
    """Adaptive batch size (train/adaptive.py, docs/tuning.md): a ramp and the gradient noise scale."""

    ramp_start: int = opt(0, "batch-size ramp (Megatron's rampup_batch_size): global batch in sequences at step 0; "
                             "0 = no ramp. The ramp ends at train.batch_size x train.grad_accum_steps x "
                             "data-parallel ranks", ge=0)
    ramp_increment: int = opt(0, "ramp: sequences added to the global batch at each increase", ge=0)
    ramp_samples: int = opt(0, "ramp: sequences consumed from ramp_start until the full global batch", ge=0)
    lr_scaling: str = opt("sqrt", "learning rate during the ramp: the schedule's LR times (B / B_full) for "
                                  "linear, sqrt(B / B_full) for sqrt, unchanged for none",
                          choices=("none", "linear", "sqrt"))
    noise_scale_interval: int = opt(0, "measure the gradient noise scale B_simple (McCandlish et al. 2018) every "
                                       "N steps from the micro-batch and the step gradients and log it with a "
                                       "suggested critical batch; 0 = never", ge=0)


@dataclass
class DeepSpeedConfig:
    """Settings of ``parallel.engine = "deepspeed"`` (ignored by the native engine; docs/coming-from.md)."""

    config: str = opt("", "a DeepSpeed ds_config.json to start from: scaletrain fills the keys it leaves out "
                          "(batch, accumulation, clipping, ZeRO stage, precision, offload) from this config; a "
                          "key set to a different value than the matching scaletrain field is an error")
    offload_optimizer: str = opt("none", "ZeRO optimizer-state offload: none, cpu (DeepSpeedCPUAdam) or nvme "
                                         "(ZeRO-Infinity, into deepspeed.nvme_path)", choices=("none", "cpu", "nvme"))
    offload_param: str = opt("none", "ZeRO-3 parameter offload: none, cpu or nvme (into deepspeed.nvme_path)",
                             choices=("none", "cpu", "nvme"))
    nvme_path: str = opt("", "a folder on a fast local disk for nvme offload (must be writable)")


@dataclass
class FinetuneConfig:
    """Start from existing weights and adapt them (docs/finetuning.md). Empty ``source``: pretraining."""

    source: str = opt("", "the base to adapt: a scaletrain run folder (its latest checkpoint) or a local Hugging "
                          "Face Llama folder (config.json + safetensors + tokenizer.json); the [model] fields and "
                          "data.tokenizer are taken from it; empty = pretrain from random weights")
    method: str = opt("lora", "full (all weights), lora, qlora (4-bit NF4 frozen base + LoRA), prompt (virtual "
                              "tokens at the input) or prefix (key/value prefixes in every layer)",
                      choices=("full", "lora", "qlora", "prompt", "prefix"))
    lora_rank: int = opt(8, "lora/qlora: rank r of the update B @ A", ge=1)
    lora_alpha: float = opt(16.0, "lora/qlora: the update is scaled by alpha / r (alpha / sqrt(r) with rslora)", gt=0)
    lora_dropout: float = opt(0.0, "lora/qlora: dropout on the adapter's input", ge=0, lt=1)
    lora_targets: list[str] = opt(["q", "k", "v", "o"], "lora/qlora: projections to adapt, among q, k, v, o "
                                                         "(attention) and gate, up, down (SwiGLU)")
    rslora: bool = opt(False, "lora/qlora: rank-stabilised scaling alpha / sqrt(r)")
    dora: bool = opt(False, "lora/qlora: weight-decomposed LoRA (DoRA): a trainable magnitude per output row "
                            "scales the normalised W + B @ A (peft's use_dora)")
    lora_plus_ratio: float = opt(1.0, "lora/qlora: LoRA+ (Hayou et al. 2024): the B matrices train at this many times "
                                      "the learning rate of the rest (16 in the paper; peft's "
                                      "create_loraplus_optimizer); 1 = plain LoRA", gt=0)
    qlora_compile: str = opt("auto", "qlora: dequantize the 4-bit base through torch.compile (one fused kernel a "
                                     "weight shape instead of torchao's dozen eager ops; the same forward and "
                                     "gradients) - true, false, or auto: on a CUDA device, off on a CPU (measured "
                                     "there: a 1.08x step after ~10 s of cold compiles; docs/finetuning.md)",
                             choices=("auto", "true", "false"))
    instructions: str = opt("", "a JSONL file of {\"prompt\", \"response\"} or {\"messages\": [...]} lines to train on "
                                "instead of data.path, loss on the responses only, packed or padded rows "
                                "(finetune.packing; docs/finetuning.md); data.val_fraction of the examples are held "
                                "out")
    packing: str = opt("auto", "instructions: several examples a row (true: a block-causal mask keeps each to itself, "
                               "positions restart per example, padding only at a row's end), one example a padded "
                               "row (false), or auto: packed for full, lora and qlora, padded for prompt and prefix "
                               "(their virtual tokens would be shared by the examples of a row) and with "
                               "parallel.pp or parallel.cp (the mask does not travel)",
                       choices=("auto", "true", "false"))
    chat_template: str = opt("auto", "instructions: the template conversations are rendered in: base (the base's "
                                     "own chat_template, e.g. Qwen3's ChatML, Llama 3's headers; an error if it has "
                                     "none), plain (scaletrain's \"User:\" / \"Assistant:\" text) or auto (base when "
                                     "the base's tokenizer folder has a chat template, else plain)",
                             choices=("auto", "base", "plain"))
    # An entry of the objective table (finetune/objectives.py: OBJECTIVES), checked with the job (train/validate.py).
    objective: str = opt("sft", "what the fine-tune minimises: sft (next-token loss on the data or "
                                "instructions), or on finetune.preferences pairs dpo (with a reference: the base "
                                "through disabled adapters, or log-probs precomputed for method=full), simpo or "
                                "orpo (no reference) (docs/finetuning.md)")
    preferences: str = opt("", "dpo/simpo/orpo: a JSONL file of {\"prompt\" (or \"messages\"), \"chosen\", "
                               "\"rejected\"} lines, rendered as instructions are, the completions scored; "
                               "data.val_fraction of the pairs are held out")
    beta: float = opt(0.1, "dpo/simpo/orpo: beta (DPO's KL strength, SimPO's reward scale, ORPO's odds-ratio "
                           "weight lambda)", gt=0)
    dpo_loss: str = opt("sigmoid", "dpo: sigmoid (the paper's; conservative with label_smoothing), robust (rDPO) "
                                   "or ipo (length-normalised squared loss), as TRL's loss_type",
                        choices=("sigmoid", "robust", "ipo"))
    label_smoothing: float = opt(0.0, "dpo sigmoid/robust and simpo: the assumed probability that a pair's "
                                      "preference is flipped", ge=0, lt=0.5)
    simpo_gamma: float = opt(0.5, "simpo: target reward margin gamma", ge=0)
    virtual_tokens: int = opt(16, "prompt/prefix: number of trainable virtual tokens", ge=1)
    freeze_embeddings: bool = opt(False, "full: keep the input embedding (and a tied head) frozen")
    freeze_blocks: int = opt(0, "full: keep the first k transformer blocks frozen", ge=0)
    teacher: str = opt("", "distil from this model while fine-tuning (a run folder or Hugging Face folder with the "
                           "same tokenizer, e.g. the unpruned original of finetune.source): the loss mixes the data "
                           "loss with the KL divergence to the teacher's logits (docs/compression.md); empty = off")
    distill_weight: float = opt(0.5, "teacher: weight w of the distillation term, loss = (1-w) data + w KL", ge=0, le=1)
    distill_temperature: float = opt(2.0, "teacher: softmax temperature T of both logits (the KL is scaled by T^2)",
                                     gt=0)
    qat: str = opt("", "full: quantization-aware fine-tuning, the block Linears' weights fake-quantized (torchao) as "
                       "`scaletrain compress --quantize` will quantize them: int4-weight or int8-weight; empty = off",
                   choices=("", "int4-weight", "int8-weight"))
    qat_group_size: int = opt(32, "qat int4-weight: weights per scale (as compress --group-size)", ge=1)
    keep_zeros: bool = opt(False, "full: block weights that are exactly zero in the base (the masks of `scaletrain "
                                  "compress --prune`) stay zero: their gradients are masked (docs/compression.md)")


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    prediction: PredictionConfig = field(default_factory=PredictionConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)


# --------------------------------------------------------------------------------------------------
# Generic machinery: walk, coerce, validate, load, dump, argparse
# --------------------------------------------------------------------------------------------------


def _sections(cls: type) -> dict[str, type]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _is_section(tp: Any) -> bool:
    return dataclasses.is_dataclass(tp)


def iter_fields(cls: type, prefix: str = ""):
    """Yield ``(dotted_name, type, dataclasses.Field)`` for every leaf field of a config tree."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if _is_section(tp):
            yield from iter_fields(tp, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", tp, f


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp)).replace("typing.", "")


def coerce(value: Any, tp: Any, key: str, where: str) -> Any:
    """Turn a TOML value or a CLI string into ``tp``; raise ConfigError naming the key otherwise."""
    origin = typing.get_origin(tp)
    from_cli = isinstance(value, str) and tp is not str and origin is not list
    try:
        if origin is list:
            (item_tp,) = typing.get_args(tp)
            if isinstance(value, str):
                value = [v.strip() for v in value.split(",") if v.strip()]
            if not isinstance(value, list):
                raise TypeError
            return [coerce(v, item_tp, key, where) for v in value]
        if tp is bool:
            if isinstance(value, bool):
                return value
            if from_cli and value.lower() in ("true", "1", "yes", "on"):
                return True
            if from_cli and value.lower() in ("false", "0", "no", "off"):
                return False
            raise TypeError
        if tp is int:
            if isinstance(value, bool):
                raise TypeError
            if isinstance(value, int):
                return value
            if from_cli:
                return int(value.replace("_", ""))
            raise TypeError
        if tp is float:
            if isinstance(value, bool):
                raise TypeError
            if isinstance(value, (int, float)):
                return float(value)
            if from_cli:
                return float(value)
            raise TypeError
        if tp is str:
            if isinstance(value, str):
                return value
            raise TypeError
    except (TypeError, ValueError):
        raise ConfigError(f"{key} must be {_type_name(tp)} (got {value!r}){where}") from None
    raise ConfigError(f"{key}: unsupported field type {tp}{where}")


def check_field(key: str, value: Any, f: dataclasses.Field, where: str = "") -> None:
    """Apply the range/choice limits declared with ``opt``."""
    m = f.metadata
    if m.get("choices") and value not in m["choices"]:
        raise ConfigError(f"{key} must be one of {', '.join(map(str, m['choices']))} (got {value!r}){where}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key} must be a finite number (got {value!r}){where}")
        for bound, ok, text in (("ge", lambda v, b: v >= b, ">="), ("gt", lambda v, b: v > b, ">"),
                                ("le", lambda v, b: v <= b, "<="), ("lt", lambda v, b: v < b, "<")):
            b = m.get(bound)
            if b is not None and not ok(value, b):
                raise ConfigError(f"{key} must be {text} {b} (got {value!r}){where}")


def read_toml(path: str | Path) -> dict:
    """Read a TOML file; missing files and syntax errors become one-line ConfigErrors."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        with p.open("rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p}: invalid TOML: {exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{p}: not UTF-8 text") from None


def _nest(flat: dict[str, Any]) -> dict:
    out: dict = {}
    for key, value in flat.items():
        node = out
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def build(cls: type, raw: dict, where: str = "", prefix: str = "", presets: dict | None = None) -> Any:
    """Construct a config tree ``cls`` from a nested dict, checking names, types and limits."""
    hints = typing.get_type_hints(cls)
    by_name = {f.name: f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in by_name:
            known = ", ".join(sorted(by_name))
            raise ConfigError(f"unknown key {prefix}{key}{where} "
                              f"(known in {prefix.rstrip('.') or 'top level'}: {known})")
    kwargs = {}
    layered = dict(raw)
    if presets is not None and layered.get("preset"):
        name = layered["preset"]
        if name not in presets:
            raise ConfigError(f"{prefix}preset: unknown preset {name!r}{where} (known: {', '.join(presets)})")
        layered = {**presets[name], **layered}
    for name, f in by_name.items():
        tp = hints[name]
        key = f"{prefix}{name}"
        if _is_section(tp):
            sub = layered.get(name, {})
            if not isinstance(sub, dict):
                raise ConfigError(f"{key} must be a [section]{where}")
            kwargs[name] = build(tp, sub, where, f"{key}.", _presets_for(tp))
        elif name in layered:
            value = layered[name]
            if tp is str and "true" in (f.metadata.get("choices") or ()):  # a bool with more choices (train.compile)
                value = _as_bool_choice(value)
            value = coerce(value, tp, key, where)
            check_field(key, value, f, where)
            kwargs[name] = value
    return cls(**kwargs)


def _as_bool_choice(value: Any) -> Any:
    """A TOML bool or a CLI yes/no word as the choice "true"/"false" of a str field that also has others."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        word = value.lower()
        return "true" if word in ("true", "1", "yes", "on") else "false" if word in ("false", "0", "no", "off") \
            else value
    return value


def _presets_for(tp: type) -> dict | None:
    return PRESETS if tp is ModelConfig else None


def load_config(path: str | Path | None = None, overrides: dict[str, str] | None = None,
                cls: type = None) -> Any:
    """Load ``cls`` (JobConfig by default) from an optional TOML file plus dotted overrides."""
    cls = cls or JobConfig
    raw = read_toml(path) if path else {}
    where = f" in {path}" if path else ""
    # Check TOML first so its errors name the file; then layer CLI overrides on top.
    build(cls, raw, where, presets=None)
    cli = _nest(overrides or {})
    merged = _deep_merge(_cli_presets(cls, raw, cli), cli)
    cfg = build(cls, merged, where if not overrides else "", presets=None)
    if cls is JobConfig:
        validate_job(cfg)
    return cfg


def _cli_presets(cls: type, raw: dict, cli: dict) -> dict:
    """``raw`` (the TOML) with a preset given on the command line applied as its own layer above the TOML:
    it replaces the TOML's preset, and the TOML fields it sets (dim, n_layers, ...) give way to it. TOML
    fields it does not set, and the command line's own fields, still apply. Without this, the TOML's fields
    would silently win (configs/default.toml spells out dim = 128, so ``--model.preset=micro`` would keep
    it while saying ``preset = "micro"``)."""
    out = dict(raw)
    for name, tp in _sections(cls).items():
        presets = _presets_for(tp)
        chosen = cli.get(name, {}).get("preset") if isinstance(cli.get(name), dict) else None
        if presets is None or not chosen or chosen not in presets or not isinstance(raw.get(name), dict):
            continue  # nothing to layer (an unknown preset is build()'s one-line error)
        out[name] = {**{k: v for k, v in raw[name].items() if k != "preset"}, **presets[chosen]}
    return out


def _deep_merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def validate_job(cfg: JobConfig) -> None:
    """Cross-field checks that no single field can make."""
    m = cfg.model
    if not m.head_dim and m.dim % m.n_heads:
        raise ConfigError(f"model.dim ({m.dim}) must be divisible by model.n_heads ({m.n_heads}) "
                          f"(or set model.head_dim)")
    if head_width(m) % 2:
        raise ConfigError(f"the head width (model.head_dim, or model.dim / model.n_heads) must be even for rotary "
                          f"embeddings (got {head_width(m)})")
    kv = m.n_kv_heads or m.n_heads
    if m.n_heads % kv:
        raise ConfigError(f"model.n_heads ({m.n_heads}) must be divisible by model.n_kv_heads ({kv})")
    check_moe(m)
    if m.qk_norm and m.qk_norm_width == "projection" and cfg.parallel.tp > 1:
        raise ConfigError("model.qk_norm_width = projection normalizes all of a token's heads at once, which "
                          "parallel.tp splits over ranks; set parallel.tp = 1 (or use data parallelism)")
    # A fine-tune's [model] comes from its base, whose rotary tables are lengthened to data.seq_len
    # (finetune/base.resolve_finetune): the default max_seq_len here says nothing about it.
    if cfg.data.seq_len > m.max_seq_len and not cfg.finetune.source:
        raise ConfigError(f"data.seq_len ({cfg.data.seq_len}) must be <= model.max_seq_len ({m.max_seq_len})")
    if -1 < cfg.schedule.min_lr < 0:
        raise ConfigError(f"schedule.min_lr must be >= 0, or -1 for a tenth of optim.lr (got {cfg.schedule.min_lr:g})")
    if cfg.schedule.name != "constant" and cfg.schedule.min_lr > cfg.optim.lr:
        # The decay would climb from optim.lr up to min_lr: never what a schedule is for.
        raise ConfigError(f"schedule.min_lr ({cfg.schedule.min_lr:g}) is above optim.lr ({cfg.optim.lr:g}): the "
                          f"{cfg.schedule.name} schedule would raise the learning rate as it decays; set "
                          f"--schedule.min_lr to at most optim.lr (e.g. {cfg.optim.lr / 10:g})")


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def config_differences(a: Any, b: Any) -> list[tuple[str, Any, Any]]:
    """``(dotted name, value in a, value in b)`` for every leaf field where two config trees differ."""
    out = []
    for key, _, _ in iter_fields(type(a)):
        va, vb = a, b
        for part in key.split("."):
            va, vb = getattr(va, part), getattr(vb, part)
        if va != vb:
            out.append((key, va, vb))
    return out


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    s = str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t")
    return f'"{s}"'


def to_toml(cfg: Any, comments: bool = True) -> str:
    """Dump a config tree as TOML (with each field's help as a comment); reloading gives the same tree."""
    lines: list[str] = []

    def emit(obj: Any, prefix: str) -> None:
        hints = typing.get_type_hints(type(obj))
        scalars = [f for f in dataclasses.fields(obj) if not _is_section(hints[f.name])]
        sections = [f for f in dataclasses.fields(obj) if _is_section(hints[f.name])]
        if prefix and (scalars or not sections):
            lines.append(f"[{prefix}]")
        for f in scalars:
            if comments:
                lines.append(f"# {f.metadata.get('help', '')}")
            lines.append(f"{f.name} = {_toml_value(getattr(obj, f.name))}")
        if prefix:
            lines.append("")
        for f in sections:
            emit(getattr(obj, f.name), f"{prefix}.{f.name}" if prefix else f.name)

    emit(cfg, "")
    return "\n".join(lines).rstrip() + "\n"


def add_config_arguments(parser: argparse.ArgumentParser, cls: type = None) -> None:
    """Add one ``--section.field`` option per leaf field, with its documentation as help."""
    cls = cls or JobConfig
    group = parser.add_argument_group("config fields (override the TOML; CLI > TOML > preset > default; "
                                      "--model.preset also overrides the TOML's fields that the preset sets)")
    for key, tp, f in iter_fields(cls):
        _add_field_argument(group, key, tp, f)


def add_job_field_arguments(parser: argparse.ArgumentParser, keys: tuple[str, ...], title: str) -> None:
    """``--section.field`` options for the job fields ``keys`` only: a command that reads a saved run's job
    (``eval``, ``compress``) overrides the fields it reads, and the rest (the model it loads, say) stay the run's."""
    group = parser.add_argument_group(title)
    fields = {key: (tp, f) for key, tp, f in iter_fields(JobConfig)}
    for key in keys:
        _add_field_argument(group, key, *fields[key])


def _add_field_argument(group, key: str, tp: Any, f: dataclasses.Field) -> None:
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    choices = f.metadata.get("choices")
    extra = f" {{{','.join(map(str, choices))}}}" if choices else ""
    group.add_argument(f"--{key}", dest=f"cfg:{key}", metavar=_type_name(tp).upper(), default=argparse.SUPPRESS,
                       help=f"{f.metadata.get('help', '')}{extra} (default: {default!r})")


def override_job(cfg: JobConfig, overrides: dict[str, str]) -> JobConfig:
    """``cfg`` (a run's saved job) with the command line's dotted ``overrides`` on top, checked as ``load_config``
    checks them (each field's type, limits and choices, then the cross-field rules): one-line ConfigErrors."""
    if not overrides:
        return cfg
    job = build(JobConfig, _deep_merge(to_dict(cfg), _nest(overrides)))
    validate_job(job)
    return job


def overrides_from_args(args: argparse.Namespace) -> dict[str, str]:
    return {k[4:]: v for k, v in vars(args).items() if k.startswith("cfg:")}


# The one flag vocabulary (issue 50): a job field is ``--section.field`` in every command that reads it, and a
# command's own inputs are kebab-case (``--run``, ``--out``, ``--hardware``). Spellings renamed into it are still
# accepted for one release, each saying its new name in one line when used.
class _RenamedFlag(argparse.Action):
    """An old spelling: stores its value where the new one does, after one ``note:`` line naming the new one."""

    def __init__(self, option_strings, dest, new: str, const=None, nargs=None, **kwargs):
        self.new = new
        super().__init__(option_strings, dest, nargs=nargs, const=const, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        value = self.const if self.nargs == 0 else values
        shown = f"{self.new}={value}" if self.dest.startswith("cfg:") else self.new  # a job field: with its value
        print(f"note: {option_string} is deprecated and goes in the next release; use {shown}", file=sys.stderr)
        setattr(namespace, self.dest, value)


def add_renamed_flag(parser: argparse.ArgumentParser, old: str, new: str, dest: str | None = None,
                     switch: bool = False, **kwargs) -> None:
    """Accept ``old`` for one release as a spelling of ``new``: a ``--section.field`` job field (stored as that
    override) or, with ``dest``, a command's own flag. ``switch``: ``old`` took no value (``--dora``) and means
    ``new=true``. Hidden from ``--help``, which shows only the new vocabulary."""
    dest = dest or f"cfg:{new.removeprefix('--')}"
    extra = {"nargs": 0, "const": "true"} if switch else {}
    parser.add_argument(old, dest=dest, action=_RenamedFlag, new=new, default=argparse.SUPPRESS,
                        help=argparse.SUPPRESS, **extra, **kwargs)
