"""A node's role: the one spelling heartbeats, step records, configs and command lines share."""

from __future__ import annotations

from enum import StrEnum


class Role(StrEnum):
    """A node's role, as heartbeats, configs and command lines spell it."""

    PREFILL = "prefill"
    DECODE = "decode"
