"""Where configs come from: DeepSpeed JSON/YAML files, dicts, JSON and base64 strings (``readers``)."""

from hf_zero.config.sources.readers import ConfigSource, deep_merge, load_raw

__all__ = ["ConfigSource", "deep_merge", "load_raw"]
