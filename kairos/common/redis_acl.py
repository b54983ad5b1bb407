"""Redis ACL users of a Kairos cluster, written from the contracts' key names (never re-spelled).

One user per node, named after its node id (:func:`node_user`): it may write only its own
heartbeat key, publish on the heartbeat channel and append to the TTFT feedback stream (its
publisher and its sidecar share it). The dispatchers' user reads every heartbeat key and the
feedback stream, takes reservations and publishes and hears them on the promise channel; nodes
can touch neither. An admin user holds
every right (``kairos up`` and operators); the ``default`` user is off, so a client without a
credential can do nothing.

The rules use Redis 7 key permissions (``%R~``: read only) and a selector (``(...)``) so that a
node may XADD to the stream but not SET or DEL it. Passwords go into the ACL file as SHA-256
hashes (``#<hex>``): the file never holds a password.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

from kairos.common.contracts import (
    REDIS_HEARTBEAT_CHANNEL,
    REDIS_NODE_KEY,
    REDIS_NODE_PATTERN,
    REDIS_PROMISE_CHANNEL,
    REDIS_RESERVATION_KEY,
    REDIS_TTFT_FEEDBACK_STREAM,
)
from kairos.common.errors import ConfigError

NODE_USER_PREFIX = "kairos-node-"
DISPATCHER_USER = "kairos-dispatcher"
ADMIN_USER = "kairos-admin"

# A node id that is safe both as an ACL user name and inside a key pattern: no glob characters
# (a node id "*" would grant every key), no spaces, no ACL syntax.
_NODE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")

# What every Kairos client may run besides its own commands (redis-py's CLIENT SETINFO on
# connect may fail: it ignores that; Redis 7.0 does not even know the subcommand).
_CONNECT = "+ping"

# The heartbeat publisher: SET ... PX, PUBLISH, and on shutdown a compare-and-delete as a
# WATCH / GET / MULTI / DEL / EXEC transaction. No EVAL: a script runs as long as it likes, and
# a node's credential must not be able to stall Redis for every other node. The sidecar: XADD
# ... MAXLEN ~.
_NODE_COMMANDS = f"-@all {_CONNECT} +set +get +del +pexpire +publish +watch +unwatch +multi +exec +discard"
# The dispatcher: SCAN + MGET of heartbeats, XREVRANGE + XREAD of the stream, the promise
# script (EVALSHA, SCRIPT LOAD when Redis lacks it) with the commands it runs on a reservation
# key and the promise channel under the same rights, and SUBSCRIBE to that channel.
_DISPATCHER_COMMANDS = (
    f"-@all {_CONNECT} +scan +mget +get +xread +xrevrange +evalsha +script|load "
    "+time +type +del +pexpire +zadd +zrange +zrem +zremrangebyscore +publish +subscribe +unsubscribe"
)


def check_node_id(node_id: str) -> str:
    """``node_id`` if it may name an ACL user and a key pattern; :class:`ConfigError` if not."""
    if not _NODE_ID.fullmatch(node_id):
        raise ConfigError(
            f"node id {node_id!r}: with Redis ACLs a node id is 1-64 letters, digits, '.', '_' or '-' "
            "(it names the node's Redis user and its key)"
        )
    return node_id


def node_user(node_id: str) -> str:
    """The Redis user of ``node_id``'s publisher and sidecar."""
    return NODE_USER_PREFIX + check_node_id(node_id)


def node_rules(node_id: str) -> str:
    """ACL rules of ``node_id``'s user: its own heartbeat key, the channel, XADD on the stream."""
    key = REDIS_NODE_KEY.format(node_id=check_node_id(node_id))
    return (
        f"resetkeys resetchannels {_NODE_COMMANDS} ~{key} &{REDIS_HEARTBEAT_CHANNEL} "
        f"(~{REDIS_TTFT_FEEDBACK_STREAM} +xadd)"
    )


def dispatcher_rules() -> str:
    """ACL rules of the dispatchers' user: read heartbeats and the stream, write reservations,
    publish and hear promises (nodes cannot: the channel is the dispatchers' alone)."""
    reservations = REDIS_RESERVATION_KEY.format(node_id="*")
    return (
        f"resetkeys resetchannels {_DISPATCHER_COMMANDS} %R~{REDIS_NODE_PATTERN} %RW~{reservations} "
        f"%R~{REDIS_TTFT_FEEDBACK_STREAM} &{REDIS_PROMISE_CHANNEL}"
    )


ADMIN_RULES = "~* &* +@all"


def password_hash(password: str) -> str:
    """The ACL file's form of a password: ``#`` and its SHA-256 in hex."""
    return "#" + hashlib.sha256(password.encode()).hexdigest()


def acl_line(user: str, password: str, rules: str) -> str:
    """One ``user`` line of an ACL file, with the password hashed."""
    return f"user {user} on {password_hash(password)} {rules}"


def acl_file(admin_password: str, dispatcher_password: str, node_passwords: Iterable[tuple[str, str]]) -> str:
    """A whole ACL file: ``default`` off, the admin, the dispatchers and one user per node
    (``(node_id, password)`` pairs)."""
    lines = [  # an ACL file has no comments: Redis refuses any line but "user ..."
        "user default off resetkeys resetchannels -@all",
        acl_line(ADMIN_USER, admin_password, ADMIN_RULES),
        acl_line(DISPATCHER_USER, dispatcher_password, dispatcher_rules()),
    ]
    lines += [acl_line(node_user(node_id), password, node_rules(node_id)) for node_id, password in node_passwords]
    return "\n".join(lines) + "\n"
