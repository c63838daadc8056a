"""Mixture of Experts: the sparse feed-forward of the one decoder (``model.moe_experts`` > 0).

A token-choice router scores every expert (softmax or sigmoid), each token takes its top-k (its weights
renormalised and scaled as the config says), the routed experts run as grouped GEMMs over the tokens sorted by
expert (``torch._grouped_mm``: one kernel a projection for all the experts, a loop over the experts where the
device or the shapes do not allow it), and the shared experts, one dense SwiGLU, run on every token. The shape
is torchtitan's ``models/common/moe.py``: experts stored stacked, (E, out, in) a projection, as E ``nn.Linear``
weights would be.

Balancing, each a choice of the config: the Switch/GShard auxiliary loss and the router z-loss are left in
``auxiliary_loss`` (name -> weighted 0-dim tensor; ``train/loss.py`` adds them to the training loss and drops them
in evaluation); the auxiliary-loss-free expert bias (DeepSeek-V3) picks the experts without weighing them and
moves after each optimizer step (``update_expert_bias``, called by the training step). The tokens each expert
took are counted for both and for the trainer's metrics (``expert_load``).

Pure PyTorch: nothing here knows about distribution. Expert parallelism (parallel/expert.py) shards the
experts' first dimension and replaces ``GroupedExperts.forward`` with a dispatch of the sorted tokens to the
ranks holding their experts, ``GroupedExperts.compute`` there, and the way back; the load counts are summed over
the data-parallel ranks before the bias moves (parallel/expert.py ``sum_expert_counts``).
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.core.options import ConfigError
from scaletrain.model.config import ModelConfig, is_moe_layer
from scaletrain.model.family import FAMILIES
from scaletrain.model.family import family as family_entry
from scaletrain.model.feed_forward import FeedForward
from scaletrain.model.presets import expert_hidden_dim


def check_moe(cfg: ModelConfig) -> None:
    """The MoE options' cross-field rules, one line each (a dense model has none to break)."""
    if not cfg.moe_experts:
        return
    default_family = ModelConfig().family
    if cfg.family != default_family and not family_entry(cfg.family).experts:
        # A family without experts in its entry (model/family/) has no config.json fields for them: such a model
        # would be exported as a dense one. An MoE model is then our own decoder's, of the default family.
        families = [name for name, f in FAMILIES.items() if f.experts]
        raise ConfigError(f"model.moe_experts is set but model.family = {cfg.family} has no mixture of experts here "
                          f"(model/family/: {', '.join(families)} have); leave model.family at {default_family} "
                          f"for our own MoE model")
    if not 1 <= cfg.moe_top_k <= cfg.moe_experts:
        raise ConfigError(f"model.moe_top_k must be between 1 and model.moe_experts ({cfg.moe_experts}) "
                          f"(got {cfg.moe_top_k}): each token is routed to that many of the experts")
    outside = [layer for layer in cfg.moe_layers if not 0 <= layer < cfg.n_layers]
    if outside:
        raise ConfigError(f"model.moe_layers {outside} are not layers of this model (0..{cfg.n_layers - 1})")
    if not any(is_moe_layer(cfg, layer) for layer in range(cfg.n_layers)):
        raise ConfigError(f"model.moe_experts = {cfg.moe_experts} but no layer is sparse (model.moe_every "
                          f"{cfg.moe_every}, model.moe_first_dense {cfg.moe_first_dense} of {cfg.n_layers} "
                          f"layers): lower them, or list model.moe_layers")


def refuse_moe(cfg: ModelConfig, where: str) -> None:
    """One line for a command that does not model a mixture of experts yet (``where``: which), rather than a
    crash or a dense model's numbers for a sparse one."""
    if cfg.moe_experts:
        raise ConfigError(f"{where} does not model a mixture of experts yet (model.moe_experts = "
                          f"{cfg.moe_experts}); it works on dense models only for now")


def _activation(name: str):
    """The gated feed-forward's activation, as ``FeedForward`` computes it."""
    return (lambda x: F.gelu(x, approximate="tanh")) if name == "gelu_tanh" else F.silu


def grouped_mm_fits(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs these operands, forward and backward: the function exists; fp32, bf16 or
    fp16 (bf16 only under torch.compile, torch 2.13); every dimension a multiple of 16 bytes (its stride rule, the
    weight gradients included); on CUDA bf16 on a Hopper or newer (torchtitan's rule). Otherwise the experts run as
    a loop."""
    if not hasattr(torch, "_grouped_mm") or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if x.device.type == "cuda" and (x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device)[0] < 9):
        return False
    if x.device.type not in ("cpu", "cuda") or type(x) is not torch.Tensor:  # a DTensor (sharded experts): loop
        return False
    if torch.compiler.is_compiling() and x.dtype != torch.bfloat16:  # its compiled (meta) form takes bf16 only
        return False
    sizes = {x.shape[-1], *(size for w in weights for size in w.shape[1:])}
    return all(size * x.element_size() % 16 == 0 for size in sizes)


def grouped_linear(rows: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, grouped: bool) -> torch.Tensor:
    """Each expert's rows @ its weight^T: ``rows`` (M, in) sorted by expert, ``counts`` (E,) rows each, ``weight``
    (E, out, in) -> (M, out). ``grouped`` (the caller's ``grouped_mm_fits``, decided once for all of a forward's
    operands): one ``torch._grouped_mm``; else one matmul an expert (reads ``counts`` back to the host). The one
    expert GEMM of ``GroupedExperts`` and of finetune/lora.py's ``LoRAExperts`` (their adapters' too)."""
    weight = weight.to(rows.dtype)
    if grouped:
        return torch._grouped_mm(rows, weight.transpose(-2, -1), offs=counts.cumsum(0, dtype=torch.int32))
    return torch.cat([part @ weight[e].T for e, part in enumerate(torch.split(rows, counts.tolist()))])


# The stacked weights' names, in ``GroupedExperts.compute``'s argument order (parallelism slices them by name).
EXPERT_WEIGHTS = ("w1", "w2", "w3")


class GroupedExperts(nn.Module):
    """E SwiGLU experts, w2(act(w1 x) * w3 x), their weights stacked: w1, w3 (E, h, d), w2 (E, d, h)."""

    def __init__(self, n_experts: int, dim: int, hidden: int, activation: str = "silu"):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.activation = activation

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (M, d): the routed tokens sorted by expert, ``counts`` (E,) of them each -> (M, d)."""
        return self.compute(x, counts, self.w1, self.w2, self.w3)

    def compute(self, x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                w3: torch.Tensor) -> torch.Tensor:
        """The experts whose stacked weights are w1, w3 (E', h, d), w2 (E', d, h) on x (M, d) sorted by expert,
        ``counts`` (E',) rows each -> (M, d). ``forward`` passes all of this module's experts; expert
        parallelism (parallel/expert.py) passes the slice a rank holds, on the tokens sent to it."""
        if torch.is_autocast_enabled(x.device.type):  # as nn.Linear under autocast: operands in its dtype
            x = x.to(torch.get_autocast_dtype(x.device.type))
        act = _activation(self.activation)
        grouped = grouped_mm_fits(x, w1, w2)  # else the sorted-token loop, one expert's rows at a time
        hidden = act(grouped_linear(x, w1, counts, grouped)) * grouped_linear(x, w3, counts, grouped)  # (M, h)
        return grouped_linear(hidden, w2, counts, grouped)  # (M, d)

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float) -> None:
        """Normal(0, std) for w1 and w3, Normal(0, out_std) for w2 (a residual-stream output, as the dense w2)."""
        nn.init.normal_(self.w1, mean=0.0, std=std)
        nn.init.normal_(self.w3, mean=0.0, std=std)
        nn.init.normal_(self.w2, mean=0.0, std=out_std)


def _in_recomputation() -> bool:
    """True inside a backward pass: activation checkpointing re-running a forward, whose routing must not be
    counted, nor its losses left, a second time."""
    return torch._C._current_graph_task_id() != -1


class MoEFeedForward(nn.Module):
    """A sparse block's feed-forward: router, routed experts, optional shared experts (see the module docstring).

    Buffers: ``expert_bias`` (E,), persistent (a checkpoint holds it): the selection bias, zeros unless
    ``moe_bias_rate``; ``tokens_since_update`` and ``tokens_since_log`` (E,) and ``dropped_since_log`` (), not
    persistent: the tokens each expert took since the bias last moved and since the metrics were last read."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_experts, self.top_k = cfg.moe_experts, cfg.moe_top_k
        self.score, self.renormalize, self.route_scale = cfg.moe_score, cfg.moe_renormalize, cfg.moe_route_scale
        self.capacity_factor = cfg.moe_capacity_factor
        self.balance_coef, self.z_loss_coef, self.bias_rate = cfg.moe_balance_coef, cfg.moe_z_loss_coef, \
            cfg.moe_bias_rate
        hidden = expert_hidden_dim(cfg)
        self.router = nn.Linear(cfg.dim, cfg.moe_experts, bias=False)
        self.experts = GroupedExperts(cfg.moe_experts, cfg.dim, hidden, cfg.activation)
        self.shared_experts = FeedForward(cfg.dim, hidden * cfg.moe_shared_experts, cfg.activation) \
            if cfg.moe_shared_experts else None
        self.register_buffer("expert_bias", torch.zeros(cfg.moe_experts))
        self.register_buffer("tokens_since_update", torch.zeros(cfg.moe_experts, dtype=torch.int64), persistent=False)
        self.register_buffer("tokens_since_log", torch.zeros(cfg.moe_experts, dtype=torch.int64), persistent=False)
        self.register_buffer("dropped_since_log", torch.zeros((), dtype=torch.int64), persistent=False)
        self.auxiliary_loss: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Zero the bias and the counts (after materializing from the meta device; a checkpoint then loads the
        bias)."""
        for buffer in (self.expert_bias, self.tokens_since_update, self.tokens_since_log, self.dropped_since_log):
            buffer.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, d) -> (B, T, d)."""
        tokens = x.reshape(-1, x.shape[-1])  # (N, d)
        logits, scores, chosen, weights = self.route(tokens)
        counts = torch.bincount(chosen.flatten(), minlength=self.n_experts)  # (E,): assignments per expert
        out, dropped = self.routed(tokens, chosen, weights, counts)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        if torch.is_grad_enabled():  # training: balance, and count the load
            # Computed in a recomputation too: activation checkpointing needs the same saved tensors both times.
            terms = self.balancing_terms(logits, scores, counts)
            if not _in_recomputation():
                self.auxiliary_loss = terms
                self.count(counts, dropped)
        return out.view_as(x)

    @torch.no_grad()
    def count(self, counts: torch.Tensor, dropped: torch.Tensor) -> None:
        """Add one forward's assignments per expert (E,) and dropped assignments () to the running counts."""
        self.tokens_since_update += counts
        self.tokens_since_log += counts
        self.dropped_since_log += dropped

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x (N, d) -> the router's logits and scores (N, E) in fp32, each token's chosen experts (N, k) and their
        weights (N, k). The bias (when balancing by it) changes which experts are chosen, never their weights."""
        logits = self.router(x).float()  # (N, E)
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        selection = scores + self.expert_bias if self.bias_rate else scores
        chosen = selection.topk(self.top_k, dim=-1).indices  # (N, k)
        weights = scores.gather(-1, chosen)  # (N, k)
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-20)
        return logits, scores, chosen, weights * self.route_scale if self.route_scale != 1.0 else weights

    def routed(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor,
               counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The routed experts' weighted sum for each token of x (N, d), and the number of assignments dropped
        for capacity (0-dim)."""
        n_tokens, k = chosen.shape
        order = chosen.flatten().argsort(stable=True)  # (N*k,): assignments grouped by expert, in token order
        kept_counts, dropped = counts, counts.new_zeros(())
        if self.capacity_factor:
            order, kept_counts = self.within_capacity(order, chosen.flatten(), counts, n_tokens)
            dropped = counts.sum() - kept_counts.sum()
        rows = x[order // k]  # (M, d): each kept assignment's token
        expert_out = self.experts(rows, kept_counts)  # (M, d)
        # Back to (token, choice) slots (a dropped one stays 0), then each token's weighted sum over its k:
        # a gather-free combine whose sum order is fixed, so it is deterministic on every device.
        slots = expert_out.new_zeros(n_tokens * k, x.shape[-1])
        slots[order] = expert_out
        combined = (slots.view(n_tokens, k, -1) * weights.unsqueeze(-1).to(slots.dtype)).sum(1)  # (N, d)
        return combined.to(x.dtype), dropped

    def capacity(self, n_tokens: int) -> int:
        """The most assignments one expert takes of a batch of ``n_tokens`` tokens."""
        return math.ceil(self.capacity_factor * n_tokens * self.top_k / self.n_experts)

    def within_capacity(self, order: torch.Tensor, experts: torch.Tensor, counts: torch.Tensor,
                        n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``order`` (N*k,) keeping each expert's first ``capacity`` assignments (in token order), and the counts
        (E,) kept."""
        capacity = self.capacity(n_tokens)
        starts = counts.cumsum(0) - counts  # (E,): where each expert's assignments begin in ``order``
        rank = torch.arange(order.numel(), device=order.device) - starts[experts[order]]  # (N*k,): within expert
        return order[rank < capacity], counts.clamp(max=capacity)

    def balancing_terms(self, logits: torch.Tensor, scores: torch.Tensor,
                        counts: torch.Tensor) -> dict[str, torch.Tensor]:
        """The weighted auxiliary terms of this forward: the Switch/GShard balance loss E * sum_e f_e P_e (f: the
        fraction of assignments to e, P: its mean router probability; 1 when the load is even) and the z-loss,
        mean(logsumexp(logits)^2); each only when its coefficient is set."""
        terms = {}
        if self.balance_coef:
            fraction = counts.float() / counts.sum()  # (E,), no gradient: the router learns through P
            probabilities = scores if self.score == "softmax" else scores / scores.sum(-1, keepdim=True)
            terms["moe_balance_loss"] = self.balance_coef * self.n_experts * (fraction * probabilities.mean(0)).sum()
        if self.z_loss_coef:
            terms["moe_z_loss"] = self.z_loss_coef * torch.logsumexp(logits, dim=-1).square().mean()
        return terms

    @torch.no_grad()
    def update_bias(self, keep: bool | torch.Tensor = True) -> None:
        """Move the selection bias towards balance by ``bias_rate`` (up for an expert that took fewer tokens than
        the mean since the last update, down for more), then restart the count. ``keep`` False (or a 0.0 tensor,
        the device-side verdict of a step skipped without a read back): the skipped step's tokens are dropped
        with it and the bias stays, as the weights do."""
        if self.bias_rate and keep is not False:
            load = self.tokens_since_update.float()  # (E,)
            move = self.bias_rate * torch.sign(load.mean() - load)
            self.expert_bias += move * keep if isinstance(keep, torch.Tensor) else move
        self.tokens_since_update.zero_()


def moe_layers(model: nn.Module) -> list[tuple[str, MoEFeedForward]]:
    """(layer index as text, module) of each sparse feed-forward of ``model`` (any wrapper around it)."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, MoEFeedForward):
            match = re.search(r"layers\.(\d+)\.", name)
            found.append((match.group(1) if match else name, module))
    return found


COUNT_BUFFERS = ("tokens_since_update", "tokens_since_log", "dropped_since_log")


def routing_counts(model: nn.Module) -> list[torch.Tensor]:
    """Every sparse layer's count buffers (``COUNT_BUFFERS``, in a fixed order): what each forward under gradients
    adds its routing to. A forward that is not the step's (a pipeline schedule's shape inference on uninitialised
    tensors) has its share taken back out of them (train/loss.py ``StageTerms``)."""
    return [getattr(layer, name) for _, layer in moe_layers(model) for name in COUNT_BUFFERS]


def update_expert_bias(models: list[nn.Module], keep: bool | torch.Tensor = True) -> None:
    """After an optimizer step: each sparse layer's bias moved by the tokens its experts took in the step (not
    after a skipped step: ``keep``, see ``MoEFeedForward.update_bias``).

    Single process: the counts are this process's. With data parallelism they are first summed over the
    data-parallel ranks (parallel/expert.py ``sum_expert_counts``, called by the training step before this, as
    torchtitan's ``_update_expert_bias``), so that every rank moves the same bias."""
    for model in models:
        for _, layer in moe_layers(model):
            layer.update_bias(keep)


def expert_load(models: list[nn.Module]) -> dict[str, float | int | list[int]]:
    """The metrics of the tokens each sparse layer's experts took since the last call, then restarted: per layer
    ``moe_tokens_per_expert/L`` (a list), ``moe_max_mean_load/L`` (the busiest expert over the mean: 1 = even)
    and ``moe_dropped_tokens/L`` (assignments over capacity), and ``moe_max_mean_load``, the worst layer's (the
    report plots it); {} for a dense model. One read back per layer."""
    record: dict[str, float | int | list[int]] = {}
    for model in models:
        for layer, module in moe_layers(model):
            tokens = module.tokens_since_log.tolist()
            mean = sum(tokens) / len(tokens)
            record[f"moe_tokens_per_expert/{layer}"] = tokens
            record[f"moe_max_mean_load/{layer}"] = max(tokens) / mean if mean else 0.0
            record[f"moe_dropped_tokens/{layer}"] = int(module.dropped_since_log)
            module.tokens_since_log.zero_()
            module.dropped_since_log.zero_()
    if record:
        record["moe_max_mean_load"] = max(v for k, v in record.items() if k.startswith("moe_max_mean_load/"))
    return record
