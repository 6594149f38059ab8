"""List every config key DeepSpeed reads, as dotted paths: run with a Python that has DeepSpeed.

    /tmp/ds-venv/bin/python scripts/deepspeed_config_keys.py > tests/unit/data/deepspeed_config_keys.json

Top-level keys are recorded while DeepSpeed's own ``DeepSpeedConfig._initialize_params`` reads a
config (a dict that notes every key looked up); the sections hf_zero parses key by key are listed
from DeepSpeed's pydantic models (field names and aliases) and, for dict-read sections, from the
keys their readers look up. The output is JSON: ``{"deepspeed": version, "keys": [...]}``.
hf_zero's test (tests/unit/test_config_schema.py) classifies every key against its tables.
"""

from __future__ import annotations

import json
import logging
import sys


class Recording(dict):
    """A dict that records the keys looked up in it (and in the dicts it returns)."""

    def __init__(self, data, prefix, seen):
        super().__init__(data)
        self.prefix, self.seen = prefix, seen

    def _note(self, key):
        if isinstance(key, str):
            self.seen.add(self.prefix + key)

    def _wrap(self, key, value):
        if isinstance(value, dict) and not isinstance(value, Recording):
            return Recording(value, f"{self.prefix}{key}.", self.seen)
        return value

    def __getitem__(self, key):
        self._note(key)
        return self._wrap(key, super().__getitem__(key))

    def get(self, key, default=None):
        self._note(key)
        return self._wrap(key, super().get(key, default))

    def __contains__(self, key):
        self._note(key)
        return super().__contains__(key)

    def keys(self):  # ``if KEY in param_dict.keys()`` is DeepSpeed's usual spelling
        owner = self

        class Keys(list):
            def __contains__(self, key):
                owner._note(key)
                return list.__contains__(self, key)

        return Keys(super().keys())


def model_keys(model, prefix: str) -> set[str]:
    keys = set()
    for name, field in model.model_fields.items():
        keys.add(prefix + name)
        if field.alias:
            keys.add(prefix + field.alias)
    return keys


def main() -> None:
    logging.disable(logging.WARNING)
    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (
        DeepSpeedZeroOffloadOptimizerConfig,
        DeepSpeedZeroOffloadParamConfig,
    )

    seen: set[str] = set()
    # Sections present (empty) so that readers which look inside a section when it exists do so.
    probe = {"checkpoint": {}, "data_types": {}, "aio": {}}
    cfg = DeepSpeedConfig.__new__(DeepSpeedConfig)
    cfg._initialize_params(Recording(probe, "", seen))
    keys = {k for k in seen}
    keys |= model_keys(DeepSpeedZeroConfig, "zero_optimization.")
    keys |= model_keys(DeepSpeedZeroOffloadOptimizerConfig, "zero_optimization.offload_optimizer.")
    keys |= model_keys(DeepSpeedZeroOffloadParamConfig, "zero_optimization.offload_param.")
    keys |= model_keys(DeepSpeedBF16Config, "bf16.")
    keys |= model_keys(DeepSpeedFP16Config, "fp16.")
    json.dump({"deepspeed": deepspeed.__version__, "keys": sorted(keys)}, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
