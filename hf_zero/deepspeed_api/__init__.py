"""hf_zero's DeepSpeed API: ``import deepspeed`` for scripts written for DeepSpeed, on hf_zero.

Fine-tuning scripts import ``deepspeed`` for a handful of things: ``zero.GatheredParameters`` to
read or edit ZeRO-3 parameters, ``zero.Init`` around model construction, ``ZeroParamStatus`` and the
``ds_*`` parameter attributes, ``deepspeed.comm`` for ranks and barriers, and
``utils.zero_to_fp32`` to read checkpoints; they ask transformers' ``is_deepspeed_zero3_enabled()``
which path to take. This package answers those names on hf_zero's engine (``symbols.py`` is the
table), and refuses every other ``deepspeed`` name with what hf_zero offers instead.

It sits above the engine (it imports engine and checkpoint code; nothing imports it but the
installer ``hf-zero run`` calls). Installed by :func:`enable_deepspeed_compat`, never over a real
DeepSpeed. ``docs/deepspeed_compat.md`` has the tables: symbols, library branches, and the
transformers-4 names the swapped Trainer accepts.
"""

from hf_zero.deepspeed_api.install import deepspeed_compat_enabled, disable_deepspeed_compat, enable_deepspeed_compat

__all__ = ["enable_deepspeed_compat", "disable_deepspeed_compat", "deepspeed_compat_enabled"]
