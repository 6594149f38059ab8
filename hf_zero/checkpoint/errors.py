"""The errors of saving and loading checkpoints.

They live apart from :mod:`hf_zero.checkpoint.sharded` (which re-exports them) so the modules it
uses, such as :mod:`hf_zero.checkpoint.safe_load`, can raise them without importing it.
"""

from __future__ import annotations

import os

__all__ = ["CheckpointError", "IncompleteCheckpointError", "refused_file"]


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded; the message names the path and what to do."""


class IncompleteCheckpointError(CheckpointError, FileNotFoundError):
    """The directory exists but has no marker: its save did not finish."""


def refused_file(path: str | os.PathLike, reason: str) -> CheckpointError:
    """The error for a checkpoint file that holds something hf_zero never writes there.

    One wording for every file kind, so a user (and a test) recognises a refused file whichever
    reader met it.
    """
    return CheckpointError(f"{os.fspath(path)} is not a checkpoint file hf_zero wrote ({reason}); refusing to load it")
