"""Config sources: path | dict | JSON string | base64 JSON | fragments -> a fresh ``dict``.

DeepSpeed JSON/YAML files, dicts and strings as ``HfDeepSpeedConfig`` takes them. Errors name the
file, line and column. Nothing here knows DeepSpeed's keys; :mod:`hf_zero.config.parse` does.
"""

from __future__ import annotations

import base64
import binascii
import copy
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Union

from hf_zero.config.errors import ZeroConfigError, show_value

__all__ = ["ConfigSource", "deep_merge", "load_raw"]

ConfigSource = Union[str, "os.PathLike[str]", Mapping[str, Any], list, tuple]
"""A path (``.json``/``.yaml``/``.yml``), a dict, a JSON string, base64-encoded JSON, or a list of
those (fragments deep-merged in order, later wins)."""


class _DuplicateKey(Exception):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # DeepSpeed rejects duplicate keys too (config_utils.dict_raise_error_on_duplicate_keys); json's
    # default silently keeps the last one, which hides copy-paste mistakes.
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _json_hint(text: str, err: json.JSONDecodeError) -> str:
    at = text[err.pos : err.pos + 2] if err.pos < len(text) else ""
    before = text[: err.pos].rstrip()[-1:] if err.pos else ""
    if at.startswith("//") or at.startswith("/*") or at.startswith("#"):
        return "JSON does not allow comments (DeepSpeed reads hjson); remove them"
    if before == "," and at[:1] in ("}", "]"):
        return "remove the trailing comma"
    if at.startswith("'"):
        return "JSON strings and keys need double quotes"
    return "fix the JSON syntax there"


def _loads_json(text: str, where: str) -> Any:
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as err:
        raise ZeroConfigError(
            f"{where}:{err.lineno}:{err.colno}: invalid JSON at line {err.lineno}, column {err.colno}: "
            f"{err.msg}; {_json_hint(text, err)}"
        ) from None
    except _DuplicateKey as dup:
        raise ZeroConfigError(
            f'{where}: key "{dup.key}" appears twice in one object; keep only one of them'
        ) from None


def _loads_yaml(text: str, where: str) -> Any:
    try:
        import yaml
    except ImportError:  # pragma: no cover - pyyaml is a dependency
        raise ZeroConfigError(f"{where}: reading YAML needs PyYAML; pip install pyyaml or use JSON") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        if mark is not None:
            line, col = mark.line + 1, mark.column + 1
            reason = getattr(err, "problem", None) or str(err)
            raise ZeroConfigError(
                f"{where}:{line}:{col}: invalid YAML at line {line}, column {col}: {reason}; fix the YAML syntax there"
            ) from None
        raise ZeroConfigError(f"{where}: invalid YAML: {err}; fix the YAML syntax") from None


def _read_file(path: Path) -> tuple[Any, str]:
    where = str(path)
    if not path.exists():
        raise ZeroConfigError(
            f"{where}: config file not found (working directory: {os.getcwd()}); check the path"
        )
    if path.is_dir():
        raise ZeroConfigError(f"{where}: is a directory; give the path of the .json or .yaml config file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ZeroConfigError(f"{where}: cannot read the config file ({err}); check its permissions and encoding") from None
    if path.suffix.lower() in (".yaml", ".yml"):
        return _loads_yaml(text, where), where
    return _loads_json(text, where), where


def _try_base64(text: str) -> str | None:
    # HF's HfDeepSpeedConfig and DeepSpeed accept urlsafe base64 of the JSON text.
    compact = "".join(text.split())
    if not compact or len(compact) % 4 == 1:
        return None
    padded = compact + "=" * (-len(compact) % 4)
    for decode in (base64.urlsafe_b64decode, base64.standard_b64decode):
        try:
            decoded = decode(padded.encode("ascii")).decode("utf-8").strip()
        except (binascii.Error, UnicodeDecodeError, UnicodeEncodeError, ValueError):
            continue
        if decoded.startswith("{"):
            return decoded
    return None


def load_raw(source: ConfigSource) -> tuple[dict[str, Any], str]:
    """Load one config source into a fresh ``dict`` (the caller's dict is deep-copied, never mutated).

    Args:
        source: A path (``str``/``PathLike``; ``.yaml``/``.yml`` read as YAML, anything else as JSON),
            a ``dict``, a JSON object string, or base64-encoded JSON.

    Returns:
        ``(config_dict, source_name)`` where ``source_name`` is the path, ``"<dict>"``,
        ``"<json string>"`` or ``"<base64 json>"``.

    Raises:
        ZeroConfigError: The file is missing or malformed (the message gives line and column), the
            string is neither a file, JSON nor base64 JSON, or the document is not an object.
    """
    if isinstance(source, Mapping):
        data, where = copy.deepcopy(dict(source)), "<dict>"
    elif isinstance(source, os.PathLike):
        data, where = _read_file(Path(os.fspath(source)).expanduser())
    elif isinstance(source, (str, bytes)):
        text = source.decode("utf-8") if isinstance(source, bytes) else source
        stripped = text.strip()
        if not stripped:
            raise ZeroConfigError("<json string>: the config is an empty string; give a path, a dict or a JSON object")
        if stripped[0] in "{[":
            data, where = _loads_json(stripped, "<json string>"), "<json string>"
        else:
            path = Path(stripped).expanduser()
            looks_like_path = (
                path.suffix.lower() in (".json", ".yaml", ".yml")
                or os.sep in stripped
                or path.exists()
            )
            decoded = None if looks_like_path else _try_base64(stripped)
            if decoded is not None:
                data, where = _loads_json(decoded, "<base64 json>"), "<base64 json>"
            elif looks_like_path or len(stripped) < 16:
                data, where = _read_file(path)
            else:
                raise ZeroConfigError(
                    f"{stripped[:60]!r}: is not an existing file, a JSON object or base64-encoded JSON; "
                    "give the path of a .json/.yaml config"
                )
    else:
        raise ZeroConfigError(
            f"<{type(source).__name__}>: a config must be a path, a dict, a JSON string or base64 JSON, "
            f"not {type(source).__name__}"
        )
    if data is None:
        data = {}  # an empty YAML file
    if not isinstance(data, dict):
        raise ZeroConfigError(
            f"{where}: the config must be an object ({{...}}) at the top level, got {type(data).__name__} "
            f"{show_value(data)[:60]}; wrap the settings in {{ }}"
        )
    return data, where


def deep_merge(base: dict, extra: dict, origin: str, origins: dict[str, str], prefix: str = "") -> None:
    for key, value in extra.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            deep_merge(base[key], value, origin, origins, dotted + ".")
        else:
            base[key] = copy.deepcopy(value)
            _mark_origin(value, origin, origins, dotted)
        origins.setdefault(dotted, origin)


def _mark_origin(value: Any, origin: str, origins: dict[str, str], dotted: str) -> None:
    # A replaced sub-tree comes wholly from `origin`: drop stale entries below it first.
    for key in [k for k in origins if k == dotted or k.startswith(dotted + ".")]:
        del origins[key]
    origins[dotted] = origin
    if isinstance(value, dict):
        for k, v in value.items():
            _mark_origin(v, origin, origins, f"{dotted}.{k}")

