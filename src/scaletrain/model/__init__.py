"""The pure model: no torch.distributed, no environment variables, no globals."""

from scaletrain.model.decoder import Transformer, build_model
from scaletrain.model.presets import PRESETS, flops_per_token, num_params

__all__ = ["Transformer", "build_model", "PRESETS", "flops_per_token", "num_params"]
