"""`kairos up --nodes FILE`: the nodes file, and the cluster plan it makes."""

from __future__ import annotations

from pathlib import Path

import pytest

from kairos.common.errors import ConfigError
from kairos.launcher.local_cluster import LocalClusterConfig
from kairos.launcher.remote_nodes import RemoteNode, RemoteNodesCluster, load_nodes

GOOD = """
prefill:
  - {id: p0, url: 10.0.0.11:8100}
  - {id: p1, url: 10.0.0.12:8100}
decode:
  - {id: d0, url: 10.0.0.21:8100, sidecar: 10.0.0.21:8200}
"""


def test_nodes_file_becomes_the_cluster_plan(tmp_path: Path) -> None:
    path = tmp_path / "nodes.yaml"
    path.write_text(GOOD)
    nodes = load_nodes(path)
    assert nodes == (
        RemoteNode("p0", "prefill", "10.0.0.11:8100"),
        RemoteNode("p1", "prefill", "10.0.0.12:8100"),
        RemoteNode("d0", "decode", "10.0.0.21:8100", "10.0.0.21:8200"),
    )
    plan = RemoteNodesCluster(LocalClusterConfig(), tmp_path, remote=nodes).plan_nodes()
    assert [(n.node_id, n.role, n.url, n.sidecar_url) for n in plan] == [
        ("p0", "prefill", "10.0.0.11:8100", ""),
        ("p1", "prefill", "10.0.0.12:8100", ""),
        ("d0", "decode", "10.0.0.21:8100", "10.0.0.21:8200"),
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[1, 2]", "expected a mapping"),
        ("prefill: []\ndecode: [{id: d0, url: 10.0.0.1:1, sidecar: 10.0.0.1:2}]", "'prefill' must list at least one"),
        ("prefill: [{id: p0, url: 10.0.0.1:1}]", "'decode' must list at least one"),
        ("prefill: [{id: p0, url: 10.0.0.1:1}]\ndecode: [{id: d0, url: 10.0.0.2:1}]\nother: 1", "expected a mapping"),
        ("prefill: [{url: 10.0.0.1:1}]\ndecode: [{id: d0, url: 10.0.0.2:1, sidecar: 10.0.0.2:2}]", "with an 'id'"),
        ("prefill: [{id: p0, url: node1:8100}]\ndecode: [{id: d0, url: 10.0.0.2:1, sidecar: 10.0.0.2:2}]", "IP:port"),
        ("prefill: [{id: p0, url: 10.0.0.1}]\ndecode: [{id: d0, url: 10.0.0.2:1, sidecar: 10.0.0.2:2}]", "IP:port"),
        ("prefill: [{id: p0, url: 10.0.0.1:0}]\ndecode: [{id: d0, url: 10.0.0.2:1, sidecar: 10.0.0.2:2}]", "port out"),
        ("prefill: [{id: p0, url: 10.0.0.1:1}]\ndecode: [{id: d0, url: 10.0.0.2:1}]", "decode[0].sidecar"),
        (
            "prefill: [{id: p0, url: 10.0.0.1:1, sidecar: 10.0.0.1:2}]\n"
            "decode: [{id: d0, url: 10.0.0.2:1, sidecar: 10.0.0.2:2}]",
            "a prefill node has no sidecar",
        ),
        ("prefill: [{id: x, url: 10.0.0.1:1}]\ndecode: [{id: x, url: 10.0.0.2:1, sidecar: 10.0.0.2:2}]", "unique"),
        (
            "prefill: [{id: p0, url: 10.0.0.1:1, gpu: 1}]\ndecode: [{id: d0, url: 10.0.0.2:1, sidecar: 10.0.0.2:2}]",
            "unknown keys",
        ),
        ("prefill: [", "nodes file"),
    ],
)
def test_bad_nodes_files_say_what_is_wrong(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "nodes.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_nodes(path)


def test_a_sidecar_runs_on_its_nodes_host(tmp_path: Path) -> None:
    nodes = (RemoteNode("p0", "prefill", "10.0.0.1:1"), RemoteNode("d0", "decode", "10.0.0.2:1", "10.0.0.3:2"))
    with pytest.raises(ConfigError, match="must run on its node's host"):
        RemoteNodesCluster(LocalClusterConfig(), tmp_path, remote=nodes).plan_nodes()


def test_missing_nodes_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nodes file"):
        load_nodes(tmp_path / "absent.yaml")
