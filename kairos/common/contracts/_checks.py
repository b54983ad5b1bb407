"""Helpers the decoders share."""

from __future__ import annotations

import json
from typing import Any


def list_or_none(values: tuple[int, ...] | None) -> list[int] | None:
    return None if values is None else list(values)


def json_object(raw: bytes | str, error: type[Exception], prefix: str = "") -> dict[str, Any]:
    """``raw`` decoded as one JSON object, else ``error`` saying what it was instead (the one
    first step of every decoder here)."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise error(f"{prefix}not JSON ({type(exc).__name__}: {exc})") from None
    if not isinstance(data, dict):
        raise error(f"{prefix}expected a JSON object, got {type(data).__name__}")
    return data


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
