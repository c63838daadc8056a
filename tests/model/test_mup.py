"""muP (model.parametrization = "mup", model/mup.py): the coordinate check of Tensor Programs V, the base
width equal to the standard model, the per-group learning rates the trainer sets, and the refused combinations."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from scaletrain.cli import main
from scaletrain.config import OptimConfig, load_config
from scaletrain.model import build_model
from scaletrain.model.config import ModelConfig
from scaletrain.model.mup import width_mult
from scaletrain.scaling.family import MoEShape
from scaletrain.train.optimizer import build_optimizer
from scaletrain.train.trainer import Trainer

VOCAB = 64


def coordinates(parametrization: str, width: int, steps: int = 4, lr: float = 1e-2,
                moe: bool = False) -> tuple[float, float]:
    """Mean |logit| and mean |last block output| after ``steps`` Adam steps on one fixed random batch (the
    coordinate check: under muP these stay put as the width grows, under the standard parametrization the
    Adam updates make them grow with the width). ``moe``: every feed-forward 4 experts top-2, each expert the
    dense width / 2 (the scaling grid's MoE family, whose widths grow with the model's)."""
    cfg = ModelConfig(vocab_size=VOCAB, dim=width, n_layers=2, n_heads=4, ffn_hidden_dim=0, multiple_of=16,
                      max_seq_len=32, parametrization=parametrization, mup_base_width=64)
    cfg = MoEShape(4, 2).apply(cfg) if moe else cfg
    model = build_model(cfg, seed=0)
    opt = build_optimizer(model, OptimConfig(lr=lr, weight_decay=0.0, implementation="foreach"),
                          torch.device("cpu"), width_mult(cfg))
    tokens = torch.randint(0, VOCAB, (8, 33), generator=torch.Generator().manual_seed(0))
    seen = {}
    model.layers["1"].register_forward_hook(lambda m, i, out: seen.__setitem__("block", out.abs().mean().item()))
    for _ in range(steps):
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        logits = model(tokens[:, :-1])
    return logits.abs().mean().item(), seen["block"]


@pytest.fixture
def one_thread():
    """Small matmuls: one thread is fastest on a busy machine (two contend with the other processes)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_coordinate_check_flat_under_mup_growing_under_standard(one_thread, moe):
    torch.manual_seed(0)
    widths = (64, 128, 256)
    for kind in ("standard", "mup"):
        coords = [coordinates(kind, w, moe=moe) for w in widths]
        logits, blocks = [c[0] for c in coords], [c[1] for c in coords]
        if kind == "mup":  # flat: within 1.5x of each other over a 4x width range
            assert max(logits) / min(logits) < 1.5, logits
            assert max(blocks) / min(blocks) < 1.5, blocks
        else:  # grows with the width (measured: logits 2.5x, block outputs ~40x from 64 to 256)
            assert logits[-1] / logits[0] > 2.0, logits
            assert blocks[-1] / blocks[0] > 4.0, blocks


def test_mup_at_base_width_is_the_standard_model():
    std = ModelConfig(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, ffn_hidden_dim=96, max_seq_len=32)
    mup = ModelConfig(**{**std.__dict__, "parametrization": "mup", "mup_base_width": 64})
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    a, b = build_model(std, seed=3), build_model(mup, seed=3)
    torch.testing.assert_close(a(tokens), b(tokens), rtol=0, atol=0)


def test_trainer_sets_the_hidden_matrices_lr_over_width_mult(tmp_path, tiny):
    over = tiny(tmp_path / "run", **{"model.parametrization": "mup", "model.mup_base_width": 16, "train.steps": 2,
                                     "schedule.name": "constant", "schedule.warmup_steps": 0, "optim.lr": 4e-3,
                                     "checkpoint.enabled": "false"})
    trainer = Trainer(load_config(None, over), log=False)
    trainer.step()
    lrs = sorted({round(g["lr"], 12) for g in trainer.optimizer.param_groups})
    assert lrs == [pytest.approx(4e-3 / 2), pytest.approx(4e-3)]  # dim 32 / base 16: width_mult 2
    trainer.close()


def test_mup_with_tied_embeddings_is_refused(tmp_path, tiny, capsys):
    over = tiny(tmp_path / "run", **{"model.parametrization": "mup", "model.tie_embeddings": "true"})
    assert main(["train"] + [f"--{k}={v}" for k, v in over.items()]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.tie_embeddings=false" in err[0]


def test_stacked_experts_are_decayed_hidden_matrices():
    """A mixture of experts' (E, out, in) weights are decayed as the dense feed-forward they replace and, under
    muP, in the hidden group (lr / width_mult); the router is a Linear inside a block, hidden too."""
    from scaletrain.train.optimizer import mup_param_groups, param_groups

    cfg = MoEShape(4, 2).apply(ModelConfig(vocab_size=VOCAB, dim=128, n_layers=2, n_heads=4, ffn_hidden_dim=0,
                                           multiple_of=16, max_seq_len=32, parametrization="mup", mup_base_width=64))
    model = build_model(cfg, seed=0)
    experts = {id(p) for n, p in model.named_parameters() if ".experts.w" in n}
    assert len(experts) == 6  # w1, w2, w3 of two sparse layers
    decay, _ = param_groups(model, 0.1)
    assert experts <= {id(p) for p in decay["params"]}
    hidden, *_ = mup_param_groups(model, 0.1, width_mult(cfg))
    assert hidden["lr_scale"] == 0.5 and experts <= {id(p) for p in hidden["params"]}
