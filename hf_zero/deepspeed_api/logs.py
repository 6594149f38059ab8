"""``deepspeed.utils.logger``, ``deepspeed.utils.log_dist`` and
``deepspeed.runtime.utils.see_memory_usage``: the logging helpers scripts (and test suites written
for DeepSpeed) import at module level, with DeepSpeed's behaviour.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

__all__ = ["logger", "log_dist", "see_memory_usage"]


def _deepspeed_logger() -> logging.Logger:
    """The ``DeepSpeed`` logger as DeepSpeed makes it (``deepspeed/utils/logging.py``): INFO, to
    stdout, its own format, not propagated; scripts quiet it with ``logger.setLevel(...)``."""
    log = logging.getLogger("DeepSpeed")
    if not log.handlers:
        handler = logging.StreamHandler(stream=sys.stdout)
        handler.setFormatter(logging.Formatter(
            "[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    return log


logger = _deepspeed_logger()


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else -1


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """Log ``message`` on the given ranks, as DeepSpeed: every process logs before a process group
    exists; after, only the ranks listed (``[-1]``: all of them), prefixed ``[Rank N]``."""
    rank = _rank()
    should_log = rank == -1
    ranks = list(ranks or [])
    if ranks and not should_log:
        should_log = ranks[0] == -1 or rank in set(ranks)
    if should_log:
        logger.log(level, f"[Rank {rank}] {message}")


def see_memory_usage(message: str, force: bool = False) -> None:
    """Log accelerator and host memory on rank 0 when ``force`` (DeepSpeed logs nothing without
    it), then reset the accelerator's peak counter, as DeepSpeed does."""
    if not force or _rank() > 0:
        return
    from hf_zero.distributed import device as accel

    gib = 2**30
    logger.info(message)
    stats = accel.memory_stats()
    if stats is not None:
        logger.info(
            f"MA {stats['allocated'] / gib:.2f} GB  Max_MA {stats['max_allocated'] / gib:.2f} GB  "
            f"CA {stats['reserved'] / gib:.2f} GB  Max_CA {stats['max_reserved'] / gib:.2f} GB")
        accel.reset_peak_memory_stats()
    try:
        import psutil
    except ImportError:  # accelerate depends on it; only a stripped install lacks it
        return
    vm: Any = psutil.virtual_memory()
    logger.info(f"CPU Virtual Memory:  used = {(vm.total - vm.available) / gib:.2f} GB, percent = {vm.percent}%")
