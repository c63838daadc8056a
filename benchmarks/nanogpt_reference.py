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
import json  # noqa: E402
import math  # noqa: E402
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
        pos = torch.arange(0, idx.size(1), dtype=torch.long)  # (T,)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B, T, C)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))  # (B, T, vocab)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    def configure_optimizers(self, cfg: RunConfig) -> torch.optim.AdamW:
        return configure_adamw(self, cfg)


def configure_adamw(model: nn.Module, cfg: RunConfig) -> torch.optim.AdamW:
    """nanoGPT's optimizer over ``model`` (its GPT, or any other: benchmarks/baby_wall.py trains ours with it).
    nanoGPT's groups: decay every tensor of >= 2 dimensions (matmul weights, embeddings), not biases and norms;
    fused only on CUDA, so on a CPU torch's default AdamW implementation."""
    params = [p for p in model.parameters() if p.requires_grad]  # the tied weight once
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2))


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
    args = parser.parse_args()
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


if __name__ == "__main__":
    sys.exit(main())
