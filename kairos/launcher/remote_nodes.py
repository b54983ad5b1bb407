"""``kairos up --nodes FILE``: the gateway (Redis, dispatcher, Envoy) for nodes that run elsewhere.

The nodes (real vLLM with the Kairos plugins, or emulated ones) and their agents run on their own
machines; each publisher sends its heartbeats to this gateway's Redis, and Envoy sends requests to
the decode sidecars. The file lists them:

    # nodes.yaml
    prefill:
      - {id: p0, url: 10.0.0.11:8100}
    decode:
      - {id: d0, url: 10.0.0.21:8100, sidecar: 10.0.0.21:8200}

Addresses are ``IP:port``: Envoy's override_host picks the sidecar by the exact address the
dispatcher names, so a hostname there would never match.

Each node gets its own Redis user (``kairos-node-<id>``: its heartbeat key and the feedback stream
only) and the dispatcher admits only the listed nodes at their listed addresses. ``kairos up``
writes each node's URL to ``<workdir>/redis/credentials/<id>.env`` for its agents.
"""

from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kairos.common.contracts import Role
from kairos.common.errors import ConfigError
from kairos.common.redis_acl import check_node_id
from kairos.launcher.local_cluster import LocalCluster, NodeProcs

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RemoteNode:
    node_id: str
    role: Role
    url: str  # IP:port of its vLLM server
    sidecar: str = ""  # IP:port of its sidecar (decode nodes)


def _address(where: str, value: Any) -> tuple[str, int]:
    if not isinstance(value, str) or value.count(":") != 1:
        raise ConfigError(f"{where}: expected IP:port, got {value!r}")
    host, _, port = value.partition(":")
    try:
        ipaddress.ip_address(host)
        number = int(port)
    except ValueError:
        raise ConfigError(f"{where}: expected IP:port (Envoy matches upstreams by address), got {value!r}") from None
    if not 0 < number < 65536:
        raise ConfigError(f"{where}: port out of range in {value!r}")
    return host, number


def load_nodes(path: Path) -> tuple[RemoteNode, ...]:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"nodes file {path}: {exc}") from exc
    if not isinstance(data, dict) or set(data) - set(Role):
        raise ConfigError(f"nodes file {path}: expected a mapping with 'prefill' and 'decode' lists")
    nodes: list[RemoteNode] = []
    for role in Role:
        entries = data.get(role) or []
        if not isinstance(entries, list) or not entries:
            raise ConfigError(f"nodes file {path}: '{role}' must list at least one node")
        for i, entry in enumerate(entries):
            where = f"nodes file {path}: {role}[{i}]"
            if not isinstance(entry, dict) or not isinstance(entry.get("id"), str) or not entry["id"]:
                raise ConfigError(f"{where}: expected a mapping with an 'id'")
            try:
                check_node_id(entry["id"])
            except ConfigError as exc:
                raise ConfigError(f"{where}: {exc.message}") from None
            unknown = set(entry) - {"id", "url", "sidecar"}
            if unknown:
                raise ConfigError(f"{where}: unknown keys {sorted(unknown)}")
            _address(f"{where}.url", entry.get("url"))
            sidecar = entry.get("sidecar", "")
            if role is Role.DECODE:
                _address(f"{where}.sidecar", sidecar)
            elif sidecar:
                raise ConfigError(f"{where}: a prefill node has no sidecar")
            nodes.append(RemoteNode(entry["id"], role, entry["url"], sidecar))
    ids = [n.node_id for n in nodes]
    if len(set(ids)) != len(ids):
        raise ConfigError(f"nodes file {path}: node ids must be unique, got {ids}")
    return tuple(nodes)


@dataclass
class RemoteNodesCluster(LocalCluster):
    remote: tuple[RemoteNode, ...] = field(default_factory=tuple)

    def plan_nodes(self) -> list[NodeProcs]:
        planned = []
        for n in self.remote:
            host, port = _address(n.node_id, n.url)
            sidecar_port = _address(n.node_id, n.sidecar)[1] if n.sidecar else None
            if n.sidecar and _address(n.node_id, n.sidecar)[0] != host:
                raise ConfigError(f"{n.node_id}: the sidecar must run on its node's host {host}, got {n.sidecar}")
            planned.append(NodeProcs(n.node_id, n.role, port, sidecar_port, host=host))
        return planned

    def start_nodes(self, timeout_s: float = 60.0) -> None:
        # Nothing to start here: say where the nodes' agents find their credentials instead.
        setup = self._redis_setup()
        for n in self.remote:
            log.info(
                "node %s (%s) at %s: its agents' Redis URL is in %s",
                n.node_id,
                n.role,
                n.url,
                setup.credentials_file(n.node_id),
            )

    def node_credentials(self) -> list[tuple[str, Path]]:
        """(node id, its credentials file) for every listed node: what ``kairos up`` prints."""
        setup = self._redis_setup()
        return [(n.node_id, setup.credentials_file(n.node_id)) for n in self.remote]
