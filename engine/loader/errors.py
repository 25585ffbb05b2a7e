"""The checkpoint error types; their home is `engine.model_files.errors` (torch-free)."""

from engine.model_files.errors import CheckpointError, CheckpointNotFoundError

__all__ = ["CheckpointError", "CheckpointNotFoundError"]
