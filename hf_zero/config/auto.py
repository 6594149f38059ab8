"""Resolve ``"auto"`` values from TrainingArguments, the model config and the run's size.

The rules are those of transformers' ``HfTrainerDeepSpeedConfig`` (``trainer_config_process`` then
``trainer_config_finalize`` in ``transformers/integrations/deepspeed.py``) plus DeepSpeed's own
batch-size derivation (``DeepSpeedConfig._set_batch_related_parameters``):

* an ``"auto"`` value takes the argument's value;
* an explicit value that contradicts the argument is a mismatch; every mismatch is collected and
  one :class:`~hf_zero.config.errors.ZeroConfigError` lists them all;
* a key absent from the file keeps its default and is not compared, except the three batch sizes
  and ``fp16/bf16.enabled``, which take the Trainer's values (accelerate adds missing precision
  sections the same way) -- see docs/config_reference.md, "auto".

Pure: takes and returns frozen :class:`~hf_zero.config.schema.ZeroConfig` objects
(``dataclasses.replace``), duck-types ``training_args`` and imports neither transformers nor
torch.distributed.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections import defaultdict
from typing import Any, Mapping

from hf_zero.config.errors import ZeroConfigError, show_value
from hf_zero.config.converters import _number
from hf_zero.config.schema import AUTO, ZeroConfig

__all__ = ["AUTO_RULES", "hidden_size_of", "resolve_auto", "trainer_auto_config"]

# DeepSpeed key -> (field path, where the value comes from). Used for messages and the docs table.
AUTO_RULES: dict[str, tuple[str, str]] = {
    "train_micro_batch_size_per_gpu": ("train_micro_batch_size_per_gpu", "--per_device_train_batch_size"),
    "gradient_accumulation_steps": ("gradient_accumulation_steps", "--gradient_accumulation_steps"),
    "train_batch_size": ("train_batch_size", "world_size x micro batch x gradient_accumulation_steps"),
    "gradient_clipping": ("gradient_clipping", "--max_grad_norm"),
    "fp16.enabled": ("fp16.enabled", "--fp16 or --fp16_full_eval"),
    "bf16.enabled": ("bf16.enabled", "--bf16 or --bf16_full_eval"),
    "optimizer.params.lr": ("optimizer.lr", "--learning_rate"),
    "optimizer.params.betas": ("optimizer.betas", "[--adam_beta1, --adam_beta2]"),
    "optimizer.params.eps": ("optimizer.eps", "--adam_epsilon"),
    "optimizer.params.weight_decay": ("optimizer.weight_decay", "--weight_decay"),
    "scheduler.params.warmup_min_lr": ("scheduler.params.warmup_min_lr", "0"),
    "scheduler.params.warmup_max_lr": ("scheduler.params.warmup_max_lr", "--learning_rate"),
    "scheduler.params.warmup_num_steps": (
        "scheduler.params.warmup_num_steps", "max(1, args.get_warmup_steps(num_training_steps))"),
    "scheduler.params.total_num_steps": ("scheduler.params.total_num_steps", "num_training_steps"),
    "zero_optimization.reduce_bucket_size": ("zero_optimization.reduce_bucket_size", "hidden_size^2"),
    "zero_optimization.stage3_prefetch_bucket_size": (
        "zero_optimization.prefetch_bucket_size", "int(0.9 x hidden_size^2)"),
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": (
        "zero_optimization.gather_16bit_weights_on_model_save",
        "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL (set by accelerate launch), else true"),
    "zero_optimization.stage3_param_persistence_threshold": (
        "zero_optimization.param_persistence_threshold", "10 x hidden_size"),
}
_DS_KEY = {path: ds_key for ds_key, (path, _) in AUTO_RULES.items()}

_BATCH = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def trainer_auto_config(zero_optimization: Mapping[str, Any], *, optimizer: bool = True) -> dict[str, Any]:
    """A DeepSpeed-style config with "auto" wherever the HF Trainer integration fills a value from
    ``TrainingArguments`` (batch sizes, accumulation, clipping, precision, and AdamW's
    hyper-parameters when ``optimizer``), around ``zero_optimization``: a file that drops into an
    existing Trainer script unchanged. No "scheduler" section: ``--lr_scheduler_type`` applies.

    >>> trainer_auto_config({"stage": 2}, optimizer=False)["gradient_clipping"]
    'auto'
    """
    cfg: dict[str, Any] = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto"},
    }
    if optimizer:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}}
    cfg["zero_optimization"] = dict(zero_optimization)
    return cfg


def hidden_size_of(model_config: Any) -> int | None:
    """The model width the HF integration sizes buckets by (``hidden_size``, else the largest of
    ``hidden_sizes``, also looked up under ``text_config`` for multimodal models).

    Args:
        model_config: A ``PretrainedConfig``, any object or mapping with those attributes, or None.

    Returns:
        The hidden size, or None when the config has none.
    """

    def get(obj: Any, name: str) -> Any:
        if isinstance(obj, Mapping):
            return obj.get(name)
        return getattr(obj, name, None)

    for cfg in (model_config, get(model_config, "text_config") if model_config is not None else None):
        if cfg is None:
            continue
        size = get(cfg, "hidden_size")
        if size is not None:
            return int(size)
        sizes = get(cfg, "hidden_sizes")
        if sizes:
            return int(max(sizes))
    return None


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == AUTO


def _same(a: Any, b: Any) -> bool:
    """Compare config and argument values as numbers ("8" == 8, 1e-05 == 0.00001)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    na, nb = _number(a), _number(b)
    if na is not None and nb is not None:
        return math.isclose(float(na), float(nb), rel_tol=1e-9, abs_tol=0.0)
    return a == b


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class _Resolver:
    def __init__(self, cfg: ZeroConfig):
        self.cfg = cfg
        self.updates: dict[str, Any] = {}
        self.problems: list[str] = []
        self.explicit = set(cfg.explicit_keys)

    def exists(self, path: str) -> bool:
        obj: Any = self.cfg
        for part in path.split("."):
            if obj is None or not hasattr(obj, part):
                return False
            obj = getattr(obj, part)
        return True

    def get(self, path: str) -> Any:
        if path in self.updates:
            return self.updates[path]
        obj: Any = self.cfg
        for part in path.split("."):
            obj = getattr(obj, part)
        return obj

    def fill(self, path: str, value: Any, hf_desc: str, *, must_match: bool = True, fill_absent: bool = False) -> None:
        """HF's ``fill_match``: ``"auto"`` -> ``value``; explicit and different -> mismatch."""
        if not self.exists(path):
            return
        current = self.get(path)
        if _is_auto(current):
            self.updates[path] = value
        elif path not in self.explicit:
            if fill_absent:
                self.updates[path] = value
        elif must_match and not _same(current, value):
            self.problems.append(
                f"{self.cfg.source}: {_DS_KEY.get(path, path)}={show_value(current)} but {hf_desc}; "
                'set it to "auto" or make them equal'
            )

    def apply(self) -> ZeroConfig:
        return _replace_paths(self.cfg, self.updates)


def _replace_paths(obj: Any, updates: Mapping[str, Any]) -> Any:
    if not updates:
        return obj
    direct: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = defaultdict(dict)
    for path, value in updates.items():
        head, _, rest = path.partition(".")
        if rest:
            nested[head][rest] = value
        else:
            direct[head] = value
    for head, sub in nested.items():
        direct[head] = _replace_paths(getattr(obj, head), sub)
    return dataclasses.replace(obj, **direct)


def _warmup_steps(args: Any, num_training_steps: int) -> int | None:
    getter = getattr(args, "get_warmup_steps", None)
    if callable(getter):
        return int(getter(num_training_steps))
    # transformers 4.x kept the ratio separately; 5.x folds it into a float warmup_steps < 1.
    steps = getattr(args, "warmup_steps", 0) or 0
    ratio = getattr(args, "warmup_ratio", 0) or 0
    if steps >= 1:
        return int(steps)
    if ratio or steps:
        return math.ceil(num_training_steps * (ratio or steps))
    return 0


def resolve_auto(
    cfg: ZeroConfig,
    *,
    training_args: Any = None,
    model_config: Any = None,
    world_size: int | None = None,
    num_training_steps: int | None = None,
) -> ZeroConfig:
    """Fill ``"auto"`` values and check explicit ones against the run's arguments.

    Args:
        cfg: A parsed config (``hf_zero.config.parse.parse_config``).
        training_args: ``transformers.TrainingArguments`` or any object with its attribute names
            (``per_device_train_batch_size``, ``gradient_accumulation_steps``, ``learning_rate``,
            ``adam_beta1``/``adam_beta2``/``adam_epsilon``, ``weight_decay``, ``max_grad_norm``,
            ``fp16``/``bf16``, optional ``world_size``, ``get_warmup_steps()``, ...). None leaves the
            values that need it as ``"auto"``.
        model_config: The model's config (``model.config``) for the hidden-size based bucket sizes,
            or None.
        world_size: Number of data-parallel ranks; defaults to ``training_args.world_size``.
        num_training_steps: Total optimizer steps, for the scheduler's ``total_num_steps`` and
            ``warmup_num_steps``.

    Returns:
        A new config; values nothing given here can resolve stay ``"auto"`` (see
        ``ZeroConfig.unresolved()``).

    Raises:
        ZeroConfigError: Every explicit value that contradicts an argument (each naming both), a
            ``train_batch_size`` that is not micro batch x accumulation x world size, hidden-size
            ``"auto"`` keys with a model config that has no hidden size, or fp16 and bf16 both on.
    """
    r = _Resolver(cfg)
    args = training_args
    ws = world_size if world_size is not None else _int_or_none(getattr(args, "world_size", None))
    batch_ok = True  # no batch-size mismatch reported: the DeepSpeed arithmetic check is meaningful

    if args is not None:
        micro = args.per_device_train_batch_size
        accum = args.gradient_accumulation_steps
        # auto_find_batch_size shrinks the micro batch at run time, so HF does not insist on a match.
        free_batch = bool(getattr(args, "auto_find_batch_size", False))
        r.fill("train_micro_batch_size_per_gpu", micro, f"--per_device_train_batch_size={micro}",
               must_match=not free_batch, fill_absent=True)
        r.fill("gradient_accumulation_steps", accum, f"--gradient_accumulation_steps={accum}", fill_absent=True)
        if ws is not None:
            if free_batch:
                # With auto_find_batch_size an explicit micro batch may stay; the total follows it.
                micro = _int_or_none(r.get("train_micro_batch_size_per_gpu")) or micro
            total = ws * micro * accum
            r.fill("train_batch_size", total,
                   f"world_size x --per_device_train_batch_size x --gradient_accumulation_steps = "
                   f"{ws} x {micro} x {accum} = {total}",
                   must_match=not free_batch, fill_absent=True)
        batch_ok = not r.problems

        clip = float(args.max_grad_norm)
        r.fill("gradient_clipping", clip, f"--max_grad_norm={clip}")
        fp16 = bool(args.fp16 or getattr(args, "fp16_full_eval", False))
        bf16 = bool(args.bf16 or getattr(args, "bf16_full_eval", False))
        r.fill("fp16.enabled", fp16, f"--fp16={str(fp16).lower()}", fill_absent=True)
        r.fill("bf16.enabled", bf16, f"--bf16={str(bf16).lower()}", fill_absent=True)

        if cfg.optimizer is not None:
            lr, eps, wd = float(args.learning_rate), float(args.adam_epsilon), float(args.weight_decay)
            betas = (float(args.adam_beta1), float(args.adam_beta2))
            r.fill("optimizer.lr", lr, f"--learning_rate={lr}")
            r.fill("optimizer.betas", betas, f"--adam_beta1, --adam_beta2={betas[0]}, {betas[1]}")
            r.fill("optimizer.eps", eps, f"--adam_epsilon={eps}")
            r.fill("optimizer.weight_decay", wd, f"--weight_decay={wd}")
        if cfg.scheduler is not None:
            lr = float(args.learning_rate)
            r.fill("scheduler.params.warmup_max_lr", lr, f"--learning_rate={lr}")
        if getattr(args, "save_on_each_node", False):
            # As transformers: node-local disks need one checkpoint copy per node.
            r.updates["checkpoint.use_node_local_storage"] = True

    if cfg.scheduler is not None:
        r.fill("scheduler.params.warmup_min_lr", 0.0, "0", must_match=False)  # not a Trainer argument
        if num_training_steps is not None:
            r.fill("scheduler.params.total_num_steps", num_training_steps,
                   f"the number of training steps={num_training_steps}")
            if args is not None:
                # deepspeed>=0.19.6 rejects warmup_num_steps <= 0; transformers passes max(1, ...).
                warmup = max(1, _warmup_steps(args, num_training_steps) or 0)
                r.fill("scheduler.params.warmup_num_steps", warmup,
                       f"--warmup_steps (for {num_training_steps} training steps)={warmup}")

    _resolve_hidden_size(r, model_config)
    _resolve_save_16bit(r)
    if batch_ok:
        _derive_batch(r, ws)

    if r.get("fp16.enabled") is True and r.get("bf16.enabled") is True:
        r.problems.append(
            f"{cfg.source}: fp16.enabled and bf16.enabled are both true after resolving \"auto\" "
            "(check --fp16/--bf16); enable only one of them"
        )
    if r.problems:
        raise ZeroConfigError(r.problems)
    return r.apply()


def _resolve_save_16bit(r: _Resolver) -> None:
    """accelerate fills ``stage3_gather_16bit_weights_on_model_save: "auto"`` from its
    ``zero3_save_16bit_model`` (the environment variable its launcher sets); without it, hf_zero's
    default (true: a ZeRO-3 ``save_model`` writes loadable weights)."""
    path = "zero_optimization.gather_16bit_weights_on_model_save"
    if not _is_auto(r.get(path)):
        return
    env = os.environ.get("ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL")
    r.fill(path, True if env is None else env.strip().lower() == "true", "", must_match=False)


def _resolve_hidden_size(r: _Resolver, model_config: Any) -> None:
    paths = ("zero_optimization.reduce_bucket_size", "zero_optimization.prefetch_bucket_size",
             "zero_optimization.param_persistence_threshold")
    waiting = [p for p in paths if _is_auto(r.get(p))]
    if not waiting or model_config is None:
        return
    hidden = hidden_size_of(model_config)
    if hidden is None:
        keys = ", ".join(_DS_KEY[p] for p in waiting)
        r.problems.append(
            f'{r.cfg.source}: {keys} are "auto" but the model config has neither hidden_size nor '
            "hidden_sizes; write numbers for them"
        )
        return
    # transformers fills the two stage-3 keys only at stage 3; below it they do nothing, and filling
    # them anyway leaves no "auto" behind.
    r.fill(paths[0], hidden * hidden, "", must_match=False)
    r.fill(paths[1], int(0.9 * hidden * hidden), "", must_match=False)
    r.fill(paths[2], 10 * hidden, "", must_match=False)


def _derive_batch(r: _Resolver, ws: int | None) -> None:
    """DeepSpeed's ``_set_batch_related_parameters`` for the batch sizes still open, then its
    ``train_batch_size == micro x accumulation x world_size`` assertion."""
    train, micro, accum = _BATCH

    def known(path: str) -> int | None:
        # An absent key holds a schema default (accumulation 1) that says nothing about the run.
        if path in r.explicit or path in r.updates:
            return _int_or_none(r.get(path))
        return None

    def absent(path: str) -> bool:
        return path not in r.explicit and path not in r.updates

    T, M, G = known(train), known(micro), known(accum)
    if ws is not None:
        if T and M and G is None:
            r.updates[accum] = T // M // ws
        elif T and G and M is None:
            r.updates[micro] = T // ws // G
        elif M and G and T is None:
            r.updates[train] = M * G * ws
        elif T and M is None and G is None and absent(micro) and absent(accum):
            r.updates[accum], r.updates[micro] = 1, T // ws
        elif M and T is None and G is None and absent(train) and absent(accum):
            r.updates[train], r.updates[accum] = M * ws, 1
    elif T and M and G is None and absent(accum):
        # DeepSpeed would divide by the world size, which is not known yet: leave it visibly open.
        r.updates[accum] = AUTO

    T, M, G = (_int_or_none(r.get(p)) for p in _BATCH)
    if ws is not None and None not in (T, M, G) and T != M * G * ws:
        r.problems.append(
            f"{r.cfg.source}: train_batch_size={T} but train_micro_batch_size_per_gpu x "
            f"gradient_accumulation_steps x world_size = {M} x {G} x {ws} = {M * G * ws}; make them "
            'consistent or set train_batch_size to "auto"'
        )
