"""Redis ACL rules and credential URLs (pure): every key a rule names comes from the contracts, a
node id cannot widen its user's rights, no password reaches a log line, and the clients' time
budgets."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kairos.common import contracts as c
from kairos.common import defaults
from kairos.common.errors import ConfigError
from kairos.common.redis_acl import acl_file, check_node_id, dispatcher_rules, node_rules, node_user, password_hash
from kairos.common.redis_client import (
    check_redis_url,
    fail_fast_client,
    fail_fast_sync_client,
    redact_url,
    with_credentials,
)


def test_a_node_may_write_its_own_key_and_append_to_the_stream_only() -> None:
    rules = node_rules("p0").split()
    keys = [r for r in rules if "~" in r]
    assert keys == [f"~{c.REDIS_NODE_KEY.format(node_id='p0')}", f"(~{c.REDIS_TTFT_FEEDBACK_STREAM}"]
    assert rules[-1] == "+xadd)"  # the stream only under a selector that allows XADD alone
    assert f"&{c.REDIS_HEARTBEAT_CHANNEL}" in rules
    assert rules[:3] == ["resetkeys", "resetchannels", "-@all"]


def test_the_dispatcher_reads_heartbeats_and_writes_reservations_only() -> None:
    rules = dispatcher_rules().split()
    assert [r for r in rules if "~" in r] == [
        f"%R~{c.REDIS_NODE_PATTERN}",
        f"%RW~{c.REDIS_RESERVATION_KEY.format(node_id='*')}",
        f"%R~{c.REDIS_TTFT_FEEDBACK_STREAM}",
    ]


@pytest.mark.parametrize("node_id", ["*", "p*", "p?", "p[0]", "a b", "", "x" * 65, "-p0", "p0\n", "é"])
def test_a_node_id_that_could_widen_its_rights_is_refused(node_id: str) -> None:
    with pytest.raises(ConfigError, match="node id"):
        node_user(node_id)
    with pytest.raises(ConfigError):
        node_rules(node_id)


def test_the_acl_file_holds_hashes_only_and_the_default_user_is_off() -> None:
    text = acl_file("admin-secret", "dispatcher-secret", [("p0", "p0-secret"), ("d0", "d0-secret")])
    lines = text.splitlines()
    assert lines[0].startswith("user default off ")
    assert [line.split()[1] for line in lines] == [
        "default",
        "kairos-admin",
        "kairos-dispatcher",
        "kairos-node-p0",
        "kairos-node-d0",
    ]
    assert "secret" not in text.replace("#", " ").split() and "p0-secret" not in text
    assert password_hash("p0-secret") in lines[3]
    assert check_node_id("node-1.a_b") == "node-1.a_b"


@pytest.mark.parametrize(
    ("url", "logged"),
    [
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("redis://:pw@h:1/0", "redis://:***@h:1/0"),
        (
            "rediss://kairos-node-p0:p%40w@h:1/0?ssl_ca_certs=/etc/ca.pem",
            "rediss://kairos-node-p0:***@h:1/0?ssl_ca_certs=/etc/ca.pem",
        ),
        ("redis://h:1/0?password=pw&db=0", "redis://h:1/0?password=***&db=0"),
        ("redis://user@h:1/0", "redis://user@h:1/0"),
    ],
)
def test_no_password_reaches_a_log_line(url: str, logged: str) -> None:
    assert redact_url(url) == logged


def test_credentials_go_into_the_url_percent_encoded() -> None:
    url = with_credentials("rediss://old:x@gw:6380/0?ssl_ca_certs=/ca.pem", "kairos-node-p0", "a/b@c:d")
    assert url == "rediss://kairos-node-p0:a%2Fb%40c%3Ad@gw:6380/0?ssl_ca_certs=/ca.pem"
    with pytest.raises(ConfigError):
        with_credentials("unix:///tmp/redis.sock", "u", "p")


def test_a_rejected_url_is_named_without_its_password() -> None:
    with pytest.raises(ConfigError) as info:
        check_redis_url("redis_url", "http://kairos-node-p0:s3cret@gw:6379/0")
    assert "s3cret" not in info.value.message and "kairos-node-p0:***@gw" in info.value.message


@pytest.mark.parametrize("make", [fail_fast_client, fail_fast_sync_client])
def test_a_fail_fast_client_gives_its_connect_more_time_than_a_command(make: Callable[..., Any]) -> None:
    """A TLS connect on a busy host outlasted the 0.25 s command budget and lost what it carried;
    the connect gets its own budget, commands keep the caller's (creating a client opens nothing)."""
    client = make("rediss://kairos-node-d0:secret@127.0.0.1:6380/0", 0.25)
    kwargs = client.connection_pool.connection_kwargs
    assert kwargs["socket_timeout"] == 0.25
    assert kwargs["socket_connect_timeout"] == defaults.REDIS_CONNECT_TIMEOUT_S > 0.25
    assert make("redis://127.0.0.1:6379/0", 5.0).connection_pool.connection_kwargs["socket_connect_timeout"] == 5.0
