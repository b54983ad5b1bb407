"""Writes to a running cluster's Redis from outside, as an attacker would, and counts what each
write does to routing (issue 11, part 3). Run it against ``kairos up``:

    .venv/bin/python -m bench.live.redis_attacks --gateway http://127.0.0.1:8000 \
        --metrics http://127.0.0.1:9100 --redis redis://127.0.0.1:6379/0 --label before

``--redis`` is the attacker's URL: no credential, a guessed one, or one node's ACL credential
(``redis://kairos-node-p0:...@host:port/0``). Five attacks, each with 30 requests through the
gateway (the held-reservation one measures deflections on a saturated prefill pool instead):

- fake prefill node: ``kairos:node:aaa-evil-p`` (first in id order) claims an idle prefill node at a dead address;
- overwritten heartbeats: p0's and p1's keys rewritten with a dead address, 100 times a second;
- fake decode node: ``kairos:node:aaa-evil-d`` claims an idle decode node behind d0's sidecar;
- held reservations: ``kairos:reserve:d*`` set with no expiry;
- junk feedback: 200 entries of predicted 10,000 s, observed 1 ms in ``kairos:ttft-feedback``.

Each row says how many attacker writes Redis refused, requests that failed, decisions the fake
node won, deflections, or the MAPE the dispatcher exports. Prints a table, writes JSON to
``bench/results/redis_attacks-<label>.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from typing import Any

import redis
from bench.harness.results import RESULTS_DIR
from kairos.common import contracts as c
from kairos.common.redis_client import redact_url

MODEL = "kairos-tiny-llama"
REQUESTS = 30
DEAD = "127.0.0.1:9"  # the discard port: nothing listens


def http(method: str, url: str, body: bytes | None = None, timeout: float = 60.0) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url, data=body, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read()
    except (urllib.error.URLError, OSError) as exc:
        return 0, {}, str(exc).encode()


def complete(gateway: str, prompt: str = " ".join(["hello"] * 500), max_tokens: int = 4) -> tuple[int, dict[str, str]]:
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}).encode()
    status, headers, _ = http("POST", f"{gateway}/v1/completions", body, timeout=120)
    return status, headers


def beat(node_id: str, role: str, url: str, sidecar: str, seq: int) -> str:
    return c.encode_heartbeat(
        c.Heartbeat(
            node_id=node_id,
            role=c.Role(role),
            url=url,
            sidecar=sidecar,
            seq=seq,
            sent_at=time.time(),
            decode_tokens=0,
            kv_tokens=0,
            kv_capacity_tokens=10_000_000,
            queued_prefill_tokens=(),
            scheduled_prefill_tokens=(),
            max_step_tokens=4096,
            model=MODEL,
        )
    )


class Writer:
    """Repeats ``write`` every ``period_s`` in a thread, counting refused and accepted writes."""

    def __init__(self, write: Callable[[int], None], period_s: float) -> None:
        self.write, self.period_s = write, period_s
        self.ok = self.refused = 0
        self.last_error = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        seq = 1_000_000
        while not self._stop.is_set():
            seq += 1
            try:
                self.write(seq)
                self.ok += 1
            except redis.RedisError as exc:
                self.refused += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
            self._stop.wait(self.period_s)

    def __enter__(self) -> Writer:
        self._thread.start()
        time.sleep(0.5)  # several beats and dispatcher polls under the attacker's value
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def nodes_report(metrics: str) -> dict[str, Any]:
    return json.loads(http("GET", f"{metrics}/nodes")[2])


def metric(metrics: str, name: str, labels: str = "") -> float | None:
    text = http("GET", f"{metrics}/metrics")[2].decode()
    for line in text.splitlines():
        if line.startswith(name + (f"{{{labels}}}" if labels else "")) and not line.startswith("#"):
            return float(line.rsplit(" ", 1)[1])
    return None


def requests(gateway: str, n: int = REQUESTS) -> list[tuple[int, dict[str, str]]]:
    return [complete(gateway) for _ in range(n)]


def attack_fake_prefill(client: redis.Redis, args: argparse.Namespace) -> dict[str, Any]:
    key = c.REDIS_NODE_KEY.format(node_id="aaa-evil-p")
    with Writer(lambda s: client.set(key, beat("aaa-evil-p", "prefill", DEAD, "", s), px=500), 0.05) as w:
        adopted = any(n["id"] == "aaa-evil-p" for n in nodes_report(args.metrics)["nodes"])
        results = requests(args.gateway)
    return {
        "writes_refused": w.refused,
        "writes_ok": w.ok,
        "adopted": adopted,
        "failed": sum(s != 200 for s, _ in results),
        "requests": len(results),
        "error": w.last_error,
    }


def attack_overwrite(client: redis.Redis, args: argparse.Namespace) -> dict[str, Any]:
    def writer(node: str) -> Writer:
        key = c.REDIS_NODE_KEY.format(node_id=node)
        return Writer(lambda seq: client.set(key, beat(node, "prefill", DEAD, "", seq), px=500), 0.01)

    with writer("p0") as w0, writer("p1") as w1:
        results = requests(args.gateway)
    return {
        "writes_refused": w0.refused + w1.refused,
        "writes_ok": w0.ok + w1.ok,
        "failed": sum(s != 200 for s, _ in results),
        "requests": len(results),
        "error": w0.last_error or w1.last_error,
    }


def attack_fake_decode(client: redis.Redis, args: argparse.Namespace, admin: redis.Redis) -> dict[str, Any]:
    real = json.loads(admin.get(c.REDIS_NODE_KEY.format(node_id="d0")) or "{}")
    sidecar = real.get("sidecar", DEAD)
    key = c.REDIS_NODE_KEY.format(node_id="aaa-evil-d")
    with Writer(
        lambda s: client.set(key, beat("aaa-evil-d", "decode", real.get("url", DEAD), sidecar, s), px=500), 0.05
    ) as w:
        results = requests(args.gateway)
    won = sum(h.get(c.H_DECODE_NODE) == "aaa-evil-d" for _, h in results)
    return {
        "writes_refused": w.refused,
        "writes_ok": w.ok,
        "decisions_won": won,
        "failed": sum(s != 200 for s, _ in results),
        "requests": len(results),
        "error": w.last_error,
    }


def deflections_on_saturated_pool(args: argparse.Namespace, admin: redis.Redis) -> int:
    """Deflections among 6 short requests sent while 4 long prompts fill the prefill queues."""
    long_prompt = " ".join(["hello"] * 15_000)
    loaders = [threading.Thread(target=complete, args=(args.gateway, long_prompt, 1), daemon=True) for _ in range(4)]
    for t in loaders:
        t.start()
        time.sleep(0.05)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        beats = [json.loads(admin.get(c.REDIS_NODE_KEY.format(node_id=n)) or "{}") for n in ("p0", "p1")]
        if all(sum(b.get("queued_prefill_tokens", [])) >= 4096 for b in beats):
            break
        time.sleep(0.02)
    time.sleep(0.2)  # a dispatcher poll or two
    routes = [complete(args.gateway, "Hello, Kairos")[1].get(c.H_ROUTE) for _ in range(6)]
    for t in loaders:
        t.join()
    return sum(r == "deflect" for r in routes)


def attack_reservations(client: redis.Redis, args: argparse.Namespace, admin: redis.Redis) -> dict[str, Any]:
    baseline = deflections_on_saturated_pool(args, admin)
    refused, error = 0, ""
    keys = [c.REDIS_RESERVATION_KEY.format(node_id=n) for n in ("d0", "d1")]
    for key in keys:
        try:
            client.set(key, "attacker")  # no expiry: held for good
        except redis.RedisError as exc:
            refused += 1
            error = f"{type(exc).__name__}: {exc}"
    try:
        attacked = deflections_on_saturated_pool(args, admin)
    finally:
        admin.delete(*keys)
    return {
        "writes_refused": refused,
        "writes_ok": len(keys) - refused,
        "deflections_without": baseline,
        "deflections_with": attacked,
        "requests": 6,
        "error": error,
    }


def attack_feedback(client: redis.Redis, args: argparse.Namespace) -> dict[str, Any]:
    requests(args.gateway, 10)  # real samples first
    time.sleep(0.5)
    before = metric(args.metrics, "kairos_dispatcher_ttft_prediction_mape", 'path="keep"')
    f = c.TtftFeedbackField
    refused, error = 0, ""
    for _ in range(200):
        junk = {
            f.REQUEST_ID: uuid.uuid4().hex,
            f.PATH: "keep",
            f.NODE: "d0",
            f.PREDICTED_MS: "10000000",
            f.OBSERVED_MS: "1",
            f.MEASURED: c.TTFT_FEEDBACK_FIRST_TOKEN,  # well-formed but for its bounds
        }
        try:
            client.xadd(c.REDIS_TTFT_FEEDBACK_STREAM, junk)
        except redis.RedisError as exc:
            refused += 1
            error = f"{type(exc).__name__}: {exc}"
    time.sleep(1.0)
    after = metric(args.metrics, "kairos_dispatcher_ttft_prediction_mape", 'path="keep"')
    malformed = metric(args.metrics, "kairos_dispatcher_ttft_feedback_malformed_total")
    return {
        "writes_refused": refused,
        "writes_ok": 200 - refused,
        "mape_before": before,
        "mape_after": after,
        "feedback_rejected_total": malformed,
        "error": error,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gateway", required=True)
    p.add_argument("--metrics", required=True, help="the dispatcher's metrics URL (/nodes, /metrics)")
    p.add_argument("--redis", required=True, help="the attacker's Redis URL")
    p.add_argument("--admin-redis", help="a URL that may read heartbeats (default: --redis)")
    p.add_argument("--label", default="run")
    p.add_argument("--only", help="comma-separated attacks to run")
    args = p.parse_args()
    client = redis.Redis.from_url(args.redis, socket_timeout=5)
    admin = redis.Redis.from_url(args.admin_redis or args.redis, socket_timeout=5)
    attacks: dict[str, Callable[[], dict[str, Any]]] = {
        "fake_prefill": lambda: attack_fake_prefill(client, args),
        "overwrite_p0_p1": lambda: attack_overwrite(client, args),
        "fake_decode": lambda: attack_fake_decode(client, args, admin),
        "held_reservations": lambda: attack_reservations(client, args, admin),
        "junk_feedback": lambda: attack_feedback(client, args),
    }
    only = set(args.only.split(",")) if args.only else set(attacks)
    results: dict[str, Any] = {"label": args.label, "attacker": redact_url(args.redis)}
    for name, run in attacks.items():
        if name in only:
            time.sleep(1.0)  # the real heartbeats take the keys back
            before = nodes_report(args.metrics).get("rejected_heartbeats")
            results[name] = run()
            after = nodes_report(args.metrics).get("rejected_heartbeats")
            if before is not None and after is not None:  # dispatchers that count them (issue 11)
                results[name]["heartbeats_rejected"] = {k: after[k] - before[k] for k in after if after[k] > before[k]}
            print(f"{name:18s} {json.dumps(results[name])}", flush=True)
    out = RESULTS_DIR / f"redis_attacks-{args.label}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
