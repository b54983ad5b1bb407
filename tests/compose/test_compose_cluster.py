"""compose/docker-compose.yml with the loopback override, run for real: the README's curl line
and an OpenAI SDK stream through the containerised Envoy, Redis with its password, restart
policies and health checks, and a decode engine killed and brought back by Docker."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

import redis as redis_lib
from kairos.common.contracts import REDIS_NODE_KEY, REDIS_NODE_PATTERN
from tests.compose.conftest import COMPOSE_DIR, PROJECT, SERVICES, compose_env
from tests.compose.docker_daemon import CACHE, ROOT, Compose, DockerDaemon
from tests.waiting import wait_until

GATEWAY = "http://127.0.0.1:8000"
DISPATCHER_NODES = "http://127.0.0.1:9100/nodes"
MODEL = "kairos-tiny-llama"


def readme_curl() -> list[str]:
    """The curl command compose/README.md gives after `docker compose ... up`."""
    text = (COMPOSE_DIR / "README.md").read_text()
    match = re.search(r"^ {4}(curl .*?)(?=\n\n)", text, re.M | re.S)
    assert match, "compose/README.md has no indented curl line"
    return shlex.split(match.group(1).replace("\\\n", " "))


def http_status_and_body(raw: str) -> tuple[int, dict[str, str], dict[str, Any]]:
    head, _, body = raw.replace("\r\n", "\n").partition("\n\n")
    status_line, *header_lines = head.splitlines()
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
    return int(status_line.split()[1]), headers, json.loads(body)


def fresh_nodes() -> set[str]:
    """Nodes the dispatcher routes on from their heartbeats: not stale, and from Redis (a node of
    the static lists alone, used while Redis holds no heartbeat, is not one)."""
    with urllib.request.urlopen(DISPATCHER_NODES, timeout=10) as response:
        return {n["id"] for n in json.load(response)["nodes"] if not n["stale"] and n["from_redis"]}


def complete(max_tokens: int = 4) -> tuple[int, str]:
    """One completion through Envoy: its status and the decode node that served it."""
    body = json.dumps({"model": MODEL, "prompt": "Hello, Kairos", "max_tokens": max_tokens}).encode()
    request = urllib.request.Request(
        f"{GATEWAY}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            json.load(response)
            return response.status, response.headers.get("x-kairos-decode-node", "")
    except urllib.error.HTTPError as exc:
        return exc.code, ""


def test_the_readme_curl_line_through_the_containerised_envoy(cluster: Compose) -> None:
    argv = readme_curl()
    assert argv[0] == "curl" and "localhost:8000/v1/completions" in argv
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True)
    status, headers, body = http_status_and_body(proc.stdout)
    assert status == 200, proc.stdout
    assert headers["server"] == "envoy"
    assert headers["x-kairos-route"] in ("keep", "deflect")
    assert headers["x-kairos-decode-node"] in ("d0", "d1")
    assert body["model"] == MODEL and body["usage"]["completion_tokens"] == 16


def test_an_openai_sdk_streamed_chat(cluster: Compose) -> None:
    client = openai.OpenAI(base_url=f"{GATEWAY}/v1", api_key="unused", max_retries=0, timeout=120)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me about foxes."}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert sum(1 for ch in chunks if ch.choices and ch.choices[0].delta.content) == 8
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8


def test_redis_refuses_clients_without_the_password(cluster: Compose, redis_password: str) -> None:
    with pytest.raises(redis_lib.AuthenticationError):
        redis_lib.Redis(host="127.0.0.1", port=6379, socket_timeout=10).ping()
    with redis_lib.Redis(host="127.0.0.1", port=6379, password=redis_password, socket_timeout=10) as client:
        assert client.ping()
        # Every node's heartbeat, written through the authenticated URL every service is given.
        # (Each key lives 0.5 s past its last beat: on a starved host a beat can be late, so wait.)
        nodes = {REDIS_NODE_KEY.format(node_id=n).encode() for n in ("p0", "p1", "d0", "d1")}
        wait_until(lambda: set(client.keys(REDIS_NODE_PATTERN)) >= nodes, timeout_s=60, what="every heartbeat key")


def test_every_service_has_a_restart_policy_and_a_health_check(cluster: Compose) -> None:
    states = cluster.states()
    for service in (*SERVICES, "model"):
        fmt = "{{.HostConfig.RestartPolicy.Name}} {{.HostConfig.NetworkMode}}"
        policy = cluster.daemon.docker("inspect", "-f", fmt, states[service]["id"]).stdout.split()
        expected = "on-failure" if service == "model" else "unless-stopped"
        assert policy == [expected, "host"], service
    assert states["model"]["status"] == "exited"
    # Health checks pass for every long-running service (on a starved host one may lag a beat).
    wait_until(
        lambda: {s for s, state in cluster.states().items() if state["health"] == "healthy"} >= set(SERVICES),
        timeout_s=120,
        what="every service healthy",
        interval_s=1.0,
    )


def test_a_killed_decode_engine_comes_back_and_the_rest_keep_serving(cluster: Compose) -> None:
    wait_until(lambda: fresh_nodes() == {"p0", "p1", "d0", "d1"}, timeout_s=120, what="all four nodes fresh")
    before = cluster.state("d0")
    # SIGKILL to its main process from the host: a crash, which the restart policy answers (a
    # `docker kill` counts as stopped by hand, and Docker would leave it down).
    subprocess.run(["kill", "-KILL", before["pid"]], check=True)
    wait_until(
        lambda: int(cluster.state("d0")["restarts"]) > int(before["restarts"]),
        timeout_s=120,
        what="d0 restarted by Docker",
        interval_s=0.2,
    )
    # Until its health check passes again, the cluster serves with d1.
    served: list[tuple[int, str]] = []

    def served_by_d1_while_d0_recovers() -> bool:
        served.append(complete())
        return served[-1] == (200, "d1") and cluster.state("d0")["health"] != "healthy"

    wait_until(served_by_d1_while_d0_recovers, timeout_s=60, what="a 200 from d1 while d0 recovers", interval_s=0.1)
    wait_until(lambda: cluster.state("d0")["health"] == "healthy", timeout_s=180, what="d0 healthy again")
    wait_until(lambda: "d0" in fresh_nodes(), timeout_s=120, what="d0's heartbeat back at the dispatcher")
    deadline = time.monotonic() + 120
    decode_nodes = set()
    while decode_nodes != {"d0", "d1"} and time.monotonic() < deadline:  # d0 takes requests again
        status, node = complete()
        assert status == 200
        decode_nodes.add(node)
    assert decode_nodes == {"d0", "d1"}


def test_the_gpu_override_renders_with_the_compose_cli(docker_daemon: DockerDaemon, env_file: Path) -> None:
    # Without a GPU: the CLI merges and validates the files (vLLM's own parser reads the engines'
    # command lines in tests/component/test_compose_gpu.py, with .venv-vllm).
    files = [
        COMPOSE_DIR / name for name in ("docker-compose.yml", "docker-compose.gpu.yml", "docker-compose.loopback.yml")
    ]
    rendered = yaml.safe_load(Compose(docker_daemon, files, env_file, PROJECT, compose_env()).run("config").stdout)
    services = rendered["services"]
    for node in ("p0", "p1", "d0", "d1"):
        assert services[node]["image"] == "kairos-vllm:local"
        assert services[node]["entrypoint"] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
        assert services[node]["network_mode"] == "host"
    (config,) = services["envoy"]["volumes"]  # 1.29 writes "source:target:mode", v2 a mapping
    assert "envoy.loopback.yaml" in str(config)


def test_the_gpu_image_builds_on_a_cuda_free_base(docker_daemon: DockerDaemon, images: None, tmp_path: Path) -> None:
    # NIXL as scripts/vllm_env.sh pins it, with its CUDA 12 build, without torch and CUDA.
    spec = re.search(
        r'NIXL_SPEC=\$\{KAIROS_NIXL_SPEC:-"nixl==([^"]+)"\}', (ROOT / "scripts" / "vllm_env.sh").read_text()
    )
    assert spec is not None
    nixl = CACHE / f"nixl-{spec.group(1)}"
    if not list(nixl.glob("*.whl")):
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(nixl),
             f"nixl=={spec.group(1)}", f"nixl-cu12=={spec.group(1)}"],
            check=True, capture_output=True, timeout=600,
        )  # fmt: skip
    context = tmp_path / "cudafree"
    context.mkdir()
    for wheel in nixl.glob("*.whl"):
        shutil.copy(wheel, context)
    shutil.copy(Path(__file__).parent / "Dockerfile.cudafree", context / "Dockerfile")
    try:
        docker_daemon.docker("build", "--network", "host", "-t", "kairos-cudafree:test", str(context), timeout=900)
        # compose/Dockerfile.vllm as the GPU override builds it, on that base: its own checks (the
        # plugins, NIXL, the logits-processor entry point) run in the build.
        docker_daemon.docker(
            "build", "--network", "host", "-f", str(COMPOSE_DIR / "Dockerfile.vllm"),
            "--build-arg", "BASE_IMAGE=kairos-cudafree:test", "-t", "kairos-vllm:test", str(ROOT),
            timeout=900,
        )  # fmt: skip
        entrypoint = docker_daemon.docker("inspect", "-f", "{{json .Config.Entrypoint}}", "kairos-vllm:test").stdout
        assert json.loads(entrypoint) == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    finally:
        # Built to be checked, not run: their 0.9 GB (a second Kairos install) go at once, as do the
        # layers of a failed build, so the rest of the run has the disk (CI's is shared).
        docker_daemon.docker("rmi", "--force", "kairos-vllm:test", "kairos-cudafree:test", check=False)
        docker_daemon.docker("image", "prune", "--force", check=False)
