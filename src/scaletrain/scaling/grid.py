"""The grid of short runs behind a scaling fit: a width/depth family of our decoder x a ladder of token counts,
sized to a time budget with the planner's own step-time prediction, each run through the ``Trainer``.

Family: head_dim 16, SwiGLU (8/3 d), untied embeddings, depth growing slowly with the width (Kaplan et al.
found the loss insensitive to the shape at a fixed non-embedding size, so one path through (width, depth) is
enough). Learning rate: muP (model/mup.py) with base width 128 and lr 2e-3, the transfer point
benchmarks/mup.py measured (its best lr moved 1.0x from width 128 to 512 under muP, 2.7x under the standard
parametrization): one lr for every size instead of a per-size sweep the budget cannot pay for. Each run has
its own cosine schedule ending at its own last step (Hoffmann et al.: a schedule longer than the run
overestimates its loss), warmup 5% of its steps.

A run's folder holds ``scale_run.json`` once it finished (its N, D, val_bpb, wall time, predicted time and the
fingerprint of the data it trained on); a grid started again skips those runs and restarts the unfinished one
from scratch (they are minutes long). A record that cannot be read, holds a value no run has, or was trained on
other data is refused in one line naming its file: it is never dropped or fitted without a word.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from scaletrain.config import ConfigError, ModelConfig, load_config, read_toml
from scaletrain.core.files import write_file
from scaletrain.data.shards import read_manifest
from scaletrain.plan.hardware_spec import parse_hardware
from scaletrain.plan.timing import step_time
from scaletrain.plan.workload import Plan, Workload
from scaletrain.scaling.family import MoEShape
from scaletrain.scaling.fit import law_params
from scaletrain.scaling.store import data_fingerprint

# (dim, n_layers) of the family, smallest first; heads = dim / HEAD_DIM
FAMILY = ((32, 2), (48, 2), (64, 2), (80, 3), (96, 3), (128, 3), (160, 4), (192, 4), (256, 5), (320, 6))
HEAD_DIM = 16
SEQ_LEN = 64
BATCH = 16  # sequences a step: 1,024 tokens
EVAL_BATCHES = 20  # the final evaluation: 20 x 16 x 64 = 20k held-out tokens, the same windows in every run
LR, MUP_BASE_WIDTH = 2e-3, 128  # benchmarks/mup.py's transfer point (see the module docstring)
SIZES, TOKEN_STEPS, TOKEN_RATIO = 4, 3, 2.5  # 4 sizes x 3 token counts, each 2.5x the last
MIN_STEPS = 30
MIN_TOKENS_PER_PARAM = 1.0  # at the grid's corner (largest model, fewest tokens): below it the run is all warmup
# Up to 4 epochs of repeated data train about as well as unique data (Muennighoff et al. 2023); more changes the law
MAX_EPOCHS = 4
RESULT = "scale_run.json"


@dataclass
class GridRun:
    """One run of the grid: its shape, tokens, non-embedding parameters and predicted seconds."""

    name: str
    dim: int
    n_layers: int
    tokens: int
    steps: int
    params: int  # N of the fit: non-embedding parameters (``law_params``; active ones of an MoE)
    predicted_seconds: float
    moe: str = ""  # '' dense, else the family's EXPERTSxTOPK ('8x2': scaling/family.py)

    @property
    def shape(self) -> MoEShape | None:
        return MoEShape.parse(self.moe)

    @property
    def flops(self) -> float:
        return 6.0 * self.params * self.tokens


def model_config(dim: int, n_layers: int, vocab_size: int, moe: MoEShape | None = None) -> ModelConfig:
    """A member of the family (the fields the trainer's [model] section takes); ``moe``: its mixture-of-experts
    member (every feed-forward routed, the active width kept: scaling/family.py)."""
    cfg = ModelConfig(vocab_size=vocab_size, dim=dim, n_layers=n_layers, n_heads=dim // HEAD_DIM, ffn_hidden_dim=0,
                      multiple_of=16, max_seq_len=SEQ_LEN, parametrization="mup", mup_base_width=MUP_BASE_WIDTH)
    return cfg if moe is None else moe.apply(cfg)


def predicted_seconds(model: ModelConfig, steps: int, hardware: str = "auto") -> float:
    """The planner's time for ``steps`` steps plus the final evaluation (a forward: ~1/3 of a step) on one
    device of ``hardware`` (``auto``: this machine, calibrated by ``scaletrain doctor``)."""
    cluster = parse_hardware(hardware, count=1)
    workload = Workload(model, SEQ_LEN, BATCH, float(steps * BATCH * SEQ_LEN), "fp32")
    step = step_time(workload, Plan(micro_batch=BATCH), cluster).step
    return step * (steps + EVAL_BATCHES / 3)


def vocabulary(data_dir: str | Path) -> tuple[int, int]:
    """(vocab size, training tokens) of a prepared data folder."""
    manifest = read_manifest(data_dir, verify=False)
    return int(manifest["vocab_size"]), int(manifest["splits"]["train"]["tokens"])


class BudgetTooSmall(ConfigError):
    """No grid fits the budget; ``smallest`` is the least budget one fits in (seconds, the planner's prediction;
    inf when the training split is too small for any grid at that corner ratio)."""

    def __init__(self, message: str, smallest: float):
        super().__init__(message)
        self.smallest = smallest


def plan_grid(data_dir: str | Path, budget_seconds: float, hardware: str = "auto",
              min_tokens_per_param: float = MIN_TOKENS_PER_PARAM,
              say: Callable[[str], None] | None = None, moe: MoEShape | None = None) -> list[GridRun]:
    """The largest grid (SIZES consecutive family members x TOKEN_STEPS token counts) whose predicted total fits
    the budget, with at least ``min_tokens_per_param`` for the largest model at the smallest token count and no
    run longer than ``MAX_EPOCHS`` epochs of the training split. ``say`` is told, in one line, when the data and
    not the budget is what limits the grid (a budget that would buy longer runs or larger models)."""
    vocab, train_tokens = vocabulary(data_dir)
    per_step = BATCH * SEQ_LEN
    smallest = math.inf  # the least budget any grid of the family fits in (said when the budget is too small)
    data_capped = False  # a grid the budget affords was cut (fewer tokens, or smaller sizes) by MAX_EPOCHS
    for start in range(len(FAMILY) - SIZES, -1, -1):
        shapes = FAMILY[start: start + SIZES]
        models = [model_config(d, L, vocab, moe) for d, L in shapes]
        n_max = max(law_params(m) for m in models)
        ladder = [TOKEN_RATIO ** j for j in range(TOKEN_STEPS)]
        # seconds per step of each size (planner), so the budget fixes the smallest token count directly
        per_step_s = [predicted_seconds(m, 1, hardware) - predicted_seconds(m, 0, hardware) for m in models]
        fixed = sum(predicted_seconds(m, 0, hardware) for m in models) * TOKEN_STEPS
        budget_steps = (budget_seconds - fixed) / (sum(per_step_s) * sum(ladder))
        most_steps = MAX_EPOCHS * train_tokens / per_step / ladder[-1]
        base_steps = min(budget_steps, most_steps)
        least_steps = max(MIN_STEPS, min_tokens_per_param * n_max / per_step)  # MIN_STEPS, and the corner's tokens
        # the budget affords this grid but the epochs cut it: to fewer tokens (chosen below) or away (too small)
        data_capped = data_capped or least_steps <= budget_steps and most_steps < budget_steps
        if base_steps >= least_steps:
            runs = [make_run(d, L, vocab, int(base_steps * r), hardware, moe) for d, L in shapes for r in ladder]
            if data_capped and say is not None:
                say(data_cap_line(data_dir, train_tokens, runs, budget_seconds))
            return runs
        if least_steps <= most_steps:
            smallest = min(smallest, fixed + least_steps * sum(per_step_s) * sum(ladder))
    where = "this machine" if hardware == "auto" else hardware
    need = (f"; the smallest grid needs --budget {math.ceil(smallest)}s on {where} (the planner's prediction)"
            if math.isfinite(smallest) else
            f"; the training split is too small for any grid at --min-tokens-per-param {min_tokens_per_param:g}")
    raise BudgetTooSmall(f"--budget {budget_seconds:g} s is too small for a grid of {SIZES} sizes x {TOKEN_STEPS} "
                         f"token counts of at least {MIN_STEPS} steps each on {where}{need}", smallest)


def data_cap_line(data_dir: str | Path, train_tokens: int, runs: list[GridRun], budget_seconds: float) -> str:
    """The line that says the data, not the budget, sized this grid (and what would lift it)."""
    total = sum(r.predicted_seconds for r in runs)
    return (f"the data caps this grid, not the budget: {data_dir}'s training split has {train_tokens:,} tokens and "
            f"no run reads it more than {MAX_EPOCHS} times (more repeats change the law), so the grid is predicted "
            f"{total / 60:.1f} min of the {budget_seconds / 60:,.0f} min budget; prepare more text for longer runs "
            f"or larger models")


def make_run(dim: int, n_layers: int, vocab_size: int, steps: int, hardware: str = "auto",
             moe: MoEShape | None = None) -> GridRun:
    """A run of the family: ``dim`` x ``n_layers`` for ``steps`` steps, with the planner's predicted time."""
    model = model_config(dim, n_layers, vocab_size, moe)
    tokens = steps * BATCH * SEQ_LEN
    prefix = f"{moe.key}-" if moe else ""
    return GridRun(f"{prefix}d{dim}-l{n_layers}-t{tokens}", dim, n_layers, tokens, steps,
                   law_params(model), predicted_seconds(model, steps, hardware),
                   moe.spec if moe else "")


def run_overrides(run: GridRun, data_dir: str | Path, run_dir: Path, threads: int = 0) -> dict[str, str]:
    """The job of one grid run, as the dotted overrides ``scaletrain train`` takes."""
    over = {"model.dim": run.dim, "model.n_layers": run.n_layers, "model.n_heads": run.dim // HEAD_DIM,
            "model.ffn_hidden_dim": 0, "model.multiple_of": 16, "model.max_seq_len": SEQ_LEN,
            "model.parametrization": "mup", "model.mup_base_width": MUP_BASE_WIDTH, "model.tie_embeddings": "false",
            "data.path": str(data_dir), "data.seq_len": SEQ_LEN, "train.batch_size": BATCH,
            "train.steps": run.steps, "train.eval_interval": 0, "train.eval_batches": EVAL_BATCHES,
            "train.sample_tokens": 0, "train.precision": "fp32", "train.compile": "false", "optim.lr": LR,
            "schedule.name": "cosine", "schedule.warmup_steps": max(1, run.steps // 20), "schedule.min_lr": LR / 10,
            "checkpoint.enabled": "false", "logging.progress": "off", "logging.tensorboard": "false",
            "train.run_dir": str(run_dir), "train.overwrite": "true"}
    if threads:
        over["train.threads"] = threads
    if run.shape is not None:
        over.update(run.shape.overrides(model_config(run.dim, run.n_layers, 0)))
    return {k: str(v) for k, v in over.items()}


def finished(run_dir: Path, data_dir: str | Path | None = None) -> dict | None:
    """The recorded result of a finished run, or None when it has not finished (no ``scale_run.json``).

    ConfigError, one line naming the file, when the record cannot be read (a truncated write), lacks a field the
    fit reads or holds a value no run has (``check_record``), or, given ``data_dir``, was trained on other data
    (``check_record_data``): a fit silently made of fewer runs, or of another folder's, is a fit changed without
    a word."""
    path = run_dir / RESULT
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: not a readable run record ({exc}); delete {run_dir} to train that run "
                          f"again, or restore the file") from None
    check_record(record, path)
    if data_dir is not None:
        check_record_data(record, path, data_dir)
    return record


_POSITIVE = ("dim", "n_layers", "tokens", "val_bpb")  # what the fit reads (N from dim x n_layers, D, L)
_NON_NEGATIVE = ("seconds", "predicted_seconds")  # stored with the fit


def check_record(record: object, path: Path) -> None:
    """ConfigError naming ``path`` and the field when a run record is not one ``train_run`` could have written."""
    again = f"delete {path.parent} to train that run again"
    if not isinstance(record, dict):
        raise ConfigError(f"{path}: not a run record (a JSON object expected, got {type(record).__name__}); {again}")
    if not isinstance(record.get("name"), str):
        raise ConfigError(f"{path}: name must be a string (got {record.get('name')!r}); {again}")
    if not isinstance(record.get("moe", ""), str):
        raise ConfigError(f"{path}: moe must be '' or EXPERTSxTOPK like '8x2' (got {record.get('moe')!r}); {again}")
    for key in (*_POSITIVE, *_NON_NEGATIVE):
        value = record.get(key)
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        whole = key in ("dim", "n_layers")
        if not number or (whole and not isinstance(value, int)) or not (value > 0 if key in _POSITIVE else
                                                                         value >= 0):
            rule = "a positive integer" if whole else "a finite number " + ("> 0" if key in _POSITIVE else ">= 0")
            raise ConfigError(f"{path}: {key} must be {rule} (got {value!r}); {again}")


def check_record_data(record: dict, path: Path, data_dir: str | Path) -> None:
    """ConfigError when the run was trained on other data than ``data_dir`` (by content fingerprint: the one
    ``scaling_fit.json`` is stamped with), or when nothing says what it was trained on. A record without its
    own fingerprint (written before runs recorded one) is judged by its folder's config.toml ``data.path``."""
    want = data_fingerprint(data_dir)
    have = record.get("data_fingerprint")
    if have is None:
        have = _config_data_fingerprint(path.parent)
    if have is None:
        raise ConfigError(f"{path} does not say which data it was trained on (no data_fingerprint, and no prepared "
                          f"folder at its config.toml's data.path): delete {path.parent} to train that run again "
                          f"on {data_dir}")
    if have != want:
        raise ConfigError(f"{path} was trained on other data (fingerprint {have}; {data_dir}'s is {want}): a fit "
                          f"does not transfer across data or tokenizers; give the data folder that grid was "
                          f"trained on, or another --out to train a grid on {data_dir}")


def _config_data_fingerprint(run_dir: Path) -> str | None:
    """The fingerprint of the folder a run's config.toml names as data.path; None when that is not known."""
    try:
        return data_fingerprint(read_toml(run_dir / "config.toml")["data"]["path"])
    except (OSError, ValueError, KeyError, TypeError, ConfigError):
        return None


def train_run(run: GridRun, data_dir: str | Path, out: Path, threads: int = 0) -> dict:
    """Train one grid run through the ``Trainer`` (the normal training entry point) and record its result. A
    Ctrl-C (the trainer's graceful stop) is a KeyboardInterrupt here, as in every command (exit 130), not a run
    that failed; the run folder's lock is freed however the run ends."""
    from scaletrain.train.preemption import INTERRUPTED
    from scaletrain.train.trainer import Trainer, TrainingError

    run_dir = out / run.name
    t0 = time.perf_counter()
    trainer = Trainer(load_config(None, run_overrides(run, data_dir, run_dir, threads)), log=True)
    try:
        summary = trainer.train()
    finally:
        trainer.close()  # train() frees it only on success: a second Ctrl-C or an error would keep it held
    if summary["preempted"] == INTERRUPTED:
        raise KeyboardInterrupt
    if summary["preempted"]:
        raise TrainingError(f"{run_dir}: stopped ({summary['preempted']}) before its end; run the same command "
                            f"again to train it from the start")
    bpb = summary.get("final_val_bpb")
    record = {**asdict(run), "flops": run.flops, "val_bpb": bpb, "val_loss": summary.get("final_val_loss"),
              "seconds": time.perf_counter() - t0, "data_fingerprint": data_fingerprint(data_dir)}
    if bpb is None or not math.isfinite(bpb):
        raise ConfigError(f"{run_dir}: the run ended without a finite val_bpb (got {bpb}); see its metrics.jsonl")
    write_file(run_dir / RESULT, json.dumps(record, indent=1))  # renamed into place: no half a record
    return record


def run_grid(runs: list[GridRun], data_dir: str | Path, out: Path, say: Callable[[str], None],
             threads: int = 0) -> list[dict]:
    """Train every run not finished yet; returns the records of all finished runs (in grid order)."""
    records = []
    for i, run in enumerate(runs, 1):
        done = finished(out / run.name, data_dir)
        if done is not None:
            say(f"[{i}/{len(runs)}] {run.name}: finished before (val bpb {done['val_bpb']:.4f}), skipped")
        else:
            say(f"[{i}/{len(runs)}] {run.name}: training ({run.steps} steps, predicted "
                f"{run.predicted_seconds:.0f} s)")
            done = train_run(run, data_dir, out, threads)
            say(f"[{i}/{len(runs)}] {run.name}: val bpb {done['val_bpb']:.4f} in {done['seconds']:.0f} s")
        records.append(done)
    return records


def finished_records(out: Path, data_dir: str | Path | None = None, moe: str = "") -> list[dict]:
    """Every finished run of the family ``moe`` ('' dense, '8x2') under ``out`` (a grid folder), whatever grid it
    came from; given ``data_dir``, every one must have been trained on that data (``finished``). The other
    family's runs in the same folder are not this fit's (a law is one family's)."""
    records = [r for r in (finished(p, data_dir) for p in sorted(out.iterdir()) if p.is_dir()) if r is not None] \
        if out.is_dir() else []
    return [r for r in records if r.get("moe", "") == moe]
