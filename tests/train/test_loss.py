"""The step's loss in one place (train/loss.py): the auxiliary-term channel a model's modules use (an MoE router's
balancing loss, issue 51) joins the backward, is logged as the step's mean, and is dropped in evaluation."""

from __future__ import annotations

import json

import pytest
import torch

from scaletrain.config import JobConfig, ModelConfig, ParallelConfig, TrainConfig
from scaletrain.parallel import ParallelDims
from scaletrain.train.loss import AUXILIARY, cross_entropy, forward_loss, take_auxiliary
from scaletrain.train.step import StepOptions, build_parallel_training, training_step

MODEL = ModelConfig(vocab_size=64, dim=16, n_layers=2, n_heads=2, ffn_hidden_dim=32, max_seq_len=8)
WEIGHT = 100.0


def _built():
    cfg = JobConfig(model=MODEL, train=TrainConfig(seed=0, precision="fp32"))
    return build_parallel_training(cfg, ParallelDims.from_config(ParallelConfig(), 1), torch.device("cpu"))


def _leave_balance_term(module, _inputs, output):
    """A test-only auxiliary term, as a router would leave one: WEIGHT x the mean square of a block's output."""
    module.__dict__[AUXILIARY] = {"balance": WEIGHT * output.float().pow(2).mean()}


def _batches(accum: int):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 64, (2, 8), generator=gen), torch.randint(0, 64, (2, 8), generator=gen), None)
            for _ in range(accum)]


def test_an_auxiliary_term_joins_the_gradient_and_is_logged_as_the_step_mean():
    pm, optimizer = _built()
    model = pm.modules[0]
    model.layers["1"].register_forward_hook(_leave_balance_term)
    batches = _batches(2)
    # The reference: the same two micro-batches' (cross-entropy + term) / 2, by hand.
    expected_loss, expected_term = 0.0, 0.0
    for inputs, targets, _ in batches:
        ce = cross_entropy(model(inputs), targets)
        term = take_auxiliary(model)["balance"]
        ((ce + term) / 2).backward()
        expected_loss, expected_term = expected_loss + float(ce) / 2, expected_term + float(term) / 2
    expected_grads = [p.grad.clone() for p in model.parameters()]
    optimizer.zero_grad(set_to_none=True)
    seen = []

    def before_update(loss: float, grad_norm: float) -> bool:
        seen.append([p.grad.clone() for p in model.parameters()])
        return False  # keep the weights: only the gradient is compared

    result = training_step(pm, optimizer, iter(batches), 2, StepOptions(grad_clip=0.0, before_update=before_update))
    assert result.loss == pytest.approx(expected_loss, rel=1e-6)  # the objective's loss, without the term
    assert result.auxiliary == {"balance": pytest.approx(expected_term, rel=1e-6)}
    assert expected_term > 0.01  # a term big enough to move the gradient
    for got, want in zip(seen[0], expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_a_model_without_auxiliary_terms_logs_none_and_evaluation_drops_them():
    pm, optimizer = _built()
    assert training_step(pm, optimizer, iter(_batches(1)), 1, StepOptions(grad_clip=1.0)).auxiliary == {}
    model = pm.modules[0]
    model.layers["0"].register_forward_hook(_leave_balance_term)
    inputs, targets, _ = _batches(1)[0]
    with torch.no_grad():
        assert forward_loss(pm, inputs, targets).item() == cross_entropy(model(inputs), targets).item()
    assert take_auxiliary(model) != {}  # the plain call above left one; forward_loss cleared its own
    assert take_auxiliary(model) == {}


# Under every engine (tests/helpers/auxiliary_parity.py, one launch of 2 gloo ranks): the pipeline, where torch's
# schedule backpropagates a stage before the last from its output's gradient only, and DeepSpeed, whose step
# calls the loss itself, give the plain path's loss, gradients and logged terms with the same test-only terms.
PIPELINES = ["pp_1f1b", "pp_gpipe", "pp_interleaved", "pp_1f1b_accum2"]
DEEPSPEED = ["ds2", "ds3"]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from helpers.launch import HELPERS, torchrun
    from scaletrain.train.deepspeed_engine.ds_config import deepspeed_missing_reason

    out = tmp_path_factory.mktemp("auxiliary") / "results.json"
    strategies = PIPELINES + (DEEPSPEED if deepspeed_missing_reason() is None else [])
    torchrun(2, str(HELPERS / "auxiliary_parity.py"), "--out", str(out), "--strategies", ",".join(strategies))
    return {r["strategy"]: r["ranks"] for r in json.loads(out.read_text())}


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", PIPELINES)
def test_auxiliary_terms_of_every_pipeline_stage_match_the_plain_path(engines, strategy):
    """Terms left on the first stage and on the last (interleaved: on stages 0 and 3 of 4) reach the gradients
    of the parameters each rank holds, the logged terms are the whole pipeline's, and evaluation drops them
    (after an evaluation, when torch's schedule infers its stages' shapes again on uninitialised tensors)."""
    ranks = engines[strategy]
    assert ranks[0]["terms_move_grads"] > 0.5  # ignoring the terms would miss the gradients by this much
    assert ranks[0]["reference_auxiliary"]["balance"] > 1e-3
    for record in ranks:
        assert record["auxiliary_names"] == ["balance", "router_z"]
        for key in ("loss", "grad_norm", "auxiliary"):
            assert record[key] < 1e-5, (key, record[key])
        assert record["grads"] < 1e-4, record["grads"]  # measured 3.5e-5 (of each parameter's largest gradient)
    assert {name for record in ranks for name in record["grad_params"]} >= {"tok_embeddings.weight", "layers.0."
                                                                            "feed_forward.w1.weight", "output.weight"}
    assert [record.get("eval") for record in ranks] == [None, pytest.approx(0.0, abs=1e-6)]  # the last stage's


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", DEEPSPEED)
def test_auxiliary_terms_under_deepspeed_match_the_native_engine(engines, strategy):
    """DeepSpeed ZeRO-2 / ZeRO-3 over 2 data-parallel ranks against the native engine's DDP with the same terms:
    the step's loss, the gradient norm (which ignoring the terms would change: the pipeline test measures by how
    much) and each rank's logged terms."""
    if strategy not in engines:
        pytest.skip("DeepSpeed is not installed")
    for record in engines[strategy]:
        assert record["auxiliary_names"] == ["balance", "router_z"]
        for key in ("loss", "grad_norm", "auxiliary", "eval"):
            assert record[key] < 1e-5, (key, record[key])
