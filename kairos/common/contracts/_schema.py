"""A contract's msgspec struct put to its other uses: its field names as constants, and the
checked decoder that names what is wrong with a value in the words of the field's type.

A struct declares each field once, with its type and constraints (``msgspec.Meta``); msgspec
decodes and checks a value against it in C. What a refused value gets here instead is the same
verdict, derived from the same declaration, with a message a person can act on: ``seq must be
an int >= 0, got -1`` rather than msgspec's ``Expected `int` >= 0, got `-1` - at `$.seq```. A
constraint the words cannot be derived from carries them in ``Meta(description=...)``, a unit in
``Meta(extra={"unit": ...})``.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
from collections.abc import Mapping
from typing import Any, TypeVar

import msgspec
from msgspec import inspect as mi

S = TypeVar("S", bound=msgspec.Struct)


@functools.cache
def fields(struct: type[msgspec.Struct]) -> tuple[mi.Field, ...]:
    """The struct's fields, in declaration (and wire) order (inspected once: type_info costs
    hundreds of microseconds, a checked decode a few)."""
    info = mi.type_info(struct)
    assert isinstance(info, mi.StructType)
    return info.fields


class FieldNames:
    """The field names of a struct as constants, for code that reads or writes the wire format
    as plain JSON: subclass with ``struct=`` and every field ``name`` becomes ``NAME = "name"``,
    with ``REQUIRED`` and ``OPTIONAL`` (fields without and with a default) in wire order. A field
    added to the struct appears here with no other edit."""

    REQUIRED: tuple[str, ...] = ()
    OPTIONAL: tuple[str, ...] = ()

    def __init_subclass__(cls, struct: type[msgspec.Struct], **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for field in fields(struct):
            constant = field.name.upper()
            if getattr(cls, constant, field.encode_name) != field.encode_name:
                raise TypeError(f"{cls.__name__}.{constant} is not {struct.__name__}'s field {field.name!r}")
            setattr(cls, constant, field.encode_name)
        cls.REQUIRED = tuple(f.encode_name for f in fields(struct) if f.required)
        cls.OPTIONAL = tuple(f.encode_name for f in fields(struct) if not f.required)


def to_json_object(struct: msgspec.Struct) -> dict[str, Any]:
    """The struct as the JSON object a caller dumps (or holds, as a record, to dump later): its
    fields in order, those left at their default out where the struct omits defaults, an enum as
    its value, a tuple as a list."""
    return _with_lists(msgspec.to_builtins(struct))


def _with_lists(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _with_lists(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_with_lists(item) for item in value]
    return value


def decode_object(data: Mapping[str, Any], struct: type[S], error: type[Exception], prefix: str = "") -> S:
    """``data`` (a decoded JSON object) as the struct. msgspec checks it in C; what it refuses,
    or a NaN or an infinity it lets through (Python's JSON reader makes them), goes to
    :func:`decode_fields`, for the same verdict as always and a message naming the field."""
    with contextlib.suppress(msgspec.ValidationError):  # refused: the checked decoder says why
        value = msgspec.convert(data, struct)
        if _finite(value):
            return value
    return struct(**decode_fields(data, struct, error, prefix))


def _finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, tuple):
        return all(_finite(item) for item in value)
    if isinstance(value, msgspec.Struct):
        return all(_finite(getattr(value, name)) for name in value.__struct_fields__)
    return True


def decode_fields(
    data: Mapping[str, Any], struct: type[msgspec.Struct], error: type[Exception], prefix: str = ""
) -> dict[str, Any]:
    """The struct's field values from a decoded JSON object, each checked against its declared
    type as msgspec checks it (unknown keys ignored, an optional field absent or null left at its
    default); ``error`` names the first field that is wrong (all missing ones at once)."""
    missing = [f.encode_name for f in fields(struct) if f.required and f.encode_name not in data]
    if missing:
        raise error(f"{prefix}missing fields {missing}")
    values: dict[str, Any] = {}
    for field in fields(struct):
        value = data.get(field.encode_name)
        if value is None and not field.required:
            continue
        values[field.name] = _decode_value(field.type, value, field.encode_name, error, prefix)
    return values


def _decode_value(t: mi.Type, value: Any, where: str, error: type[Exception], prefix: str) -> Any:
    with contextlib.suppress(_Invalid):
        return _convert(t, value, list)
    # Wrong somewhere inside a nested object, or a list of them: say where.
    inner = _without_none(t)
    if isinstance(inner, mi.StructType) and isinstance(value, dict):
        return inner.cls(**decode_fields(value, inner.cls, error, f"{prefix}{where}: "))
    if isinstance(inner, mi.VarTupleType) and isinstance(inner.item_type, mi.StructType) and isinstance(value, list):
        return tuple(_decode_value(inner.item_type, x, f"{where}[{i}]", error, prefix) for i, x in enumerate(value))
    raise error(f"{prefix}{where} must be {describe(t)}, got {value!r}")


def _without_none(t: mi.Type) -> mi.Type:
    if isinstance(t, mi.UnionType):
        (other,) = [u for u in t.types if not isinstance(u, mi.NoneType)]
        return other
    return t


def check_fields(struct: msgspec.Struct, error: type[Exception], prefix: str = "") -> None:
    """Check a struct built in Python (where msgspec checks nothing) against its declared types
    (a sequence as the tuple msgspec would hold)."""
    for field in fields(type(struct)):
        value = getattr(struct, field.name)
        try:
            _convert(field.type, value, tuple)
        except _Invalid:
            raise error(f"{prefix}{field.encode_name} must be {describe(field.type)}, got {value!r}") from None


class _Invalid(Exception):
    """A value that is not what its field declares (raised by :func:`_convert`, never escapes)."""


def _convert(t: mi.Type, value: Any, sequence: type[list] | type[tuple]) -> Any:
    """``value`` as the field holds it (a ``sequence``, a JSON list, as a tuple; an int as a float
    where a float is declared), or :class:`_Invalid`."""
    if isinstance(t, mi.Metadata):
        return _convert(t.type, value, sequence)
    if isinstance(t, mi.UnionType):
        if value is None and any(isinstance(u, mi.NoneType) for u in t.types):
            return None
        (other,) = [u for u in t.types if not isinstance(u, mi.NoneType)]
        return _convert(other, value, sequence)
    if isinstance(t, mi.IntType):
        if not isinstance(value, int) or isinstance(value, bool) or not _within(t, value):
            raise _Invalid
        return value
    if isinstance(t, mi.FloatType):
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise _Invalid
        if not _within(t, value):
            raise _Invalid
        return float(value)
    if isinstance(t, mi.StrType):
        if not isinstance(value, str) or (t.pattern is not None and not re.search(t.pattern, value)):
            raise _Invalid
        return value
    if isinstance(t, mi.EnumType):
        try:
            return t.cls(value)
        except ValueError:
            raise _Invalid from None
    if isinstance(t, mi.VarTupleType):
        if not isinstance(value, sequence):
            raise _Invalid
        return tuple(_convert(t.item_type, x, sequence) for x in value)
    if isinstance(t, mi.StructType):
        if isinstance(value, t.cls) and sequence is tuple:  # built in Python: checked field by field
            check_fields(value, _Invalid)
            return value
        if not isinstance(value, dict):
            raise _Invalid
        return t.cls(**decode_fields(value, t.cls, _Invalid))
    raise TypeError(f"a contract field of type {t} has no checked decoding")


def _within(t: mi.IntType | mi.FloatType, value: float) -> bool:
    return (
        (t.ge is None or value >= t.ge)
        and (t.gt is None or value > t.gt)
        and (t.le is None or value <= t.le)
        and (t.lt is None or value < t.lt)
    )


def describe(t: mi.Type, plural: bool = False) -> str:
    """What a value of the declared type is, in words: ``an int >= 0``, ``a list of ints >= 0``,
    ``a number in [0.25, 4.0]``, ``'prefill' or 'decode'``."""
    if isinstance(t, mi.Metadata):
        extra_json_schema = t.extra_json_schema or {}
        if "description" in extra_json_schema:
            return extra_json_schema["description"]
        unit = (t.extra or {}).get("unit")
        return describe(t.type, plural) if unit is None else _describe_number(t.type, plural, unit)
    if isinstance(t, mi.UnionType):
        (other,) = [u for u in t.types if not isinstance(u, mi.NoneType)]
        return describe(other, plural)
    if isinstance(t, mi.IntType | mi.FloatType):
        return _describe_number(t, plural)
    if isinstance(t, mi.StrType):
        return "strings" if plural else "a string"
    if isinstance(t, mi.EnumType):
        return " or ".join(repr(member.value) for member in t.cls)
    if isinstance(t, mi.VarTupleType):
        return f"a list of {describe(t.item_type, plural=True)}"
    if isinstance(t, mi.StructType):
        return "objects" if plural else "an object"
    raise TypeError(f"a contract field of type {t} has no description")


def _describe_number(t: mi.Type, plural: bool, unit: str | None = None) -> str:
    assert isinstance(t, mi.IntType | mi.FloatType)
    kind = ("ints" if plural else "an int") if isinstance(t, mi.IntType) else ("numbers" if plural else "a number")
    if unit is not None:
        kind += f" of {unit}"
    if t.ge is not None and t.le is not None:
        return f"{kind} in [{t.ge}, {t.le}]"
    bounds = [
        f"{op} {bound}" for op, bound in ((">=", t.ge), (">", t.gt), ("<=", t.le), ("<", t.lt)) if bound is not None
    ]
    return " ".join([kind, *bounds])
