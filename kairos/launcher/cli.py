"""The ``kairos`` command."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from kairos.common import defaults
from kairos.common.cli_types import floats, ints
from kairos.common.config import load_config
from kairos.common.errors import KairosError
from kairos.common.runtime import LOG_LEVELS, configure_logging
from kairos.core.policies import policy_synopsis
from kairos.launcher import replay, top, up
from kairos.profiling.cli import add_profile_parser


def _add_sim(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sim",
        help="simulate policies on a workload or trace (one run or a sweep)",
        description="Simulate routing policies on a disaggregated cluster. Settings come from "
        "defaults < --config YAML (section 'sim') < KAIROS_SIM_* environment < flags.",
    )
    p.add_argument("--config", type=Path, help="YAML file with a 'sim' section")
    p.add_argument("--workload", help="bursty, lpld, lphd, hpld, hphd, azure_conv or multiturn (default bursty)")
    p.add_argument("--trace", help="trace file: own JSONL, Azure CSV or Mooncake JSONL; rescaled to each --rps")
    p.add_argument(
        "--policies",
        help=f"comma-separated specs: {policy_synopsis()} (default pd,kairos)",
    )
    p.add_argument("--rps", type=floats, help="request rates, e.g. 6,7,8 (default 8)")
    p.add_argument("--duration", dest="duration_s", type=float, help="simulated seconds of arrivals per point")
    p.add_argument("--seed", type=int)
    p.add_argument("--cv", type=float, help="inter-arrival coefficient of variation")
    p.add_argument("--error", type=float, help="ground-truth step-time error, e.g. 0.1 = 10%% MAE")
    p.add_argument(
        "--error-form",
        choices=("iid", "correlated"),
        help="iid (default): each step's error drawn alone; correlated: a per-node bias, drawn once "
        "per node, plus per-step noise, with the same overall MAE (--error)",
    )
    p.add_argument(
        "--error-bias-share",
        type=float,
        help=f"correlated form: the bias's share of the error's variance (default {defaults.SIM_ERROR_BIAS_SHARE:g}; "
        "the per-step noise has the rest)",
    )
    p.add_argument("--profile", help="latency profile: packaged name or JSON path")
    p.add_argument("--prefill-nodes", type=int)
    p.add_argument("--decode-nodes", type=int)
    p.add_argument("--heartbeat-ms", type=float, help="heartbeat period (default 100)")
    p.add_argument("--tbt-slo-ms", type=float, help="TBT SLO tau (default 70)")
    p.add_argument("--ttft-slo-s", type=float, help="TTFT SLO (default 4)")
    p.add_argument("--chunks", type=ints, help="chunk-size candidates, e.g. 2048,1024,512,256,128")
    p.add_argument("--jobs", type=int, help="parallel simulations (default: one per core)")
    p.add_argument("--json", type=Path, help="write the records as a JSON list here")
    p.add_argument("--plots", type=Path, help="write PNG plots into this folder")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(handler=_run_sim)


def _run_sim(args: argparse.Namespace) -> int:
    from kairos.sim.experiment import SimSettings, print_progress, run_sweep
    from kairos.sim.plots import format_table, write_plots

    overrides: dict[str, Any] = {
        "workload": args.workload,
        "trace": args.trace,
        "policies": args.policies,
        "rps": args.rps,
        "duration_s": args.duration_s,
        "seed": args.seed,
        "cv": args.cv,
        "error": args.error,
        "error_form": args.error_form,
        "error_bias_share": args.error_bias_share,
        "profile": args.profile,
        "prefill_nodes": args.prefill_nodes,
        "decode_nodes": args.decode_nodes,
        "heartbeat_s": None if args.heartbeat_ms is None else args.heartbeat_ms / 1e3,
        "tbt_slo_s": None if args.tbt_slo_ms is None else args.tbt_slo_ms / 1e3,
        "ttft_slo_s": args.ttft_slo_s,
        "chunk_candidates": args.chunks,
        "jobs": args.jobs,
    }
    settings = load_config(SimSettings, args.config, section="sim", env_prefix="KAIROS_SIM_", overrides=overrides)
    records = run_sweep(settings, None if args.quiet else print_progress)
    print(format_table(records))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(records, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.plots:
        for path in write_plots(records, args.plots):
            print(f"wrote {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kairos", description="Kairos: load-aware prefill deflection")
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        help="DEBUG, INFO, WARNING or ERROR (default INFO); `kairos --log-level DEBUG up` applies it to every "
        "process of the cluster (DEBUG: one line per routing decision)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_sim(sub)
    up.add_parser(sub)
    replay.add_parser(sub)
    top.add_parser(sub)
    add_profile_parser(sub)
    # The cluster's processes, each also runnable as `python -m MODULE`. Their flags (--help
    # included) are the module's own: main() hands everything after the name to it unparsed.
    for name, (_, help_text) in _COMPONENTS.items():
        p = sub.add_parser(name, help=f"{help_text} (`kairos {name} --help` for its flags)", add_help=False)
        p.set_defaults(handler=_component(name), component=name)
    return parser


class Component(Protocol):
    """A module ``kairos NAME`` runs: a service's (:class:`kairos.common.runtime.Service`) or a tool's."""

    def build_parser(self) -> argparse.ArgumentParser: ...

    def main(self, argv: Sequence[str] | None = None) -> int: ...


# Each component's module is imported when its command runs, not before: the dispatcher's alone
# (gRPC) would add a sixth to the start-up of every `kairos` command, `kairos --help` included.
def _dispatcher() -> Component:
    from kairos.extproc import main as dispatcher

    return dispatcher


def _sidecar() -> Component:
    from kairos.nodeagent import sidecar

    return sidecar


def _heartbeat() -> Component:
    from kairos.nodeagent import heartbeat

    return heartbeat


def _emulated_node() -> Component:
    from kairos.sim import emulated_vllm

    return emulated_vllm


def _tiny_model() -> Component:
    from kairos.launcher import tinymodel

    return tinymodel


# name -> (its module, imported on use; help)
_COMPONENTS: dict[str, tuple[Callable[[], Component], str]] = {
    "dispatcher": (_dispatcher, "run the dispatcher (Envoy ext_proc service)"),
    "sidecar": (_sidecar, "run a decode-node sidecar"),
    "heartbeat": (_heartbeat, "run a node's heartbeat publisher"),
    "emulated-node": (_emulated_node, "run an emulated vLLM node"),
    "tiny-model": (_tiny_model, "build the tiny Llama model directory"),
}


def component_parser(name: str) -> argparse.ArgumentParser:
    """The argument parser that ``kairos NAME`` hands its arguments to (to check a command line
    without running it)."""
    module, _ = _COMPONENTS[name]
    return module().build_parser()


def _component(name: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        module, _ = _COMPONENTS[name]
        return int(module().main(args.component_argv))

    return run


def parse_command_line(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """``kairos [--log-level L] COMMAND ...``. A component's arguments are left, in their order,
    to its own parser: argparse's REMAINDER cannot take them (it refuses any that start with
    ``-``, so `kairos heartbeat --node-id p0` and even `--help` were errors)."""
    args, rest = parser.parse_known_args(argv)
    if getattr(args, "component", None) is None:
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
    else:
        args.component_argv = rest
    return args


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parse_command_line(parser, argv)
    configure_logging(args.log_level)
    try:
        return int(args.handler(args))
    except (KairosError, ValueError) as exc:  # bad settings or inputs: say what, not a traceback
        message = exc.message if isinstance(exc, KairosError) else str(exc)
        print(f"kairos {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
