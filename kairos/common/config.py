"""Frozen configuration dataclasses loaded from YAML, then environment, then flags.

Each component keeps its settings in one frozen dataclass; ``load_config`` builds it from
(in increasing precedence) the dataclass defaults, a YAML mapping, ``PREFIX_FIELD`` environment
variables and explicit overrides (parsed command-line flags). Values are converted to the
field's annotated type, so ``KAIROS_SIM_DECODE_NODES=4`` becomes an ``int``.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml

from kairos.common.errors import ConfigError

T = TypeVar("T")


def _convert(name: str, hint: Any, value: Any) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        is_none = value is None or (isinstance(value, str) and value.lower() in ("none", "null", ""))
        if is_none and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(name, inner[0], value)
    if origin is tuple:
        items = value.split(",") if isinstance(value, str) else list(value)
        return tuple(_convert(name, args[0], x.strip() if isinstance(x, str) else x) for x in items if x != "")
    if hint is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{name}: {value!r} is not a boolean")
    if isinstance(hint, type) and issubclass(hint, str | int | float):
        try:
            return hint(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{name}: {value!r} is not a valid {hint.__name__}") from None
    return value


def load_config(
    cls: type[T],
    yaml_path: str | Path | None = None,
    *,
    section: str | None = None,
    env_prefix: str | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> T:
    """Build ``cls`` from defaults < YAML (optionally one ``section`` of it) < env < overrides.

    Unknown keys in the YAML or the overrides are errors, not silently ignored.
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    values: dict[str, Any] = {}
    if yaml_path is not None:
        try:
            data = yaml.safe_load(Path(yaml_path).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read config {yaml_path}: {exc}") from exc
        if section is not None:
            data = data.get(section) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{yaml_path}: expected a mapping{f' under {section!r}' if section else ''}")
        unknown = sorted(set(data) - fields)
        if unknown:
            raise ConfigError(f"{yaml_path}: unknown keys {unknown}; known: {sorted(fields)}")
        values.update(data)
    if env_prefix:
        env = os.environ if environ is None else environ
        for name in fields:
            key = f"{env_prefix}{name.upper()}"
            if key in env:
                values[name] = env[key]
    for name, value in (overrides or {}).items():
        if name not in fields:
            raise ConfigError(f"unknown setting {name!r}; known: {sorted(fields)}")
        if value is not None:
            values[name] = value
    converted = {k: _convert(f"{cls.__name__}.{k}", hints[k], v) for k, v in values.items()}
    try:
        return cls(**converted)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{cls.__name__}: {exc}") from exc


def check_hostport(name: str, value: str) -> None:
    """Raise :class:`~kairos.common.errors.ConfigError` unless ``value`` is ``host:port``."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{name}: expected host:port, got {value!r}")
