"""``kairos profile collect | fit | show | check``: the profiling pipeline's command line.

    kairos profile collect --node URL --role decode --out runs/d0 [--rates 1,2,4] [--budget-s 1800]
    kairos profile fit runs/p0 runs/d0 --out my-profile.json [--plots plots/]
    kairos profile show my-profile.json
    kairos profile check my-profile.json fresh-runs/ [--threshold 0.05] [--json]

``add_profile_parser(subparsers)`` registers the ``profile`` command on the ``kairos`` parser;
``python -m profiling collect|fit|show|check ...`` runs the same subcommands. Heavy imports (aiohttp,
scikit-learn, matplotlib) happen when a subcommand runs, never at import.

Exit codes: 0 done; 1 collect ran out of budget before every phase completed, or check found
drift; 2 bad input (message on stderr, no traceback).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kairos.common.cli_types import floats, ints
from kairos.common.contracts import Role
from kairos.common.errors import KairosError


def add_subcommands(parser: argparse.ArgumentParser) -> None:
    """The subcommands, on ``parser`` (the ``profile`` command, or ``python -m profiling``)."""
    from kairos.profiling import plan as p  # constants only: cheap

    sub = parser.add_subparsers(dest="profile_command", required=True)

    col = sub.add_parser(
        "collect",
        help="drive a running node through traces and the microbenchmark, keeping its step records",
        description="Drive a vLLM or emulated node with Bursty-like traces at several rates and the paper's "
        "section 3.2 microbenchmark (decode nodes), and write one JSONL step-record file per phase plus "
        "manifest.json into --out. Step records come from GET /kairos/steps (emulated node) or --step-log.",
    )
    col.add_argument("--node", required=True, help="the node's OpenAI server, e.g. http://127.0.0.1:8101")
    col.add_argument("--role", required=True, choices=[str(r) for r in Role])
    col.add_argument("--out", required=True, type=Path, help="directory for the run files and manifest.json")
    col.add_argument("--rates", type=floats, default=p.DEFAULT_RATES, help="trace rates in requests/s (1,2,4)")
    col.add_argument("--duration-s", type=float, default=60.0, help="model seconds of arrivals per rate (60)")
    col.add_argument("--budget-s", type=float, default=1800.0, help="wall seconds for the whole collection (1800)")
    col.add_argument("--resume", action="store_true", help="continue the collection in --out, skip complete phases")
    col.add_argument("--time-scale", type=float, default=1.0, help="the emulated node's --time-scale (1)")
    col.add_argument("--step-log", type=Path, help="the vLLM step recorder's JSONL file (instead of /kairos/steps)")
    col.add_argument("--model", help="served model name (default: the first of GET /v1/models)")
    col.add_argument("--workload", default="bursty", help="kairos.traffic.workloads name for the traces (bursty)")
    col.add_argument("--seed", type=int, default=0)
    col.add_argument(
        "--max-prompt-tokens",
        type=int,
        help="longest prompt; below 32768 every prompt length is scaled by N/32768 (small CPU models)",
    )
    col.add_argument("--max-output-tokens", type=int, default=1024, help="trace completions are clipped to this")
    col.add_argument("--batch-sizes", type=ints, default=p.DEFAULT_BATCH_SIZES, help="microbenchmark B (4,8,16,32)")
    col.add_argument("--contexts", type=ints, default=p.DEFAULT_CONTEXTS, help="microbenchmark K (842,3569,14013)")
    col.add_argument("--chunks", type=ints, default=p.DEFAULT_CHUNKS, help="microbenchmark chi (128,...,2048)")
    col.add_argument("--no-micro", action="store_true", help="traces only, no microbenchmark")

    fit = sub.add_parser(
        "fit",
        help="fit the latency models to step records and write a profile",
        description="Fit decode_step, prefill_step and mixed_increment (and kv_transfer from transfers.jsonl) "
        "with scikit-learn; held-out MAPE by run (GroupKFold).",
    )
    fit.add_argument("dirs", nargs="+", type=Path, help="collection directories (or single run files)")
    fit.add_argument("--out", required=True, type=Path, help="profile JSON to write")
    fit.add_argument("--name", help="profile name (default: the --out file name)")
    fit.add_argument("--model", help="served model (default: from the collections' manifests)")
    fit.add_argument("--hardware", help="accelerator description (default 'unspecified')")
    fit.add_argument(
        "--base", help="profile to copy models without records from (kv_transfer, ...); default the packaged one"
    )
    fit.add_argument("--plots", type=Path, help="write predicted-vs-measured PNGs here")
    fit.add_argument("--folds", type=int, default=5, help="GroupKFold splits over runs (5)")
    fit.add_argument("--knee-step", type=int, default=64, help="coarse knee grid in tokens (64)")
    fit.add_argument("--allow-negative", action="store_true", help="plain least squares, coefficients of any sign")
    fit.add_argument("--kv-bytes-per-token", type=float, help="KV bytes per token, for transfers without bytes")

    show = sub.add_parser(
        "show",
        help="what a profile is of, where it came from, and each model's held-out MAPE",
        description="Print a profile's model, hardware and provenance, and the held-out MAPE each model was "
        "fitted with (kairos profile check measures it again on fresh records).",
    )
    show.add_argument("profile", help="profile JSON path or packaged name")

    chk = sub.add_parser(
        "check",
        help="measure a profile on fresh step records and flag drift",
        description="MAPE of each model of PROFILE on fresh records vs the MAPE the profile stores. "
        "Exit 1 when a model drifted.",
    )
    chk.add_argument("profile", help="profile JSON path or packaged name")
    chk.add_argument("dirs", nargs="+", type=Path, help="collection directories (or single run files)")
    chk.add_argument("--threshold", type=float, default=0.05, help="allowed MAPE rise, fraction (0.05 = 5 points)")
    chk.add_argument("--min-samples", type=int, default=20, help="fewer fresh rows: not judged (20)")
    chk.add_argument("--json", action="store_true", help="print the report as JSON")


def add_profile_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register ``kairos profile ...`` on the ``kairos`` command's subparsers."""
    parser = subparsers.add_parser(
        "profile",
        help="profile a model/hardware pair: collect step records, fit a profile, check it",
        description="The one-time profiling of paper section 5.1: collect | fit | show | check.",
    )
    add_subcommands(parser)
    parser.set_defaults(handler=run)


def _collect(args: argparse.Namespace) -> int:
    from kairos.profiling.collect import CollectConfig, run_collect
    from kairos.profiling.plan import PlanConfig

    plan = PlanConfig(
        role=args.role,
        rates=args.rates,
        duration_s=args.duration_s,
        workload=args.workload,
        seed=args.seed,
        max_prompt_tokens=args.max_prompt_tokens,
        max_output_tokens=args.max_output_tokens,
        micro=not args.no_micro,
        batch_sizes=args.batch_sizes,
        contexts=args.contexts,
        chunks=args.chunks,
    )
    cfg = CollectConfig(
        node=args.node,
        out_dir=args.out,
        plan=plan,
        budget_s=args.budget_s,
        resume=args.resume,
        time_scale=args.time_scale,
        step_log=args.step_log,
        model=args.model,
    )
    summary = run_collect(cfg)
    if not summary.complete:
        print(
            f"collect: the budget ran out; {len(summary.incomplete)} phases not complete "
            f"({', '.join(summary.incomplete)}): rerun with --resume",
            file=sys.stderr,
        )
        return 1
    print(f"collect: {len(summary.ran)} phases run, {len(summary.skipped)} already complete, in {args.out}")
    return 0


def _fit(args: argparse.Namespace) -> int:
    from kairos.core.latency import DEFAULT_PROFILE, load_profile
    from kairos.profiling.fit import FitConfig, ProfileMeta, fit_profile, format_table, write_plots, write_profile

    cfg = FitConfig(
        positive=not args.allow_negative,
        folds=args.folds,
        knee_step=args.knee_step,
        knee_refine_step=min(4, args.knee_step),
    )
    base = load_profile(args.base or DEFAULT_PROFILE)
    meta = ProfileMeta(name=args.name or args.out.stem, model=args.model, hardware=args.hardware)
    result = fit_profile(args.dirs, meta, base, cfg, args.kv_bytes_per_token)
    write_profile(result.profile, args.out)
    print(format_table(result))
    if result.copied:
        print(f"copied from base profile {base.name}: {', '.join(result.copied)}")
    print(f"wrote {args.out}")
    if args.plots:
        for path in write_plots(result, args.plots):
            print(f"wrote {path}")
    return 0


def _show(args: argparse.Namespace) -> int:
    from kairos.core.latency import load_profile
    from kairos.profiling.fit import format_profile

    print(format_profile(load_profile(args.profile)))
    return 0


def _check(args: argparse.Namespace) -> int:
    from kairos.core.latency import load_profile
    from kairos.profiling.check import CheckConfig, check_profile, format_report, report_json

    report = check_profile(load_profile(args.profile), args.dirs, CheckConfig(args.threshold, args.min_samples))
    print(report_json(report) if args.json else format_report(report))
    return 1 if report.drifted else 0


_COMMANDS = {"collect": _collect, "fit": _fit, "show": _show, "check": _check}


def run(args: argparse.Namespace) -> int:
    """Run the parsed ``profile`` subcommand; bad input is a message and exit code 2."""
    try:
        return _COMMANDS[args.profile_command](args)
    except KairosError as exc:
        print(f"kairos profile {args.profile_command}: error: {exc.message}", file=sys.stderr)
        return 2
    except OSError as exc:  # an output path that cannot be written, ...
        print(f"kairos profile {args.profile_command}: error: {exc}", file=sys.stderr)
        return 2
