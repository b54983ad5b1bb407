"""Redis keys and channels: heartbeats and deflection reservations."""

from __future__ import annotations

# ---------------------------------------------------------------------------------------------
# Redis: heartbeats and deflection reservations
# ---------------------------------------------------------------------------------------------
REDIS_NODE_KEY = "kairos:node:{node_id}"  # JSON heartbeat, SET with PX expiry (dead node vanishes)
REDIS_NODE_PATTERN = "kairos:node:*"
REDIS_HEARTBEAT_CHANNEL = "kairos:heartbeats"  # the same JSON is PUBLISHed here on every beat
# A dispatcher that deflects to a node first promises it here: a sorted set of the node's recent
# deflections, which the promise script alone writes (``kairos.extproc.reservations``).
REDIS_RESERVATION_KEY = "kairos:reserve:{node_id}"
# The promise script PUBLISHes each promise it grants here, so that the other dispatcher replicas
# count it before their next decision rather than after a refused promise of their own.
REDIS_PROMISE_CHANNEL = "kairos:promises"
# No dispatcher holds a reservation longer than this: a key without an expiry, or with a longer
# one, was not set by a dispatcher, and the next dispatcher that wants the node takes it over.
RESERVATION_MAX_TTL_S = 10.0
