"""``kairos up``: a whole local cluster (Envoy, Redis, dispatcher, emulated 2P2D nodes with
their sidecars and heartbeat publishers) until Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path

from kairos.common.config import add_flags, flag_values
from kairos.common.errors import KairosError
from kairos.launcher.local_cluster import SOURCE, LocalCluster, LocalClusterConfig
from kairos.launcher.node_profile import describe_given, profile_cache_dir, wants_fitted_profile
from kairos.launcher.observability import DASHBOARD, write_observability
from kairos.launcher.processes import ProcessError, Supervisor
from kairos.launcher.remote_nodes import RemoteNodesCluster, load_nodes
from kairos.launcher.vllm_cluster import VllmBackend, VllmCluster, default_vllm_python


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "up",
        help="run a local cluster: Envoy, Redis, dispatcher and emulated prefill/decode nodes",
        description="Start a local Kairos cluster and keep it up until Ctrl-C or SIGTERM. Settings: defaults "
        "< --config YAML (section 'cluster') < KAIROS_CLUSTER_* environment < flags.",
    )
    p.add_argument("--config", type=Path, help="YAML file with a 'cluster' section")
    p.add_argument(
        "--workdir", type=Path, help="logs and generated files (default: a temporary folder, removed on exit)"
    )
    p.add_argument(
        "--nodes", type=Path, help="YAML file of nodes running elsewhere: start only Redis, the dispatcher and Envoy"
    )
    p.add_argument(
        "--backend",
        choices=("emulated", "vllm"),
        default="emulated",
        help="emulated nodes (default) or real vLLM servers with the Kairos plugins (CPU: the tiny model)",
    )
    p.add_argument(
        "--vllm-python",
        help="python of the vLLM environment (default: $KAIROS_VLLM_PYTHON, else ./.venv-vllm, else this python "
        "if it has vLLM)",
    )
    add_flags(p, LocalClusterConfig)  # the cluster's settings, the dispatchers' and the sidecars' among them
    p.set_defaults(handler=run_up)


def _cluster(args: argparse.Namespace, config: LocalClusterConfig, workdir: Path) -> LocalCluster:
    if args.nodes is not None:
        return RemoteNodesCluster(config, workdir, remote=load_nodes(args.nodes))
    if args.backend == "emulated":
        return LocalCluster(config, workdir)
    backend = VllmBackend(python=args.vllm_python or default_vllm_python())
    fit = wants_fitted_profile(args.profile, config.profile)
    cache = profile_cache_dir(args.workdir, os.environ) if fit else None
    return VllmCluster(config, workdir, backend=backend, profile_cache=cache, say=lambda line: print(line, flush=True))


def _profile_line(cluster: LocalCluster, args: argparse.Namespace) -> str:
    """Which profile the cluster routes with and where it came from."""
    choice = cluster.profile_choice if isinstance(cluster, VllmCluster) else None
    if choice is not None:
        return choice.describe()
    return describe_given(cluster.config.profile, args.profile, args.backend, args.nodes is not None)


def _await_heartbeats(cluster: LocalCluster, stop: threading.Event, timeout_s: float) -> None:
    """Until every dispatcher routes on every listed node; says which are missing meanwhile. Not
    fatal: the gateway routes on what it has, so requests work as soon as one node of each role beats."""

    def waiting(unseen: list[str]) -> None:
        print(f"waiting for heartbeats from {', '.join(unseen)} ...", flush=True)

    try:
        cluster.wait_for_heartbeats(timeout_s, stop=stop, on_waiting=waiting)
    except ProcessError as exc:
        print(f"kairos up: {exc}; routing without them", file=sys.stderr)
        return
    if not stop.is_set():
        print(f"heartbeats from all {len(cluster.nodes)} nodes", flush=True)


def _say(line: str) -> None:
    print(f"kairos up: {line}", file=sys.stderr, flush=True)


def _print_redis(cluster: LocalCluster) -> None:
    """Where Redis is and where its credentials are (never the passwords themselves)."""
    setup = cluster.redis_setup
    assert setup is not None, "the cluster started Redis"
    scheme = "rediss" if setup.tls else "redis"
    print(
        f"Redis at {scheme}://{setup.advertise}:{setup.port}/0: ACL users only (default user off); "
        f"the admin's URL is in {setup.credentials_file('admin')}",
        flush=True,
    )
    if isinstance(cluster, RemoteNodesCluster):
        print("each node's agents use their own Redis user: copy its file to the node, then run", flush=True)
        print("  set -a; . ./NODE.env; set +a   # before kairos heartbeat / kairos sidecar (no --redis)", flush=True)
        for node_id, path in cluster.node_credentials():
            print(f"  {node_id}: {path}", flush=True)
        if setup.tls:
            print(f"  and the CA {setup.ca_path} to the same path on each node", flush=True)


def run_up(args: argparse.Namespace) -> int:
    config = SOURCE.load(args.config, flag_values(args, LocalClusterConfig))
    if args.log_level:  # kairos --log-level, before the subcommand: every process's
        config = dataclasses.replace(config, log_level=args.log_level)
    stop = threading.Event()
    # Before the temporary folder exists, so that no signal can leave it behind. SIGHUP: the
    # terminal went away, which stops the cluster as Ctrl-C does.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    if args.workdir is not None:
        return _serve(args, config, args.workdir, stop)
    workdir = Path(tempfile.mkdtemp(prefix="kairos-up-"))
    try:
        return _serve(args, config, workdir, stop)
    finally:  # after every child has stopped: nothing writes there any more
        shutil.rmtree(workdir, ignore_errors=True)
        print(f"removed {workdir} (--workdir keeps the logs and generated files)", flush=True)


def _serve(args: argparse.Namespace, config: LocalClusterConfig, workdir: Path, stop: threading.Event) -> int:
    """Start the cluster in ``workdir``, keep it up until ``stop``, then stop it: the exit status."""
    try:
        cluster = _cluster(args, config, workdir)
    except KairosError as exc:
        print(f"kairos up: error: {exc.message}", file=sys.stderr)
        return 2
    what = f"the gateway for {args.nodes}" if args.nodes else f"{config.prefill_nodes}P{config.decode_nodes}D"
    print(f"starting {what} (logs in {workdir / 'logs'}) ...", flush=True)
    try:
        cluster.start()
        if stop.is_set():
            return 130
        _print_redis(cluster)
        print(f"routing with {_profile_line(cluster, args)}", flush=True)
        _await_heartbeats(cluster, stop, timeout_s=120.0 if args.nodes else 30.0)
        if stop.is_set():
            return 130
        url = cluster.gateway_url
        print(f"\nKairos gateway ready at {url}  (policy {config.policy}, profile {cluster.config.profile})")
        print("try:")
        print(
            f"  curl -s {url}/v1/completions -H 'Content-Type: application/json' "
            f'-d \'{{"model": "{config.model_name}", "prompt": "Hello, Kairos", "max_tokens": 16}}\' -i'
        )
        targets = cluster.write_prometheus_targets(workdir / "prometheus-targets.json")
        prometheus = write_observability(workdir / "observability", targets)
        print(f"watch it: kairos top --dispatcher http://127.0.0.1:{cluster.dispatcher_metrics_ports[0]}")
        print(f"Prometheus targets (file_sd): {targets}")
        print(f"Prometheus with the alert rules: prometheus --config.file={prometheus}")
        print(f"Grafana dashboard: {prometheus.parent / DASHBOARD}")
        print("Ctrl-C stops everything.", flush=True)
        # A child that exits is restarted (a crash loop gives up on that child only); the rest
        # of the cluster keeps serving meanwhile, as it does for any node fault.
        supervisor = Supervisor(cluster.group, say=_say)
        while not stop.wait(0.2):
            supervisor.check()
        return 0
    except KairosError as exc:
        print(f"kairos up: error: {exc.message}", file=sys.stderr)
        return 1
    finally:
        print("stopping ...", flush=True)
        cluster.stop()
        print("stopped.", flush=True)
