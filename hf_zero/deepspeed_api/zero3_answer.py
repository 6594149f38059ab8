"""``is_deepspeed_zero3_enabled()`` under hf_zero: who asks decides what the answer means.

Scripts ask it to learn whether parameters are sharded and must be gathered to be read or saved
(Qwen: ``_zero3_consolidated_16bit_state_dict()`` when true, ``model.state_dict()`` otherwise).
transformers, peft and accelerate ask it to pick DeepSpeed code paths that call DeepSpeed
(``zero.Init`` around model construction, ``_load_state_dict_into_zero3_model``...). hf_zero shards
the model when the Trainer builds its engine, after all of that construction code has run, so those
libraries' plain paths are the right ones, except for ``generate()``, which must keep every rank
stepping while any rank still generates (:data:`CALLER_RULES`).

A script gets DeepSpeed's answer for the stage it asked for: true at stage 3 only. Scripts branch
on it (Qwen's LoRA recipe refuses to start at ZeRO-3 on a base model; its stage-2 branch reads the
parameters one by one), so answering true at stage 2 sent them down the wrong road. That hf_zero's
stage 2 also shards parameters between steps (FSDP2 with ``reshard_after_forward=False``) is an
internal matter, decided elsewhere and not by this answer: ``generate()`` must keep every rank
stepping at stages 2 and 3 (the ``sharded`` rules below); a script's ``model.state_dict()`` is
gathered onto rank 0 (``integration/script_state_dict.py``); and sharded parameters carry
``ds_id``, so the ``maybe_zero_3`` reads of the stage-2 branch gather them through
``zero.GatheredParameters``. The stage comes from the zero config of the latest
``TrainingArguments`` built with one (as transformers keeps the DeepSpeed config of the latest
arguments), else from ``--zero_config``/``--deepspeed`` on the command line.

:data:`LIBRARY_BRANCHES` is the survey of the installed libraries' DeepSpeed branches and what
each does under hf_zero; ``docs/deepspeed_compat.md`` renders both tables.
"""

from __future__ import annotations

import fnmatch
import sys
from dataclasses import dataclass

__all__ = [
    "CallerRule",
    "CALLER_RULES",
    "LibraryBranch",
    "LIBRARY_BRANCHES",
    "is_deepspeed_zero3_enabled",
    "parameters_sharded",
    "rule_for",
    "zero_stage",
]


@dataclass(frozen=True)
class CallerRule:
    """How :func:`is_deepspeed_zero3_enabled` answers code of the modules matching ``pattern``."""

    pattern: str
    """``fnmatch`` pattern on the calling module's ``__name__``."""
    answer: str
    """``stage 3`` (DeepSpeed's answer: true at stage 3), ``sharded`` (true at stages 2 and 3: the
    parameters are shards between steps) or ``false``."""
    why: str


_GENERATE = ("generate() defaults synced_gpus to it: every rank keeps running forwards until all have "
             "finished, since each forward of a sharded model gathers parameters with collectives")
_BEFORE_SHARDING = ("its DeepSpeed branches run while the model is built, loaded, resized or given adapters, "
                    "before hf_zero shards it; there the tensors are whole (or meta under low-memory loading), "
                    "so the plain branches are right, and the DeepSpeed ones would call zero.Init and read "
                    "DeepSpeed's own config")

CALLER_RULES: tuple[CallerRule, ...] = (
    CallerRule("transformers.generation.*", "sharded", _GENERATE),
    CallerRule("transformers.models.*.generation_*", "sharded", _GENERATE),
    CallerRule("transformers.trainer_seq2seq", "sharded", "Seq2SeqTrainer's generating evaluation: " + _GENERATE),
    CallerRule("transformers.*", "false", _BEFORE_SHARDING),
    CallerRule("peft.*", "false", _BEFORE_SHARDING),
    CallerRule("accelerate.*", "false", "accelerate decides on its own DeepSpeed plugin, which hf_zero never creates"),
    CallerRule("trl.*", "false", "TRL's branch wraps models with deepspeed.initialize"),
    CallerRule("hf_zero.*", "false", "hf_zero never asks; listed so that its own code gets transformers' answer"),
    CallerRule("*", "stage 3", "a script (or the user's own module): DeepSpeed's answer for the stage it asked for. "
               "At stage 2 its branch for whole parameters still gets whole tensors: `model.state_dict()` is "
               "gathered onto rank 0, and parameters carry `ds_id`, so `maybe_zero_3`-style reads gather them"),
)


def rule_for(module_name: str) -> CallerRule:
    """The first rule of :data:`CALLER_RULES` whose pattern matches ``module_name``."""
    for rule in CALLER_RULES:
        if fnmatch.fnmatchcase(module_name, rule.pattern):
            return rule
    raise AssertionError("CALLER_RULES ends with '*'")  # pragma: no cover


def zero_stage() -> int | None:
    """The ZeRO stage of the run's zero config (the latest arguments', else the command line's);
    None without one."""
    from hf_zero.integration.arguments import latest_zero_config

    config = latest_zero_config()
    if config is None:
        config = _command_line_config()
    return None if config is None else int(config.stage)


def parameters_sharded() -> bool:
    """True when the run's zero config has stage 2 or 3 (the parameters are, or will be, sharded)."""
    stage = zero_stage()
    return stage is not None and stage >= 2


def _command_line_config():
    """The config named by ``--zero_config``/``--deepspeed`` in ``sys.argv``, parsed (None when
    absent or unreadable: the script's own argument parsing reports a bad file)."""
    from hf_zero.engine.materialize import zero_config_from_argv

    source = zero_config_from_argv(sys.argv[1:])
    if source is None:
        return None
    try:
        from hf_zero.config.parse import parse_config

        return parse_config(source)
    except Exception:
        return None


def is_deepspeed_zero3_enabled() -> bool:
    """hf_zero's ``transformers.integrations.deepspeed.is_deepspeed_zero3_enabled``: for a
    script, DeepSpeed's answer (ZeRO stage 3); for library code, the answer of
    :data:`CALLER_RULES` (false, except around ``generate()``: whether the parameters are sharded)."""
    try:
        caller = sys._getframe(1).f_globals.get("__name__", "") or ""
    except ValueError:  # called from the interpreter's top frame
        caller = ""
    answer = rule_for(caller).answer
    if answer == "false":
        return False
    if answer == "sharded":
        return parameters_sharded()
    return zero_stage() == 3


# ----------------------------------------------------------------------------------------- survey
@dataclass(frozen=True)
class LibraryBranch:
    """One place in the installed libraries that branches on DeepSpeed."""

    library: str
    where: str
    branch: str
    """What the DeepSpeed branch does."""
    under_hf_zero: str
    """What happens when the script runs under hf_zero."""


_Z3_FALSE = "is_deepspeed_zero3_enabled() answers false here (caller rule `transformers.*`): "

LIBRARY_BRANCHES: tuple[LibraryBranch, ...] = (
    LibraryBranch("transformers", "modeling_utils: `_from_config`, `get_init_context` (from_pretrained)",
                  "builds the model inside `deepspeed.zero.Init(config_dict_or_path=deepspeed_config())`",
                  _Z3_FALSE + "the model is built normally; at stage 3 under `hf-zero run`, hf_zero's low-memory "
                  "loading builds it on the meta device on local ranks other than 0 (zero.Init's purpose)"),
    LibraryBranch("transformers", "modeling_utils: `_load_pretrained_model`, `_move_missing_keys_from_meta_to_device`, "
                  "`_initialize_missing_keys`; integrations/deepspeed: `_load_state_dict_into_zero3_model`, "
                  "`initialize_weights_zero3`",
                  "rank 0 reads the checkpoint and copies it into partitioned parameters under "
                  "`GatheredParameters(..., modifier_rank=0)`",
                  _Z3_FALSE + "weights load normally; the engine copies rank 0's weights into every rank's shards"),
    LibraryBranch("transformers", "modeling_utils: `resize_token_embeddings`, `_get_resized_embeddings`, "
                  "`_get_resized_lm_head`",
                  "reads sizes and copies old rows inside `GatheredParameters`",
                  _Z3_FALSE + "scripts resize before building the Trainer, on whole tensors; on a meta rank the "
                  "mean-initialisation of new rows is skipped (materialize.py) and rank 0's rows are used"),
    LibraryBranch("transformers", "integrations/accelerate: `check_and_set_device_map`, `accelerate_dispatch`",
                  "ignores `device_map` under ZeRO-3",
                  _Z3_FALSE + "device_map behaves as without DeepSpeed (hf_zero places the model itself)"),
    LibraryBranch("transformers", "generation/utils: `generate` (synced_gpus default); trainer_seq2seq: "
                  "`prediction_step`",
                  "sets `synced_gpus` so that finished ranks keep running forwards",
                  "answers true at stages 2 and 3 (caller rules `transformers.generation.*`, "
                  "`transformers.trainer_seq2seq`): every rank keeps stepping, as the sharded forward needs"),
    LibraryBranch("transformers", "trainer_pt_utils: `get_model_param_count`",
                  "counts `ds_numel` instead of `numel()`",
                  _Z3_FALSE + "a DTensor's `numel()` is the full size already"),
    LibraryBranch("transformers", "models: wav2vec2, hubert, sew, sew_d, wavlm, unispeech(_sat), data2vec_audio, "
                  "wav2vec2_bert, wav2vec2_conformer, seamless_m4t(_v2), speecht5, vits, patchtst, distilbert, "
                  "nllb_moe",
                  "weight-norm convolutions and sinusoidal tables initialised under `GatheredParameters` with "
                  "`register_external_parameter`; LayerDrop forced off so ranks stay in step",
                  _Z3_FALSE + "initialisation runs on whole tensors before sharding. LayerDrop is NOT forced off: "
                  "set the model's layerdrop to 0 for multi-rank training at stages 2 and 3"),
    LibraryBranch("transformers", "trainer: about 30 `self.is_deepspeed_enabled` branches (`deepspeed_init`, "
                  "DeepSpeed dtype cast of inputs, `self.deepspeed.config`, DeepSpeed checkpoint save and load)",
                  "hands training, saving and resuming to DeepSpeed",
                  "the Trainer's own code reads accelerate's value (false); ZeroTrainer's hooks train, save and "
                  "resume; only a script's code sees true (integration/deepspeed_surface.py)"),
    LibraryBranch("peft", "utils/integrations: `gather_params_ctx`, `check_deepspeed_zero3_enabled` (LoRA "
                  "initialisations such as PiSSA/OLoRA/LoftQ/EVA, DoRA's weight norm, trainable tokens, CPT, "
                  "AdaLoRA)",
                  "gathers the base weight with `deepspeed.zero.GatheredParameters`; trainable tokens collect rows "
                  "on `torch.cuda.current_device()` and broadcast them",
                  "answers false (caller rule `peft.*`): adapters are created before hf_zero shards the model, on "
                  "whole tensors, and rank 0's values reach every rank when it does"),
    LibraryBranch("peft", "utils/other `ModulesToSaveWrapper.update`, peft_model / mixed_model parameter counts",
                  "use `ds_numel` when a parameter has 0 elements (partitioned by zero.Init)",
                  "parameters are never empty under hf_zero; DTensor `numel()` is the full size"),
    LibraryBranch("peft", "tuners (lora, ia3, vblora, fourierft, ...) and `peft_model`: `ds_shape`",
                  "read the full shape of a partitioned weight from `ds_shape`",
                  "a DTensor's shape is the full shape; `ds_shape` (set on sharded parameters) agrees"),
    LibraryBranch("peft", "tuners/adalora/layer: `deepspeed_config()` then `deepspeed.utils.safe_get_full_grad`",
                  "reads full gradients from DeepSpeed",
                  "`deepspeed_config()` stays None (hf_zero never sets transformers' DeepSpeed config): plain path"),
    LibraryBranch("accelerate", "state: `from deepspeed import comm`; accelerator: `prepare_deepspeed`, "
                  "`deepspeed.initialize`; utils/deepspeed: DeepSpeed's CPU Adam/Adagrad/Lion; utils/dataclasses: "
                  "`set_z3_leaf_modules`; utils/operations: `GatheredParameters` wrapper",
                  "taken when accelerate's distributed type is DEEPSPEED (a DeepSpeed plugin)",
                  "never taken: hf_zero routes `--deepspeed` to `--zero_config`, so no DeepSpeed plugin and no "
                  "ACCELERATE_USE_DEEPSPEED"),
    LibraryBranch("accelerate", "utils/other: `extract_model_from_parallel`; utils/imports: `is_deepspeed_available`",
                  "imports `deepspeed.DeepSpeedEngine` when DeepSpeed is installed",
                  "`is_deepspeed_available()` stays false: hf_zero's namespace has no package metadata (transformers' "
                  "check is the same)"),
    LibraryBranch("trl", "grpo_trainer, rloo_trainer: `self.is_deepspeed_enabled`; trainer/utils: "
                  "`is_deepspeed_zero3_enabled()` then `GatheredParameters` over `ds_status`; models/utils, "
                  "callbacks, distributed: `import deepspeed`",
                  "wraps reference models with `deepspeed.initialize`, gathers the LM head for generation",
                  "TRL's code reads accelerate's `is_deepspeed_enabled` (false) and gets false from "
                  "`is_deepspeed_zero3_enabled()` (caller rule `trl.*`): TRL's plain paths"),
    LibraryBranch("trl", "import_utils: `is_deepspeed_available` (find_spec only, no metadata check)",
                  "reports DeepSpeed's version in `trl env`",
                  "answers true while hf_zero's namespace is installed; only `trl env` reads it (run it outside "
                  "`hf-zero run`)"),
)
