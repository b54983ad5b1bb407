"""Algorithm 1 decision time, p50/p99, from 2 to 512 decode nodes (1K/10K/32K-token prompts,
2 prefill nodes) and from 2 to 64 prefill nodes (16 decode nodes, 32K tokens); and with 16 to
512 decode nodes all alike (10K tokens), the bounded search's own worst case.

Also the cluster view's share of each decision (``ClusterTracker``: record the dispatch, read
the view) under a keep-path stream, where every keep stays incoming on its decode node for its
predicted prefill time (2 s here) while heartbeats arrive every 100 dispatches.

Targets: p99 <= 100 µs with 2 decode nodes at 10K tokens; p99 <= 1 ms with 16 and with 128 at
32K (the paper: "under 1 ms"). Worst case on purpose: every decode node has a different (B, K),
so no schedule is shared, and the prefill queues are long enough that the search runs to the
TTFT SLO bound instead of stopping early. Before each call one decode node's state is replaced
by an equal new object, as a dispatch or a heartbeat replaces it in the tracker's view, so
nothing a decision derives from the view as a whole is reused from the call before.

    python -m bench.micro.decision_latency [--calls 3000] [--phase on|off] [--split off|offload|fastest]
                                           [--json PATH]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

from bench.harness.results import percentiles_us, write_result
from kairos.common import defaults
from kairos.core.algorithm import SPLIT_CHOICES, DeciderConfig, decide
from kairos.core.decision import Decision, Reason, Route
from kairos.core.latency import LatencyModels, load_profile
from kairos.core.state import ClusterView, DecodeNodeState, PrefillNodeState
from kairos.core.view import ClusterTracker

DECODE_SWEEP = (2, 16, 64, 128, 512)
PROMPTS = (1024, 10240, 32768)
PREFILL_SWEEP = (2, 4, 8, 16, 32, 64)  # at 16 decode nodes and 32K tokens
ALIKE_SWEEP = (16, 128, 512)  # decode nodes all alike (see cluster), 10K tokens
SPLIT_QUEUE = 4  # prompts queued on the first prefill node in the split rows (see cluster)


# Every node mid-step when its heartbeat was taken, as a busy node reports it (its state's
# running_step_elapsed_s): the estimators then take the rest of each node's step from it.
PREFILL_PHASE_S, DECODE_PHASE_S = 0.05, 0.01


def cluster(
    decode_nodes: int, prefill_nodes: int = 2, alike: bool = False, phase: bool = True, queued: int = 34
) -> ClusterView:
    # 34 queued prompts and more: Eq. 2 waits 5.1 s and more on each prefill node, so the keep path
    # misses the 4 s SLO and the search runs to that bound. ``queued`` 4 (the split rows): the keep
    # path meets the SLO, no deflection is as quick, and the split's k search plans every k on
    # every node (none is quick enough either: its worst case).
    prefill = tuple(
        PrefillNodeState.from_queue(
            f"p{i}",
            [3569] * (queued + i),
            2048,
            reported_at=0.0,
            running_step_elapsed_s=PREFILL_PHASE_S if phase else None,
        )
        for i in range(prefill_nodes)
    )
    # B cycles through 64 batch sizes (4 to 67) and K differs on every node. ``alike``: every node
    # at B = 4 with K one token apart, TTFTs a hair apart that no lower bound tells apart, so
    # every node's schedule is planned.
    elapsed = DECODE_PHASE_S if phase else None
    decode = tuple(
        DecodeNodeState(f"d{i}", 4, 4 * 3569 + i, 1_300_000, reported_at=0.0, running_step_elapsed_s=elapsed)
        if alike
        else DecodeNodeState(
            f"d{i}",
            4 + i % 64,
            (4 + i % 64) * 3569 + 97 * i,
            1_300_000,
            reported_at=0.0,
            running_step_elapsed_s=elapsed,
        )
        for i in range(decode_nodes)
    )
    return ClusterView(prefill=prefill, decode=decode)


def decision_samples(
    view: ClusterView, prompt: int, calls: int, models: LatencyModels, config: DeciderConfig
) -> list[int]:
    """Nanoseconds per ``decide``, one decode node's state renewed (equal values) before each."""
    decode = list(view.decode)
    views = []
    for k in range(calls + 200):
        i = k % len(decode)
        decode[i] = replace(decode[i])
        views.append(ClusterView(prefill=view.prefill, decode=tuple(decode)))
    for v in views[:200]:  # warm-up
        decide(prompt, v, 0.05, models, config)
    samples = []
    for v in views[200:]:
        t0 = time.perf_counter_ns()
        decide(prompt, v, 0.05, models, config)
        samples.append(time.perf_counter_ns() - t0)
    return samples


def tracker_samples(decode_nodes: int, calls: int) -> list[int]:
    """Nanoseconds per dispatch for ``record`` + ``view`` of a stream of keeps, 1 ms apart."""
    view = cluster(decode_nodes)
    tracker = ClusterTracker()

    def heartbeats(at: float) -> None:
        for p in view.prefill:
            tracker.update_prefill(replace(p, reported_at=at))
        for d in view.decode:
            tracker.update_decode(DecodeNodeState(d.node_id, d.decode_tokens, d.kv_tokens, d.kv_capacity_tokens, at))

    samples = []
    for k in range(calls):
        now = k * 1e-3
        if k % 100 == 0:
            heartbeats(now)
        keep = Decision(Route.KEEP, Reason.KEEP_POLICY, f"d{k % decode_nodes}", f"p{k % 2}", (), 2.0, None, 3569)
        t0 = time.perf_counter_ns()
        tracker.record(keep, now)
        tracker.view()
        samples.append(time.perf_counter_ns() - t0)
    return samples


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--phase",
        choices=("on", "off"),
        default="on",
        help="on: every node reports how long its step in flight has run (as nodes do); off: none does",
    )
    parser.add_argument(
        "--split",
        choices=SPLIT_CHOICES,
        default=defaults.SPLIT,
        help="the split route's rule (DeciderConfig.split); with it on, rows where its k search runs in full too",
    )
    args = parser.parse_args()
    models = load_profile()
    config = DeciderConfig(split=args.split)
    cases = [(d, 2, p, False, 34) for d in DECODE_SWEEP for p in PROMPTS]
    cases += [(16, n, 32768, False, 34) for n in PREFILL_SWEEP if n != 2]
    cases += [(d, 2, 10240, True, 34) for d in ALIKE_SWEEP]
    if args.split != "off":
        cases += [(d, 2, p, False, SPLIT_QUEUE) for d in DECODE_SWEEP for p in PROMPTS]
    rows = []
    print(
        f"{'decode nodes':>12} {'prefill nodes':>13} {'prompt':>7} {'alike':>5} {'queued':>6} {'route':>8} "
        f"{'decode node':>11} "
        f"{'p50 µs':>8} {'p99 µs':>8} {'max µs':>8}"
    )
    for decode_nodes, prefill_nodes, prompt, alike, queued in cases:
        view = cluster(decode_nodes, prefill_nodes, alike, phase=args.phase == "on", queued=queued)
        decision = decide(prompt, view, 0.05, models, config)
        stats = percentiles_us(decision_samples(view, prompt, args.calls, models, config))
        rows.append(
            {
                "decode_nodes": decode_nodes,
                "prefill_nodes": prefill_nodes,
                "prompt_tokens": prompt,
                "alike": alike,
                "queued": queued,
                "route": decision.route.value,
                "reason": decision.reason.value,
                "decode_node": decision.decode_node,
                **stats,
            }
        )
        print(
            f"{decode_nodes:>12} {prefill_nodes:>13} {prompt:>7} {'yes' if alike else 'no':>5} {queued:>6} "
            f"{decision.route.value:>8} {decision.decode_node:>11} "
            f"{stats['p50_us']:>8.1f} {stats['p99_us']:>8.1f} {stats['max_us']:>8.1f}"
        )

    def p99(decode_nodes: int, prompt: int, queued: int = 34) -> float:
        return next(
            r
            for r in rows
            if (r["decode_nodes"], r["prefill_nodes"], r["prompt_tokens"], r["alike"], r["queued"])
            == (decode_nodes, 2, prompt, False, queued)
        )["p99_us"]

    targets = {
        "2_nodes_10k_p99_us<=100": p99(2, 10240) <= 100,
        "16_nodes_32k_p99_us<=1000": p99(16, 32768) <= 1000,
        "128_nodes_32k_p99_us<=1000": p99(128, 32768) <= 1000,
    }
    if args.split != "off":  # issue 34: with the k search, 2 decode nodes at 10K within 150 us
        targets["split_2_nodes_10k_p99_us<=150"] = p99(2, 10240, SPLIT_QUEUE) <= 150
    print("targets met:", targets)
    tracker_rows = []
    print(
        f"\ncluster view per dispatch (record + view), keeps incoming for 2 s\n{'decode nodes':>12} "
        f"{'p50 µs':>8} {'p99 µs':>8} {'max µs':>8}"
    )
    for nodes in DECODE_SWEEP:
        stats = percentiles_us(tracker_samples(nodes, max(args.calls, 5000))[1000:])  # past the 2 s fill-up
        tracker_rows.append({"decode_nodes": nodes, **stats})
        print(f"{nodes:>12} {stats['p50_us']:>8.1f} {stats['p99_us']:>8.1f} {stats['max_us']:>8.1f}")
    payload = {
        "phase": args.phase,
        "split": args.split,
        "rows": rows,
        "targets_met": targets,
        "tracker_rows": tracker_rows,
    }
    write_result("decision_latency", payload, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
