"""nanoGPT's train.py loop, restated compactly: the reference side of benchmarks/time_to_loss.py.

nanoGPT cannot be fetched on these machines, so this file restates what karpathy/nanoGPT's model.py and
train.py compute at a CPU-sized config (written here, not copied), run as its own process as nanoGPT is:

- model: GPT-2 blocks (pre-LayerNorm without bias, fused q/k/v projection, causal scaled_dot_product_attention,
  GELU MLP 4x wide), learned positions, the output head tied to the token embedding, normal(0, 0.02) init with
  the residual projections (c_proj) at 0.02 / sqrt(2 * n_layer), dropout modules at p = 0;
- optimizer: AdamW with nanoGPT's two groups (weight decay on tensors of >= 2 dimensions only), not fused on
  a CPU (nanoGPT passes fused=True only on CUDA), betas (0.9, beta2), gradient clipping at 1.0;
- schedule: nanoGPT's get_lr (linear warmup (it + 1) / (warmup + 1), cosine to min_lr by lr_decay_iters);
- data: its get_batch (batch_size random offsets from torch.randint, windows of block_size + 1), seed 1337;
- loop: estimate_loss over eval_iters random batches of *both* splits every eval_interval steps (part of its
  wall time, so kept), a checkpoint whenever the val loss improves (always_save_checkpoint = False), a loss
  line every log_interval steps, iterations 0..max_iters inclusive (the last evaluation is at max_iters), eager
  (the baseline ran with --compile=False), fp32 (on a CPU nanoGPT's autocast is a nullcontext and its
  float16 GradScaler disables itself).

It reads scaletrain's prepared token folder (the same tokens and train/val split our recipes train on; the
char split is nanoGPT's own: the first 90% of Tiny Shakespeare, 1,003,854 / 111,540 tokens). Without --data it
prepares the config's recipe into benchmarks/out/nanogpt-data/<config> with scaletrain's own preparation.

    python benchmarks/nanogpt_reference.py --config char            # BASELINES.md's baby-GPT run
    python benchmarks/nanogpt_reference.py --config bpe --data DIR  # configs/gutenberg_bpe_small.toml's tokens
    python benchmarks/nanogpt_reference.py --config gpt2 --speed --data DIR --batch-size 64 --vocab-size 50304
        # nanoGPT's GPU loop at GPT-2 124M: bf16 autocast + compile + fused AdamW, one JSON line (tokens/s, memory)

stdout: one JSON line per evaluation {"step", "train_loss", "val_loss", "time"} (time.time() when the
evaluation finished), then {"end": true, "step", "time", "wall_s", "median_step_ms"} when training ends, then
(unless --windows-batches 0, after the timed part) {"val_loss_windows", "windows_batches"}: the final model's
val loss on the windows scaletrain's evaluation scores (evenly spread over the val split), so both sides can be
compared on the same tokens. nanoGPT's own progress lines go to stderr.
"""

from __future__ import annotations

import time

STARTED = time.time()  # before torch is imported: the process's own start-up is part of its wall time

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from scaletrain.data.loader import TokenStream, eval_batches  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class RunConfig:
    """nanoGPT's train.py settings that these runs use (its defaults where a config does not set them)."""

    recipe: str             # our recipe on the same data (where the tokens come from without --data)
    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    batch_size: int
    max_iters: int
    eval_interval: int
    eval_iters: int
    learning_rate: float = 1e-3
    warmup_iters: int = 100
    lr_decay_iters: int = 0  # 0: max_iters (as the baseline's --lr_decay_iters=2000 with --max_iters=2000)
    min_lr: float = 1e-4
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0
    dropout: float = 0.0
    bias: bool = False
    log_interval: int = 1
    seed: int = 1337


CONFIGS = {
    # BASELINES.md: config/train_shakespeare_char.py with --device=cpu --compile=False --eval_iters=20
    # --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128 --max_iters=2000
    # --lr_decay_iters=2000 --dropout=0.0
    "char": RunConfig(recipe="configs/shakespeare_char_baby_adamw.toml", n_layer=4, n_head=4, n_embd=128, block_size=64,
                      batch_size=12, max_iters=2000, eval_interval=250, eval_iters=20),
    # configs/gutenberg_bpe_small.toml's size, context, batch and steps, with the small configs' hyperparameters
    # (lr 1e-3, warmup 100, cosine to lr / 10, beta2 0.99, weight decay 0.1).
    # nanoGPT's GPT-2 124M (config/train_gpt2.py: 12 x 12 x 768, context 1024, bias off, dropout 0, lr 6e-4,
    # beta2 0.95, warmup 2000) for --speed: the batch is the caller's (scripts/gpu_check.py: our train row's).
    "gpt2": RunConfig(recipe="", n_layer=12, n_head=12, n_embd=768, block_size=1024, batch_size=12, max_iters=50,
                      eval_interval=0, eval_iters=0, learning_rate=6e-4, warmup_iters=2000, min_lr=6e-5,
                      beta2=0.95, log_interval=10),
    "bpe": RunConfig(recipe="configs/gutenberg_bpe_small.toml", n_layer=4, n_head=4, n_embd=128, block_size=128,
                     batch_size=16, max_iters=1000, eval_interval=250, eval_iters=20, log_interval=10),
}


# -- the model (nanoGPT's model.py) --------------------------------------------------------------------------

class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: RunConfig):
        super().__init__()
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)  # q, k, v in one matmul
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
                   for t in self.c_attn(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: RunConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: RunConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)  # nanoGPT's LayerNorm: F.layer_norm, eps 1e-5
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: RunConfig, vocab_size: int):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, cfg.n_embd), wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
            drop=nn.Dropout(cfg.dropout), h=nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer)),
            ln_f=nn.LayerNorm(cfg.n_embd, bias=cfg.bias)))
        self.lm_head = nn.Linear(cfg.n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2's scaled init of the residual projections
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)  # (T,)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B, T, C)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))  # (B, T, vocab)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    def configure_optimizers(self, cfg: RunConfig) -> torch.optim.AdamW:
        return configure_adamw(self, cfg)


def configure_adamw(model: nn.Module, cfg: RunConfig, device_type: str = "cpu") -> torch.optim.AdamW:
    """nanoGPT's optimizer over ``model`` (its GPT, or any other: benchmarks/baby_wall.py trains ours with it).
    nanoGPT's groups: decay every tensor of >= 2 dimensions (matmul weights, embeddings), not biases and norms;
    fused only on CUDA (``use_fused = fused_available and device_type == 'cuda'``), so on a CPU torch's default
    AdamW implementation."""
    params = [p for p in model.parameters() if p.requires_grad]  # the tied weight once
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    extra = {"fused": True} if device_type == "cuda" else {}
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), **extra)


# -- the loop (nanoGPT's train.py) ---------------------------------------------------------------------------

def get_lr(it: int, cfg: RunConfig) -> float:
    """Linear warmup, then cosine from learning_rate down to min_lr at lr_decay_iters, then min_lr."""
    decay_iters = cfg.lr_decay_iters or cfg.max_iters
    if it < cfg.warmup_iters:
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    if it > decay_iters or decay_iters <= cfg.warmup_iters:  # the latter: a short override (nanoGPT divides by 0)
        return cfg.min_lr
    decay_ratio = (it - cfg.warmup_iters) / (decay_iters - cfg.warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))  # 1 -> 0
    return cfg.min_lr + coeff * (cfg.learning_rate - cfg.min_lr)


def load_splits(data_dir: Path) -> dict[str, np.ndarray]:
    """The prepared folder's train and val tokens, each one array (nanoGPT's train.bin / val.bin)."""
    streams = {split: TokenStream(str(data_dir), split) for split in ("train", "val")}
    return {split: s.read(0, s.total) for split, s in streams.items()}


def get_batch(data: np.ndarray, cfg: RunConfig) -> tuple[torch.Tensor, torch.Tensor]:
    ix = torch.randint(len(data) - cfg.block_size, (cfg.batch_size,))
    x = torch.stack([torch.from_numpy(data[i:i + cfg.block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + cfg.block_size].astype(np.int64)) for i in ix])
    return x, y  # (B, T) each


@torch.no_grad()
def estimate_loss(model: GPT, splits: dict[str, np.ndarray], cfg: RunConfig) -> dict[str, float]:
    model.eval()
    out = {}
    for split in ("train", "val"):
        losses = torch.zeros(cfg.eval_iters)
        for k in range(cfg.eval_iters):
            losses[k] = model(*get_batch(splits[split], cfg))[1].item()
        out[split] = losses.mean().item()
    model.train()
    return out


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def train(cfg: RunConfig, splits: dict[str, np.ndarray], vocab_size: int, out_dir: Path) -> GPT:
    """nanoGPT's training loop; emits the eval and end records."""
    torch.manual_seed(cfg.seed)
    model = GPT(cfg, vocab_size)
    n_params = sum(p.numel() for p in model.parameters()) - model.transformer.wpe.weight.numel()
    print(f"number of parameters: {n_params / 1e6:.2f}M", file=sys.stderr)
    optimizer = model.configure_optimizers(cfg)
    best_val_loss, step_seconds = 1e9, []
    X, Y = get_batch(splits["train"], cfg)  # the very first batch
    t0 = time.time()
    iter_num = 0
    while True:
        lr = get_lr(iter_num, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        if iter_num % cfg.eval_interval == 0:
            losses = estimate_loss(model, splits, cfg)
            emit({"step": iter_num, "train_loss": round(losses["train"], 4), "val_loss": round(losses["val"], 4),
                  "time": time.time()})
            if losses["val"] < best_val_loss:
                best_val_loss = losses["val"]
                if iter_num > 0:
                    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                "iter_num": iter_num, "best_val_loss": best_val_loss, "config": asdict(cfg)},
                               out_dir / "ckpt.pt")
        _, loss = model(X, Y)
        X, Y = get_batch(splits["train"], cfg)  # fetched while (on a GPU) the forward runs
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t1 = time.time()
        step_seconds.append(t1 - t0)
        t0 = t1
        if iter_num % cfg.log_interval == 0:
            print(f"iter {iter_num}: loss {loss.item():.4f}, time {step_seconds[-1] * 1000:.2f}ms", file=sys.stderr)
        iter_num += 1
        if iter_num > cfg.max_iters:
            break
    end = time.time()
    emit({"end": True, "step": cfg.max_iters, "time": end, "wall_s": round(end - STARTED, 3),
          "median_step_ms": round(1000 * statistics.median(step_seconds), 2)})
    return model


# -- the speed run (nanoGPT's train.py on a GPU: bf16 autocast, torch.compile, fused AdamW) -----------------

def get_batch_on(data: np.ndarray, cfg: RunConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``get_batch`` moved to ``device`` as nanoGPT does on CUDA: pinned, then copied without blocking."""
    x, y = get_batch(data, cfg)
    if device.type == "cuda":
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x, y


def speed(cfg: RunConfig, train_tokens: np.ndarray, vocab_size: int, device: torch.device, dtype: str,
          compile_: bool, skip: int) -> dict:
    """nanoGPT's loop as its train.py runs it on a GPU: the model in fp32 under ``torch.autocast(dtype)``,
    ``torch.compile(model)``, fused AdamW on CUDA, clipping at 1.0, the next batch fetched while the forward
    runs, and ``loss.item()`` only every ``log_interval`` steps (no other host-device sync: nanoGPT has none).
    Tokens/s is the time of the steps after the first ``skip`` (the compile and the allocator's warm-up),
    measured between two synchronisations, over their tokens; peak memory is the allocator's maximum."""
    torch.manual_seed(cfg.seed)
    torch.backends.cuda.matmul.allow_tf32 = True  # nanoGPT's train.py sets both
    torch.backends.cudnn.allow_tf32 = True
    model = GPT(cfg, vocab_size).to(device)
    optimizer = configure_adamw(model, cfg, device.type)
    step_fn = torch.compile(model) if compile_ else model
    amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype)
    ctx = (lambda: torch.autocast(device.type, dtype=amp)) if amp is not None else contextlib.nullcontext
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == "fp16")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    X, Y = get_batch_on(train_tokens, cfg, device)
    started = time.perf_counter()
    t_timed, lossf = started, float("nan")
    for iter_num in range(cfg.max_iters):
        if iter_num == skip:
            sync()
            t_timed = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = get_lr(iter_num, cfg)
        with ctx():
            _, loss = step_fn(X, Y)
        X, Y = get_batch_on(train_tokens, cfg, device)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if iter_num % cfg.log_interval == 0 or iter_num == cfg.max_iters - 1:
            lossf = loss.item()
            print(f"iter {iter_num}: loss {lossf:.4f}, {time.perf_counter() - started:.1f}s", file=sys.stderr)
    sync()
    timed_s, timed = time.perf_counter() - t_timed, cfg.max_iters - skip
    tokens = timed * cfg.batch_size * cfg.block_size
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"speed": True, "device": str(device), "dtype": dtype, "compile": compile_, "steps": cfg.max_iters,
            "timed_steps": timed, "tokens_per_second": round(tokens / timed_s, 1),
            "step_ms": round(1000 * timed_s / timed, 2), "peak_memory_mib": round(peak / 2**20, 1),
            "loss": round(lossf, 4), "batch_size": cfg.batch_size, "block_size": cfg.block_size,
            "vocab_size": vocab_size, "parameters": sum(p.numel() for p in model.parameters()),
            "flops_per_token": flops_per_token(model, cfg)}


def flops_per_token(model: GPT, cfg: RunConfig) -> float:
    """Training FLOPs per token as scaletrain's MFU counts them (model/presets.py, PaLM's convention, nanoGPT's
    estimate_mfu's too): 6 x the matmul weights (every Linear, the tied head once) + attention's 12 L T d."""
    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    return 6.0 * matmul + 12.0 * cfg.n_layer * cfg.block_size * cfg.n_embd


@torch.no_grad()
def windows_val_loss(model: GPT, data_dir: Path, cfg: RunConfig, num_batches: int) -> float:
    """Mean loss over the windows scaletrain's evaluation scores (``eval_batches``: evenly spread over val)."""
    model.eval()
    batches = eval_batches(str(data_dir), "val", cfg.block_size, cfg.batch_size, num_batches)
    # contiguous: the targets are a strided view (window[:, 1:]) and nanoGPT's forward flattens with .view
    losses = [model(x.contiguous(), y.contiguous())[1].item() for x, y in batches]
    return sum(losses) / len(losses)


def prepared_data(cfg: RunConfig, config_name: str) -> Path:
    """The recipe's tokens, prepared by scaletrain into benchmarks/out/nanogpt-data/<config> (once)."""
    from scaletrain.config import load_config
    from scaletrain.data.run_data import prepare_data

    cache = ROOT / "benchmarks" / "out" / "nanogpt-data" / config_name
    return prepare_data(load_config(str(ROOT / cfg.recipe), {"data.cache_dir": str(cache)}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="char")
    parser.add_argument("--data", default="", help="a scaletrain prepared token folder (default: prepare the "
                        "config's recipe into benchmarks/out/nanogpt-data/<config>)")
    parser.add_argument("--max-iters", type=int, default=0, help="override max_iters (and lr_decay_iters with it)")
    parser.add_argument("--eval-interval", type=int, default=0, help="override eval_interval")
    parser.add_argument("--windows-batches", type=int, default=20,
                        help="after training, score the val windows scaletrain evaluates (0 = skip)")
    speed_args = parser.add_argument_group("--speed: nanoGPT's GPU loop (bf16 autocast + compile + fused AdamW), "
                                           "timed; one JSON line")
    speed_args.add_argument("--speed", action="store_true", help="time the training loop only (no evaluation)")
    speed_args.add_argument("--device", default="cuda")
    speed_args.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    speed_args.add_argument("--no-compile", action="store_true")
    speed_args.add_argument("--skip", type=int, default=10, help="steps left out of the timing (the compile)")
    for name in ("n-layer", "n-head", "n-embd", "block-size", "batch-size", "vocab-size"):
        speed_args.add_argument(f"--{name}", type=int, default=0, help="override the config's (vocab: the data's)")
    args = parser.parse_args()
    if args.speed:
        return run_speed(args)
    cfg = CONFIGS[args.config]
    overrides = {"max_iters": args.max_iters, "lr_decay_iters": args.max_iters, "eval_interval": args.eval_interval}
    cfg = RunConfig(**{**asdict(cfg), **{k: v for k, v in overrides.items() if v}})
    data_dir = Path(args.data) if args.data else prepared_data(cfg, args.config)
    vocab_size = json.loads((data_dir / "manifest.json").read_text())["vocab_size"]  # nanoGPT's meta.pkl
    out_dir = Path(tempfile.mkdtemp(prefix="nanogpt-out-"))
    try:
        model = train(cfg, load_splits(data_dir), vocab_size, out_dir)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    if args.windows_batches:
        emit({"val_loss_windows": round(windows_val_loss(model, data_dir, cfg, args.windows_batches), 4),
              "windows_batches": args.windows_batches})
    return 0


def run_speed(args: argparse.Namespace) -> int:
    """``--speed``: the config (its sizes overridden by the flags) on ``--data``'s train tokens; one JSON line."""
    if not args.data:
        print("--speed needs --data (a scaletrain prepared token folder)", file=sys.stderr)
        return 2
    cfg = CONFIGS[args.config]
    sizes = {"n_layer": args.n_layer, "n_head": args.n_head, "n_embd": args.n_embd, "block_size": args.block_size,
             "batch_size": args.batch_size, "max_iters": args.max_iters}
    cfg = RunConfig(**{**asdict(cfg), **{k: v for k, v in sizes.items() if v}})
    if args.skip >= cfg.max_iters:
        print(f"--skip {args.skip} leaves no timed step of {cfg.max_iters}", file=sys.stderr)
        return 2
    data_dir = Path(args.data)
    vocab_size = args.vocab_size or json.loads((data_dir / "manifest.json").read_text())["vocab_size"]
    splits = load_splits(data_dir)
    emit(speed(cfg, splits["train"], vocab_size, torch.device(args.device), args.dtype, not args.no_compile,
               args.skip))
    return 0


if __name__ == "__main__":
    sys.exit(main())
