"""The promise channel's messages: what the promise script publishes, and nothing else, is heard."""

from __future__ import annotations

import json

import pytest

from kairos.extproc.reservations import HeardPromise, decode_promise_message, parse_member


@pytest.mark.parametrize(
    ("member", "parsed"),
    [
        ("dispatcher-a|7|512", ("dispatcher-a", 512)),
        ("owner|with|bars|3|10", ("owner|with|bars", 10)),  # the script's pattern: (.+)|%d+|(%d+)
        ("a|0|0", ("a", 0)),
        ("|1|10", None),
        ("a|x|10", None),
        ("a|1|-10", None),
        ("a|1|1e3", None),
        ("a|1|٣", None),  # a digit to str.isdigit, not to the script
        ("a|10", None),
        ("", None),
    ],
)
def test_a_member_parses_as_the_script_matches_it(member: str, parsed: tuple[str, int] | None) -> None:
    assert parse_member(member) == parsed


def test_the_scripts_message_names_its_node_owner_tokens_and_member() -> None:
    raw = json.dumps({"node": "d0", "promise": "dispatcher-a|7|512"}).encode()
    assert decode_promise_message(raw) == HeardPromise("d0", "dispatcher-a", 512, "dispatcher-a|7|512")


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"not json",
        b"\xff\xfe",
        b"[]",
        b'"d0"',
        b'{"node": "d0"}',
        b'{"promise": "a|1|1"}',
        b'{"node": "", "promise": "a|1|1"}',
        b'{"node": 7, "promise": "a|1|1"}',
        b'{"node": "d0", "promise": ["a|1|1"]}',
        b'{"node": "d0", "promise": "a|1"}',
        b'{"node": "d0", "promise": "a|1|1.5"}',
    ],
)
def test_anything_else_on_the_channel_is_no_promise(raw: bytes) -> None:
    assert decode_promise_message(raw) is None
