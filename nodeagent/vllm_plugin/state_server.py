"""The local channel from the vLLM engine process to the heartbeat publisher (and Prometheus).

A daemon thread serves ``GET /kairos/state`` (the newest snapshot, as bytes the scheduler
thread swapped in whole) and ``GET /kairos/steps?since=N`` (the step recorder's ring) on
loopback (paths and formats: :mod:`kairos.common.contracts`). The publisher polls it every
heartbeat period, so the engine never writes to Redis and a slow reader never slows a step.
``GET /metrics`` serves what vLLM's own ``/metrics`` cannot know: the step-budget overruns.
"""

from __future__ import annotations

import json
import logging
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest

from kairos.common.contracts import (
    STATE_PATH,
    STEP_BUDGET_OVERRUNS_HELP,
    STEP_BUDGET_OVERRUNS_METRIC,
    STEPS_PATH,
    STEPS_SINCE,
    encode_steps_page,
    parse_steps_since,
)
from kairos.nodeagent.vllm_plugin.recorder import StepRecorder

log = logging.getLogger(__name__)

METRICS_PATH = "/metrics"


class StateServer:
    def __init__(self, host: str, port: int, recorder: StepRecorder | None = None) -> None:
        self._snapshot: bytes | None = None
        self._recorder = recorder
        self._registry = CollectorRegistry()
        self._overruns = Counter(STEP_BUDGET_OVERRUNS_METRIC, STEP_BUDGET_OVERRUNS_HELP, registry=self._registry)
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                url = urlsplit(self.path)
                if url.path == STATE_PATH:
                    body = server._snapshot
                    if body is None:
                        self._reply(HTTPStatus.SERVICE_UNAVAILABLE, _error("engine state not ready yet"))
                    else:
                        self._reply(HTTPStatus.OK, body)
                elif url.path == STEPS_PATH:
                    self._steps(parse_qs(url.query).get(STEPS_SINCE, ["0"])[0])
                elif url.path == METRICS_PATH:
                    self._reply(HTTPStatus.OK, generate_latest(server._registry), CONTENT_TYPE_LATEST)
                else:
                    self._reply(HTTPStatus.NOT_FOUND, _error(f"no route {url.path}; try {STATE_PATH}"))

            def _steps(self, since: str) -> None:
                if server._recorder is None:
                    self._reply(HTTPStatus.NOT_FOUND, _error("step recorder is off (KAIROS_VLLM_RECORD_STEPS=1)"))
                    return
                try:
                    start = parse_steps_since(since)
                except ValueError as exc:
                    self._reply(HTTPStatus.BAD_REQUEST, _error(str(exc)))
                    return
                rec = server._recorder
                self._reply(HTTPStatus.OK, encode_steps_page(rec.node, rec.next_index, rec.since(start)).encode())

            def _reply(self, status: HTTPStatus, body: bytes, content_type: str = "application/json") -> None:
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", content_type)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except ConnectionError:
                    # The publisher gave up waiting (a busy engine process was slow to answer):
                    # its next poll gets a fresh snapshot; nothing to report here.
                    return

            def log_message(self, format: str, *args: object) -> None:
                return  # one line per heartbeat poll would drown vLLM's own log

        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="kairos-state", daemon=True)
        self._thread.start()
        log.info("kairos: engine state on http://%s:%d%s", host, self.port, STATE_PATH)

    def publish(self, snapshot: bytes | None) -> None:
        """The newest state JSON; None withdraws it (503: the publisher stops beating)."""
        self._snapshot = snapshot  # one reference swap: readers see the old or the new, whole

    def count_step_budget_overrun(self) -> None:
        self._overruns.inc()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def _error(message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "kairos_state"}}).encode()
