"""Policies by name: each policy module registers a factory that parses its own parameters and
owns its defaults (llm-d's plugin registry), and a spec such as ``kairos:alpha=1.3,beta=0.9``
is parsed and built here. Unknown names and parameters fail with the messages users know."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from kairos.common.errors import UnknownPolicyError
from kairos.core import algorithm as alg
from kairos.core.decision import Decision
from kairos.core.latency import LatencyModels
from kairos.core.policies.spec import PolicySpec
from kairos.core.state import ClusterView


class Policy(Protocol):
    """What the simulator and the dispatcher need from a policy."""

    @property
    def label(self) -> str:
        """Short name with parameters, for tables and plots, e.g. ``kairos(a=1.3,b=1)``."""
        ...

    @property
    def fresh_state(self) -> bool:
        """True for the Oracle: the simulator hands it the true state, not the last heartbeat."""
        ...

    def decide(self, prompt_tokens: int, view: ClusterView, now: float) -> Decision: ...


# Policies that read the nodes' prefix caches (``kairos``, ``oracle``, ``pd``) say so with a
# ``prefix_aware`` attribute, and then take ``decide(..., cached=...)``: the prompt tokens each
# node has cached, by node id. ``prefix=off`` makes them cache-blind, for comparison.
# Policies that read a request's own SLOs (``kairos``, ``oracle``, unless ``slo=off``) say so with
# an ``slo_aware`` attribute, and then take ``decide(..., slo=...)`` (kairos.core.slo.RequestSLO).

# Builds a policy from its parsed spec; ``base`` supplies the SLOs and chunk candidates.
PolicyFactory = Callable[[PolicySpec, LatencyModels, alg.DeciderConfig], Policy]


def _is_word(text: str) -> bool:
    """A name or parameter a spec can spell: the parser lowercases them and splits on ``:,=;``."""
    return bool(text) and text == text.strip().lower() and not any(c in text for c in ":,=; ")


@dataclass(frozen=True)
class PolicyPlugin:
    """One registered policy."""

    name: str
    factory: PolicyFactory
    # Accepted parameter -> what its value looks like (``N``, ``off``, ``S|off``), for help texts.
    params: Mapping[str, str] = field(default_factory=dict)
    # It needs the simulator's true state (the Oracle): the gateway refuses it.
    simulator_only: bool = False

    @property
    def synopsis(self) -> str:
        """How a user writes the spec, e.g. ``llmd[:threshold=N,chunk=N]``."""
        if not self.params:
            return self.name
        return f"{self.name}[:{','.join(f'{k}={v}' for k, v in self.params.items())}]"


class PolicyRegistry:
    """Policies by name, in the order they were registered (error messages list them so)."""

    def __init__(self, plugins: Iterable[PolicyPlugin] = ()) -> None:
        self._plugins: dict[str, PolicyPlugin] = {}
        for plugin in plugins:
            self.add(plugin)

    def add(self, plugin: PolicyPlugin) -> PolicyPlugin:
        if plugin.name in self._plugins:
            raise ValueError(f"policy {plugin.name!r} is already registered")
        bad = [w for w in (plugin.name, *plugin.params) if not _is_word(w)]
        if bad:
            raise ValueError(f"policy {plugin.name!r}: {bad} cannot be written in a spec (lowercase, no ':,=; ')")
        self._plugins[plugin.name] = plugin
        return plugin

    def register(
        self,
        name: str,
        factory: PolicyFactory,
        params: Mapping[str, str] | None = None,
        *,
        simulator_only: bool = False,
    ) -> PolicyPlugin:
        return self.add(PolicyPlugin(name, factory, dict(params or {}), simulator_only))

    def copy(self) -> PolicyRegistry:
        return PolicyRegistry(self._plugins.values())

    def names(self) -> tuple[str, ...]:
        return tuple(self._plugins)

    def plugins(self) -> tuple[PolicyPlugin, ...]:
        return tuple(self._plugins.values())

    def lookup(self, name: str, spec: str | None = None) -> PolicyPlugin:
        """The policy called ``name`` (as written in ``spec``, for the error)."""
        plugin = self._plugins.get(name)
        if plugin is None:
            written = name if spec is None else spec
            raise UnknownPolicyError(f"unknown policy {name!r} in {written!r}; known policies: {list(self.names())}")
        return plugin

    def parse(self, spec: str) -> tuple[str, dict[str, str]]:
        """``"kairos:alpha=1.3,beta=0.9"`` -> ``("kairos", {"alpha": "1.3", "beta": "0.9"})``."""
        name, _, rest = spec.strip().partition(":")
        name = name.strip().lower()
        accepted = self.lookup(name, spec).params
        params: dict[str, str] = {}
        for item in filter(None, (x.strip() for x in rest.split(","))):
            key, eq, value = item.partition("=")
            key = key.strip().lower()
            if not eq or key not in accepted:
                raise UnknownPolicyError(
                    f"policy {name!r}: bad parameter {item!r} in {spec!r}; accepted: {list(accepted) or 'none'}"
                )
            params[key] = value.strip()
        return name, params

    def create(self, spec: str, models: LatencyModels, base: alg.DeciderConfig | None = None) -> Policy:
        """Build a policy from a spec string; ``base`` supplies the SLOs and chunk candidates (a
        Kairos spec's ``chunks=`` overrides the latter)."""
        name, params = self.parse(spec)
        return self._plugins[name].factory(PolicySpec(name, params), models, base or alg.DeciderConfig())

    def validate_gateway(self, spec: str) -> None:
        """Fail at startup, not at the first request: the spec must parse, and it must not need
        the simulator's true state (the Oracle)."""
        name, _ = self.parse(spec)
        if self._plugins[name].simulator_only:
            raise UnknownPolicyError(
                f"the {name} policy needs the simulator's true state; the gateway runs one of "
                f"{[p.name for p in self.plugins() if not p.simulator_only]}"
            )

    def split(self, text: str) -> list[str]:
        """Split ``"pd,kairos:alpha=1.3,beta=0.9,sq:theta=4"`` into policy specs: a ``key=value``
        item without a policy name belongs to the spec before it. ``;`` also separates specs."""
        specs: list[str] = []
        for part in (p.strip() for chunk in text.split(";") for p in chunk.split(",")):
            if not part:
                continue
            if "=" in part and ":" not in part and specs:
                specs[-1] += ("," if ":" in specs[-1] else ":") + part
            else:
                specs.append(part)
        if not specs:
            raise UnknownPolicyError(f"no policy in {text!r}; known policies: {list(self.names())}")
        for spec in specs:
            self.parse(spec)  # fail fast, before any simulation runs
        return specs

    def synopsis(self, *, gateway: bool = False) -> str:
        """Every spec a user may write (``gateway``: those the gateway runs), for help texts."""
        return ", ".join(p.synopsis for p in self.plugins() if not (gateway and p.simulator_only))


# The policies Kairos ships: each module of this package registers its own on import.
REGISTRY = PolicyRegistry()


def register(
    name: str, factory: PolicyFactory, params: Mapping[str, str] | None = None, *, simulator_only: bool = False
) -> PolicyPlugin:
    """Register a policy with Kairos's registry; a name registered twice raises."""
    return REGISTRY.register(name, factory, params, simulator_only=simulator_only)


def parse_policy_spec(spec: str) -> tuple[str, dict[str, str]]:
    """``"kairos:alpha=1.3,beta=0.9"`` -> ``("kairos", {"alpha": "1.3", "beta": "0.9"})``."""
    return REGISTRY.parse(spec)


def create_policy(spec: str, models: LatencyModels, base: alg.DeciderConfig | None = None) -> Policy:
    """Build a policy from a spec string such as ``kairos:alpha=1.3,beta=0.9``; raises
    UnknownPolicyError on unknown names, parameters and values. ``base`` supplies the SLOs and
    chunk candidates (a Kairos spec's ``chunks=`` overrides the latter)."""
    return REGISTRY.create(spec, models, base)


def validate_gateway_policy(spec: str) -> None:
    """Fail at startup, not at the first request: the spec must parse, and it must not need the
    simulator's true state (the Oracle)."""
    REGISTRY.validate_gateway(spec)


def split_policy_list(text: str) -> list[str]:
    """Split ``"pd,kairos:alpha=1.3,beta=0.9,sq:theta=4"`` into policy specs (see
    :meth:`PolicyRegistry.split`); each must parse."""
    return REGISTRY.split(text)


def policy_synopsis(*, gateway: bool = False) -> str:
    """Every spec a user may write, for the command line's help."""
    return REGISTRY.synopsis(gateway=gateway)
