"""What an accelerate config file and launch options mean for hf_zero (:class:`AccelerateSettings`),
and how ``hf-zero run`` hands it to every rank (one environment variable, :data:`SETTINGS_ENV`).

The data only: :mod:`hf_zero.config.sources.accelerate_yaml` reads files and launch options,
:mod:`hf_zero.config.sources.accelerate_plugins` applies accelerate's plugin rules to them, and both
produce these. No torch, transformers or accelerate import here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["SETTINGS_ENV", "AccelerateSettings", "WrapSpec", "settings_env_value", "settings_from_environment"]

SETTINGS_ENV = "HF_ZERO_ACCELERATE_SETTINGS"
"""The converted settings (JSON) ``hf-zero run`` gives each rank of an accelerate-form line;
read by :func:`settings_from_environment` (the Trainer and the ``Accelerator`` hand-off)."""


@dataclass(frozen=True)
class WrapSpec:
    """Which submodules become FSDP2 units (accelerate's ``fsdp_auto_wrap_policy``).

    Attributes:
        policy: ``TRANSFORMER_BASED_WRAP``, ``SIZE_BASED_WRAP`` or ``NO_WRAP``.
        transformer_classes: class names to wrap (TRANSFORMER_BASED_WRAP); empty = the model's
            ``_no_split_modules``, as accelerate does when no names are given.
        min_num_params: SIZE_BASED_WRAP's threshold: a submodule holding at least this many
            parameters not already in a unit becomes one (torch's ``size_based_auto_wrap_policy``).
    """

    policy: str
    transformer_classes: tuple[str, ...] = ()
    min_num_params: int | None = None


@dataclass(frozen=True)
class AccelerateSettings:
    """What an accelerate config file and launch options mean for hf_zero.

    Attributes:
        distributed_type: ``DEEPSPEED``, ``FSDP``, ``MULTI_GPU``, ``MULTI_CPU`` or ``NO``.
        zero_config: the DeepSpeed-style config hf_zero trains with (``"auto"`` values included, as
            accelerate's plugin leaves them), or None for DDP/one process (no ZeRO).
        mixed_precision: ``no``, ``fp16`` or ``bf16``.
        wrap: the FSDP wrap policy (None: hf_zero's default, the model's transformer blocks).
        state_dict_type: FSDP's ``fsdp_state_dict_type`` (None for DeepSpeed).
        activation_checkpointing: FSDP's ``fsdp_activation_checkpointing``: gradient checkpointing.
        low_memory_loading: ``zero3_init_flag`` / ``fsdp_cpu_ram_efficient_loading`` at stage 3:
            from_pretrained loads weights on local rank 0 only (hf_zero's zero.Init analogue).
        gradient_accumulation_steps: the launch value (DeepSpeed), or None.
        num_processes, num_machines, machine_rank, main_process_ip, main_process_port, gpu_ids,
        same_network, rdzv_backend: the process layout, as accelerate reads it.
        no_effect: ``"key: why"`` for each setting given that changes nothing under hf_zero.
        notes: other lines to show once (how a value was read).
        source: where the settings came from, for messages.
    """

    distributed_type: str
    zero_config: dict[str, Any] | None
    mixed_precision: str = "no"
    wrap: WrapSpec | None = None
    state_dict_type: str | None = None
    activation_checkpointing: bool = False
    low_memory_loading: bool | None = None
    gradient_accumulation_steps: int | None = None
    num_processes: int | None = None
    num_machines: int | None = None
    machine_rank: int | None = None
    main_process_ip: str | None = None
    main_process_port: int | None = None
    gpu_ids: str | None = None
    same_network: bool = False
    rdzv_backend: str | None = None
    no_effect: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=())
    source: str = "<accelerate options>"

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict (for ``hf-zero config --from-accelerate`` and for the ranks' environment)."""
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["wrap"] = None if self.wrap is None else {
            "policy": self.wrap.policy, "transformer_classes": list(self.wrap.transformer_classes),
            "min_num_params": self.wrap.min_num_params}
        out["no_effect"], out["notes"] = list(self.no_effect), list(self.notes)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> AccelerateSettings:
        """Inverse of :meth:`to_json`."""
        data = dict(data)
        wrap = data.pop("wrap", None)
        if wrap is not None:
            wrap = WrapSpec(policy=wrap["policy"], transformer_classes=tuple(wrap.get("transformer_classes") or ()),
                            min_num_params=wrap.get("min_num_params"))
        data["no_effect"] = tuple(data.get("no_effect") or ())
        data["notes"] = tuple(data.get("notes") or ())
        return cls(wrap=wrap, **{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


def settings_env_value(settings: AccelerateSettings) -> str:
    """The settings as the one environment variable ``hf-zero run`` gives every rank."""
    return json.dumps(settings.to_json(), sort_keys=True)


def settings_from_environment(env: Mapping[str, str] | None = None) -> AccelerateSettings | None:
    """The settings ``hf-zero run`` gave this rank (:data:`SETTINGS_ENV`), or None."""
    text = (os.environ if env is None else env).get(SETTINGS_ENV)
    if not text:
        return None
    return AccelerateSettings.from_json(json.loads(text))
