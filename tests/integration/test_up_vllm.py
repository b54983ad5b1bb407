"""``kairos up --backend vllm`` routes with a profile fitted to the vLLM nodes it starts, says which
and where it came from, and a later start on the same model and host finds it cached.

A cluster of its own (``kairos up`` as a user runs it), so this module runs before the tier's
shared cluster starts (files run in name order), never two vLLM pairs at once.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from unittest.mock import ANY

import pytest

from kairos.common import defaults
from kairos.common.contracts import Role
from kairos.core.calibration import prior_from_mape
from kairos.core.latency import load_profile
from kairos.launcher import node_profile, top
from kairos.launcher.processes import free_port
from kairos.launcher.vllm_node import VllmNodeSpec
from tests import timings
from tests.e2e.conftest import post_json
from tests.e2e.test_up import Output
from tests.integration.conftest import MODEL_NAME, ROOT, _vllm_python, get_json, scrape
from tests.waiting import wait_until

pytestmark = pytest.mark.vllm

KAIROS = (sys.executable, "-m", "kairos.launcher.cli")


def _stop(proc: subprocess.Popen[str]) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


def test_kairos_up_vllm_routes_with_a_profile_fitted_to_its_nodes_and_caches_it(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    python = _vllm_python()
    tmp_path = tmp_path_factory.mktemp("up")  # short: vLLM's IPC socket paths under it must fit 107 bytes
    workdir = tmp_path / "w"
    spec = VllmNodeSpec("d0", Role.DECODE, python, workdir / "model", MODEL_NAME, 1, 2, 3)  # as kairos up makes d0's
    started = time.monotonic()
    argv = [*KAIROS, "up", "--backend", "vllm", "--prefill-nodes", "1", "--decode-nodes", "1"]
    argv += ["--port", str(free_port()), "--workdir", str(workdir)]
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env={**os.environ, "KAIROS_VLLM_PYTHON": python},
    )
    out = Output(proc)
    try:
        # vLLM's start on two starved cores, then the fit: minutes, not seconds.
        out.until("fitting a latency profile to p0, d0 (kairos profile collect + fit", 900)
        line = out.until("routing with profile", 600).strip()
        timings.record(
            "integration tier: kairos up --backend vllm, start with the profile fit", time.monotonic() - started
        )
        name = re.search(r"routing with profile (kairos-tiny-llama-cpu-[0-9a-f]{8}) ", line)
        assert name is not None, line
        assert "(fitted to these nodes on start in " in line and str(workdir / "profiles") in line, line
        live = load_profile(workdir / node_profile.PROFILE_FILE)
        assert live.name == name.group(1) and live.provenance["measured"] is True
        # Every step model fitted to these nodes' own steps, its error measured on runs it never saw;
        # only the KV transfer model is the base profile's (the collection measures no transfers).
        assert live.provenance["copied_from_base"]["models"] == ["kv_transfer"]
        for model in (live.decode, live.prefill, live.mixed):
            assert model.samples and model.mape is not None, model
            assert f"{model.name} {model.mape:.1%}" in line
        assert live.model.startswith(f"{MODEL_NAME} (LlamaForCausalLM, 2 layers, hidden 128, float32)")
        host = node_profile.host_facts(python)
        assert live.hardware == node_profile.describe_host(node_profile.engine_facts(spec), host)
        facts = live.provenance[node_profile.CACHE_KEY]
        cache_file = workdir / "profiles" / f"{node_profile.profile_key(facts)}.json"
        assert load_profile(cache_file) == live

        ready = out.until("Kairos gateway ready at", 120)
        gateway = re.search(r"ready at (http://\S+)", ready).group(1)  # type: ignore[union-attr]
        watch = out.until("kairos top --dispatcher", 30)
        dispatcher = re.search(r"--dispatcher (http://\S+)", watch).group(1)  # type: ignore[union-attr]
        out.until("Ctrl-C stops everything", 30)
        # The dispatcher routes with the fitted profile, from the live file.
        info = top.parse_metrics(scrape(f"{dispatcher}/metrics"))["kairos_dispatcher_profile_info"]
        assert [dict(labels) | {"value": v} for labels, v in info.items()] == [
            {"name": live.name, "hash": ANY, "source": str(workdir / node_profile.PROFILE_FILE), "value": 1.0}
        ]

        # The decode node measures its steps against it too (it re-reads the live file as it steps).
        body = {"model": MODEL_NAME, "prompt": "Hello, Kairos", "max_tokens": 8}
        d0_log = workdir / "logs" / "d0-vllm.log"

        def reloaded() -> bool:
            status, _, answer = post_json(f"{gateway}/v1/completions", body, timeout=120)
            assert status == 200, answer
            return f"step budgets now enforced with profile {live.name}" in d0_log.read_text()

        wait_until(reloaded, timeout_s=120, what="the decode node enforcing the fitted profile", interval_s=0.5)
        prior = prior_from_mape(live.mixed.mape)

        def d0_calibration() -> float | None:
            nodes = {n["id"]: n for n in get_json(f"{dispatcher}/nodes")["nodes"]}
            value = nodes["d0"].get("step_calibration")
            # Measured against the fitted profile: from its error's prior up (under 500 steps).
            return value if value is not None and value >= prior - 1e-9 else None

        wait_until(d0_calibration, timeout_s=60, what="d0's calibration against the fitted profile")
        shown = subprocess.run(
            [*KAIROS, "top", "--dispatcher", dispatcher, "--plain", "--iterations", "1"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        assert f"\nprofile {live.name} ({workdir / 'profile.json'})\n" in shown, shown
        row = re.search(r"^d0 +decode .* x(\d+\.\d\d) .*$", shown, re.M)
        assert row is not None, shown
        assert (f"SLOW d0: steps up to {row.group(1)}x" in shown) == (float(row.group(1)) > top.SLOW_STEP_CALIBRATION)
    finally:
        rc = _stop(proc)
    assert rc == 0, "".join(out.lines)

    # What the next `kairos up` on this model and host computes before its engines start finds it.
    again = node_profile.StartUpProfile(
        workdir / "profiles",
        node_profile.key_facts(
            node_profile.model_config(workdir / "model"),
            node_profile.engine_facts(spec),
            node_profile.host_facts(python),
        ),
        tmp_path / "again" / node_profile.PROFILE_FILE,
        MODEL_NAME,
    )
    assert again.cache_file == cache_file
    assert (
        again.prepare() == live
        and again.finish(live, lambda: pytest.fail("fitted again")).origin == node_profile.CACHED
    )
    assert defaults.PROFILE not in line
