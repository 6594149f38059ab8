"""Turn hf_zero's DeepSpeed API on (``hf-zero run`` does; ``hf_zero.enable_deepspeed_compat()``
for ``torchrun`` and notebooks) and off again (tests).

Installing does four things, all undone by :func:`disable_deepspeed_compat`:

1. appends the ``deepspeed`` import finder to ``sys.meta_path`` (``finder.py``);
2. sets hf_zero's ``is_deepspeed_zero3_enabled`` (``zero3_answer.py``) on
   ``transformers.integrations.deepspeed`` and ``transformers.integrations``, where scripts look it up;
   transformers' own modules keep the function they imported (and get the same answers from ours);
3. registers :func:`~hf_zero.deepspeed_api.zero.tag_zero_params` with ZeroTrainer, so sharded
   parameters carry ``ds_id``/``ds_status``/``ds_numel``/``ds_shape``;
4. nothing at all when a real DeepSpeed is importable: scripts then get DeepSpeed, and one log
   line says so (hf_zero's Trainer-side answers, ``is_deepspeed_enabled`` and
   ``_zero3_consolidated_16bit_state_dict``, do not depend on this API and stay).
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

from hf_zero.utils.logging import get_logger

__all__ = ["enable_deepspeed_compat", "disable_deepspeed_compat", "deepspeed_compat_enabled"]

logger = get_logger()


class _State:
    finder: Any = None
    originals: dict[tuple[Any, str], Any] = {}


def _real_deepspeed_origin() -> str | None:
    """Where an importable DeepSpeed (or anything importable as ``deepspeed``) lives, else None."""
    from hf_zero.deepspeed_api.finder import DeepSpeedApiFinder

    loaded = sys.modules.get("deepspeed")
    if loaded is not None:
        if getattr(loaded, "__hf_zero_deepspeed_api__", False):
            return None
        return getattr(loaded, "__file__", None) or repr(loaded)
    try:
        spec = importlib.util.find_spec("deepspeed")
    except (ImportError, ValueError):
        return None
    if spec is None or isinstance(spec.loader, DeepSpeedApiFinder):
        return None
    return spec.origin or ", ".join(spec.submodule_search_locations or []) or "an installed package"


def _patch(owner: Any, attr: str, value: Any) -> None:
    key = (owner, attr)
    if key not in _State.originals:
        _State.originals[key] = owner.__dict__.get(attr, _MISSING)
    setattr(owner, attr, value)


_MISSING = object()


def deepspeed_compat_enabled() -> bool:
    """Whether hf_zero's DeepSpeed API is installed in this process."""
    return _State.finder is not None


def enable_deepspeed_compat() -> bool:
    """Let scripts written for DeepSpeed run on hf_zero: ``import deepspeed`` gives hf_zero's
    DeepSpeed API (``deepspeed.zero.GatheredParameters``, ``zero.Init``, ``ZeroParamStatus``,
    ``deepspeed.comm``, ``deepspeed.utils.zero_to_fp32``, ``transformers.deepspeed``...), and
    ``is_deepspeed_zero3_enabled()`` tells a script whether hf_zero shards the parameters.

    ``hf-zero run`` calls it in every rank; call it yourself at the top of a script started with
    ``torchrun`` or in a notebook. Idempotent. Never shadows a real DeepSpeed: when one is
    importable nothing is installed and a log line says where it is.

    Returns:
        True when the API is installed (now or before), False when a real DeepSpeed was found.

    Example::

        >>> import hf_zero
        >>> hf_zero.enable_deepspeed_compat()
        True
        >>> from deepspeed import zero            # hf_zero's
    """
    if _State.finder is not None:
        return True
    origin = _real_deepspeed_origin()
    if origin is not None:
        logger.info(
            "hf_zero: DeepSpeed is installed (%s): scripts that import deepspeed get it, not hf_zero's DeepSpeed "
            "API, and DeepSpeed's zero.GatheredParameters does not know hf_zero's shards. Uninstall deepspeed "
            "(or use an environment without it) to have hf_zero answer those imports.", origin,
        )
        return False
    import transformers.integrations
    import transformers.integrations.deepspeed as hf_deepspeed

    from hf_zero.deepspeed_api.finder import DeepSpeedApiFinder
    from hf_zero.deepspeed_api.zero import tag_zero_params
    from hf_zero.deepspeed_api.zero3_answer import is_deepspeed_zero3_enabled
    from hf_zero.integration.trainer import ZeroTrainerMixin

    _State.finder = DeepSpeedApiFinder()
    sys.meta_path.append(_State.finder)  # last: a real module of the same name is found first
    _patch(hf_deepspeed, "is_deepspeed_zero3_enabled", is_deepspeed_zero3_enabled)
    _patch(transformers.integrations, "is_deepspeed_zero3_enabled", is_deepspeed_zero3_enabled)
    if tag_zero_params not in ZeroTrainerMixin.engine_listeners:
        ZeroTrainerMixin.engine_listeners.append(tag_zero_params)
    logger.debug("hf_zero: DeepSpeed API installed (import deepspeed gives hf_zero's)")
    return True


def disable_deepspeed_compat() -> None:
    """Undo :func:`enable_deepspeed_compat`: remove the finder and the ``deepspeed`` modules it
    created, restore transformers' function, stop tagging parameters (tags already set stay)."""
    if _State.finder is None:
        return
    from hf_zero.deepspeed_api.finder import TRANSFORMERS_ALIAS
    from hf_zero.deepspeed_api.zero import tag_zero_params
    from hf_zero.integration.trainer import ZeroTrainerMixin

    if _State.finder in sys.meta_path:
        sys.meta_path.remove(_State.finder)
    for name in [n for n in sys.modules if n == "deepspeed" or n.startswith("deepspeed.") or n == TRANSFORMERS_ALIAS]:
        module = sys.modules[name]
        if getattr(getattr(module, "__spec__", None), "loader", None) is _State.finder:
            del sys.modules[name]
    import transformers

    alias = transformers.__dict__.get("deepspeed")
    if alias is not None and getattr(getattr(alias, "__spec__", None), "loader", None) is _State.finder:
        del transformers.__dict__["deepspeed"]
    for (owner, attr), value in _State.originals.items():
        if value is _MISSING:
            owner.__dict__.pop(attr, None)
        else:
            setattr(owner, attr, value)
    _State.originals.clear()
    if tag_zero_params in ZeroTrainerMixin.engine_listeners:
        ZeroTrainerMixin.engine_listeners.remove(tag_zero_params)
    _State.finder = None
