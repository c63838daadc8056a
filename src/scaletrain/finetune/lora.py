"""LoRA: a frozen linear layer plus a trainable low-rank update, ``y = x W^T + s * B A x`` (Hu et al., 2021).

``LoRALinear`` *is* an ``nn.Linear`` (it keeps the ``weight`` parameter under its own name), so a model with
adapters has the same parameter names as the base plus ``lora_A`` / ``lora_B`` beside each adapted weight:
base checkpoints, export and the parallel plans find the weights where they always were. The computation is
peft's ``lora.Linear`` op for op (``base(x) + lora_B(lora_A(dropout(x))) * scaling``), which is what makes
the logits equal to peft's to fp32 rounding (tests/finetune/test_finetune.py).

DoRA (Liu et al., 2024; ``finetune.dora``): a trainable ``lora_magnitude`` m (one value per output row,
starting at the row norms of W) rescales the direction of W + s B A: ``y = m / ||W + s B A||_row * (x W^T
+ s B A x)``, with the norm treated as a constant in backward (the paper's section 4.3), computed as peft's
``DoraLinearLayer`` does, so the logits equal peft's with ``use_dora=True``.

Experts (a mixture of experts' ``GroupedExperts``): the roles gate / up / down also select the stacked expert
weights w1 / w3 / w2 (E, out, in) of a sparse block, and ``LoRAExperts`` gives every expert its own adapter,
A (E, r, in) and B (E, out, r), computed on the routed tokens sorted by expert with the same grouped GEMM (or
per-expert loop) the experts use, ``model/moe.py:grouped_linear``; the role ``router`` adapts the router's
nn.Linear. QLoRA holds each stacked expert weight as one 2-D NF4 tensor (``_quantize_experts``).

QLoRA: the frozen ``weight`` may be a 4-bit NF4 tensor (torchao ``NF4Tensor``, see ``quantize_from_base``); the
forward then calls torchao's ``linear_nf4``, which dequantizes block by block and differentiates with respect
to the input only - the base never gets a gradient. With ``finetune.qlora_compile`` the same dequantization runs
as one ``torch.compile``d kernel a weight shape (``CompiledLinearNF4``) instead of torchao's dozen eager ops.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.core.options import ConfigError
from scaletrain.model.hf_names import PROJECTIONS, block_suffix
from scaletrain.model.moe import GroupedExperts, _activation, grouped_linear, grouped_mm_fits


def is_nf4(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is torchao's 4-bit NF4 tensor (by class name: torchao is imported only for qlora)."""
    return type(tensor).__name__ == "NF4Tensor"


class LoRALinear(nn.Linear):
    """An ``nn.Linear`` whose frozen ``weight`` (out, in) gets the update ``scaling * lora_B @ lora_A``; a frozen
    ``bias`` (Qwen2's q/k/v) stays as it is, outside the update, as in peft.

    ``lora_A`` (r, in) starts Kaiming-uniform and ``lora_B`` (out, r) at zero (peft's default), so a fresh
    adapter leaves the model's function unchanged."""

    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float, dropout: float = 0.0,
                 rslora: bool = False, device=None, dtype=None, dora: bool = False, bias: bool = False):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.rank = rank
        self.dora = dora
        if dora:  # DoRA's magnitude; its initial value is the base's row norms (methods.load_base_and_adapters)
            self.lora_magnitude = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype))
        self.scaling = alpha / (math.sqrt(rank) if rslora else rank)
        self.lora_A = nn.Parameter(torch.empty(rank, in_features, device=device, dtype=dtype))
        self.lora_B = nn.Parameter(torch.empty(out_features, rank, device=device, dtype=dtype))
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.weight.requires_grad_(False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, rank: int, alpha: float, dropout: float, rslora: bool,
                    dora: bool = False) -> LoRALinear:
        """A LoRA layer sharing ``linear``'s weight and bias parameters (meta or real), both frozen."""
        new = cls(linear.in_features, linear.out_features, rank, alpha, dropout, rslora,
                  device=linear.weight.device, dtype=linear.weight.dtype, dora=dora, bias=linear.bias is not None)
        new.weight = linear.weight
        new.weight.requires_grad_(False)
        if linear.bias is not None:
            new.bias = linear.bias
            new.bias.requires_grad_(False)
        return new

    # Class-level default: ``put_back`` sets it on the 4-bit layers of a run with ``finetune.qlora_compile`` on.
    nf4_compiled = False

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        return frozen_linear(x, self.weight, self.bias, self.nf4_compiled)

    def _adapter_input(self, x: torch.Tensor) -> torch.Tensor:
        """The adapter's input: dropout, then the adapter's dtype - except under autocast, which casts it for the
        matmuls itself. Casting a bf16 input to fp32 here made autocast save a second bf16 copy of it for the
        backward, one per adapted projection: +16 MiB (+25%) on the default model's LoRA step in bf16."""
        x = self.lora_dropout(x)
        return x if torch.is_autocast_enabled(x.device.type) else x.to(self.lora_A.dtype)

    # Class-level default: ``adapters_disabled`` sets it on the instances it switches off (no state_dict entry).
    disabled = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.disabled:  # the base alone (``adapters_disabled``: DPO's reference model, peft's disable_adapter)
            return self.base_forward(x)
        if self.dora:
            return self._dora_forward(x)
        x_adapter = self._adapter_input(x)
        update = F.linear(F.linear(x_adapter, self.lora_A), self.lora_B) * self.scaling  # (..., out)
        # In the base output's dtype, as peft does: under autocast the block's input is the fp32 residual stream
        # and the projection bf16, and casting to the input's dtype made every adapted projection's output (and
        # the SwiGLU after it) fp32 - twice the activation bytes of the same step without adapters.
        result = self.base_forward(x)
        return result + update.to(result.dtype)

    def _plain_weight(self) -> torch.Tensor:
        if not is_nf4(self.weight):
            return self.weight
        if self.nf4_compiled:  # DoRA's row norms dequantize every forward too
            return compiled_dequantize_nf4(self.weight, self.weight.dtype)
        return self.weight.get_original_weight()

    def _dora_forward(self, x: torch.Tensor) -> torch.Tensor:
        """peft's ``lora.Linear`` + ``DoraLinearLayer``, op for op: base + (m/n - 1) * base + m/n * s * B A x."""
        result = self.base_forward(x)
        x_adapter = self._adapter_input(x)
        # with dropout, the magnitude rescales the base output of the dropped input, as in peft; the bias is not
        # rescaled (peft subtracts it from the base output first)
        if not isinstance(self.lora_dropout, nn.Identity):
            base = F.linear(x_adapter, self._plain_weight())
        else:
            base = result if self.bias is None else result - self.bias
        weight = self._plain_weight().to(self.lora_A.dtype)
        norm = torch.linalg.norm(weight + self.scaling * (self.lora_B @ self.lora_A).detach(), dim=1).detach()
        scale = (self.lora_magnitude / norm).view(1, -1)
        lora = F.linear(F.linear(x_adapter, self.lora_A), self.lora_B)
        return result + ((scale - 1) * base + scale * lora * self.scaling).to(result.dtype)

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """W + scaling * B @ A in full precision (a 4-bit base is dequantized first); under DoRA, each row
        rescaled to its magnitude: m / ||W + s B A||_row * (W + s B A)."""
        merged = self._plain_weight().float() + self.scaling * (self.lora_B.float() @ self.lora_A.float())
        if self.dora:
            merged = merged * (self.lora_magnitude.float() / torch.linalg.norm(merged, dim=1)).view(-1, 1)
        return merged

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, scaling={self.scaling:g}"


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[int]:
    """Within the block, every ``LoRALinear`` of ``model`` computes its frozen base alone: the model *is* its base,
    with no second copy of the weights (peft's ``disable_adapter``, which TRL's DPO uses as the reference model).
    Yields how many adapters were switched off (0: the model has none, and is unchanged)."""
    adapters = [m for m in model.modules() if isinstance(m, (LoRALinear, LoRAExperts))]
    for module in adapters:
        module.disabled = True
    try:
        yield len(adapters)
    finally:
        for module in adapters:
            del module.disabled  # back to the class default


# Roles beyond the projections: a mixture of experts' router (Hugging Face: mlp.gate / block_sparse_moe.gate).
ROUTER = "router"
TARGET_ROLES = (*PROJECTIONS, ROUTER)
# The expert weight of GroupedExperts each feed-forward role adapts (w2(act(w1 x) * w3 x), as FeedForward's).
EXPERT_WEIGHTS = {"gate": "w1", "up": "w3", "down": "w2"}


def check_lora_targets(targets: list[str]) -> None:
    """The one rule for ``finetune.lora_targets``: a non-empty list of projection roles (model/hf_names.py) or
    ``router``."""
    unknown = [t for t in targets if t not in TARGET_ROLES]
    if unknown:
        raise ConfigError(f"finetune.lora_targets: unknown target(s) {', '.join(unknown)}; choose among "
                          f"{', '.join(TARGET_ROLES)}")
    if not targets:
        raise ConfigError(f"finetune.lora_targets is empty, which would match no module of the model; choose "
                          f"among {', '.join(TARGET_ROLES)}")


def _role_suffixes(role: str) -> tuple[str, ...]:
    """The nn.Linear modules (suffixes inside a block) a role selects: its projection, and for the feed-forward
    roles a sparse block's shared experts' too."""
    if role == ROUTER:
        return ("feed_forward.router",)
    if role in EXPERT_WEIGHTS:
        return (block_suffix(role), f"feed_forward.shared_experts.{block_suffix(role).rpartition('.')[2]}")
    return (block_suffix(role),)


def lora_module_names(model: nn.Module, targets: list[str]) -> list[str]:
    """Names of the nn.Linear modules ``targets`` (finetune.lora_targets, checked by ``check_lora_targets``)
    select in ``model``'s blocks, in order (the experts: ``expert_module_names``)."""
    suffixes = tuple(s for t in targets for s in _role_suffixes(t))
    return [name for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and name.startswith("layers.") and name.endswith(suffixes)]


def expert_module_names(model: nn.Module, targets: list[str]) -> list[str]:
    """Names of the ``GroupedExperts`` whose weights the feed-forward roles among ``targets`` select."""
    if not set(targets) & set(EXPERT_WEIGHTS):
        return []
    return [name for name, module in model.named_modules()
            if isinstance(module, GroupedExperts) and name.startswith("layers.")]


def present_roles(model: nn.Module) -> list[str]:
    """The target roles that name a module of ``model``'s blocks."""
    return [role for role in TARGET_ROLES
            if lora_module_names(model, [role]) or expert_module_names(model, [role])]


def apply_lora(model: nn.Module, targets: list[str], rank: int, alpha: float, dropout: float,
               rslora: bool, dora: bool = False) -> list[str]:
    """Replace the targeted projections by ``LoRALinear`` and the targeted experts by ``LoRAExperts`` in place;
    returns the adapted module names. A target that names no module of this model: one line naming those that
    do."""
    present = present_roles(model)
    absent = [t for t in targets if t not in present]
    if absent:
        raise ConfigError(f"finetune.lora_targets: {', '.join(absent)} name(s) no module of this base; it has "
                          f"{', '.join(present)}")
    names = lora_module_names(model, targets)
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, LoRALinear.from_linear(getattr(parent, child), rank, alpha, dropout, rslora, dora))
    weights = [EXPERT_WEIGHTS[t] for t in targets if t in EXPERT_WEIGHTS]
    experts = expert_module_names(model, targets)
    for name in experts:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, LoRAExperts.from_experts(getattr(parent, child), weights, rank, alpha, dropout,
                                                        rslora, dora))
    return names + experts


def magnitude_weight_name(name: str) -> str:
    """The base weight a DoRA magnitude parameter starts from (its row norms): ``...wq.lora_magnitude`` ->
    ``...wq.weight``; an expert's ``...experts.adapters.w1.lora_magnitude`` -> ``...experts.w1``."""
    if ".adapters." in name:
        experts, _, weight = name.removesuffix(".lora_magnitude").rpartition(".adapters.")
        return f"{experts}.{weight}"
    return name.removesuffix("lora_magnitude") + "weight"


class ExpertAdapter(nn.Module):
    """One stacked expert weight's adapters: ``lora_A`` (E, r, in), ``lora_B`` (E, out, r), and under DoRA
    ``lora_magnitude`` (E, out), one value per expert and output row."""

    def __init__(self, n_experts: int, in_features: int, out_features: int, rank: int, dora: bool,
                 device=None, dtype=None):
        super().__init__()
        self.lora_A = nn.Parameter(torch.empty(n_experts, rank, in_features, device=device, dtype=dtype))
        self.lora_B = nn.Parameter(torch.empty(n_experts, out_features, rank, device=device, dtype=dtype))
        if dora:
            self.lora_magnitude = nn.Parameter(torch.empty(n_experts, out_features, device=device, dtype=dtype))


class LoRAExperts(GroupedExperts):
    """``GroupedExperts`` (its frozen w1 / w2 / w3 under their own names) whose weights named in ``adapters``
    (a ModuleDict "w1" -> ``ExpertAdapter``) get each expert's own update ``scaling * B_e A_e``: every projection
    is x W_e^T + s * (x A_e^T) B_e^T on the expert's rows, DoRA's rescaled by m_e / ||W_e + s B_e A_e||_row as
    ``LoRALinear``'s. The base's expert parallelism (parallel/expert.py, ``compute`` on weight slices) would
    bypass the adapters: train/validate.py refuses parallel.ep > 1 with them."""

    disabled = False  # as LoRALinear's (``adapters_disabled``)

    @classmethod
    def from_experts(cls, experts: GroupedExperts, weights: list[str], rank: int, alpha: float, dropout: float,
                     rslora: bool, dora: bool = False) -> LoRAExperts:
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        for key in ("w1", "w2", "w3"):
            setattr(new, key, getattr(experts, key))
            getattr(new, key).requires_grad_(False)
        new.activation, new.rank, new.dora = experts.activation, rank, dora
        new.n_experts, new.hidden, new.dim = experts.w1.shape  # kept: QLoRA stores the weights 2-D
        new.scaling = alpha / (math.sqrt(rank) if rslora else rank)
        new.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        new.adapters = nn.ModuleDict({
            key: ExpertAdapter(w.shape[0], w.shape[2], w.shape[1], rank, dora, device=w.device, dtype=w.dtype)
            for key in weights for w in (getattr(experts, key),)})
        return new

    def weight_shape(self, key: str) -> tuple[int, int, int]:
        """The stacked weight ``key``'s (E, out, in): w1, w3 (E, h, d), w2 (E, d, h)."""
        return (self.n_experts, self.dim, self.hidden) if key == "w2" else (self.n_experts, self.hidden, self.dim)

    # Class-level default: ``put_back`` sets it on the 4-bit experts of a run with ``finetune.qlora_compile`` on.
    nf4_compiled = False

    def stacked(self, key: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The frozen stacked weight ``key`` (E, out, in): as it is, or QLoRA's 4-bit one (held 2-D, (E out, in),
        ``quantize_from_base``) dequantized (no gradient: the base is frozen)."""
        weight = getattr(self, key)
        if not is_nf4(weight):
            return weight if dtype is None else weight.to(dtype)
        plain = compiled_dequantize_nf4(weight, dtype or weight.dtype) if self.nf4_compiled \
            else weight.get_original_weight()
        return plain.view(self.weight_shape(key)).to(dtype or plain.dtype)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (M, d): the routed tokens sorted by expert, ``counts`` (E,) of them each -> (M, d)."""
        if self.disabled and not is_nf4(self.w1):
            return super().forward(x, counts)
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        # the shapes alone decide the grouped GEMM (a 4-bit weight is held 2-D): meta stand-ins of the stacked ones
        shapes = [torch.empty(self.weight_shape(k), device="meta") for k in ("w1", "w2")]
        matrices = [p for a in self.adapters.values() for p in (a.lora_A, a.lora_B)]
        grouped = grouped_mm_fits(x, *shapes, *matrices)

        def mm(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # each expert's rows @ its weight^T
            return grouped_linear(rows, weight, counts, grouped)

        def frozen(rows: torch.Tensor, key: str) -> torch.Tensor:  # rows @ the frozen W_e^T
            if is_nf4(getattr(self, key)):
                return FrozenExpertsMM.apply(rows, self, key, mm)
            return mm(rows, getattr(self, key))

        def project(rows: torch.Tensor, key: str) -> torch.Tensor:
            out = frozen(rows, key)
            if key not in self.adapters or self.disabled:
                return out
            adapter = self.adapters[key]
            dropped = self.lora_dropout(rows)
            lora = mm(mm(dropped, adapter.lora_A), adapter.lora_B)
            if not self.dora:
                return out + lora * self.scaling
            base = out if isinstance(self.lora_dropout, nn.Identity) else frozen(dropped, key)
            weight = self.stacked(key, adapter.lora_A.dtype).detach()
            norm = torch.linalg.norm(weight + self.scaling * (adapter.lora_B @ adapter.lora_A).detach(), dim=-1)
            scale = (adapter.lora_magnitude / norm.detach()).repeat_interleave(counts, dim=0)  # (M, out)
            return out + ((scale - 1) * base + scale * lora * self.scaling).to(out.dtype)

        act = _activation(self.activation)
        return project(act(project(x, "w1")) * project(x, "w3"), "w2")

    @torch.no_grad()
    def merged_weights(self) -> dict[str, torch.Tensor]:
        """Every stacked weight (E, out, in) in fp32 (a 4-bit one dequantized), the adapted ones W + s * B @ A,
        DoRA's rows rescaled to m / ||.||."""
        out = {}
        for key in ("w1", "w2", "w3"):
            merged = self.stacked(key).float()
            if key in self.adapters:
                adapter = self.adapters[key]
                merged = merged + self.scaling * (adapter.lora_B.float() @ adapter.lora_A.float())
                if self.dora:
                    merged = merged * (adapter.lora_magnitude.float()
                                       / torch.linalg.norm(merged, dim=-1)).unsqueeze(-1)
            out[key] = merged
        return out


class FrozenExpertsMM(torch.autograd.Function):
    """Each expert's rows @ its frozen 4-bit weight^T (``mm``, LoRAExperts' grouped GEMM or loop), torchao's
    ``LinearNF4`` for stacked experts: the gradient with respect to the rows only, the 4-bit weight kept for the
    backward and dequantized again there, never saved in full precision (an (E, out, in) fp32 copy a projection and
    layer would hold the whole base's experts unquantized until the backward)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, experts: LoRAExperts, key: str, mm) -> torch.Tensor:
        ctx.experts, ctx.key, ctx.mm = experts, key, mm
        return mm(rows, experts.stacked(key, rows.dtype))

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        weight = ctx.experts.stacked(ctx.key, grad_output.dtype)  # (E, out, in)
        return ctx.mm(grad_output, weight.transpose(-2, -1)), None, None, None


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its weight: each ``LoRALinear`` (and a 4-bit ``NF4Linear``) becomes a plain fp32
    ``nn.Linear``, each ``LoRAExperts`` a plain fp32 ``GroupedExperts`` (in place)."""
    for name, module in list(model.named_modules()):
        if isinstance(module, (LoRALinear, NF4Linear)):
            parent_name, _, child = name.rpartition(".")
            plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, device="cpu")
            if module.bias is not None:  # frozen, not part of the update (peft merges the weight only)
                plain.bias.copy_(module.bias)
            if isinstance(module, LoRALinear):
                plain.weight.copy_(module.merged_weight())
            else:  # a 4-bit projection without adapter: dequantized
                plain.weight.copy_(module.weight.get_original_weight() if is_nf4(module.weight) else module.weight)
            setattr(model.get_submodule(parent_name), child, plain)
        elif isinstance(module, LoRAExperts):
            parent_name, _, child = name.rpartition(".")
            plain = GroupedExperts(module.n_experts, module.dim, module.hidden, module.activation)
            for key, merged in module.merged_weights().items():
                getattr(plain, key).copy_(merged)
            setattr(model.get_submodule(parent_name), child, plain)
    return model


def check_qlora_installed() -> None:
    """QLoRA's 4-bit NF4 base is torchao's: without it (the ``finetune`` extra), one line saying what to install,
    before anything is built (not a ``ModuleNotFoundError`` from inside the model)."""
    try:
        import torchao  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"finetune.method=qlora needs torchao for its 4-bit base ({exc}): pip install "
                          f"'scaletrain[finetune]', or use finetune.method=lora") from None


def frozen_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  compiled: bool = False) -> torch.Tensor:
    """x W^T (+ b) for a frozen weight, plain or 4-bit NF4 (torchao's ``linear_nf4``, or with ``compiled`` the
    same computation with a compiled dequantization: ``CompiledLinearNF4``); the bias stays full precision."""
    if not is_nf4(weight):
        return F.linear(x, weight, bias)
    if compiled:
        out = CompiledLinearNF4.apply(x, weight)
    else:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

        out = linear_nf4(x, weight)
    return out if bias is None else out + bias.to(out.dtype)


def dequantize_nf4(quantized_data: torch.Tensor, quantized_scalers: torch.Tensor, quantization_factor: torch.Tensor,
                   scaler_mean: torch.Tensor, nf4: torch.Tensor, block_size: int, scaler_block_size: int,
                   shape: tuple[int, ...], scale_dtype: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    """torchao's ``NF4Tensor.get_original_weight`` op for op, over its inner tensors, cast to ``dtype``: unpack the two
    4-bit codes of each byte, look them up in the ``nf4`` code book, rescale by the block scales (themselves int8,
    double-quantized, rescaled by ``quantization_factor`` a scaler block plus ``scaler_mean``). Plain tensors, so that
    ``torch.compile`` traces no tensor subclass (dynamo can trace ``NF4Tensor``, but inductor's cache cannot hash it:
    every run would compile cold). ``tests/finetune/test_qlora_compile.py`` holds it bitwise equal to torchao's."""
    codes = quantized_data.view(-1)  # (numel / 2,) uint8: two codes a byte, the first in the high nibble
    first = nf4[(codes >> 4).to(torch.long)]
    second = nf4[(codes & 0b1111).to(torch.long)]
    n_scaler_blocks = quantized_scalers.numel() // scaler_block_size
    scalers = (quantized_scalers.view(n_scaler_blocks, scaler_block_size) / quantization_factor.unsqueeze(-1))
    scalers = scalers.flatten().to(scale_dtype) + scaler_mean  # (n_blocks,): one absmax a block of weights
    repeated = scalers.unsqueeze(-1).expand(scalers.size(0), block_size // 2).flatten()  # (numel / 2,)
    return torch.stack([first * repeated, second * repeated], dim=-1).reshape(shape).to(dtype)


_compiled_dequantize = None
_compiled_keys: set[tuple] = set()  # (shape, dtypes, blocks, device) the compiled dequantization has a graph for
# Graphs the compiled dequantization may hold in one process: a model needs 4-5 (one a weight shape and dtype), but a
# process that builds several (tests, the benchmark, eval after training) would pass dynamo's default of 8 recompiles
# a function, after which it runs eagerly.
NF4_GRAPHS_LIMIT = 256


def compiled_dequantize_nf4(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The NF4 ``weight`` in ``dtype`` through ``torch.compile``d ``dequantize_nf4``: one graph a weight shape and
    dtype, compiled on first use (a Llama block has 4 shapes, a Qwen3 / Gemma 3 block 5; a run dequantizes to one
    dtype, DoRA's row norms to a second). Static shapes: on this CPU the dynamic-shape kernel ran 5.7x slower than
    the static one (8.1 against 1.4 ns a weight). Eager torchao runs it as a dozen kernels with int64 and fp32
    intermediates (the GPU check measured 171 bytes of traffic a weight); compiled, it is one kernel that reads the
    4.5 bits and writes ``dtype``.

    Called without gradients and outside autocast (neither changes an elementwise dequantization): dynamo guards on
    both, and the forward (under autocast) and the backward (outside it) would otherwise compile every shape twice."""
    global _compiled_dequantize
    if _compiled_dequantize is None:
        _compiled_dequantize = torch.compile(dequantize_nf4, dynamic=False)
    args = (weight.quantized_data, weight.quantized_scalers, weight.quantization_factor, weight.scaler_mean,
            weight.nf4, weight.block_size, weight.scaler_block_size, tuple(weight.shape), weight.dtype, dtype)
    device = weight.device.type
    key = (args[7], weight.dtype, dtype, weight.block_size, weight.scaler_block_size, weight.device)
    with contextlib.ExitStack() as plain:
        if torch.is_grad_enabled():
            plain.enter_context(torch.no_grad())
        if torch.is_autocast_enabled(device):
            plain.enter_context(torch.autocast(device, enabled=False))
        if key not in _compiled_keys:  # a new graph: a raised recompile limit, for this function's compile only
            # (named cache_size_limit before torch 2.7; the GPU machine's 2.11 and this 2.13 have recompile_limit)
            limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
            plain.enter_context(torch._dynamo.config.patch(**{limit: NF4_GRAPHS_LIMIT}))
            _compiled_keys.add(key)
        return _compiled_dequantize(*args)


def _matmul_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype F.linear multiplies ``x`` in: autocast's (bf16) when it is on, else the input's own."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


class CompiledLinearNF4(torch.autograd.Function):
    """torchao's ``LinearNF4`` (x W^T, the gradient with respect to x only, the 4-bit weight saved for the backward
    and dequantized again there, never kept in full precision) with the dequantization compiled. Under autocast the
    weight is dequantized straight to autocast's dtype (eager dequantizes to fp32 and autocast rounds that: the same
    values), and the matmul is F.linear, the same call eager makes."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(weight)
        return F.linear(x, compiled_dequantize_nf4(weight, _matmul_dtype(x)))

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        (weight,) = ctx.saved_tensors
        return grad_output @ compiled_dequantize_nf4(weight, grad_output.dtype), None


class NF4Linear(nn.Linear):
    """A frozen linear layer whose weight is stored in 4-bit NF4 (QLoRA's non-adapted projections); a bias (Qwen2's
    q/k/v) stays in full precision."""

    nf4_compiled = False  # as LoRALinear's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return frozen_linear(x, self.weight, self.bias, self.nf4_compiled)


# Elements torchao quantizes at a time: its nearest-code search holds ~130 bytes of temporaries per element
# (a distance to each of the 16 codes, twice), so its default chunk of 1M elements held 130 MB, and glibc's
# heap, fragmented by those blocks between the small 4-bit results, kept ~100 MB of a 7.2M-parameter base's
# QLoRA build resident for the whole run. 64K elements hold ~8 MB; the quantization itself is done once.
NF4_CHUNK = 1 << 16


def to_nf4(weight: torch.Tensor, block_size: int, scaler_block_size: int) -> nn.Parameter:
    """``weight`` as a frozen torchao NF4 parameter (QLoRA's 4-bit base; the planner measures its bytes)."""
    from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor

    # torchao needs blocks that tile the matrix and scaler blocks that tile the blocks' scales; QLoRA's
    # 64 / 256 unless a small matrix asks for smaller divisors.
    numel = weight.numel()
    blocks = math.gcd(numel, block_size)
    scaler_blocks = math.gcd(numel // blocks, scaler_block_size)
    default, nf4_tensor.CHUNK_SIZE = nf4_tensor.CHUNK_SIZE, NF4_CHUNK  # torchao's knob (its "Quantize in Chunks")
    try:
        return nn.Parameter(nf4_tensor.to_nf4(weight.detach().contiguous(), blocks, scaler_blocks),
                            requires_grad=False)
    finally:
        nf4_tensor.CHUNK_SIZE = default


@torch.no_grad()
def quantize_from_base(model: nn.Module, base_state: Mapping[str, torch.Tensor], block_size: int = 64,
                       scaler_block_size: int = 256, device: torch.device | str = "cpu"
                       ) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """QLoRA, on the meta model before it is materialized: every frozen projection of the blocks - adapted
    (``LoRALinear``) or not (then an ``NF4Linear``) - gets its weight as torchao NF4 (4-bit NormalFloat,
    block-wise absmax scales themselves quantized to int8: "double quantization"), read from ``base_state``
    and quantized one tensor at a time, so the fp32 base is never whole in memory. (Materializing the model
    first and quantizing after held all of it at once: on a GPU, the fp32 base of the 7B model a user wants to
    fit on a 24 GB card.) The embedding, the output head, the norms and the biases stay in full precision, as in
    QLoRA (and bitsandbytes' default for ``lm_head``).

    Each module keeps an empty placeholder through ``parallelize`` (nothing to allocate or initialise);
    ``put_back`` returns the 4-bit weights afterwards. Returns the (module, attribute, NF4 weight) triples (a sparse
    block's stacked experts too: ``_quantize_experts``)."""
    held = []
    for name, module in list(model.named_modules()):
        if isinstance(module, GroupedExperts) and name.startswith("layers."):
            held += _quantize_experts(model, name, module, base_state, block_size, scaler_block_size, device)
            continue
        if not (isinstance(module, nn.Linear) and name.startswith("layers.")):
            continue
        if not isinstance(module, LoRALinear):
            if module.weight.requires_grad:
                continue  # trainable: not part of the frozen base
            plain = NF4Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
            if module.bias is not None:  # loaded from the base as every other full-precision parameter
                plain.bias.requires_grad_(False)
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, plain)
            module = plain
        # Quantized where the model will run: the 4-bit weights must live on the training device (found by the
        # first GPU check: a CUDA QLoRA step met its NF4 base on the CPU).
        held.append((module, "weight", to_nf4(base_state[f"{name}.weight"].to(device), block_size, scaler_block_size)))
        module.weight = nn.Parameter(torch.empty(0, device="meta"), requires_grad=False)
    return held


def _quantize_experts(model: nn.Module, name: str, experts: GroupedExperts, base_state: Mapping[str, torch.Tensor],
                      block_size: int, scaler_block_size: int, device) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """QLoRA's experts: each stacked weight (E, out, in) as one 2-D NF4 tensor (E out, in) - torchao's NF4 holds 2-D
    weights, and its blocks run over the flattened elements, so the rows of every expert are quantized as those of
    one (E out, in) matrix - dequantized and viewed (E, out, in) in the forward (``LoRAExperts.stacked``). Experts
    without adapters become a ``LoRAExperts`` with none (its forward is the one that dequantizes)."""
    if not isinstance(experts, LoRAExperts):
        experts = LoRAExperts.from_experts(experts, [], rank=1, alpha=1.0, dropout=0.0, rslora=False)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, experts)
    held = []
    for key in ("w1", "w2", "w3"):
        n_experts, out_features, in_features = experts.weight_shape(key)
        weight = base_state[f"{name}.{key}"].to(device).reshape(n_experts * out_features, in_features)
        held.append((experts, key, to_nf4(weight, block_size, scaler_block_size)))
        setattr(experts, key, nn.Parameter(torch.empty(0, device="meta"), requires_grad=False))
    return held


def qlora_compiled(setting: str, device: torch.device | str) -> bool:
    """``finetune.qlora_compile`` for a run on ``device``: ``true`` / ``false`` as said; ``auto`` compiles on a CUDA
    device (the GPU check measured torchao's eager dequantization at 171 bytes of traffic a weight) and not on a CPU:
    there the compiled step was 1.08x the eager one after ~10 s of cold compiles (4 weight shapes), paid back only
    after ~200 steps of an 11M-parameter model (benchmarks/results/qlora_speed.json, docs/finetuning.md)."""
    if setting != "auto":
        return setting == "true"
    return torch.device(device).type == "cuda"


def put_back(held: list[tuple[nn.Module, str, nn.Parameter]], compiled: bool = False) -> int:
    """After ``parallelize``: the 4-bit weights of ``quantize_from_base`` back into their modules (``compiled``: their
    forward and backward dequantize through ``CompiledLinearNF4``); their bytes."""
    for module, key, weight in held:
        setattr(module, key, weight)
        module.nf4_compiled = compiled
    return sum(nf4_bytes(weight) for _, _, weight in held)


def nf4_bytes(tensor: torch.Tensor) -> int:
    """Bytes an NF4 tensor really stores (4-bit codes, int8 scales, their fp32 scale factors, the code book)."""
    inner, _ = tensor.__tensor_flatten__()
    return sum(getattr(tensor, name).numel() * getattr(tensor, name).element_size() for name in inner)
