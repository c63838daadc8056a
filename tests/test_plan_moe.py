"""The planner's mixture of experts: total vs active parameters of published shapes, memory against a real step."""

import pytest

from scaletrain.config import load_config
from scaletrain.model.presets import active_params, num_params

# (preset, published total, published active, in billions): the model cards / papers. gpt-oss's card counts the
# unembedding but not the input embedding among the active parameters; the others count both tables.
PUBLISHED = [("olmoe-1b-7b", 6.9, 1.3, False), ("qwen3-30b-a3b", 30.5, 3.3, False),
             ("mixtral-8x7b", 46.7, 12.9, False), ("gpt-oss-20b", 21.0, 3.6, True)]


@pytest.mark.parametrize("preset,total,active,without_input_embedding", PUBLISHED)
def test_moe_presets_have_the_published_parameter_counts(preset, total, active, without_input_embedding):
    cfg = load_config(None, {"model.preset": preset}).model
    counted = active_params(cfg) - (cfg.vocab_size * cfg.dim if without_input_embedding else 0)
    assert num_params(cfg) / 1e9 == pytest.approx(total, rel=0.02)
    assert counted / 1e9 == pytest.approx(active, rel=0.03)
    assert active_params(cfg) < num_params(cfg)
