"""Make an unmodified Trainer script train with hf_zero: swap transformers' classes for ours.

``hf-zero run script.py ...`` calls :func:`use_hf_zero_trainer` in every rank before the script
runs, so ``from transformers import Trainer, TrainingArguments`` (and subclasses the script
defines) get the hf_zero versions, and ``--zero_config``/``--deepspeed`` reach hf_zero. It also
installs hf_zero's DeepSpeed API (``import deepspeed`` in the script; never over a real
DeepSpeed). Without a zero config the swapped classes train exactly like transformers' own; they
additionally accept the transformers-4 names scripts still pass (integration/versions.py).
"""

from __future__ import annotations

__all__ = ["use_hf_zero_trainer"]


def use_hf_zero_trainer(deepspeed_api: bool = True) -> None:
    """Replace ``Trainer``, ``Seq2SeqTrainer``, ``TrainingArguments`` and
    ``Seq2SeqTrainingArguments`` in ``transformers`` (top level and their modules) with hf_zero's,
    and (``deepspeed_api``) install hf_zero's DeepSpeed API (:func:`hf_zero.enable_deepspeed_compat`).
    Idempotent."""
    import transformers
    import transformers.trainer
    import transformers.trainer_seq2seq
    import transformers.training_args
    import transformers.training_args_seq2seq

    from hf_zero.integration.arguments import ZeroSeq2SeqTrainingArguments, ZeroTrainingArguments
    from hf_zero.integration.trainer import ZeroSeq2SeqTrainer, ZeroTrainer

    swaps = {
        "Trainer": (ZeroTrainer, transformers.trainer),
        "Seq2SeqTrainer": (ZeroSeq2SeqTrainer, transformers.trainer_seq2seq),
        "TrainingArguments": (ZeroTrainingArguments, transformers.training_args),
        "Seq2SeqTrainingArguments": (ZeroSeq2SeqTrainingArguments, transformers.training_args_seq2seq),
    }
    for name, (cls, module) in swaps.items():
        setattr(transformers, name, cls)
        setattr(module, name, cls)
    if deepspeed_api:
        from hf_zero.deepspeed_api import enable_deepspeed_compat

        enable_deepspeed_compat()
