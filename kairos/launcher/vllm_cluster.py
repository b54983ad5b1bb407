"""A local cluster whose nodes are real vLLM servers (with the Kairos plugins and NixlConnector)
instead of emulated ones; Redis, Envoy, the dispatcher, sidecars and publishers are the same
processes as in :class:`~kairos.launcher.local_cluster.LocalCluster`.

Used by the integration tier (vLLM on CPU with a tiny model) and by ``kairos up --backend vllm``.
vLLM takes tens of seconds to start, so every engine is launched before the first is waited on.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kairos.common.config import with_settings
from kairos.common.contracts import STEPS_PATH, Role
from kairos.common.errors import ConfigError
from kairos.common.kv_events import KvEventEndpoints
from kairos.launcher.local_cluster import LOOPBACK, LocalCluster, NodeProcs
from kairos.launcher.node_profile import (
    FIT_LOG,
    PROFILE_FILE,
    FitTarget,
    ProfileChoice,
    StartUpProfile,
    engine_facts,
    fit_nodes,
    host_facts,
    key_facts,
    model_config,
)
from kairos.launcher.processes import ManagedProcess, free_port, http_ready
from kairos.launcher.vllm_node import VllmNodeSpec

DEFAULT_VLLM_VENV = ".venv-vllm"  # what scripts/vllm_env.sh builds


@dataclass(frozen=True)
class VllmBackend:
    """How the cluster runs vLLM."""

    python: str  # interpreter of an environment with vLLM and kairos-gateway installed
    device: str = "cpu"
    load_format: str = "dummy"  # the tiny test model has no weights
    kv_cache_bytes: int = 256 * 2**20
    record_steps: bool = True  # the step recorder, served at the state port's /kairos/steps
    prefix_caching: bool = True  # vLLM's default; on, each node publishes its KV cache events
    startup_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if not Path(self.python).is_file() or not os.access(self.python, os.X_OK):
            raise ConfigError(
                f"no vLLM environment at {self.python} (build one with: bash scripts/vllm_env.sh, or set "
                "KAIROS_VLLM_PYTHON to a python that has vllm and kairos-gateway installed)"
            )


def default_vllm_python(repo: Path | None = None) -> str:
    """``$KAIROS_VLLM_PYTHON``; else ``.venv-vllm/bin/python`` under ``repo`` (default: the
    current directory, a checkout's root, where scripts/vllm_env.sh builds it) when there is one;
    else this interpreter when it has vLLM (``pip install kairos-gateway[vllm]``: one environment).
    Never a path found from where this module is installed."""
    env = os.environ.get("KAIROS_VLLM_PYTHON")
    if env:
        return env
    venv = (repo or Path.cwd()) / DEFAULT_VLLM_VENV / "bin" / "python"
    if not venv.is_file() and importlib.util.find_spec("vllm") is not None:
        return sys.executable
    return str(venv)  # absent: VllmBackend says how to build it


@dataclass
class VllmCluster(LocalCluster):
    backend: VllmBackend | None = None
    state_ports: dict[str, int] = field(default_factory=dict)
    specs: dict[str, VllmNodeSpec] = field(default_factory=dict)
    # Set: the cluster routes with a profile fitted to its nodes on start, or the one cached in
    # this folder for the same model and host (kairos.launcher.node_profile), not config.profile.
    profile_cache: Path | None = None
    profile_choice: ProfileChoice | None = None  # what start() settled on, with profile_cache
    say: Callable[[str], None] = print  # the progress line of a start that fits its profile

    def state_url(self, node: NodeProcs) -> str:
        return f"{LOOPBACK}:{self.state_ports[node.node_id]}"

    def prometheus_targets(self) -> list[dict[str, Any]]:
        """Besides vLLM's own /metrics: each plugin state server's (step-budget overruns)."""
        return [
            *super().prometheus_targets(),
            *(
                {
                    "targets": [self.state_url(node)],
                    "labels": {"job": "kairos-node-state", "node": node.node_id, "role": str(node.role)},
                }
                for node in self.nodes
            ),
        ]

    def kv_event_endpoints(self, node: NodeProcs) -> KvEventEndpoints | None:
        """Where the node's vLLM publishes its KV cache events (None: prefix caching off)."""
        return self.specs[node.node_id].kv_event_endpoints()

    def steps_url(self, node_id: str) -> str:
        return f"http://{LOOPBACK}:{self.state_ports[node_id]}{STEPS_PATH}"

    def start_nodes(self, timeout_s: float = 60.0) -> None:
        backend = self.backend
        if backend is None:
            raise ConfigError("VllmCluster needs a VllmBackend")
        if self.profile_cache is not None:  # before any spec is made: the decode nodes load it
            self.config = with_settings(self.config, profile=str(self.workdir / PROFILE_FILE))
        processes = [self.engine_process(node) for node in self.nodes]
        startup = self._start_up_profile() if self.profile_cache is not None else None
        found = startup.prepare() if startup is not None else None
        for node, engine in zip(self.nodes, processes, strict=True):
            node.engine = engine
            self.group.procs.append(engine)  # stopped with the rest, even if start-up fails
            engine.start()
        for engine in processes:
            engine.wait_ready(max(timeout_s, backend.startup_timeout_s))
        if startup is not None:  # before the dispatchers start: they load the live file
            targets = [self._fit_target(role) for role in (Role.PREFILL, Role.DECODE)]
            runs = self.workdir / "profile-runs"
            if found is None:
                self.say(
                    f"fitting a latency profile to {', '.join(t.node_id for t in targets)} (kairos profile collect "
                    f"+ fit, about 40 s; log in {runs / FIT_LOG}) ..."
                )
            self.profile_choice = startup.finish(found, lambda: fit_nodes(startup, targets, runs))
        for node in self.nodes:
            self.start_agents(node, timeout_s)

    def _start_up_profile(self) -> StartUpProfile:
        assert self.profile_cache is not None and self.backend is not None and self.model_dir is not None
        if not self.backend.record_steps:
            raise ConfigError("fitting a profile to the nodes needs their step recorder (VllmBackend.record_steps)")
        decode = next(spec for spec in self.specs.values() if spec.role == Role.DECODE)
        facts = key_facts(model_config(self.model_dir), engine_facts(decode), host_facts(self.backend.python))
        return StartUpProfile(self.profile_cache, facts, Path(self.config.profile), self.config.model_name)

    def _fit_target(self, role: Role) -> FitTarget:
        """The first node of ``role``: every node of a role runs the same engine on this host."""
        node = next(n for n in self.nodes if n.role == role)
        return FitTarget(node.node_id, role, node.url, Path(self.specs[node.node_id].step_log))

    def engine_process(self, node: NodeProcs) -> ManagedProcess:
        assert self.backend is not None and self.model_dir is not None
        cfg, backend = self.config, self.backend
        self.state_ports[node.node_id] = free_port()
        workdir = self.workdir / "vllm" / node.node_id
        shutil.rmtree(workdir, ignore_errors=True)  # stale IPC sockets of an earlier run
        workdir.mkdir(parents=True)
        spec = VllmNodeSpec(
            node_id=node.node_id,
            role=node.role,
            python=backend.python,
            model_dir=self.model_dir,
            served_model_name=cfg.model_name,
            port=node.vllm_port,
            state_port=self.state_ports[node.node_id],
            nixl_port=free_port(),
            max_model_len=cfg.max_model_len,
            max_num_batched_tokens=cfg.prefill_step_tokens if node.role == Role.PREFILL else cfg.decode_step_tokens,
            kv_cache_bytes=backend.kv_cache_bytes,
            device=backend.device,
            load_format=backend.load_format,
            profile=cfg.profile if node.role == Role.DECODE else "",
            step_log=str(self.workdir / "steps" / f"{node.node_id}.jsonl") if backend.record_steps else "",
            record_steps=backend.record_steps,
            workdir=workdir,
            prefix_caching=backend.prefix_caching,
            kv_events_port=free_port() if backend.prefix_caching else 0,
            kv_events_replay_port=free_port() if backend.prefix_caching else 0,
        )
        self.specs[node.node_id] = spec
        # What the node's heartbeat publisher advertises (LocalCluster.start_agents): exactly the
        # engine's own --kv-events-config, not the ports LocalCluster planned for an emulated node.
        node.kv_events = spec.kv_events_config()
        return ManagedProcess(
            f"{node.node_id}-vllm",
            spec.argv(),
            self._log(f"{node.node_id}-vllm"),
            ready=http_ready(f"http://{node.url}/health"),
            env=spec.env(),
            cwd=workdir,
        )
