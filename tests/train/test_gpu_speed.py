"""Issue 41's CPU-checkable GPU-speed settings: train.compile_mode (passed to torch.compile, refused in one line
where it cannot work) and the fused AdamW choice."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from scaletrain.config import ConfigError, OptimConfig, load_config
from scaletrain.parallel.compile import apply_compile
from scaletrain.train.optimizer import build_optimizer
from scaletrain.train.step import skips_on_device
from scaletrain.train.validate import check_runnable


@pytest.mark.parametrize("extra, device, message", [
    ({"train.compile_mode": "reduce-overhead"}, "cpu", "records CUDA graphs and needs a GPU"),
    ({"train.compile_mode": "reduce-overhead", "parallel.activation_checkpointing": "full"}, "cuda",
     "needs the whole model compiled as one graph"),
    ({"train.compile_mode": "max-autotune-no-cudagraphs", "train.compile": "false"}, "cpu",
     "needs train.compile=true"),
])
def test_a_compile_mode_that_cannot_work_is_refused_in_one_line(tmp_path, tiny, extra, device, message):
    cfg = load_config(None, tiny(tmp_path / "run", **extra))
    with pytest.raises(ConfigError, match=message) as err:
        check_runnable(cfg, 1, device, "bf16", here=False)
    assert "\n" not in str(err.value)


def test_compile_modes_that_can_work_pass(tmp_path, tiny):
    for extra, device in (({"train.compile_mode": "reduce-overhead"}, "cuda"),
                          ({"train.compile_mode": "max-autotune-no-cudagraphs", "train.compile": "true"}, "cpu")):
        check_runnable(load_config(None, tiny(tmp_path / "run", **extra)), 1, device, "bf16", here=False)


def test_the_mode_reaches_torch_compile_for_the_whole_model_and_per_block(monkeypatch):
    calls = []
    monkeypatch.setattr(nn.Module, "compile", lambda self, **kw: calls.append((type(self).__name__, kw)))
    model = nn.Module()
    model.layers = nn.ModuleDict({"0": nn.Linear(2, 2), "1": nn.Linear(2, 2)})
    apply_compile(model, whole_model=True, mode="reduce-overhead")
    apply_compile(model, whole_model=False, mode="max-autotune-no-cudagraphs")
    apply_compile(model, whole_model=True)
    assert calls == [("Module", {"mode": "reduce-overhead"}),
                     ("Linear", {"mode": "max-autotune-no-cudagraphs"}),
                     ("Linear", {"mode": "max-autotune-no-cudagraphs"}), ("Module", {})]


def test_auto_adamw_is_fused_where_every_parameter_can_be_and_foreach_otherwise():
    cpu = torch.device("cpu")
    plain = nn.Linear(4, 4)
    fused = build_optimizer(plain, OptimConfig(), cpu)
    assert all(g["fused"] for g in fused.param_groups) and skips_on_device(fused)
    mixed = nn.Module()
    mixed.a = nn.Linear(4, 4)
    mixed.b = nn.Linear(4, 4, device="meta")  # a parameter on another device type (as an offloaded one)
    other = build_optimizer(mixed, OptimConfig(), cpu)
    assert not any(g.get("fused") for g in other.param_groups) and all(g["foreach"] for g in other.param_groups)
    assert not skips_on_device(other)  # the trainer then reads each step's loss and norm, as before
