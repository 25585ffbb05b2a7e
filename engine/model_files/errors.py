"""The error types checkpoint loading raises for bad or unsupported files."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint is corrupt or unsupported; the message names the file and the cause."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint path does not exist or holds no loadable files."""
