"""The operator's view of a running cluster: a real Prometheus (Debian's package; scripts/test.sh
installs it) scrapes every process of a local cluster through the targets file ``kairos up``
writes, with the repository's rules loaded, and every dashboard query answers with data; then
``kairos top`` runs in tmux, as a person would run it, and its pane shows the cluster, and the
alerts when Redis goes away (from Prometheus and evaluated locally)."""

from __future__ import annotations

import json
import math
import re
import shlex
import shutil
import subprocess
import sys
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kairos.api.tokenizer import PromptTokenizer
from kairos.common import contracts as c
from kairos.launcher.local_cluster import LocalCluster
from kairos.launcher.processes import ManagedProcess, free_port, http_ready
from tests.e2e.conftest import http, post_json, start_cluster, text_of
from tests.observability import RULES, dashboard_queries
from tests.waiting import wait_until

pytestmark = pytest.mark.skipif(
    shutil.which("prometheus") is None or shutil.which("tmux") is None,
    reason="needs prometheus and tmux (apt-get install prometheus tmux; scripts/test.sh does)",
)
MODEL = "kairos-tiny-llama"


@pytest.fixture(scope="module")
def prometheus(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Prometheus scraping the cluster every second; its URL. Stopped (by its PID) after the module."""
    folder = tmp_path_factory.mktemp("prometheus")
    targets = cluster.write_prometheus_targets(folder / "prometheus-targets.json")
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [{"job_name": "kairos", "file_sd_configs": [{"files": [str(targets)]}]}],
    }
    (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
    url = f"http://127.0.0.1:{free_port()}"
    proc = ManagedProcess(
        "prometheus",
        [
            "prometheus",
            f"--config.file={folder / 'prometheus.yml'}",
            f"--storage.tsdb.path={folder / 'data'}",
            f"--web.listen-address={url.removeprefix('http://')}",
        ],
        folder / "prometheus.log",
        ready=http_ready(f"{url}/-/ready"),
    )
    proc.start()
    try:
        proc.wait_ready(60.0)
        yield url
    finally:
        proc.stop()


def api(prometheus: str, path: str, **params: str) -> Any:
    status, _, raw = http("GET", f"{prometheus}/api/v1/{path}?{urllib.parse.urlencode(params)}", timeout=30)
    body = json.loads(raw)
    assert status == 200 and body["status"] == "success", body
    return body["data"]


def has_data(prometheus: str, query: str) -> bool:
    """The query answers with at least one series holding a number (NaN: a quantile of nothing)."""
    return any(not math.isnan(float(series["value"][1])) for series in api(prometheus, "query", query=query)["result"])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[LocalCluster]:
    """The e2e tier's cluster with the split route on (its default is off): the dashboard's split
    panels need splits to show."""
    c = start_cluster(tmp_path_factory.mktemp("observed"), model_dir, split="offload")
    yield c
    c.stop()


def send_traffic(cluster: LocalCluster, tokenizer: PromptTokenizer) -> None:
    """What every panel needs to show something: keeps, deflections and splits with the sidecars'
    TTFT feedback, one request the dispatcher rejects, and one hop a sidecar refuses."""
    # On an idle cluster 400 tokens deflect and 6000 split (tests/e2e/test_split.py); 6000 with a
    # 1 ms TTFT SLO of its own keep (no other path can meet it: Eq. 7's SLO clause). A prompt of
    # its own each time (a repeated one would be found cached on a decode node, and deflect). On a
    # starved host a decision may keep the others too (a late heartbeat, a slow promise), so
    # rounds go until every route has been taken.
    decisions: list[tuple[str, str]] = []

    def every_route() -> bool:
        for tokens, slo in ((400, {}), (6000, {}), (6000, {c.H_SLO_TTFT_MS: "1"})):
            # Streamed: a TTFT sample is a stream's first token (a non-streamed response has none).
            body = {"model": MODEL, "prompt": text_of(tokenizer, tokens), "max_tokens": 4, "stream": True}
            status, headers, raw = http(
                "POST",
                f"{cluster.gateway_url}/v1/completions",
                json.dumps(body).encode(),
                {"content-type": "application/json", **slo},
            )
            assert status == 200 and raw.rstrip().endswith(b"data: [DONE]"), raw[-300:]
            decisions.append((headers[c.H_ROUTE], headers[c.H_REASON]))
        return len(decisions) >= 6 and {"keep", "deflect", "split"} <= {route for route, _ in decisions}

    try:
        wait_until(every_route, 120.0, interval_s=0.5, what="a keep, a deflection and a split")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; (route, reason) of each: {decisions}") from None
    status, _, _ = http(
        "POST", f"{cluster.gateway_url}/v1/completions", b"{not json", {"content-type": "application/json"}
    )
    assert status == 400
    sidecar = next(n for n in cluster.nodes if n.sidecar_port)
    status, _, _ = http(
        "POST",
        f"http://{sidecar.sidecar_url}/v1/completions",
        json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 1}).encode(),
        {"content-type": "application/json", c.H_ROUTE: "keep", c.H_PREFILL_HOST: "127.0.0.1:9"},
    )
    assert status >= 400  # hop 1 refused: 127.0.0.1:9 is no prefill node of this cluster


def test_every_dashboard_query_returns_data_from_a_real_prometheus(
    cluster: LocalCluster, prometheus: str, tokenizer: PromptTokenizer
) -> None:
    endpoints = (
        len(cluster.dispatcher_metrics_ports) + len(cluster.nodes) + sum(bool(n.sidecar_port) for n in cluster.nodes)
    )
    wait_until(
        lambda: [t["health"] for t in api(prometheus, "targets")["activeTargets"]] == ["up"] * endpoints,
        60.0,
        what="every dispatcher, node and sidecar scraped",
    )
    send_traffic(cluster, tokenizer)
    queries = dashboard_queries()
    empty: list[str] = []

    def all_answer() -> bool:
        empty[:] = [where for where, query in queries if not has_data(prometheus, query)]
        if empty:  # more of everything, so that no 1-minute rate window runs dry while waiting
            send_traffic(cluster, tokenizer)
        return not empty

    try:
        wait_until(all_answer, 90.0, interval_s=0.5, what="every dashboard query answering with data")
    except AssertionError:
        pytest.fail(f"dashboard queries without data: {empty}")
    # The rules evaluate against the live series without errors.
    rules = [r for g in api(prometheus, "rules")["groups"] for r in g["rules"]]
    assert len(rules) == sum(len(g["rules"]) for g in yaml.safe_load(RULES.read_text())["groups"])  # every rule loaded
    wait_until(
        lambda: all(r["health"] == "ok" for r in api(prometheus, "rules")["groups"][0]["rules"]),
        30.0,
        what="recording rules evaluated",
    )
    assert [r["lastError"] for g in api(prometheus, "rules")["groups"] for r in g["rules"] if r.get("lastError")] == []


class Tmux:
    """A private tmux server (its own socket) for panes running ``kairos top``."""

    def __init__(self, socket: Path) -> None:
        self.socket = socket

    def run(self, *args: str) -> str:
        done = subprocess.run(["tmux", "-S", str(self.socket), *args], capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        return done.stdout

    def start(self, name: str, argv: list[str]) -> None:
        # The pane stays after the command ends, so a crash shows in the capture instead of a
        # vanished session.
        command = f'{shlex.join(argv)}; echo "kairos top exited: $?"; sleep 3600'
        self.run("new-session", "-d", "-s", name, "-x", "132", "-y", "48", command)

    def capture(self, name: str) -> str:
        return self.run("capture-pane", "-p", "-t", name)

    def kill(self) -> None:
        subprocess.run(["tmux", "-S", str(self.socket), "kill-server"], capture_output=True, timeout=30)


def node_rows(pane: str) -> dict[str, list[str]]:
    return {m.group(1): m.group(0).split() for m in re.finditer(r"^([pd]\d)\s+(prefill|decode)\s.*$", pane, re.M)}


def test_kairos_top_in_tmux_shows_the_cluster_and_the_alerts_of_a_redis_outage(
    cluster: LocalCluster, prometheus: str, tokenizer: PromptTokenizer, tmp_path: Path
) -> None:
    dispatcher = f"http://127.0.0.1:{cluster.dispatcher_metrics_ports[0]}"
    top = [sys.executable, "-m", "kairos", "top", "--dispatcher", dispatcher, "--interval", "0.5"]
    tmux = Tmux(tmp_path / "tmux.sock")
    panes: dict[str, str] = {}

    def shows(name: str, *patterns: str) -> bool:
        panes[name] = tmux.capture(name)
        return all(re.search(p, panes[name], re.M) for p in patterns)

    def wait_pane(name: str, *patterns: str, timeout_s: float = 60.0, feed: bool = False) -> str:
        """Until the pane shows every pattern; with ``feed``, one request per look, so that the
        decision rates between two frames are not zero."""

        def probe() -> bool:
            if feed:
                post_json(f"{cluster.gateway_url}/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2})
            return shows(name, *patterns)

        try:
            wait_until(probe, timeout_s, interval_s=0.2, what=f"{patterns} in the {name} pane")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the pane:\n{panes.get(name)}") from None
        return panes[name]

    try:
        tmux.start("prom", [*top, "--prometheus", prometheus])
        tmux.start("local", top)
        send_traffic(cluster, tokenizer)
        for name in ("prom", "local"):
            wait_pane(
                name,
                r"^status ok$",
                r"^DECISIONS +(?!0\.0/s)\d+\.\d/s, \d+% deflected",
                r"^ +\w+ +\w+ +(?!0\.00/s)\d+\.\d\d/s +\d+ total$",
                # The class rows read the decode nodes' sidecars (their addresses from /nodes):
                # a goodput figure needs two reads of them.
                r"^  standard +\d+ \(.*\) +(\d+\.\d% of \d+|-) +\d+\.\d tok/s$",
                feed=True,
            )
            rows = node_rows(panes[name])
            assert sorted(rows) == sorted(n.node_id for n in cluster.nodes), panes[name]
            for node in cluster.nodes:
                row = rows[node.node_id]
                assert row[1] == str(node.role) and row[2].isdigit() and "/" in row[3], panes[name]
                assert "STALE" not in row, panes[name]
        assert f"ALERTS (prometheus {prometheus}): " in panes["prom"] and "ALERTS (local): " in panes["local"]
        print("\n--- kairos top, cluster healthy ---\n" + panes["prom"].rstrip())

        assert cluster.redis is not None
        cluster.redis.stop()
        try:
            wait_pane(
                "local",
                r"^status degraded$",
                r"FIRING +critical +KairosDispatcherDegraded",
                r"FIRING +warning +KairosNodeHeartbeatStale +decode node d0",
            )
            assert all("STALE" in row for row in node_rows(panes["local"]).values()), panes["local"]
            # Prometheus fires after the rules' `for` (15 s, 10 s) on its own scrapes.
            wait_pane(
                "prom",
                r"FIRING +critical +KairosDispatcherDegraded",
                r"FIRING +warning +KairosNodeHeartbeatStale",
                timeout_s=120.0,
            )
            print("\n--- kairos top, Redis down ---\n" + panes["prom"].rstrip())
        finally:
            cluster.start_redis()
        wait_until(
            lambda: (
                shows("local", r"^status ok$")
                and "KairosDispatcherDegraded" not in panes["local"]
                and not any("STALE" in row for row in node_rows(panes["local"]).values())
            ),
            60.0,
            interval_s=0.5,
            what="the local pane back to a healthy cluster",
        )
    finally:
        tmux.kill()
