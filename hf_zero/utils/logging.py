"""hf_zero's logger: visible by default, quiet if the application configures logging itself."""

from __future__ import annotations

import logging

__all__ = ["get_logger"]

_NAME = "hf_zero"


def get_logger() -> logging.Logger:
    """The ``hf_zero`` logger. Without a handler anywhere (a plain script, a notebook) it prints
    INFO and above to stderr, prefixed ``[hf_zero]``; an application that configured logging
    (root handlers, or handlers on this logger) keeps full control."""
    logger = logging.getLogger(_NAME)
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[hf_zero] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger
