"""The one error type of the estimator."""

from __future__ import annotations

__all__ = ["EstimatorError"]


class EstimatorError(ValueError):
    """Bad estimator input (an unreadable model path, a malformed size, an impossible option).

    The message always quotes the offending value so a CLI user can fix it without a traceback.
    """
