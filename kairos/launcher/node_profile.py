"""The latency profile of the vLLM nodes a cluster starts (``kairos up --backend vllm``): fitted
to those nodes on start, and cached by model and hardware so that the next start reuses it.

A profile describes one model on one host; the packaged default describes DeepSeek-V2-Lite on an
A100, so a dispatcher routing CPU vLLM nodes with it mispredicts every step. Nor can a profile
shipped for the tiny model on CPU hold on another CPU. So once the engines are up and before any
dispatcher starts, the cluster runs ``kairos profile``'s own collect and fit (:data:`PLANS`: short
traces on one prefill node, then short traces and the paper's microbenchmark on one decode node)
and routes with what comes out; the profile's held-out MAPE goes into the start-up line.

The cache key (:func:`profile_key`) is a digest of what step times depend on and nothing else:
the model's ``config.json``, the engine's settings (device, dtype, threads), the host (CPU
model, the CPUs this process may use, vLLM's and torch's versions) and the collection plans.
The file carries those facts (``provenance.cache_key``) and is reused only when they are equal.
What the key cannot see, a host busier than when the profile was fitted, the decode nodes'
step calibration shows (``kairos top`` flags it).

Pure parts (the choice, the key, the description) are apart from the I/O (:func:`host_facts`,
:func:`fit_nodes`), which :class:`~kairos.launcher.vllm_cluster.VllmCluster` runs.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import platform
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from kairos.common import contracts as c
from kairos.common import defaults
from kairos.common.contracts import Role
from kairos.common.contracts.api import COMPLETIONS_PATH, MODELS_PATH
from kairos.common.errors import KairosError, ProfileError
from kairos.core.latency import LatencyModels, load_profile
from kairos.launcher.vllm_node import VllmNodeSpec
from kairos.profiling.plan import PlanConfig

# Bump when the plans (or anything else fitted on start) change: a cached fit is then refitted.
PLAN_VERSION = 1
# Prompts are scaled to this many tokens at most (the workload's 32K context scales down to it),
# so that a prefill on two shared cores takes tens of milliseconds, not seconds.
MAX_PROMPT_TOKENS = 2000
# Two runs or more of each kind, so each model's MAPE is measured on runs its fit did not see
# (GroupKFold by run). About 40 s on two cores, one node after the other.
PLANS: dict[Role, PlanConfig] = {
    Role.PREFILL: PlanConfig(
        role=Role.PREFILL, rates=(1.0, 4.0), duration_s=6.0, max_prompt_tokens=MAX_PROMPT_TOKENS, micro=False
    ),
    Role.DECODE: PlanConfig(
        role=Role.DECODE,
        rates=(2.0, 4.0),
        duration_s=6.0,
        max_prompt_tokens=MAX_PROMPT_TOKENS,
        max_output_tokens=32,
        batch_sizes=(2, 8),
        contexts=(4096, 16384),  # scaled like every prompt: 250 and 1000 tokens
        chunks=(128, 512),
    ),
}
COLLECT_BUDGET_S = 240.0  # wall seconds for the whole collection; a starved host gets partial phases
PROFILE_FILE = "profile.json"  # in the workdir: the file the dispatchers and decode nodes watch
FIT_LOG = "fit.log"  # the collection's progress and the fit's table, beside the runs
CACHE_KEY = "cache_key"  # the profile's provenance entry holding the facts it was keyed by

# Where a profile came from, as the start-up line says it.
FITTED = "fitted to these nodes on start"
CACHED = "cached fit of this model on this host"
FIT_FAILED = "the packaged default: the fit on start failed"


@dataclass(frozen=True)
class ProfileChoice:
    """What a cluster routes with and why."""

    models: LatencyModels
    path: Path  # the file the dispatchers and decode nodes load (and watch)
    origin: str  # FITTED, CACHED or FIT_FAILED and why
    cache_file: Path | None  # None: nothing cached (the fit failed)
    fit_s: float | None = None  # wall seconds the fit took (FITTED)

    def describe(self) -> str:
        """The start-up line: the profile, where it came from, and its held-out error."""
        took = f" in {self.fit_s:.0f} s" if self.fit_s is not None else ""
        where = f"; {self.cache_file}" if self.cache_file is not None else ""
        return f"profile {self.models.name} ({self.origin}{took}{where}): held-out MAPE {mape_summary(self.models)}"


# ---------------------------------------------------------------------------------------------
# Pure: the choice, the key, the description
# ---------------------------------------------------------------------------------------------
def wants_fitted_profile(flag_profile: str | None, config_profile: str) -> bool:
    """Whether vLLM nodes get a profile fitted to them: unless ``--profile`` named one, or the
    config file or environment set one other than the packaged default (which describes another
    model on other hardware; ``--profile`` still forces it)."""
    return flag_profile is None and config_profile == defaults.PROFILE


def describe_given(profile: str, flag_profile: str | None, backend: str, remote: bool) -> str:
    """The start-up line of a cluster that fits no profile: which it routes with, who chose it,
    and what it has to do with the nodes."""
    if flag_profile is not None:
        who = "given by --profile"
    elif profile == defaults.PROFILE:
        who = "the packaged default"
    else:
        who = "set in the config or environment"
    if remote:
        fit = "the nodes run elsewhere: `kairos profile collect` + `fit` on them, then --profile FILE"
    elif backend == "emulated":
        fit = "the emulated nodes run this same profile"
    else:
        fit = "not fitted to these nodes"
    return f"profile {profile} ({who}; {fit})"


def profile_cache_dir(workdir: Path | None, environ: Mapping[str, str]) -> Path:
    """Where fitted profiles are kept: in ``--workdir`` when one is given (it outlives the run),
    else the user's cache (``$XDG_CACHE_HOME/kairos/profiles``), since a temporary workdir goes
    with the cluster and the next start would fit again."""
    if workdir is not None:
        return workdir / "profiles"
    base = environ.get("XDG_CACHE_HOME") or str(Path(environ.get("HOME", "~")).expanduser() / ".cache")
    return Path(base) / "kairos" / "profiles"


def key_facts(model_config: Mapping[str, Any], engine: Mapping[str, Any], host: Mapping[str, Any]) -> dict[str, Any]:
    """Everything a fitted profile's step times depend on (and the plans that measured them)."""
    return {
        "plan_version": PLAN_VERSION,
        "plans": {str(role): asdict(plan) for role, plan in PLANS.items()},
        "model": dict(model_config),
        "engine": dict(engine),
        "host": dict(host),
    }


def profile_key(facts: Mapping[str, Any]) -> str:
    """A digest of ``facts`` (order-independent): the cache file's name."""
    canonical = json.dumps(facts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def engine_facts(spec: VllmNodeSpec) -> dict[str, Any]:
    """The engine settings of a node that change its step times: device, weights, dtype, threads."""
    argv = spec.argv()
    dtype = argv[argv.index("--dtype") + 1] if "--dtype" in argv else "auto"
    env = spec.env()
    return {
        "device": spec.device,
        "load_format": spec.load_format,
        "dtype": dtype,
        "omp_threads": env.get("OMP_NUM_THREADS", "default"),
    }


def describe_model(served_model: str, facts: Mapping[str, Any]) -> str:
    """The profile's ``model`` field, e.g. ``kairos-tiny-llama (LlamaForCausalLM, 2 layers,
    hidden 128, float32)``."""
    model, engine = facts["model"], facts["engine"]
    arch = ", ".join(model.get("architectures") or ["unknown architecture"])
    layers, hidden = model.get("num_hidden_layers", "?"), model.get("hidden_size", "?")
    return f"{served_model} ({arch}, {layers} layers, hidden {hidden}, {engine.get('dtype', '?')})"


def describe_host(engine: Mapping[str, Any], host: Mapping[str, Any]) -> str:
    """The profile's ``hardware`` field, e.g. ``vllm 0.32.0 (torch 2.13.0) on cpu: 2 x Intel ...,
    1 OpenMP thread per engine``."""
    return (
        f"vllm {host.get('vllm')} (torch {host.get('torch')}) on {engine.get('device')}: {host.get('cpus')} x "
        f"{host.get('cpu')} ({host.get('machine')}), {engine.get('omp_threads')} OpenMP thread(s) per engine"
    )


def matches(models: LatencyModels, facts: Mapping[str, Any]) -> bool:
    """Whether a cached profile was fitted for exactly these facts (a JSON round trip of them)."""
    return models.provenance.get(CACHE_KEY) == json.loads(json.dumps(facts, default=str))


def mape_summary(models: LatencyModels) -> str:
    """Each step model's held-out MAPE, e.g. ``decode_step 12.3%, prefill_step -, ...``."""
    copied = set(models.provenance.get("copied_from_base", {}).get("models", ()))

    def one(name: str, mape: float | None) -> str:
        if name in copied:
            return f"{name} copied from {models.provenance['copied_from_base']['profile']}"
        return f"{name} {'-' if mape is None else f'{mape:.1%}'}"

    return ", ".join(
        one(name, m.mape)
        for name, m in (
            (c.DECODE_STEP, models.decode),
            (c.PREFILL_STEP, models.prefill),
            (c.MIXED_INCREMENT, models.mixed),
        )
    )


# ---------------------------------------------------------------------------------------------
# I/O: facts about this host and model, the cache, the fit
# ---------------------------------------------------------------------------------------------
_VERSIONS = (
    "import importlib.metadata as m, json\n"
    "dists = m.packages_distributions()\n"
    "print(json.dumps({p: m.version(dists[p][0]) if p in dists else None for p in ('vllm', 'torch')}))\n"
)


def host_facts(vllm_python: str) -> dict[str, Any]:
    """The CPU this cluster's engines run on, and the vLLM and torch that run them."""
    try:
        out = subprocess.run([vllm_python, "-c", _VERSIONS], capture_output=True, text=True, timeout=60, check=True)
        versions = json.loads(out.stdout)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        raise ProfileError(f"cannot read the vLLM environment's versions with {vllm_python}: {exc}") from exc
    return {
        "machine": platform.machine(),
        "cpu": _cpu_model(),
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        **versions,
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def model_config(model_dir: Path) -> dict[str, Any]:
    """The model's architecture: its ``config.json`` (the tokenizer does not change step times)."""
    try:
        return json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ProfileError(f"cannot read {model_dir / 'config.json'}: {exc}") from exc


def cached(cache_file: Path, facts: Mapping[str, Any]) -> LatencyModels | None:
    """The cached profile for these facts, or None (absent, unreadable or fitted for others)."""
    if not cache_file.is_file():
        return None
    try:
        models = load_profile(cache_file)
    except KairosError:
        return None
    return models if matches(models, facts) else None


@dataclass(frozen=True)
class FitTarget:
    """One node to collect on."""

    node_id: str
    role: Role
    url: str  # its OpenAI server, host:port
    step_log: Path  # its step recorder's JSONL file


@dataclass(frozen=True)
class StartUpProfile:
    """The profile of one cluster start: the cached fit when there is one, else one to fit once
    the engines are up. :meth:`prepare` before the engines start (the decode nodes load the live
    file at start and re-read it when it changes), :meth:`finish` once they serve, before the
    dispatchers start."""

    cache_dir: Path
    facts: Mapping[str, Any]  # key_facts
    live: Path  # the file the dispatchers and decode nodes load
    served_model: str

    @property
    def cache_file(self) -> Path:
        return self.cache_dir / f"{profile_key(self.facts)}.json"

    @property
    def name(self) -> str:
        return f"{self.served_model}-{self.facts['engine'].get('device', 'unknown')}-{profile_key(self.facts)[:8]}"

    def prepare(self) -> LatencyModels | None:
        """Write the live file: the cached fit (returned), else the packaged default until the
        fit lands (None: :meth:`finish` must fit)."""
        from kairos.profiling.fit import write_profile

        models = cached(self.cache_file, self.facts)
        write_profile(models or load_profile(), self.live)
        return models

    def finish(self, found: LatencyModels | None, fit: Callable[[], LatencyModels]) -> ProfileChoice:
        """The cached profile ``prepare`` found, else ``fit()``'s (cached, and written live). A
        failed fit leaves the packaged default live, and says so."""
        from kairos.profiling.fit import write_profile

        if found is not None:
            return ProfileChoice(found, self.live, CACHED, self.cache_file)
        started = time.monotonic()
        try:
            models = fit()
        except KairosError as exc:  # the next start fits again: nothing is cached
            return ProfileChoice(load_profile(), self.live, f"{FIT_FAILED}: {exc.message}", None)
        took = time.monotonic() - started
        write_profile(models, self.cache_file)
        write_profile(models, self.live)
        return ProfileChoice(models, self.live, FITTED, self.cache_file, took)


def fit_nodes(startup: StartUpProfile, targets: Sequence[FitTarget], runs_dir: Path) -> LatencyModels:
    """``kairos profile collect`` on each target in turn (its role's plan, progress in
    ``runs_dir/fit.log``), then ``kairos profile fit`` on all the runs: the profile, named and
    described by ``startup``, with its facts in the provenance."""
    from kairos.profiling.collect import CollectConfig, collect
    from kairos.profiling.fit import ProfileMeta, fit_profile, format_table

    runs_dir.mkdir(parents=True, exist_ok=True)
    with (runs_dir / FIT_LOG).open("a") as out:

        def log(line: str) -> None:
            print(line, file=out, flush=True)

        async def collect_all() -> list[Any]:
            await asyncio.gather(*(_warm_up(t, log) for t in targets))
            # One node at a time: collected at once, the decode node's traces would run beside the
            # prefill node's busy engine and its microbenchmark alone, so a model's runs would
            # differ by the load the other node puts on the shared cores, not only by what the
            # model describes. It costs the prefill traces' time.
            return [
                await collect(
                    CollectConfig(
                        node=t.url,
                        out_dir=runs_dir / t.node_id,
                        plan=PLANS[t.role],
                        budget_s=COLLECT_BUDGET_S / len(targets),
                        step_log=t.step_log,
                    ),
                    progress=log,
                )
                for t in targets
            ]

        for summary in asyncio.run(collect_all()):
            if not summary.complete:
                log(f"collection cut short by its {COLLECT_BUDGET_S:g} s budget: {', '.join(summary.incomplete)}")
        facts = startup.facts
        meta = ProfileMeta(
            startup.name, describe_model(startup.served_model, facts), describe_host(facts["engine"], facts["host"])
        )
        result = fit_profile([runs_dir / t.node_id for t in targets], meta, load_profile())
        log(format_table(result))
    provenance = {
        **result.profile.provenance,
        "summary": f"{result.profile.provenance['summary']}, collected by kairos up on start "
        f"({', then '.join(f'{t.node_id} as {t.role}' for t in targets)})",
        CACHE_KEY: json.loads(json.dumps(facts, default=str)),
    }
    return replace(result.profile, provenance=provenance)


async def _warm_up(target: FitTarget, log: Callable[[str], None]) -> None:
    """One short completion: a fresh engine's first step takes about a second on CPU (set-up, not
    a step any model describes)."""
    import aiohttp

    base = f"http://{target.url}"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
            async with http.get(f"{base}{MODELS_PATH}") as resp:
                model = (await resp.json())["data"][0]["id"]
            body = {"model": model, "prompt": list(range(3, 35)), "max_tokens": 2}
            async with http.post(f"{base}{COMPLETIONS_PATH}", json=body) as resp:
                await resp.read()
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, IndexError) as exc:
        log(f"{target.node_id}: warm-up request failed ({exc!r}); collecting anyway")
