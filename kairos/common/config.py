"""Configuration declared once: a frozen dataclass per component, its flags, environment variables
and YAML section derived from it.

A component's settings are the fields of one frozen dataclass. A field declared with
:func:`setting` carries its help text (and, where a user already knows another spelling, its flag
names); a field declared with :func:`part` nests another component's dataclass whole, so a
composite (the dispatcher: its cluster view, decider, request limits...) never copies its parts'
fields. Every setting has one name, the field's, in every medium:

- the flag ``--name-with-dashes`` (:func:`add_flags`),
- the environment variable ``PREFIX_NAME`` (``KAIROS_DISPATCHER_ALPHA``),
- the key ``name`` of the component's YAML section (flat: ``dispatcher: {alpha: 1.3}``).

A part's settings join its composite's names (a part may prefix them, and the composite may omit
those it sets itself, such as the listen port a launcher picks). Two parts declaring the same
name (with one type and one default) share it: the one value goes to both, as the dispatcher's
``stale_after_s`` goes to its membership rules and its decider alike.

:func:`load_config` builds the dataclass from, in increasing precedence, its defaults, a YAML
section, the environment and explicit overrides (parsed flags); values are converted to each
field's annotated type, so ``KAIROS_SIM_DECODE_NODES=4`` becomes an ``int``. :func:`config_mapping`
is its inverse (a launcher writes a child's YAML section with it, never an argv).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import sys
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import yaml

from kairos.common.errors import ConfigError

T = TypeVar("T")

_SETTING = "kairos.setting"  # a field's metadata key: its Help
_PART = "kairos.part"  # a field's metadata key: its Part
_INTERNAL = "kairos.internal"  # a field's metadata key: set by code, not a user's setting


@dataclass(frozen=True)
class Help:
    """What a setting tells its users, and how its flag reads a value."""

    text: str | Callable[[], str]  # a callable: text known only when the parser is built (a registry's names)
    flags: tuple[str, ...] = ()  # the flag's names; () = --field-name (a known spelling, or vLLM's aliases)
    # "value" (default): the flag takes a value; "switch": a bare flag that turns it on (vLLM's
    # store_true flags); "negatable": --flag / --no-flag (argparse's BooleanOptionalAction).
    form: str = "value"
    metavar: str | None = None
    parse: Callable[[str], Any] | None = None  # text -> value, for a type _convert cannot read
    format: Callable[[Any], str] | None = None  # value -> text, parse's inverse (config_mapping)


@dataclass(frozen=True)
class Part:
    """A nested component's dataclass, as its composite takes it."""

    cls: type
    text: str
    prefix: str = ""  # prepended to the part's setting names ("admission_" + "max_wait_s")
    omit: tuple[str, ...] = ()  # the part's settings (their names in the part) the composite sets itself


def setting(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    flags: tuple[str, ...] = (),
    form: str = "value",
    metavar: str | None = None,
    parse: Callable[[str], Any] | None = None,
    format: Callable[[Any], str] | None = None,
    default_factory: Callable[[], Any] | Any = dataclasses.MISSING,
) -> Any:
    """A dataclass field that is a user's setting: its default and its help text."""
    if form not in ("value", "switch", "negatable"):
        raise ValueError(f"form must be value, switch or negatable, got {form!r}")
    meta = {_SETTING: Help(help, flags, form, metavar, parse, format)}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def internal(
    default: Any = dataclasses.MISSING, *, default_factory: Callable[[], Any] | Any = dataclasses.MISSING
) -> Any:
    """A dataclass field that code sets and users cannot (no flag, variable or YAML key)."""
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata={_INTERNAL: True})
    return dataclasses.field(default=default, metadata={_INTERNAL: True})


def part(cls: type, *, help: str, prefix: str = "", omit: tuple[str, ...] = ()) -> Any:
    """A dataclass field nesting component ``cls`` (built from its own defaults)."""
    return dataclasses.field(default_factory=cls, metadata={_PART: Part(cls, help, prefix, omit)})


@dataclass(frozen=True)
class Setting:
    """One user-visible name of a config tree, and the field(s) it sets."""

    name: str
    paths: tuple[tuple[str, ...], ...]  # field names from the root, one per part that shares the name
    hint: Any  # the field's annotated type
    default: Any  # dataclasses.MISSING: required
    help: Help | None  # None: a field declared without setting()

    def env_var(self, prefix: str) -> str:
        return f"{prefix}{self.name.upper()}"

    def flag_names(self) -> tuple[str, ...]:
        return (self.help.flags if self.help else ()) or (f"--{self.name.replace('_', '-')}",)


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _walk(cls: type, path: tuple[str, ...], prefix: str, omit: frozenset[str]) -> Iterator[Setting]:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init or f.name in omit or _INTERNAL in f.metadata:
            continue
        nested = f.metadata.get(_PART)
        if nested is not None:
            # A part's omitted names are field names at any depth of it.
            yield from _walk(nested.cls, (*path, f.name), prefix + nested.prefix, omit | frozenset(nested.omit))
            continue
        yield Setting(prefix + f.name, ((*path, f.name),), hints[f.name], _field_default(f), f.metadata.get(_SETTING))


def settings_of(cls: type) -> dict[str, Setting]:
    """Every setting of dataclass ``cls`` by name, its parts' included (a shared name once, with
    all its fields). Raises TypeError where two parts declare one name differently."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    out: dict[str, Setting] = {}
    for s in _walk(cls, (), "", frozenset()):
        seen = out.get(s.name)
        if seen is None:
            out[s.name] = s
            continue
        if seen.hint != s.hint or seen.default != s.default:
            raise TypeError(
                f"{cls.__name__}: setting {s.name!r} is declared twice, differently "
                f"({'.'.join(seen.paths[0])}: {seen.hint} = {seen.default!r}; "
                f"{'.'.join(s.paths[0])}: {s.hint} = {s.default!r})"
            )
        out[s.name] = dataclasses.replace(seen, paths=seen.paths + s.paths, help=seen.help or s.help)
    return out


def _convert(name: str, hint: Any, value: Any, help: Help | None = None) -> Any:
    if help is not None and help.parse is not None and isinstance(value, str):
        try:
            return help.parse(value)
        except ConfigError as exc:
            raise ConfigError(f"{name}: {exc.message}") from None
        except ValueError as exc:
            raise ConfigError(f"{name}: {exc}") from None
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        is_none = value is None or (isinstance(value, str) and value.lower() in ("none", "null", ""))
        if is_none and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(name, inner[0], value, help)
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
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            return hint(value)
        except ValueError:
            raise ConfigError(f"{name}: {value!r} is not one of {[str(m.value) for m in hint]}") from None
    if isinstance(hint, type) and issubclass(hint, str | int | float):
        try:
            return hint(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{name}: {value!r} is not a valid {hint.__name__}") from None
    return value


def _build(cls: type[T], values: Mapping[tuple[str, ...], Any], path: tuple[str, ...] = ()) -> T:
    """``cls`` from the converted values by field path; its parts built first, from theirs."""
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        here = (*path, f.name)
        if (nested := f.metadata.get(_PART)) is not None:
            if any(p[: len(here)] == here for p in values):
                kwargs[f.name] = _build(nested.cls, values, here)
        elif here in values:
            kwargs[f.name] = values[here]
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{cls.__name__}: {exc}") from exc


def load_config(
    cls: type[T],
    yaml_path: str | Path | None = None,
    *,
    section: str | None = None,
    env_prefix: str | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> T:
    """Build ``cls`` from defaults < YAML (optionally one ``section`` of it) < env < overrides,
    each keyed by setting name (:func:`settings_of`).

    Unknown keys in the YAML or the overrides are errors, not silently ignored.
    """
    known = settings_of(cls)
    raw: dict[str, Any] = {}
    if yaml_path is not None:
        try:
            data = yaml.safe_load(Path(yaml_path).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read config {yaml_path}: {exc}") from exc
        if section is not None:
            data = (data.get(section) or {}) if isinstance(data, dict) else data
        if not isinstance(data, dict):
            raise ConfigError(f"{yaml_path}: expected a mapping{f' under {section!r}' if section else ''}")
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ConfigError(f"{yaml_path}: unknown keys {unknown}; known: {sorted(known)}")
        raw.update(data)
    if env_prefix:
        env = os.environ if environ is None else environ
        for s in known.values():
            if (var := s.env_var(env_prefix)) in env:
                raw[s.name] = env[var]
    for name, value in (overrides or {}).items():
        if name not in known:
            raise ConfigError(f"unknown setting {name!r}; known: {sorted(known)}")
        if value is not None:
            raw[name] = value
    return _build(cls, _converted_by_path(cls, raw))


def _converted_by_path(cls: type, settings: Mapping[str, Any]) -> dict[tuple[str, ...], Any]:
    known = settings_of(cls)
    values: dict[tuple[str, ...], Any] = {}
    for name, value in settings.items():
        s = known.get(name)
        if s is None:
            raise ConfigError(f"unknown setting {name!r}; known: {sorted(known)}")
        converted = _convert(f"{cls.__name__}.{name}", s.hint, value, s.help)
        for path in s.paths:
            values[path] = converted
    return values


def _replace(config: T, values: Mapping[tuple[str, ...], Any], path: tuple[str, ...] = ()) -> T:
    changes: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        here = (*path, f.name)
        if _PART in f.metadata:
            if any(p[: len(here)] == here for p in values):
                changes[f.name] = _replace(getattr(config, f.name), values, here)
        elif here in values:
            changes[f.name] = values[here]
    try:
        return dataclasses.replace(config, **changes) if changes else config
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{type(config).__name__}: {exc}") from exc


def with_settings(config: T, **settings: Any) -> T:
    """``config`` with settings changed by name (as :func:`settings_of` names them), its parts
    rebuilt and each checked again: how a launcher gives each child its own port and peers."""
    return _replace(config, _converted_by_path(type(config), settings))


def _get(config: Any, path: tuple[str, ...]) -> Any:
    for name in path:
        config = getattr(config, name)
    return config


def _plain(value: Any, help: Help | None) -> Any:
    if help is not None and help.format is not None:
        return help.format(value)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple):
        return [_plain(x, None) for x in value]
    return value


def config_mapping(config: Any, *, changed_only: bool = True, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """``config``'s settings by name as plain YAML values, what :func:`load_config` reads back to
    an equal config: those that differ from their defaults (``changed_only``), less ``skip``
    (a secret the child reads from its environment)."""
    out: dict[str, Any] = {}
    for s in settings_of(type(config)).values():
        if s.name in skip:
            continue
        value = _get(config, s.paths[0])
        if any(_get(config, p) != value for p in s.paths[1:]):
            raise ValueError(f"{type(config).__name__}: the fields of shared setting {s.name!r} differ")
        if changed_only and value == s.default:
            continue
        out[s.name] = _plain(value, s.help)
    return out


def write_config(path: Path, section: str | None, config: Any, *, skip: tuple[str, ...] = ()) -> Path:
    """``config`` as a YAML file (its settings under ``section``) a service reads with --config."""
    mapping = config_mapping(config, skip=skip)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({section: mapping} if section else mapping, sort_keys=True))
    return path


@dataclass(frozen=True)
class ConfigSource(Generic[T]):
    """Where one service's settings come from (its YAML section and environment prefix) and the
    module that runs it: what a launcher needs to hand a child its configuration, declared beside
    the configuration class, apart from the service's (heavier) serving code."""

    config_class: type[T]
    section: str | None
    env_prefix: str
    module: str  # what ``python -m`` runs

    def load(
        self,
        yaml_path: str | Path | None = None,
        overrides: Mapping[str, Any] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> T:
        return load_config(
            self.config_class,
            yaml_path,
            section=self.section,
            env_prefix=self.env_prefix,
            overrides=overrides,
            environ=environ,
        )

    def env_var(self, name: str) -> str:
        """The environment variable of setting ``name`` (a launcher passes a secret so)."""
        return settings_of(self.config_class)[name].env_var(self.env_prefix)

    def write(self, path: Path, config: T, *, skip: tuple[str, ...] = ()) -> Path:
        """``config``'s settings as the YAML file :meth:`command` hands the service (``skip``: the
        settings its environment gives, such as a Redis URL with a password)."""
        return write_config(path, self.section, config, skip=skip)

    def command(self, config_file: Path, log_level: str | None = None) -> list[str]:
        """The service's process, on this interpreter, reading its settings from ``config_file``."""
        level = ["--log-level", log_level] if log_level else []
        return [sys.executable, "-m", self.module, "--config", str(config_file), *level]


def _describe_default(s: Setting) -> str:
    if s.default is dataclasses.MISSING:
        return "required"
    value = _plain(s.default, s.help)
    if value in ("", [], None):
        return "default: none"
    if isinstance(value, list):
        value = ",".join(map(str, value))
    if s.hint is bool:
        value = "on" if value else "off"
    elif isinstance(value, float):
        value = f"{value:g}"
    return f"default {value}"


def add_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per setting of ``cls`` (:func:`settings_of`), its help text the field's, its value
    left as text for :func:`load_config` to convert (one conversion, one error message)."""
    for s in settings_of(cls).values():
        if s.help is None:
            raise TypeError(f"{cls.__name__}: setting {s.name!r} has no help text (declare it with setting())")
        said = s.help.text() if callable(s.help.text) else s.help.text
        text = f"{said} ({_describe_default(s)})"
        if s.help.form == "switch":
            parser.add_argument(*s.flag_names(), dest=s.name, action="store_const", const=True, help=text)
        elif s.help.form == "negatable":
            parser.add_argument(*s.flag_names(), dest=s.name, action=argparse.BooleanOptionalAction, help=text)
        else:
            hint = s.hint
            choices = [str(m.value) for m in hint] if isinstance(hint, type) and issubclass(hint, enum.Enum) else None
            metavar = s.help.metavar or ("on|off" if hint is bool else None)
            parser.add_argument(*s.flag_names(), dest=s.name, choices=choices, metavar=metavar, help=text)


def flag_values(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The settings of ``cls`` given on the command line (:func:`add_flags`'s), by name."""
    return {name: v for name in settings_of(cls) if (v := getattr(args, name, None)) is not None}


def check_hostport(name: str, value: str) -> None:
    """Raise :class:`~kairos.common.errors.ConfigError` unless ``value`` is ``host:port``."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{name}: expected host:port, got {value!r}")
