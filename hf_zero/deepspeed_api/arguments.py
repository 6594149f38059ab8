"""``deepspeed.add_config_arguments(parser)``: the ``--deepspeed``/``--deepspeed_config`` flags
DeepSpeed adds to a script's argparse parser (``deepspeed/__init__.py``), so that scripts which
build their parser this way start. hf_zero reads the config from ``--zero_config`` (or
``--deepspeed ds.json``) through the Trainer, or from ``hf_zero.initialize(model, config)``.
"""

from __future__ import annotations

import argparse

__all__ = ["add_config_arguments"]


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's argument group to ``parser`` and return it (as DeepSpeed does)."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no impact on DeepSpeed backend)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser
