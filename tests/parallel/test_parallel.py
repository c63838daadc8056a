"""Single-process tests of the parallel package: degree validation (before any process group), stage
splitting, activation checkpointing, per-block compile, deterministic materialization, accumulation."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from scaletrain.config import ConfigError, JobConfig, ModelConfig, ParallelConfig
from scaletrain.model import Transformer, build_model
from scaletrain.parallel import ParallelDims
from scaletrain.parallel.activation_checkpoint import apply_ac
from scaletrain.parallel.compile import apply_compile
from scaletrain.parallel.context import check_context_parallel_supported
from scaletrain.parallel.init import materialize
from scaletrain.parallel.pipeline import split_model, stage_ids

TINY = ModelConfig(vocab_size=64, dim=64, n_layers=4, n_heads=4, ffn_hidden_dim=128, max_seq_len=32)


def dims_for(world: int, **fields) -> ParallelDims:
    return ParallelDims.from_config(ParallelConfig(**fields), world)


# -- degrees -> mesh -------------------------------------------------------------------------------------
def test_fill_and_mesh_order():
    dims = dims_for(8, dp_shard=-1, tp=2, pp=2)
    assert (dims.dp_shard, dims.zero_stage, dims.dp_size) == (2, 3, 2)
    assert list(dims.mesh_shape.items()) == [("pp", 2), ("dp_shard", 2), ("tp", 2)]
    assert dims_for(2, dp_replicate=-1).zero_stage == 0  # auto: DDP without sharding
    assert dims_for(1).mesh_shape == {}


@pytest.mark.parametrize("world, fields, message", [
    (2, {}, "= 1, but the world size is 2"),
    (4, dict(dp_replicate=-1, dp_shard=-1), "only one of"),
    (6, dict(tp=4, dp_shard=-1), "does not divide the world size 6"),
    (2, dict(dp_replicate=2, zero_stage=3), "zero_stage=3 shards with FSDP2"),
    (2, dict(dp_shard=2, zero_stage=1), "asks for DDP"),
    (4, dict(dp_replicate=2, tp=2), "DDP (dp_replicate without dp_shard) cannot wrap"),
    (4, dict(dp_replicate=2, pp=2), "not supported with parallel.pp > 1"),
    (4, dict(dp_shard=2, tp=2, zero_stage=1), "zero_stage=1"),
    (2, dict(dp_shard=2, low_comm="diloco"), "low_comm=diloco"),
    (2, dict(pp=2, pp_schedule="interleaved_1f1b"), "pp_virtual_stages >= 2"),
    (2, dict(pp=2, pp_virtual_stages=2), "needs parallel.pp_schedule=interleaved_1f1b"),
])
def test_invalid_degrees_are_one_line_config_errors(world, fields, message):
    with pytest.raises(ConfigError) as err:
        dims_for(world, **fields)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("fields, model, message", [
    (dict(tp=8, dp_shard=1), {}, "model.n_heads (4) must be divisible by parallel.tp (8)"),
    (dict(tp=2), dict(vocab_size=65), "model.vocab_size (65) must be divisible by parallel.tp (2)"),
    (dict(tp=2), dict(tie_embeddings=True), "tie_embeddings"),
    (dict(pp=3), {}, "model.n_layers (4) must be divisible by the pipeline stages"),
    (dict(pp=2, pp_schedule="interleaved_1f1b", pp_virtual_stages=4), {}, "stages"),
    (dict(pp=2, pp_microbatches=3), {}, "train.batch_size (8) must be divisible"),
    (dict(cp=2), dict(max_seq_len=64), "set model.max_seq_len"),
])
def test_model_checks(fields, model, message):
    world = 1
    for key in ("tp", "pp", "cp"):
        world *= fields.get(key, 1)
    dims = dims_for(world, **fields)
    with pytest.raises(ConfigError) as err:
        dims.check_model(ParallelConfig(**fields), dataclasses.replace(TINY, **model), seq_len=32, batch_size=8)
    assert message in str(err.value)


def test_trainer_rejects_bad_degrees_before_any_process_group(monkeypatch, tmp_path):
    from scaletrain.train.trainer import Trainer

    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = JobConfig()
    cfg = dataclasses.replace(cfg, parallel=ParallelConfig(tp=2, dp_shard=2),
                              train=dataclasses.replace(cfg.train, run_dir=str(tmp_path / "run"), device="cpu"))
    with pytest.raises(ConfigError, match="= 4, but the world size is 2"):
        Trainer(cfg)
    assert not dist.is_initialized() and not (tmp_path / "run").exists()


def test_context_parallel_refuses_cpu_clearly():
    with pytest.raises(ConfigError, match="not supported on this device"):
        check_context_parallel_supported(torch.device("cpu"))


# -- pipeline split --------------------------------------------------------------------------------------
def test_split_model_partitions_parameters():
    full = build_model(TINY, "cpu", seed=0)
    names = set(dict(full.named_parameters()))
    parts = [split_model(full, s, 4) for s in range(4)]
    per_stage = [set(dict(p.named_parameters())) for p in parts]
    assert set().union(*per_stage) == names
    assert sum(map(len, per_stage)) == len(names)  # disjoint
    assert parts[0].tok_embeddings is not None and parts[1].tok_embeddings is None
    assert parts[3].output is not None and parts[2].output is None
    assert list(parts[2].layers) == ["2"]
    assert stage_ids(1, pp=2, virtual_stages=2) == [1, 3]  # loop placement for interleaved 1F1B


# -- activation checkpointing and compile ----------------------------------------------------------------
def _loss_and_grads(model, tokens):
    model.zero_grad()
    loss = model(tokens).logsumexp(-1).mean()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("mode, every, wrapped", [("full", 2, 4), ("selective", 2, 2), ("selective", 3, 2)])
def test_activation_checkpointing_is_exact_and_keeps_names(mode, every, wrapped):
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    plain, ckpt = build_model(TINY, "cpu", seed=1), build_model(TINY, "cpu", seed=1)
    names = [n for n, _ in ckpt.named_parameters()]
    assert apply_ac(ckpt, mode, every) == wrapped
    assert [n for n, _ in ckpt.named_parameters()] == names
    loss_a, grads_a = _loss_and_grads(plain, tokens)
    loss_b, grads_b = _loss_and_grads(ckpt, tokens)
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))


@pytest.mark.slow
def test_per_block_compile_matches_eager():
    cfg = dataclasses.replace(TINY, n_layers=2)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    eager, compiled = build_model(cfg, "cpu", seed=1), build_model(cfg, "cpu", seed=1)
    apply_compile(compiled)
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in eager.named_parameters()]
    loss_a, grads_a = _loss_and_grads(eager, tokens)
    loss_b, grads_b = _loss_and_grads(compiled, tokens)
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


# -- materialization and accumulation --------------------------------------------------------------------
@pytest.mark.parametrize("distributed", [False, True])
def test_materialize_gives_the_single_process_weights(distributed):
    reference = build_model(TINY, "cpu", seed=5)
    with torch.device("meta"):
        model = Transformer(TINY)
    materialize([model], TINY, torch.device("cpu"), seed=5, distributed=distributed)
    for (name, a), (_, b) in zip(reference.state_dict().items(), model.state_dict().items()):
        assert torch.equal(a, b), name
    assert torch.equal(reference.rope_cos, model.rope_cos)


def test_grad_accumulation_matches_one_big_batch():
    from helpers import dist_parity

    one_batch = dist_parity.reference_losses(accum=1)
    accumulated = dist_parity.reference_losses(accum=4)  # 4 micro-batches of 2 rows == 1 batch of 8
    assert one_batch[-1] < one_batch[0] - 0.3  # it learns, so a wrong update would show
    for a, b in zip(accumulated, one_batch):
        assert abs(a - b) / abs(b) < 1e-5


def test_materialize_keeps_tied_embeddings_tied():
    """to_empty gives every module new parameter tensors: the path for split or replicated layouts (DDP, ZeRO-1)
    must tie the head to the embedding again, or the ranks train two matrices the checkpoint saves as one."""
    import torch

    from scaletrain.model import build_model
    from scaletrain.model.config import ModelConfig
    from scaletrain.parallel.init import materialize

    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, ffn_hidden_dim=64, max_seq_len=32,
                      tie_embeddings=True)
    reference = build_model(cfg, "cpu", seed=3)
    for distributed in (False, True):
        model = build_model(cfg, "meta")
        materialize([model], cfg, torch.device("cpu"), seed=3, distributed=distributed)
        assert model.output.weight is model.tok_embeddings.weight
        assert len(list(model.parameters())) == len(list(reference.parameters()))
        assert torch.equal(model.tok_embeddings.weight, reference.tok_embeddings.weight)
