"""The dispatcher reloads its latency profile file mid-replay, through a real local cluster, without
dropping a request: an atomic rewrite (temporary file + rename) is swapped in; a non-atomic one
(a truncated write, then the full write) is first rejected, with the old models kept, then
swapped in once complete. The same replay shows the sidecars' TTFT feedback reaching the
dispatcher through Redis.

The replay lasts as long as the rewrites do, however slow the host: it is sent in rounds (slices
of one bursty trace, each request id once) until the rewrites are done and one more round, begun
after the last reload, has run whole on the new profile; and never less than the whole trace."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kairos.common import contracts as c
from kairos.core.latency import load_profile
from kairos.launcher.local_cluster import LocalCluster
from kairos.launcher.replay import ReplayConfig, RequestResult, replay
from kairos.traffic.requests import RequestSpec
from kairos.traffic.workloads import make_workload
from tests.e2e.conftest import http, start_cluster, wait_for_fresh_polls
from tests.waiting import wait_until

TIME_SCALE = 2.0
RELOAD_S = 0.2  # the dispatcher's file check period in this test
REQUESTS = 48  # the trace: 12 s of model time at 4 RPS, sent whole at least once
ROUND = 12  # requests per round of the replay (about 1.5 s of wall time)


def _trace() -> list[RequestSpec]:
    base = make_workload("bursty", rps=4.0, num_requests=REQUESTS, seed=11)
    return [
        RequestSpec(r.request_id, r.arrival_s, 100 + r.prompt_tokens % 3200, min(r.output_tokens, 16)) for r in base
    ]


def _round(trace: list[RequestSpec], k: int) -> list[RequestSpec]:
    """Round ``k``: the trace's ``k``-th slice of ``ROUND`` requests (cycling), its ids made unique."""
    start = (k * ROUND) % len(trace)
    return [
        RequestSpec(f"{r.request_id}-r{k}", r.arrival_s, r.prompt_tokens, r.output_tokens)
        for r in trace[start : start + ROUND]
    ]


class _Traffic(threading.Thread):
    """Replays ``trace`` in rounds until :meth:`finish`, and then one round more, begun after it
    (and not before the whole trace has been sent once): the traffic outlasts whatever the test
    does before calling finish. ``abort`` ends it after the current round (a failed test)."""

    def __init__(self, trace: list[RequestSpec], config: ReplayConfig) -> None:
        super().__init__(daemon=True)
        self.trace, self.config = trace, config
        self.results: list[RequestResult] = []
        self.after: list[RequestResult] = []  # the rounds begun after finish()
        self._finish, self._abort = threading.Event(), threading.Event()

    def finish(self) -> None:
        self._finish.set()

    def abort(self) -> None:
        self._abort.set()
        self._finish.set()

    def run(self) -> None:
        k = 0
        while not self._abort.is_set():
            after = self._finish.is_set()
            done = replay(_round(self.trace, k), self.config, stream=None)
            self.results.extend(done)
            k += 1
            if after:
                self.after.extend(done)
                if k * ROUND >= len(self.trace):
                    return


def _profile(name: str, decode_scale: float) -> bytes:
    doc = load_profile().to_dict()
    doc["name"] = name
    doc["models"][c.DECODE_STEP]["intercept"] *= decode_scale
    return json.dumps(doc, indent=1).encode()


def _metrics(cluster: LocalCluster) -> dict[str, list[tuple[dict[str, str], float]]]:
    _, _, raw = http("GET", f"http://127.0.0.1:{cluster.dispatcher_metrics_ports[0]}/metrics", timeout=30)
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(raw.decode()):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def _reloads(cluster: LocalCluster) -> dict[str, float]:
    return {labels["outcome"]: v for labels, v in _metrics(cluster)["kairos_dispatcher_profile_reloads_total"]}


def _profile_in_use(cluster: LocalCluster) -> str:
    (labels,) = [labels for labels, v in _metrics(cluster)["kairos_dispatcher_profile_info"] if v == 1]
    return labels["name"]


def _decisions(cluster: LocalCluster) -> float:
    # No series before the first decision (its labels are the route and reason).
    return sum(v for _, v in _metrics(cluster).get("kairos_dispatcher_decisions_total", []))


def test_profile_rewrites_mid_replay_reload_without_dropping_a_request(tmp_path: Path, model_dir: Path) -> None:
    path = tmp_path / "profile.json"
    path.write_bytes(_profile("e2e-v1", 1.0))
    trace = _trace()
    cluster = start_cluster(
        tmp_path / "cluster",
        model_dir,
        time_scale=TIME_SCALE,
        profile=str(path),
        profile_reload_s=RELOAD_S,
    )
    config = ReplayConfig(
        url=cluster.gateway_url,
        model_dir=str(model_dir),
        time_scale=TIME_SCALE,
        request_timeout_s=30.0,
        deadline_s=90.0,
    )
    traffic = _Traffic(trace, config)
    try:
        assert _profile_in_use(cluster) == "e2e-v1"
        assert _reloads(cluster) == {"ok": 0, "error": 0}
        traffic.start()
        wait_until(lambda: _decisions(cluster) >= 3, what="requests flowing through the dispatcher")

        # 1. Atomic: a temporary file renamed over the profile.
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(_profile("e2e-v2", 1.1))
        os.replace(tmp, path)
        wait_until(lambda: _profile_in_use(cluster) == "e2e-v2", what="the atomic rewrite swapped in")
        assert _reloads(cluster) == {"ok": 1, "error": 0}

        # 2. Not atomic: the file truncated and half written (a writer caught mid-write)...
        v3 = _profile("e2e-v3", 0.9)
        path.write_bytes(v3[: len(v3) // 2])
        wait_until(lambda: _reloads(cluster)["error"] >= 1, what="the partial file rejected")
        # Several checks of the same bad version: still one error, old models. The dispatcher's
        # loop taking 7 newer heartbeats of a node (>= 0.6 s of its own polling, beats are 0.1 s
        # apart) is its checks' chance, every RELOAD_S on the same loop, however slow the host.
        wait_for_fresh_polls(cluster, polls=round(3 * RELOAD_S / c.HEARTBEAT_PERIOD_S) + 1)
        assert _profile_in_use(cluster) == "e2e-v2"
        errors = _reloads(cluster)["error"]
        # ...then the full write.
        path.write_bytes(v3)
        wait_until(lambda: _profile_in_use(cluster) == "e2e-v3", what="the completed rewrite swapped in")
        reloads = _reloads(cluster)
        # Each truncation may be seen as one more bad version (a check between truncate and write).
        assert reloads["ok"] == 2 and 1 <= errors <= reloads["error"] <= errors + 1, reloads

        # SIGHUP re-reads at once; same content, nothing swapped.
        dispatcher = cluster.dispatcher_procs[0]
        os.kill(dispatcher.pid, signal.SIGHUP)
        log = cluster.workdir / "logs" / "dispatcher0.log"
        wait_until(lambda: "its content is the one in use, e2e-v3" in log.read_text(), what="SIGHUP re-read")
        assert traffic.is_alive(), "the traffic stopped before the rewrites were done"  # it runs until finish()
        traffic.finish()

        traffic.join(timeout=180)
        assert not traffic.is_alive()
        results = traffic.results
        assert len(results) >= len(trace) and len({r.request_id for r in results}) == len(results)
        failed = [r for r in results if not r.ok]
        assert failed == [], failed[:3]
        assert {r.route for r in results} == {"keep", "deflect"}
        # A whole round was decided after the last reload, on the new profile, and nothing reloaded since.
        assert traffic.after and all(r.ok for r in traffic.after)
        assert _profile_in_use(cluster) == "e2e-v3"
        assert _reloads(cluster) == reloads

        text = log.read_text()
        assert text.count("profile reload rejected:") == reloads["error"]
        assert f"profile reload rejected: {path}: not valid JSON" in text
        assert "still using e2e-v2 (" in text
        assert text.count("profile reloaded from") == 2

        # The sidecars' TTFT samples (one per request: every routed request carries a prediction)
        # reach the dispatcher through the Redis stream.
        def samples() -> float:
            m = _metrics(cluster)
            return sum(v for _, v in m["kairos_dispatcher_ttft_observed_over_predicted_count"])

        wait_until(lambda: samples() == len(results), what="every request's TTFT sample read by the dispatcher")
        mape = {labels["path"]: v for labels, v in _metrics(cluster)["kairos_dispatcher_ttft_prediction_mape"]}
        assert set(mape) == {"keep", "deflect"} and all(v >= 0 for v in mape.values()), mape
    finally:
        traffic.abort()  # no-op after a clean run
        cluster.stop()
        if traffic.ident is not None:
            traffic.join(timeout=60)
