"""A parsed policy spec's parameters, read the way every policy's factory reads them: each
reader names the policy and the parameter in its error, as users know the messages."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kairos.common.errors import UnknownPolicyError

CHUNKS_SEPARATOR = "/"  # in a spec's chunks=... value: "," separates the spec's parameters


def format_chunks(candidates: tuple[int, ...]) -> str:
    """``(2048, 1024)`` -> ``"2048/1024"``, as a spec's ``chunks=`` takes them."""
    return CHUNKS_SEPARATOR.join(map(str, candidates))


def parse_chunks(name: str, raw: str) -> tuple[int, ...]:
    """A spec's ``chunks=2048/1024/512/256/128`` (``DeciderConfig`` checks their order)."""
    try:
        return tuple(int(x) for x in raw.split(CHUNKS_SEPARATOR))
    except ValueError:
        raise UnknownPolicyError(f"policy {name!r}: chunks={raw!r} must be integers separated by '/'") from None


def field_default(cls: type, name: str) -> Any:
    """The default of dataclass ``cls``'s field ``name``: a policy's defaults live on its class,
    and its factory reads them from there."""
    for field in dataclasses.fields(cls):
        if field.name == name:
            if field.default is dataclasses.MISSING:
                raise TypeError(f"{cls.__name__}.{name} has no default")
            return field.default
    raise TypeError(f"{cls.__name__} has no field {name!r}")


@dataclass(frozen=True)
class PolicySpec:
    """``kairos:alpha=1.3`` parsed: the policy's name and its parameters' raw values (the
    registry has checked that the policy accepts each)."""

    name: str
    params: Mapping[str, str]

    def __contains__(self, key: str) -> bool:
        return key in self.params

    def get(self, key: str, default: str) -> str:
        return self.params.get(key, default)

    def error(self, message: str) -> UnknownPolicyError:
        return UnknownPolicyError(f"policy {self.name!r}: {message}")

    def value(self, key: str, cast: type = float) -> Any:
        """The parameter, given, as a ``cast``."""
        raw = self.params[key]
        try:
            return cast(raw)
        except ValueError:
            raise self.error(f"{key}={raw!r} is not a {cast.__name__}") from None

    def number(self, key: str, default: float, cast: type = float) -> Any:
        """The parameter as a ``cast``, or ``default`` when the spec does not set it."""
        return default if key not in self.params else self.value(key, cast)

    def integer(self, key: str, default: int) -> int:
        return int(self.number(key, default, int))

    def bounded(self, key: str, default: float, low: float, high: float) -> float:
        """A float in [low, high]."""
        value = self.number(key, default)
        if not (low <= value <= high):  # "not" so that NaN fails too
            raise self.error(f"{key}={value} must be in [{low:g}, {high:g}]")
        return value

    def on_off(self, key: str) -> bool:
        """An ``on``/``off`` switch, on unless the spec says otherwise."""
        raw = self.params.get(key, "on").lower()
        if raw not in ("on", "off"):
            raise self.error(f"{key}={self.params[key]!r} must be 'on' or 'off'")
        return raw == "on"

    def chunks(self) -> tuple[int, ...]:
        """The spec's ``chunks=``: step-size candidates."""
        return parse_chunks(self.name, self.params["chunks"])
