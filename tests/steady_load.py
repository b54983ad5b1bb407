"""Steady open-loop traffic through the gateway while faults are injected (a test and benchmark
utility, not shipped code): one request every ``1 / rps`` seconds, each on its own thread, so a
slow or hung request never delays the next arrival. Every request's send time, end time and
outcome is kept, so a caller can count what failed around a fault."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Outcome:
    request_id: str
    sent_at: float  # time.monotonic()
    done_at: float
    status: int  # HTTP status, 0 = no response (connection refused, reset, timeout)
    error: str  # "" when the request got a whole, correct completion
    route: str = ""  # x-kairos-route: keep or deflect
    decode_node: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


@dataclass
class SteadyLoad:
    """``SteadyLoad(url, prompt).start()`` ... ``stop()``; ``outcomes`` holds the finished requests."""

    url: str  # the gateway, http://host:port
    prompt: str
    rps: float = 6.0
    max_tokens: int = 4
    model: str = "kairos-tiny-llama"
    timeout_s: float = 60.0
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _threads: list[threading.Thread] = field(default_factory=list)
    _pacer: threading.Thread | None = None

    def start(self) -> SteadyLoad:
        self._pacer = threading.Thread(target=self._pace, name="steady-load", daemon=True)
        self._pacer.start()
        return self

    def stop(self) -> list[Outcome]:
        """Stop sending; wait for every request in flight; the outcomes in send order."""
        self._stop.set()
        if self._pacer is not None:
            self._pacer.join()
        for t in self._threads:
            t.join(self.timeout_s + 5)
        with self._lock:
            return sorted(self.outcomes, key=lambda o: o.sent_at)

    def finished_since(self, t0: float) -> int:
        """Requests finished that were sent at or after ``t0`` (monotonic)."""
        with self._lock:
            return sum(1 for o in self.outcomes if o.sent_at >= t0)

    def _pace(self) -> None:
        period = 1.0 / self.rps
        next_at = time.monotonic()
        while not self._stop.is_set():
            t = threading.Thread(target=self._one, daemon=True)
            t.start()
            self._threads.append(t)
            next_at += period
            self._stop.wait(max(0.0, next_at - time.monotonic()))

    def _one(self) -> None:
        rid = f"load-{uuid.uuid4().hex[:12]}"
        body = json.dumps({"model": self.model, "prompt": self.prompt, "max_tokens": self.max_tokens}).encode()
        req = urllib.request.Request(
            f"{self.url}/v1/completions",
            data=body,
            method="POST",
            headers={"content-type": "application/json", "x-request-id": rid},
        )
        sent = time.monotonic()
        status, error, route, node = 0, "", "", ""
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                status = resp.status
                route, node = resp.headers.get("x-kairos-route", ""), resp.headers.get("x-kairos-decode-node", "")
                reply = json.loads(resp.read())
                if reply.get("usage", {}).get("completion_tokens") != self.max_tokens:
                    error = f"incomplete completion: {json.dumps(reply)[:200]}"
        except urllib.error.HTTPError as err:
            status, error = err.code, f"HTTP {err.code}: {err.read()[:200].decode('utf-8', 'replace')}"
        except (OSError, ValueError) as exc:  # refused, reset, timed out, or not JSON
            error = f"{type(exc).__name__}: {exc}"
        with self._lock:
            self.outcomes.append(Outcome(rid, sent, time.monotonic(), status, error, route, node))
