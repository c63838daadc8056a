"""``scaletrain plan`` and ``scaletrain doctor``: argparse wiring, input checks, output.

The dispatcher (scaletrain/cli.py) calls ``add_plan_arguments`` / ``run_plan`` and ``add_doctor_arguments``
/ ``run_doctor`` (``scaletrain plan ...``, ``scaletrain doctor ...``). Bad input is one line on stderr and
exit code 2. ``python -m scaletrain.commands.plan`` runs the same two commands stand-alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
from pathlib import Path

from scaletrain.config import (
    ConfigError,
    DataConfig,
    JobConfig,
    OptimConfig,
    PredictionConfig,
    add_config_arguments,
    add_renamed_flag,
    load_config,
    overrides_from_args,
)
from scaletrain.core.files import check_output_path, write_file
from scaletrain.finetune.objectives import objective_entry
from scaletrain.hardware.catalog import Hardware
from scaletrain.model.presets import PRESETS, num_params
from scaletrain.plan.deadline import check_limits
from scaletrain.plan.timing import workload_utilisation
from scaletrain.plan.wall import LoopSettings, evaluation_note, predicted_wall
from scaletrain.plan.workload import CHINCHILLA_TOKENS_PER_PARAM, Plan, Workload
from scaletrain.scaling.fit import law_params
from scaletrain.scaling.quality import add_quality_arguments, print_prediction, quality_search
from scaletrain.train.optimizer import optimizer_entry

_SUFFIX = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}



def write_json(doc: dict, target: str) -> None:
    """``--json PATH`` writes the document to PATH; ``--json -`` prints it."""
    text = json.dumps(doc, indent=2, default=str)
    if target == "-":
        print(text)
    else:
        write_file(target, text, f"the JSON {target}")

def parse_count(text: str, what: str) -> float:
    """'300B', '1.5e9', '2_000_000', '10M' -> a number; ConfigError otherwise."""
    m = re.fullmatch(r"\s*([0-9_.]+(?:e[+-]?\d+)?)\s*([kmbgt]?)\s*", text.lower())
    try:
        if not m:
            raise ValueError
        value = float(m.group(1).replace("_", "")) * _SUFFIX.get(m.group(2), 1)
    except ValueError:
        raise ConfigError(f"{what} must be a number like 300B, 1.5e9 or 20M (got {text!r})") from None
    if value <= 0 or not math.isfinite(value):  # 1e400 reads as inf, and overflowed as an int later
        raise ConfigError(f"{what} must be a finite number > 0 (got {text!r})")
    return value


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``scaletrain plan``: the job as train reads it (``--config`` + ``--section.field``), and the
    plan's own inputs in kebab-case (tokens, hardware, pins, deadline, output)."""
    parser.description = ("Predict memory, time and cost of a job and search its parallel plan. The job is read as "
                          "`scaletrain train` reads it: --config TOML overridden by --section.field flags (the "
                          "model, data.seq_len, train.precision, optim.*, finetune.* for --finetune.method, train "
                          "evaluation and checkpoint intervals); kebab-case flags are the plan's own inputs.")
    src = parser.add_argument_group("job and tokens (the job's fields are the --section.field flags below)")
    src.add_argument("--config", default="", help="a job TOML: its [model], data.seq_len, train batch and "
                                                  "precision are the defaults of this plan")
    src.add_argument("--tokens", default="chinchilla",
                     help=f"tokens to train: a number (300B, 1.5e9) or 'chinchilla' = {CHINCHILLA_TOKENS_PER_PARAM} "
                          "per parameter (a convention)")
    src.add_argument("--global-batch", type=int, default=None,
                     help="sequences per optimizer step across all ranks (default: a --config's train.batch_size x "
                          "grad_accum_steps, else ~0.5M tokens on GPUs, 16 on CPU)")
    _add_renamed_job_flags(parser)
    hw = parser.add_argument_group("hardware")
    hw.add_argument("--hardware", default="auto", help="catalog NAME, NAME:COUNT or NAME:COUNTxNODES "
                                                       "(e.g. h100-sxm:8x4), or auto (this machine, from doctor)")
    hw.add_argument("--count", type=int, default=None, help="devices per node (overrides NAME:COUNT)")
    hw.add_argument("--nodes", type=int, default=None, help="nodes (overrides NAME:COUNTxNODES)")
    hw.add_argument("--prices", default="", help="TOML price table overriding the built-in one")
    pin = parser.add_argument_group("pin part of the plan (the search varies the rest): the --parallel.FIELD flags "
                                    "given (" + ", ".join(PINNED_FIELDS) + "; -1, auto, is searched), and")
    pin.add_argument("--micro-batch", dest="pin_micro_batch", type=int, default=None,
                     help="sequences per micro-batch and data-parallel rank to keep (the global batch stays "
                          "--global-batch's)")
    pin.add_argument("--engine", dest="pin_engine", choices=("native", "deepspeed", "all"), default=None,
                     help="native (default), deepspeed (ZeRO-1/2/3, CPU / NVMe offload; needs DeepSpeed) or all "
                          "(both, ranked together)")
    when = parser.add_argument_group("deadline / budget (instead of one cluster: which device count)")
    when.add_argument("--deadline", type=float, default=None,
                      help="hours: the cheapest device count and plan that finishes by then (on demand and spot)")
    when.add_argument("--budget", type=float, default=None,
                      help="USD: the fastest device count and plan that costs at most this (on demand and spot)")
    when.add_argument("--max-nodes", type=int, default=64, help="the most nodes --deadline/--budget consider")
    out = parser.add_argument_group("output")
    out.add_argument("--top", type=int, default=5, help="plans to show")
    out.add_argument("--json", default="", help="write everything as JSON to this file ('-' = stdout)")
    out.add_argument("--emit", default="", help="write the best plan as a runnable job TOML to this file")
    add_quality_arguments(parser)
    add_config_arguments(parser, JobConfig)


# The job fields `plan` once declared itself, kebab-case, renamed into the one vocabulary (issue 50): accepted for
# one release, each saying its new spelling. (old flag, job field, takes no value)
RENAMED_JOB_FLAGS = (
    ("--model", "model.preset", False), ("--vocab-size", "model.vocab_size", False),
    ("--seq-len", "data.seq_len", False), ("--precision", "train.precision", False),
    ("--optimizer", "optim.name", False), ("--muon-adapters", "optim.muon_adapters", True),
    ("--method", "finetune.method", False), ("--lora-rank", "finetune.lora_rank", False),
    ("--lora-targets", "finetune.lora_targets", False), ("--virtual-tokens", "finetune.virtual_tokens", False),
    ("--dora", "finetune.dora", True), ("--qlora-compile", "finetune.qlora_compile", False),
    ("--objective", "finetune.objective", False),
    *((f"--{name.replace('_', '-')}", f"parallel.{name}", False) for name in ("dp_replicate", "dp_shard", "tp", "pp",
                                                                              "cp", "zero_stage")),
    ("--ac", "parallel.activation_checkpointing", False), ("--offload", "parallel.cpu_offload", False),
)
# The job's [parallel] fields a plan keeps when the command line sets them (a --config's are searched over).
PINNED_FIELDS = ("dp_replicate", "dp_shard", "tp", "pp", "cp", "zero_stage", "activation_checkpointing", "cpu_offload")


def _add_renamed_job_flags(parser: argparse.ArgumentParser) -> None:
    for old, key, switch in RENAMED_JOB_FLAGS:
        add_renamed_flag(parser, old, f"--{key}", switch=switch)


# Every numeric flag of `plan` and its rule: a value out of range is one line naming the flag (0 and negative
# values were taken for "not given" and planned the defaults, or surfaced as another flag's message).
# (The job's fields are train's, checked by load_config.)
_AT_LEAST_ONE = ("global_batch", "count", "nodes", "pin_micro_batch", "top")


def check_numbers(args: argparse.Namespace) -> None:
    """The numeric flags in range, before anything is planned; ConfigError naming the first that is not."""
    for name in _AT_LEAST_ONE:
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise ConfigError(f"--{_flag(name)} must be a positive integer (got {value})")
    check_limits(args.deadline, args.budget, args.max_nodes)  # --deadline, --budget, --max-nodes
    target = getattr(args, "target_bpb", None)  # inf and nan were searched for ("the cheapest way to reach inf")
    if target is not None and not (math.isfinite(target) and target > 0):
        raise ConfigError(f"--target-bpb must be a finite number of bits per byte > 0 (got {target:g})")


def _flag(dest: str) -> str:
    return dest.removeprefix("pin_").replace("_", "-")


@dataclasses.dataclass(frozen=True)
class PlanJob:
    """The job a plan is for, read as ``train`` reads it: ``--config`` (or the defaults) overridden by the
    ``--section.field`` flags (``load_config``: every field and choice, the same one-line errors)."""

    cfg: JobConfig
    flags: frozenset[str]  # the dotted fields the command line set
    recipe: str  # the --config path, "" without one (then only the flags say what the job is)

    def given(self, key: str) -> bool:
        """``key`` set on the command line (a section's name ending in '.': any of its fields)."""
        return any(k.startswith(key) for k in self.flags) if key.endswith(".") else key in self.flags


def plan_job(args: argparse.Namespace) -> PlanJob:
    """``--config`` + the ``--section.field`` flags (old spellings included) as one checked job."""
    overrides = overrides_from_args(args)
    cfg = load_config(args.config or None, overrides)
    objective_entry(cfg.finetune.objective)  # a name outside the objective table: one line, as train says it
    return PlanJob(cfg, frozenset(overrides), args.config)


def workload_from_args(args: argparse.Namespace, job: PlanJob, hardware: Hardware, this_machine: bool = False
                       ) -> tuple[Workload, bool]:
    """The workload and whether its token count is the Chinchilla convention. ``hardware`` is the target
    (``this_machine``: ``--hardware auto``), whose precision ``auto`` resolves to what the trainer picks there."""
    device_kind = hardware.kind
    cfg = job.cfg
    if not job.recipe and not job.given("model."):
        raise ConfigError("give a model: --model.preset=PRESET (" + ", ".join(_presets()) + ") or --config job.toml")
    model = cfg.model
    if model.vocab_size <= 0 and job.recipe:
        model = dataclasses.replace(model, vocab_size=data_vocabulary(cfg.data))
    elif model.vocab_size <= 0 and getattr(args, "data", ""):  # `plan --data DATA --model.preset=nano`: its manifest
        model = dataclasses.replace(model, vocab_size=data_vocabulary(DataConfig(path=args.data)))
    if model.vocab_size <= 0:
        where = "; data.tokenizer = 'char' over raw text has a vocabulary only once prepared" if job.recipe else ""
        raise ConfigError(f"the model has no vocab_size (preset {model.preset or '-'!r} takes it from the data"
                          f"{where}): pass --model.vocab_size")
    seq = cfg.data.seq_len if job.recipe or job.given("data.seq_len") else min(1024, model.max_seq_len)
    if seq > model.max_seq_len:
        raise ConfigError(f"data.seq_len {seq} exceeds the model's max_seq_len ({model.max_seq_len})")
    precision = planned_precision(cfg.train.precision, hardware, this_machine)
    if args.global_batch is not None:
        batch = args.global_batch
    elif job.recipe and not job.given("model.preset"):
        batch = cfg.train.batch_size * cfg.train.grad_accum_steps
    else:
        batch = max(1, round(524288 / seq)) if device_kind == "gpu" else 16
    if batch < 1:
        raise ConfigError(f"--global-batch must be >= 1 (got {batch})")
    chinchilla = args.tokens.strip().lower() in ("chinchilla", "chinchilla-optimal")
    tokens = CHINCHILLA_TOKENS_PER_PARAM * num_params(model) if chinchilla else parse_count(args.tokens, "--tokens")
    if batch * seq > tokens:  # one step would hold more than the whole run: "1 steps" of more data than there is
        source = f"Chinchilla: {CHINCHILLA_TOKENS_PER_PARAM} per parameter" if chinchilla else f"--tokens {args.tokens}"
        raise ConfigError(f"--global-batch {batch:,} x {seq:,} tokens = {batch * seq:,} tokens a step, more than the "
                          f"{tokens:,.0f} tokens to train ({source}); lower --global-batch or raise --tokens")
    optimizer, muon_adapters = planned_optimizer(job)
    return Workload(model, seq, batch, tokens, precision, optimizer, muon_adapters), chinchilla


def planned_optimizer(job: PlanJob) -> tuple[str, bool]:
    """(optimizer, muon_adapters) to plan for: the job's optim.name, and optim.muon_adapters, which only Muon has
    (asked for on the command line with another optimizer: refused)."""
    optimizer = job.cfg.optim.name
    where = "--optim.name" if job.given("optim.name") else f"optim.name in {job.recipe}" if job.recipe \
        else "optim.name"
    takes_adapters = "muon_adapters" in optimizer_entry(optimizer, where).fields
    if job.given("optim.muon_adapters") and job.cfg.optim.muon_adapters and not takes_adapters:
        raise ConfigError(f"--optim.muon_adapters puts LoRA's adapters under Muon: it needs --optim.name=muon "
                          f"(planning {optimizer}); add --optim.name=muon or drop it")
    return optimizer, takes_adapters and job.cfg.optim.muon_adapters


def planned_precision(requested: str, hardware: Hardware, this_machine: bool) -> str:
    """The precision the trainer would run ``requested`` in on ``hardware`` (``train/precision.resolve_precision``'s
    rule): an explicit name as given; ``auto`` -> bf16 on a GPU (every catalog GPU has bf16), and on a CPU bf16
    where its bf16 matmuls are at least ``BF16_MIN_SPEEDUP`` times fp32's -- on this machine the trainer's own
    measurement (cached, the one ``train`` reads), on a catalog CPU its calibrated matmul rates."""
    import torch

    from scaletrain.train.precision import BF16_MIN_SPEEDUP, resolve_precision

    if requested == "fp8":  # torchao's float8 GEMMs; the rest of the step (and its memory) is bf16's
        return "bf16"
    if requested != "auto":
        return requested
    if hardware.kind == "gpu":
        return "bf16"
    if this_machine:
        return resolve_precision("auto", torch.device("cpu"))[0]
    ratio = hardware.peak_flops.get("bf16", 0.0) / hardware.peak_flops["fp32"]
    return "bf16" if ratio >= BF16_MIN_SPEEDUP else "fp32"


def data_vocabulary(data: DataConfig) -> int:
    """The model vocabulary the trainer would take from ``data`` (model.vocab_size = 0), found without
    preparing anything, padded as the trainer pads it at tp = 1 (``padded_vocab_size``); 0 when unknown.

    In the trainer's order: a prepared data.path's manifest (its tokenizer wins; data.tokenizer and
    data.vocab_size only apply to raw text), else the BPE of data.vocab_size trained on the raw text (the
    most it can have), else a data.tokenizer tokenizer.json's; a char tokenizer's is known once prepared."""
    from scaletrain.data.shards import MANIFEST, read_manifest
    from scaletrain.data.tokenizer import load_tokenizer
    from scaletrain.parallel.dims import padded_vocab_size

    if not data.path.startswith("builtin:") and (Path(data.path) / MANIFEST).is_file():
        vocab = int(read_manifest(data.path, verify=False)["vocab_size"])
    elif data.tokenizer == "bpe":
        vocab = data.vocab_size
    elif data.tokenizer != "char":
        vocab = load_tokenizer(data.tokenizer).vocab_size
    else:
        return 0
    return padded_vocab_size(vocab, 1)


def _presets() -> dict:
    return PRESETS


def _is_auto(spec: str) -> bool:
    """``--hardware auto`` (or ``auto:N``): this machine."""
    return spec.strip().lower().split(":")[0] == "auto"


def _pins(args: argparse.Namespace, job: PlanJob) -> dict:
    """What the search keeps: the [parallel] fields the command line sets (-1, auto, is left to the search),
    ``--micro-batch`` and ``--engine``."""
    pins = {name: getattr(job.cfg.parallel, name) for name in PINNED_FIELDS if job.given(f"parallel.{name}")}
    pins = {name: value for name, value in pins.items() if value != -1}
    # parallel.ep (expert parallelism), where the config has it: a pin on the plan's own ep degree
    if job.given("parallel.ep") and getattr(job.cfg.parallel, "ep", 1) not in (-1, 0):
        pins["ep"] = getattr(job.cfg.parallel, "ep", 1)
    for name in ("dp_replicate", "dp_shard"):  # 0 passes the field's own check (ge=-1), not a degree to plan
        if pins.get(name) == 0:
            raise ConfigError(f"--parallel.{name}=0: a degree to plan must be >= 1 (or -1: the search chooses)")
    for name in ("micro_batch", "engine"):
        if getattr(args, f"pin_{name}") is not None:
            pins[name] = getattr(args, f"pin_{name}")
    return pins


def run_plan(args: argparse.Namespace) -> int:
    """Predict, search, print; exit 0 with a plan, 2 on bad input or when nothing fits."""
    from rich.console import Console

    from scaletrain.plan.cost import load_prices, training_cost
    from scaletrain.plan.emit import write_config
    from scaletrain.plan.hardware_spec import parse_hardware
    from scaletrain.plan.report import plan_dict, print_report, workload_dict
    from scaletrain.plan.search import search, what_would_fit

    console = Console(stderr=args.json == "-", width=max(120, Console().width))
    try:
        check_numbers(args)
        job = plan_job(args)
        for flag, target in (("--json", args.json), ("--emit", args.emit)):  # before the search, not after it
            if target and target != "-":
                check_output_path(target, f"{flag} {target}")
        cluster = parse_hardware(args.hardware, args.count, args.nodes)
        prices, as_of = load_prices(args.prices)
        fits = _fits_of(args)
        searched = None if not fits else quality_search(
            args, fits, data_vocabulary(DataConfig(path=args.data)), cluster, prices, as_of,
            planned_precision(job.cfg.train.precision, cluster.hardware, _is_auto(args.hardware)), console,
            model_given=bool(job.recipe) or job.given("model."),
            seq_len=job.cfg.data.seq_len if job.given("data.seq_len") else None)
        if args.target_bpb is not None and not fits:
            raise ConfigError("--target-bpb needs --data FOLDER (a prepared data folder with a scaling_fit.json)")
        if searched is not None:
            if args.json:
                write_json(searched, args.json)
            return 0
        workload, chinchilla = workload_from_args(args, job, cluster.hardware, _is_auto(args.hardware))
        if fits:  # what the run buys, beside what it costs: by the law of the model's own family
            print_prediction(_family_fit(args, fits, workload.model), args.data, law_params(workload.model),
                             workload.train_tokens, console)
        # A fine-tune: --finetune.method given, or a config that fine-tunes (a fine-tune run's own config.toml
        # names its base in finetune.source): planned as pretraining it would train, and save, every weight.
        if job.given("finetune.method") or job.cfg.finetune.source:
            return _finetune_plan(args, job.cfg, _pins(args, job), workload, cluster, console)
        if args.deadline is not None or args.budget is not None:
            return _deadline_plan(args, _pins(args, job), workload, cluster, prices, as_of, console)
        result = search(workload, cluster, _pins(args, job))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    hosts = cluster.nodes if cluster.hardware.kind == "cpu" else None
    # the whole wall, as the trainer's done line counts it: the steps, evaluations, samples and checkpoints
    walls = [predicted_wall(workload, c.plan, cluster, c.time.step, loop_settings(job.cfg, workload, c.plan))
             for c in result.ranked[: args.top]]
    costs = [training_cost(cluster.hardware.name, cluster.world_size, wall.total, prices, as_of, hosts)
             for wall in walls]
    print_report(console, workload, cluster, result, costs, chinchilla, args.top, walls)
    if walls and (note := evaluation_note(walls[0], loop_settings(job.cfg, workload, result.ranked[0].plan))):
        console.print(note)
    doc = {"workload": workload_dict(workload, chinchilla),
           "hardware": {"name": cluster.hardware.name, "devices_per_node": cluster.devices_per_node,
                        "nodes": cluster.nodes, "peak_flops": cluster.hardware.peak_flops,
                        "memory_bytes": cluster.hardware.memory_bytes, "utilisation": cluster.hardware.utilisation,
                        "utilisation_half_width": cluster.hardware.utilisation_half_width,
                        "attention_utilisation": cluster.hardware.attention_utilisation,
                        "utilisation_for_this_model": workload_utilisation(workload, cluster.hardware),
                        "utilisation_source": cluster.hardware.utilisation_source, "source": cluster.hardware.source},
           "plans": [plan_dict(c, workload, cost, wall) for c, cost, wall in zip(result.ranked[: args.top], costs,
                                                                                  walls)],
           "rejected": [c.as_dict() for c in result.rejected[: args.top]], "considered": result.considered}
    status = 0
    if not result.ranked:
        closest = result.rejected[0] if result.rejected else None
        if closest is None:
            print("error: no plan can be built for these degrees on this hardware", file=sys.stderr)
            return 2
        advice = what_would_fit(workload, closest.plan, cluster)
        doc["advice"] = advice
        print(f"error: nothing fits: the leanest plan ({closest.plan.label()}) {closest.reason}; {advice}",
              file=sys.stderr)
        status = 2
    if args.json:
        write_json(doc, args.json)
    if args.emit and result.ranked:
        best = result.ranked[0]

        predicted = PredictionConfig(plan=f"{best.plan.label()} on {cluster.describe()}", step_seconds=best.time.step,
                                     memory_bytes=float(best.memory.total),
                                     tokens_per_second=best.time.tokens_per_second)
        path = write_config(args.emit, workload, best.plan, cluster.hardware.kind,
                            header=f"written by `scaletrain plan` for {cluster.describe()}: {best.plan.label()}, "
                                   f"predicted {best.time.tokens_per_second:,.0f} tokens/s", prediction=predicted)
        console.print(f"wrote {path}")
    return status


def loop_settings(job: JobConfig, workload: Workload, plan: Plan, rows_per_example: int = 1) -> LoopSettings:
    """What the planned run does beside its steps: the job's [train] evaluation and sample settings and
    [checkpoint] interval (a --config's and the flags', else the defaults ``plan --emit`` writes), over the
    workload's steps, an evaluation batch being the plan's micro-batch (train.batch_size; a preference pair is two
    rows)."""
    rows = plan.micro_batch * (plan.microbatches if plan.pp > 1 else 1) * rows_per_example
    return LoopSettings.of_job(job, workload.steps, rows)


def _fits_of(args: argparse.Namespace) -> dict:
    """``--data``'s scaling fits by family ({'dense': (fit, document), 'moe8x2': ...}; scaling/family.py), {} without
    --data; ScalingFitError (one line) when it has none, or one is unreadable or from other data."""
    if not args.data:
        return {}
    from scaletrain.scaling.store import fitted_families, load_fit

    return {key: load_fit(args.data, key) for key in fitted_families(args.data) or ["dense"]}


def _family_fit(args: argparse.Namespace, fits: dict, model):
    """The fit of ``model``'s family (a law is one family's); ScalingFitError naming the command that makes it."""
    from scaletrain.scaling.family import family_key
    from scaletrain.scaling.store import load_fit

    key = family_key(model)
    return fits[key] if key in fits else load_fit(args.data, key)


def _deadline_plan(args: argparse.Namespace, pins: dict, workload, cluster, prices: dict, as_of: str, console) -> int:
    """``scaletrain plan --deadline H / --budget USD`` (plan/deadline.py): the options and the choice."""
    from rich.table import Table

    from scaletrain.plan.deadline import answer

    doc = answer(workload, cluster, pins, prices, as_of, args.deadline, args.budget, args.max_nodes)
    table = Table(title=f"{workload.train_tokens:,.0f} tokens on {cluster.hardware.name} (prices as of {as_of})")
    for col in ("devices", "nodes", "fastest plan", "hours", "on-demand $", "spot $"):
        table.add_column(col)
    for o in doc["options"]:
        table.add_row(str(o["devices"]), str(o["nodes"]), o["plan"], f"{o['hours']:,.2f}",
                      f"{o['on_demand_usd']:,.2f}", f"{o['spot_usd']:,.2f}")
    console.print(table)
    for pricing, pick in doc["choice"].items():
        what = pricing.replace("_", "-")
        if pick is None:
            console.print(f"{what}: no option meets the limit")
        else:
            console.print(f"{what}: {pick['devices']} device(s) ({pick['nodes']} node(s)), {pick['plan']}: "
                          f"{pick['hours']:,.2f} h, ${pick[pricing + '_usd']:,.2f}")
    if args.json:
        write_json(doc, args.json)
    if "error" in doc:
        print(f"error: {doc['error']}", file=sys.stderr)
        return 2
    return 0


def _finetune_plan(args: argparse.Namespace, job: JobConfig, pins: dict, workload, cluster, console) -> int:
    """``scaletrain plan --finetune.method=M``: the memory per device and step time of fine-tuning the job's
    [finetune] (its lora_rank, lora_targets, virtual_tokens, dora, objective, qlora_compile), and whether it fits."""
    from scaletrain.plan.finetune import finetune_answer, finetune_step_time, preference_step_time
    from scaletrain.plan.report import gib, human, mfu_text, optimizer_text, wall_text
    from scaletrain.train.validate import check_optimizer

    ft = job.finetune
    # the trainer's own rules for the optimizer of a fine-tune (muon_adapters: LoRA / QLoRA only)
    check_optimizer(JobConfig(model=workload.model, finetune=ft,
                              optim=OptimConfig(name=workload.optimizer, muon_adapters=workload.muon_adapters)))
    answer = finetune_answer(workload, cluster.hardware.memory_bytes, cluster.hardware.kind, ft,
                             pins.get("micro_batch"), pins.get("activation_checkpointing", "none"),
                             cluster.hardware.allocator)
    console.print(f"fine-tuning {workload.model.preset or 'the model'} ({human(answer['total_parameters'])} "
                  f"parameters) with {ft.method}: {answer['trainable_parameters']:,} trainable "
                  f"({100 * answer['trainable_parameters'] / answer['total_parameters']:.2f}%); optimizer "
                  f"{optimizer_text(workload)}")
    console.print(f"per device at micro-batch {answer['micro_batch']} x {answer['seq_len']} tokens: "
                  f"{gib(answer['per_device_bytes'])} = frozen base {gib(answer['frozen_bytes'])} + "
                  f"trainable states {gib(answer['trainable_state_bytes'])} + activations "
                  f"{gib(answer['activations'])} + loss / runtime; {cluster.hardware.name} has "
                  f"{gib(answer['device_memory_bytes'])}: " + ("fits" if answer["fits"] else "does NOT fit"))
    objective = objective_entry(ft.objective)
    if objective.pairs:  # plan/finetune.py preference_memory
        console.print(f"{ft.objective}: micro-batch {answer['micro_batch']} pairs = {answer['rows']} rows in one "
                      f"forward; reference {answer['reference']} ({gib(answer['reference_bytes'])} in the loss "
                      f"phase)")
    plan = Plan(dp_replicate=cluster.world_size, micro_batch=answer["micro_batch"],
                activation_checkpointing=pins.get("activation_checkpointing", "none"))
    timing = (preference_step_time(workload, plan, cluster, ft) if objective.pairs  # --global-batch counts pairs
              else finetune_step_time(workload, plan, cluster, ft))
    console.print(f"step time on {cluster.describe()}: {timing['step_seconds']:.3g} s "
                  f"({timing['tokens_per_second']:,.0f} tokens/s, MFU {mfu_text(timing['mfu'])})")
    loop = loop_settings(job, workload, plan, objective.rows_per_example)
    wall = predicted_wall(workload, plan, cluster, timing["step_seconds"], loop, ft)
    console.print(wall_text(wall))
    if note := evaluation_note(wall, loop):
        console.print(note)
    if timing.get("reference_seconds"):
        console.print(f"  of which the reference's no-grad forward (adapters off): {timing['reference_seconds']:.3g} s")
    if timing.get("reference_pass_seconds"):
        console.print(f"  the reference log-probs, computed once before training: "
                      f"{timing['reference_pass_seconds']:.3g} s a micro-batch of pairs over the data")
    if args.json:
        write_json({"finetune": {**answer, **timing, "optimizer": workload.optimizer,
                                 "muon_adapters": workload.muon_adapters, "wall": wall.as_dict()},
                    "hardware": cluster.hardware.name},
                   args.json)
    return 0 if answer["fits"] else 2


def add_doctor_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``scaletrain doctor``."""
    parser.add_argument("--json", default="", help="also write the report as JSON to this file ('-' = stdout)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="repeat the CPU microbenchmarks and keep the best of each (shared cores are noisy)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: one torch thread timed by process CPU time, for machines shared with other "
                             "jobs (the planner then uses these per-core rates when run with one thread)")


def run_doctor(args: argparse.Namespace) -> int:
    """Print what this machine is and measure it; the calibration file feeds ``plan --hardware auto``."""
    from rich.console import Console
    from rich.table import Table

    from scaletrain.plan.doctor import measure_machine

    console = Console(stderr=args.json == "-")
    if args.json and args.json != "-":  # before the measurements, not after them
        check_output_path(args.json, f"--json {args.json}")
    if args.rounds < 1:
        print(f"error: --rounds must be >= 1 (got {args.rounds})", file=sys.stderr)
        return 2
    if args.clock == "cpu":
        import torch

        torch.set_num_threads(1)
    try:
        report = measure_machine(log=lambda s: console.print(s), rounds=args.rounds, clock=args.clock)
    except ConfigError as exc:  # CalibrationError: a busy machine or a self-contradicting calibration
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if "system" in report:
        table = Table(title="This machine", show_header=False)
        for k, v in report["system"].items():
            if k.endswith("_bytes") and isinstance(v, (int, float)):
                v = f"{v / 2**30:.1f} GiB"
            table.add_row(k, str(v))
        console.print(table)
        console.print(f"calibration written to {report['calibration_file']}")
    if args.json:
        write_json(report, args.json)
    if "system" not in report:  # a rank of `torchrun ... doctor`: its measurement is saved and printed
        # Now and then (about 1 run in 5 on 2 gloo CPU ranks) a rank aborted in C++ teardown at interpreter exit,
        # after destroy_process_group ("terminate called without an active exception", SIGABRT), turning a
        # finished measurement into a failed launch. Nothing is left to do: leave without that teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry: ``python -m scaletrain.commands.plan {plan,doctor} ...``."""
    parser = argparse.ArgumentParser(prog="scaletrain")
    sub = parser.add_subparsers(dest="command", required=True)
    add_plan_arguments(sub.add_parser("plan", help="predict memory, time and cost; search the parallel plan"))
    add_doctor_arguments(sub.add_parser("doctor", help="describe and calibrate this machine"))
    args = parser.parse_args(argv)
    return run_plan(args) if args.command == "plan" else run_doctor(args)


if __name__ == "__main__":
    sys.exit(main())

