"""Preference tuning: ``finetune.objective = dpo | simpo | orpo`` on preference pairs (data/preferences.py).

Every micro-batch of B pairs is (2B, T) rows, chosen then rejected, through one forward. A row's log-probability
log pi(y | x) is the sum of its completion tokens' log-probabilities (``sequence_logps``); the objectives
compare the chosen and rejected sums of each pair:

- DPO (Rafailov et al. 2023), with a reference model pi_ref and beta: the implicit rewards are
  r = beta * (log pi(y|x) - log pi_ref(y|x)), and ``finetune.dpo_loss`` picks the loss on d = (log-ratio of
  chosen) - (log-ratio of rejected), as TRL's ``DPOTrainer`` has them:
  ``sigmoid``: -(1 - e) log s(beta d) - e log s(-beta d), with e = finetune.label_smoothing (conservative DPO;
  e = 0 is the paper's loss and TRL's "sigmoid"); ``robust`` (rDPO, TRL's "robust"): the unbiased
  label-noise estimator ((1 - e) (-log s(beta d)) - e (-log s(-beta d))) / (1 - 2e); ``ipo`` (Azar et al. 2023,
  TRL's normalisation): (d_avg - 1 / (2 beta))^2 with each log-ratio divided by its completion's tokens.
- SimPO (Meng et al. 2024), no reference: rewards beta * the mean token log-probability, loss
  -log s(r_chosen - r_rejected - gamma) (TRL's CPO with loss_type="simpo"; label smoothing as there).
- ORPO (Hong et al. 2024), no reference: the chosen completions' mean token NLL minus beta * mean log s(log odds
  ratio), the odds of each completion from its mean token probability (TRL's ORPO ``odds_ratio_loss``);
  rewards beta * the mean token log-probability. Unlike TRL, whose NLL term also scores the prompt, ours
  scores the completion only, as every fine-tuning loss here.

The reference for DPO costs no copy of the model: with LoRA / DoRA / QLoRA it is the same model with its
adapters switched off (``adapters_disabled``) for one no-grad forward of the same rows; with full fine-tuning
the reference log-probabilities of every pair are computed once from the base before training (in fp32,
after the base is loaded and before any checkpoint is), stored in the run folder (``reference_logps.pt``) and
read back on a resume, so a resumed run uses the very same numbers.

``PreferenceObjective`` is installed on a ``ParallelModel`` as distillation's ``Distiller`` is: its ``loss``
is ``pm.objective_loss`` (train/loss.py, set by finetune/objectives.py's entry), a forward pre-hook keeps the
batch's token ids for the reference. It keeps the
rewards, margin and accuracy of the pairs it scores, training and evaluation apart, for the trainer's log
(``preference_metrics``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from scaletrain.config import ConfigError, FinetuneConfig, JobConfig
from scaletrain.core.files import file_sha256
from scaletrain.data.preferences import pair_rows, read_preferences
from scaletrain.data.tokenizer import DataError, load_tokenizer
from scaletrain.finetune.base import open_base
from scaletrain.finetune.lora import adapters_disabled
from scaletrain.finetune.method_table import method_entry
from scaletrain.model.loss import CHUNK_BYTES
from scaletrain.parallel.tensor import mask_padding

DPO_LOSSES = ("sigmoid", "robust", "ipo")
REFERENCE_FILE = "reference_logps.pt"
IGNORE = -100


def sequence_logps(logits: torch.Tensor, targets: torch.Tensor,
                   vocab_limit: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (N, T, V), targets (N, T) with -100 where nothing is scored -> (the summed log-probability of
    each row's targets (N,), fp32; the number of targets of each row (N,))."""
    if vocab_limit is not None and vocab_limit < logits.size(-1):
        logits = mask_padding(logits, vocab_limit)
    per_token = -F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none",
                                 ignore_index=IGNORE).view(targets.shape)  # (N, T), 0 where ignored
    return per_token.sum(-1), (targets != IGNORE).sum(-1)


# A pair whose two rewards differ by no more than this share of the log-probabilities they are computed from is a
# tie (``PairScores.ties``): at DPO's first step the policy is the reference, and a full fine-tune's stored fp32
# reference, scored in other batches, differs from the policy's own forward by rounding (rewards ~1e-7 on
# log-probabilities ~-50); 1e-5 is ~100 fp32 roundings (eps 1.2e-7) of those sums, far below what one step moves.
TIE_TOLERANCE = 1e-5


@dataclass
class PairScores:
    """One micro-batch's pairs: the loss to minimise and, per pair, the rewards that are logged, with the scale
    of what each pair's two rewards were computed from (beta x the |log-probabilities| entering them)."""

    loss: torch.Tensor  # scalar
    chosen_rewards: torch.Tensor  # (B,)
    rejected_rewards: torch.Tensor  # (B,)
    reward_scale: torch.Tensor  # (B,)

    def ties(self) -> torch.Tensor:
        """(B,) bool: the pairs whose reward margin is within rounding of their scale (``TIE_TOLERANCE``): neither
        won nor lost, where the sign of a 1e-7 margin would count half of them as won."""
        margin = (self.chosen_rewards - self.rejected_rewards).double().abs()
        return margin <= TIE_TOLERANCE * self.reward_scale.double()

    def wins(self) -> torch.Tensor:
        """(B,) bool: the pairs whose chosen reward is higher, ties aside (TRL's ``rewards/accuracies`` counts
        ``chosen > rejected``: an exact tie is no win there either)."""
        return (self.chosen_rewards > self.rejected_rewards) & ~self.ties()


def dpo_loss(chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor,
             beta: float, loss_type: str = "sigmoid", label_smoothing: float = 0.0,
             chosen_tokens: torch.Tensor | None = None, rejected_tokens: torch.Tensor | None = None) -> PairScores:
    """DPO and its variants (module docstring) on per-pair summed log-probabilities (B,) of the policy and
    the reference; ``*_tokens`` (B,): the completions' token counts (IPO's normalisation)."""
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    delta = chosen_ratio - rejected_ratio  # (B,)
    e = label_smoothing
    if loss_type == "sigmoid":
        losses = -(1 - e) * F.logsigmoid(beta * delta) - e * F.logsigmoid(-beta * delta)
    elif loss_type == "robust":
        losses = (-(1 - e) * F.logsigmoid(beta * delta) + e * F.logsigmoid(-beta * delta)) / (1 - 2 * e)
    elif loss_type == "ipo":
        average = chosen_ratio / chosen_tokens.clamp(min=1) - rejected_ratio / rejected_tokens.clamp(min=1)
        losses = (average - 1 / (2 * beta)) ** 2
    else:
        raise ConfigError(f"finetune.dpo_loss must be one of {', '.join(DPO_LOSSES)} (got {loss_type!r})")
    scale = beta * (chosen.abs() + ref_chosen.abs() + rejected.abs() + ref_rejected.abs()).detach()
    return PairScores(losses.mean(), beta * chosen_ratio.detach(), beta * rejected_ratio.detach(), scale)


def simpo_loss(chosen: torch.Tensor, rejected: torch.Tensor, chosen_tokens: torch.Tensor,
               rejected_tokens: torch.Tensor, beta: float, gamma: float, label_smoothing: float = 0.0) -> PairScores:
    """SimPO: length-normalised log-probabilities, a target margin ``gamma``, no reference."""
    chosen_avg, rejected_avg = chosen / chosen_tokens.clamp(min=1), rejected / rejected_tokens.clamp(min=1)
    logits = chosen_avg - rejected_avg - gamma / beta
    e = label_smoothing
    losses = -F.logsigmoid(beta * logits) * (1 - e) - F.logsigmoid(-beta * logits) * e
    return _average_rewards(losses.mean(), chosen_avg, rejected_avg, beta)


def _average_rewards(loss: torch.Tensor, chosen_avg: torch.Tensor, rejected_avg: torch.Tensor,
                     beta: float) -> PairScores:
    """SimPO's and ORPO's scores: rewards beta x the mean token log-probabilities (B,)."""
    chosen, rejected = beta * chosen_avg.detach(), beta * rejected_avg.detach()
    return PairScores(loss, chosen, rejected, chosen.abs() + rejected.abs())


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurate at both ends (Maechler 2012)."""
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def orpo_loss(chosen: torch.Tensor, rejected: torch.Tensor, chosen_tokens: torch.Tensor,
              rejected_tokens: torch.Tensor, beta: float) -> PairScores:
    """ORPO: the chosen completions' token-mean NLL minus beta * mean log s(log odds ratio), no reference."""
    chosen_avg, rejected_avg = chosen / chosen_tokens.clamp(min=1), rejected / rejected_tokens.clamp(min=1)
    log_odds = (chosen_avg - rejected_avg) - (log1mexp(chosen_avg) - log1mexp(rejected_avg))
    nll = -chosen.sum() / chosen_tokens.sum().clamp(min=1)
    loss = nll - beta * F.logsigmoid(log_odds).mean()
    return _average_rewards(loss, chosen_avg, rejected_avg, beta)


def reference_rows(vocab: int, seq_len: int, rows: int) -> int:
    """How many rows a no-grad scoring pass sends through the head at once: their fp32 logits within
    ``CHUNK_BYTES`` (at least one row), so a large vocabulary's logits are never all held (8 rows of 1024
    tokens of Qwen3's 151,936 would be 5 GB, twice with their log-softmax)."""
    return min(rows, max(1, CHUNK_BYTES // (4 * vocab * seq_len)))


@torch.no_grad()
def scored_logps(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, attn_mask: torch.Tensor | None,
                 vocab_limit: int | None, whole: bool) -> torch.Tensor:
    """Each row's summed target log-probability (N,) without a gradient: on a model held whole (``whole``: no
    FSDP shards) the blocks run once and the head by ``reference_rows`` rows at a time."""
    if not whole:
        return sequence_logps(model(inputs, attn_mask=attn_mask), targets, vocab_limit)[0]
    hidden = model(inputs, attn_mask=attn_mask, hidden_only=True)  # (N, T, d)
    step = reference_rows(model.cfg.vocab_size, targets.size(1), len(targets))
    return torch.cat([sequence_logps(model.head(hidden[i:i + step]), targets[i:i + step], vocab_limit)[0]
                      for i in range(0, len(targets), step)])


def row_key(inputs: torch.Tensor, targets: torch.Tensor) -> str:
    """The identity of one padded row (its input ids and targets): what a stored reference log-prob belongs to."""
    digest = hashlib.blake2b(inputs.cpu().numpy().tobytes(), digest_size=16)
    digest.update(targets.cpu().numpy().tobytes())
    return digest.hexdigest()


class PrecomputedReference:
    """Full fine-tuning's reference: the base's log-probability of every row of every pair, computed once and
    looked up by the row's content (so any order, rank slice or resume finds its own)."""

    def __init__(self, table: dict[str, float]):
        self.table = table

    @classmethod
    def build(cls, model: nn.Module, rows: list[tuple[torch.Tensor, torch.Tensor]], batch_size: int,
              device: torch.device, vocab_limit: int | None, whole: bool) -> PrecomputedReference:
        """One no-grad fp32 pass of ``model`` (the base) over ``rows`` [(inputs (T,), targets (T,))]."""
        table: dict[str, float] = {}
        mode = model.training
        model.eval()
        with torch.no_grad():
            for start in range(0, len(rows), batch_size):
                chunk = rows[start:start + batch_size]
                inputs = torch.stack([r[0] for r in chunk]).to(device)
                targets = torch.stack([r[1] for r in chunk]).to(device)
                logps = scored_logps(model, inputs, targets, None, vocab_limit, whole)
                for (row_inputs, row_targets), value in zip(chunk, logps.tolist()):
                    table[row_key(row_inputs, row_targets)] = value
        model.train(mode)
        return cls(table)

    def save(self, path: Path, fingerprint: dict) -> None:
        keys = sorted(self.table)
        torch.save({"fingerprint": fingerprint, "keys": keys,
                    "logps": torch.tensor([self.table[k] for k in keys], dtype=torch.float64)}, path)

    @classmethod
    def load(cls, path: Path, fingerprint: dict) -> PrecomputedReference | None:
        """The stored table when it was computed for ``fingerprint`` (the same base, data and rows), else None."""
        if not path.is_file():
            return None
        stored = torch.load(path, weights_only=True)
        if stored.get("fingerprint") != fingerprint:
            return None
        return cls(dict(zip(stored["keys"], stored["logps"].tolist())))

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        try:
            values = [self.table[row_key(i, t)] for i, t in zip(inputs, targets)]
        except KeyError:
            raise DataError(f"a preference row has no stored reference log-probability ({REFERENCE_FILE}); the "
                            f"data changed since it was computed: start a new run folder") from None
        return torch.tensor(values, dtype=torch.float32, device=targets.device)


class PreferenceObjective:
    """The preference loss installed on a ``ParallelModel`` (single part: data parallelism only)."""

    def __init__(self, pm, ft: FinetuneConfig, score: PairScore, reference: PrecomputedReference | None = None):
        self.ft, self.score, self.reference = ft, score, reference
        self.model = pm.modules[0]
        self.vocab_limit = pm.vocab_limit
        self.whole = held_whole(pm)
        self.inputs: tuple | None = None
        # [sum of chosen rewards, rejected rewards, wins, chosen log-probs, rejected log-probs, pairs, ties]
        self.sums = {"train": torch.zeros(7, dtype=torch.float64), "eval": torch.zeros(7, dtype=torch.float64)}
        pm.parts[0].register_forward_pre_hook(self._keep_inputs, with_kwargs=True)
        pm.preference = self  # its rewards, for ``preference_metrics``

    def _keep_inputs(self, _module, args, kwargs):
        self.inputs = (args[0], kwargs.get("attn_mask"))

    def reference_logps(self, targets: torch.Tensor) -> torch.Tensor:
        """The reference's log-probabilities of this micro-batch's rows (2B,): stored, or the adapter-free model's."""
        inputs, attn_mask = self.inputs
        if self.reference is not None:
            return self.reference(inputs, targets)
        with adapters_disabled(self.model):  # the base: LoRA / DoRA / QLoRA without adapters
            return scored_logps(self.model, inputs, targets, attn_mask, self.vocab_limit, self.whole)

    def scores(self, logps: torch.Tensor, tokens: torch.Tensor, targets: torch.Tensor) -> PairScores:
        """The objective on one (2B, T) micro-batch from its rows' summed log-probabilities and target counts
        (2B,) (``sequence_logps``)."""
        return self.score(self, *logps.chunk(2), *tokens.chunk(2), targets)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logps, tokens = sequence_logps(logits, targets, self.vocab_limit)
        scored = self.scores(logps, tokens, targets)
        c, r = scored.chosen_rewards.double(), scored.rejected_rewards.double()
        chosen, rejected = logps.detach().double().chunk(2)
        row = torch.stack([c.sum(), r.sum(), scored.wins().double().sum(), chosen.sum(), rejected.sum(),
                           torch.tensor(float(len(c)), dtype=torch.float64, device=c.device),
                           scored.ties().double().sum()])
        self.sums["train" if self.model.training else "eval"] += row.cpu()
        return scored.loss

    def pop_metrics(self, mode: str) -> dict:
        """The means over the pairs scored in ``mode`` since the last call (over every data-parallel rank), then
        reset; {} when none were."""
        sums, self.sums[mode] = self.sums[mode], torch.zeros(7, dtype=torch.float64)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            device = next(self.model.parameters()).device
            sums = sums.to(device)
            dist.all_reduce(sums)
            sums = sums.cpu()
        if sums[5] == 0:
            return {}
        c, r, acc, lc, lr, n, ties = (float(v) for v in sums)
        prefix = "" if mode == "train" else "val_"
        return {f"{prefix}reward_chosen": c / n, f"{prefix}reward_rejected": r / n,
                f"{prefix}reward_margin": (c - r) / n, f"{prefix}reward_accuracy": acc / n,
                f"{prefix}reward_ties": ties / n, f"{prefix}logps_chosen": lc / n, f"{prefix}logps_rejected": lr / n}


# (objective, chosen, rejected log-probs (B,), their target counts (B,), the (2B, T) targets) -> the pairs' scores:
# the loss of one preference objective (finetune/objectives.py's entries name theirs).
PairScore = Callable[["PreferenceObjective", torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                     PairScores]


def dpo_scores(objective: PreferenceObjective, chosen: torch.Tensor, rejected: torch.Tensor,
               chosen_tokens: torch.Tensor, rejected_tokens: torch.Tensor, targets: torch.Tensor) -> PairScores:
    """DPO against the reference's log-probabilities of the same rows."""
    ft = objective.ft
    ref_chosen, ref_rejected = objective.reference_logps(targets).chunk(2)
    return dpo_loss(chosen, rejected, ref_chosen, ref_rejected, ft.beta, ft.dpo_loss, ft.label_smoothing,
                    chosen_tokens, rejected_tokens)


def simpo_scores(objective: PreferenceObjective, chosen: torch.Tensor, rejected: torch.Tensor,
                 chosen_tokens: torch.Tensor, rejected_tokens: torch.Tensor, targets: torch.Tensor) -> PairScores:
    ft = objective.ft
    return simpo_loss(chosen, rejected, chosen_tokens, rejected_tokens, ft.beta, ft.simpo_gamma, ft.label_smoothing)


def orpo_scores(objective: PreferenceObjective, chosen: torch.Tensor, rejected: torch.Tensor,
                chosen_tokens: torch.Tensor, rejected_tokens: torch.Tensor, targets: torch.Tensor) -> PairScores:
    return orpo_loss(chosen, rejected, chosen_tokens, rejected_tokens, objective.ft.beta)


def held_whole(pm) -> bool:
    """Whether this rank holds the model whole as plain tensors (its head can be called alone)."""
    return not pm.sharded and pm.pipeline is None and hasattr(pm.modules[0], "head")


def preference_metrics(pm, mode: str) -> dict:
    """The rewards, margin and accuracy of the pairs scored since the last call (``PreferenceObjective``), or {}
    for a run without a preference objective. Collective over data-parallel ranks: every rank calls it."""
    objective = getattr(pm, "preference", None)
    return {} if objective is None else objective.pop_metrics(mode)


def reference_fingerprint(cfg: JobConfig) -> dict:
    """What the stored reference log-probabilities depend on: the base's weights, the pairs and how they are
    rendered into rows."""
    ft = cfg.finetune
    return {"base": open_base(ft.source).sha256, "preferences": file_sha256(Path(ft.preferences)),
            "seq_len": cfg.data.seq_len, "chat_template": ft.chat_template, "tokenizer": cfg.data.tokenizer}


def precomputed_reference(pm, cfg: JobConfig, say=print) -> PrecomputedReference:
    """Full fine-tuning's reference table: read from the run folder when it was stored for this base and data
    (a resume), else computed from the model as it is now (the base, just loaded) and stored (rank 0)."""
    path = Path(cfg.train.run_dir) / REFERENCE_FILE
    fingerprint = reference_fingerprint(cfg)
    stored = PrecomputedReference.load(path, fingerprint)
    if stored is not None:
        say(f"DPO reference: {len(stored.table)} log-probabilities read from {path}")
        return stored
    pairs = read_preferences(cfg.finetune.preferences, load_tokenizer(Path(cfg.data.tokenizer)), cfg.data.seq_len,
                             cfg.finetune.chat_template)
    ci, ct, ri, rt = pair_rows(pairs, cfg.data.seq_len)
    rows = list(zip(torch.cat([ci, ri]), torch.cat([ct, rt])))
    reference = PrecomputedReference.build(pm.modules[0], rows, 2 * cfg.train.batch_size, pm.device, pm.vocab_limit,
                                           held_whole(pm))
    if not dist.is_initialized() or dist.get_rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        reference.save(path, fingerprint)
    say(f"DPO reference: the base's log-probabilities of {len(rows)} rows computed once and stored in {path}")
    return reference


def attach_for_evaluation(pm, cfg: JobConfig, run_dir: str | Path, score: PairScore,
                          reference_model: bool) -> PreferenceObjective:
    """A finished run's objective on its loaded model (``scaletrain eval``), so its val loss is the one training
    recorded: DPO's reference is the run's stored log-probabilities (method=full) or its adapters switched off."""
    ft = cfg.finetune
    reference = None
    if reference_model and method_entry(ft.method).trains_base:
        path = Path(run_dir) / REFERENCE_FILE
        reference = PrecomputedReference.load(path, reference_fingerprint(cfg))
        if reference is None:
            raise DataError(f"{path}: missing, or stored for another base or preference file; a DPO run's val loss "
                            f"needs the reference log-probabilities it trained with")
    elif reference_model:
        with adapters_disabled(pm.modules[0]) as count:
            if not count:
                raise DataError(f"{run_dir}: a DPO run's model has no adapters to switch off for its reference")
    return PreferenceObjective(pm, ft, score, reference)


def attach_preference(pm, cfg: JobConfig, score: PairScore, reference_model: bool,
                      say=print) -> PreferenceObjective:
    """``finetune.objective``'s scoring on ``pm`` (the base and adapters loaded); with a reference model (DPO),
    full fine-tuning precomputes the reference first, adapters use the adapter-free model."""
    precomputed = reference_model and method_entry(cfg.finetune.method).trains_base
    reference = precomputed_reference(pm, cfg, say) if precomputed else None
    return PreferenceObjective(pm, cfg.finetune, score, reference)
