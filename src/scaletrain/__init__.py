"""scaletrain: from raw text to a trained language model, and what it will cost before you start."""

__version__ = "0.1.0"
