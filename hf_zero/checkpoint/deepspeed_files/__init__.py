"""DeepSpeed's own ZeRO checkpoints (``checkpoint-N/global_stepN/``), read without DeepSpeed and
without running code from them.

- :mod:`.restricted_load`: ``torch.load(weights_only=True)`` with DeepSpeed's few pickled names
  as plain stand-ins; anything else is refused naming the file and the global.
- :mod:`.layout`: which files, which ZeRO stage, how many ranks, bf16 or not; the layouts hf_zero
  does not read are errors that say what to do.
- :mod:`.fp32_weights`: the full fp32 tensors, with the names and values of DeepSpeed's
  ``zero_to_fp32``, and Adam's per-parameter state (those of DeepSpeed's ``ds_to_universal``).

- :mod:`.engine_state`: all of it loaded into an hf_zero engine (weights, Adam's state, learning
  rates, loss scaler, counters), so a DeepSpeed run continues under hf_zero.

Used by ``hf-zero consolidate`` (:mod:`hf_zero.checkpoint.consolidate`), ``deepspeed.utils.zero_to_fp32``'s
functions (:mod:`hf_zero.deepspeed_api.zero_to_fp32`) and ``ZeroTrainer``'s ``resume_from_checkpoint``
(:mod:`hf_zero.integration.trainer_checkpoints`).
``training_args.bin`` and the checkpoint's own ``zero_to_fp32.py`` are never loaded or run.
"""

from hf_zero.checkpoint.deepspeed_files.fp32_weights import DeepSpeedWeights, WeightEntry
from hf_zero.checkpoint.deepspeed_files.layout import DeepSpeedLayout, find_deepspeed_checkpoint, is_deepspeed_checkpoint
from hf_zero.checkpoint.deepspeed_files.restricted_load import DEEPSPEED_GLOBALS, load_deepspeed_file

__all__ = [
    "DEEPSPEED_GLOBALS",
    "DeepSpeedLayout",
    "DeepSpeedWeights",
    "WeightEntry",
    "find_deepspeed_checkpoint",
    "is_deepspeed_checkpoint",
    "load_deepspeed_file",
]
