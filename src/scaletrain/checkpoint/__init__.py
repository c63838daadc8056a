"""Checkpointing as one component over stateful objects, and export."""

from scaletrain.checkpoint.manager import CheckpointError, CheckpointManager

__all__ = ["CheckpointManager", "CheckpointError"]
