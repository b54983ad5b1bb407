"""The policy registry: each policy module registers a factory by name, owns its defaults (its
class's field defaults), and a policy registered from outside the package is built, checked,
listed and refused exactly as the shipped ones, without touching any other file."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from kairos.common.errors import UnknownPolicyError
from kairos.core import algorithm as alg
from kairos.core.decision import Decision, Reason
from kairos.core.latency import LatencyModels
from kairos.core.policies import (
    POLICY_NAMES,
    REGISTRY,
    AibrixPolicy,
    DynamoPolicy,
    LlmdPolicy,
    PDPolicy,
    PolicyRegistry,
    PolicySpec,
    StaticPolicy,
    create_policy,
    register,
    registry,
    split_policy_list,
    static,
    validate_gateway_policy,
)
from kairos.core.policies.baseline import keep
from kairos.core.policies.spec import field_default
from kairos.core.state import ClusterView
from kairos.launcher.cli import main
from tests.builders import decode_node, flat_models, prefill_node, view

FLAT = flat_models()
SHIPPED = ["pd", "sq", "sl", "kairos", "oracle", "llmd", "dynamo", "aibrix"]


# ---------------------------------------------------------------------------------------------
# The shipped registry
# ---------------------------------------------------------------------------------------------
def test_the_shipped_policies_register_in_their_documented_order() -> None:
    assert list(REGISTRY.names()) == list(POLICY_NAMES) == SHIPPED


def test_an_unknown_name_lists_the_known_ones_in_order() -> None:
    with pytest.raises(UnknownPolicyError) as info:
        create_policy(" FIFO :x=1", FLAT)
    assert info.value.message == f"unknown policy 'fifo' in ' FIFO :x=1'; known policies: {SHIPPED}"


def test_a_name_registered_twice_raises_and_leaves_the_first() -> None:
    before = REGISTRY.lookup("pd")
    with pytest.raises(ValueError, match="'pd' is already registered"):
        register("pd", lambda spec, models, base: PDPolicy(models, base))
    assert REGISTRY.lookup("pd") is before
    assert REGISTRY.names() == POLICY_NAMES


@pytest.mark.parametrize(
    ("name", "params"),
    [("Toy", {}), ("to:y", {}), ("to y", {}), ("", {}), ("toy", {"Depth": "N"}), ("toy", {"a=b": "N"})],
)
def test_a_name_or_parameter_no_spec_can_spell_is_refused(name: str, params: dict[str, str]) -> None:
    # The parser lowercases names and parameters and splits on ":,=": such a policy is unreachable.
    with pytest.raises(ValueError, match="cannot be written in a spec"):
        PolicyRegistry().register(name, lambda spec, models, base: PDPolicy(models, base), params)


def _default(cls: type, name: str) -> object:
    (field,) = (f for f in dataclasses.fields(cls) if f.name == name)
    assert field.default is not dataclasses.MISSING
    return field.default


# A spec with no parameters, and each attribute of the built policy that comes from a default.
DEFAULTS = [
    ("pd", PDPolicy, "prefix_aware", "prefix_aware"),
    ("sq", StaticPolicy, "chunk_tokens", "chunk_tokens"),
    ("sl", StaticPolicy, "chunk_tokens", "chunk_tokens"),
    ("llmd", LlmdPolicy, "threshold", "threshold"),
    ("llmd", LlmdPolicy, "chunk_tokens", "chunk_tokens"),
    ("dynamo", DynamoPolicy, "mode", "mode"),
    ("dynamo", DynamoPolicy, "isl_tokens", "isl_tokens"),
    ("dynamo", DynamoPolicy, "isl_ratio", "isl_ratio"),
    ("dynamo", DynamoPolicy, "prefill_busy", "prefill_busy"),
    ("dynamo", DynamoPolicy, "kv_busy", "kv_busy"),
    ("dynamo", DynamoPolicy, "chunk_tokens", "chunk_tokens"),
    ("aibrix", AibrixPolicy, "high_s", "high_s"),
    ("aibrix", AibrixPolicy, "low_s", "low_s"),
    ("aibrix", AibrixPolicy, "chunk_tokens", "chunk_tokens"),
]


@pytest.mark.parametrize(("spec", "cls", "attr", "field"), DEFAULTS)
def test_a_policys_defaults_are_its_class_defaults(spec: str, cls: type, attr: str, field: str) -> None:
    assert getattr(create_policy(spec, FLAT), attr) == _default(cls, field)


# Another valid value for each default, to show that the factory reads the class's default
# rather than a copy of it.
OTHER = {
    "prefix_aware": False,
    "chunk_tokens": 640,
    "threshold": 99,
    "mode": "either",
    "isl_tokens": 777,
    "isl_ratio": 0.3,
    "prefill_busy": 2.5,
    "kv_busy": 0.9,
    "high_s": 3.0,
    "low_s": 0.125,
}


@pytest.mark.parametrize(("spec", "cls", "attr", "field"), [d for d in DEFAULTS if d[0] != "pd"])
def test_a_default_lives_once_on_the_class_and_the_factory_reads_it(
    spec: str, cls: type, attr: str, field: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    (declared,) = (f for f in dataclasses.fields(cls) if f.name == field)
    monkeypatch.setattr(declared, "default", OTHER[field])
    assert getattr(create_policy(spec, FLAT), attr) == OTHER[field]


@pytest.mark.parametrize(("spec", "threshold"), [("sq", 4), ("sl", 2048)])
def test_the_static_rules_thresholds_default_from_their_one_table(
    spec: str, threshold: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert create_policy(spec, FLAT).threshold == static.RULES[spec][1] == threshold  # type: ignore[attr-defined]
    monkeypatch.setitem(static.RULES, spec, (static.RULES[spec][0], 7))
    assert create_policy(spec, FLAT).threshold == 7  # type: ignore[attr-defined]


def test_the_help_lists_every_spec_and_the_gateway_refuses_the_oracle() -> None:
    gateway = REGISTRY.synopsis(gateway=True)
    assert "oracle" in REGISTRY.synopsis() and "oracle" not in gateway
    assert "kairos[:pending=N|none,alpha=A,beta=B," in gateway
    assert "aibrix[:high=S,low=S,chunk=N]" in gateway
    with pytest.raises(UnknownPolicyError, match="the oracle policy needs the simulator's true state"):
        validate_gateway_policy("oracle:alpha=2")


# ---------------------------------------------------------------------------------------------
# A policy from outside the package: registered in a copy of the registry
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ToyPolicy:
    """Keep every request, by P/D, but only when the prompt is at least ``depth`` tokens; a test
    plug-in with one parameter, its default on the class."""

    models: LatencyModels
    config: alg.DeciderConfig
    depth: int = 3
    fresh_state: bool = False

    @property
    def label(self) -> str:
        return f"toy(depth={self.depth})"

    def decide(self, prompt_tokens: int, view: ClusterView, now: float) -> Decision:
        return keep(self.models, self.config, prompt_tokens, view, now, Reason.KEEP_POLICY)


def build_toy(spec: PolicySpec, models: LatencyModels, base: alg.DeciderConfig) -> ToyPolicy:
    depth = spec.integer("depth", field_default(ToyPolicy, "depth"))
    if depth < 1:
        raise spec.error(f"depth={depth} must be >= 1")
    return ToyPolicy(models, base, depth)


@pytest.fixture
def extended(monkeypatch: pytest.MonkeyPatch) -> Iterator[PolicyRegistry]:
    """Kairos's registry plus ``toy`` (and the simulator-only ``toy-oracle``), in place of the
    shipped one for this test only."""
    copy = REGISTRY.copy()
    copy.register("toy", build_toy, {"depth": "N"})
    copy.register("toy-oracle", build_toy, {"depth": "N"}, simulator_only=True)
    monkeypatch.setattr(registry, "REGISTRY", copy)
    yield copy
    assert "toy" not in REGISTRY.names()  # the shipped registry never saw it


def test_a_registered_policy_builds_from_its_spec_with_its_own_params(extended: PolicyRegistry) -> None:
    toy = create_policy("toy", FLAT)
    assert isinstance(toy, ToyPolicy) and toy.depth == 3 and toy.label == "toy(depth=3)"
    base = alg.DeciderConfig(tbt_slo_s=0.05)
    tuned = create_policy(" TOY : Depth = 8 ", FLAT, base)
    assert isinstance(tuned, ToyPolicy) and (tuned.depth, tuned.config) == (8, base)
    d = tuned.decide(100, view((prefill_node(),), (decode_node(),)), 0.0)
    assert d.reason is Reason.KEEP_POLICY
    assert split_policy_list("pd,toy:depth=2;toy") == ["pd", "toy:depth=2", "toy"]
    validate_gateway_policy("toy:depth=2")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("toy:width=2", "policy 'toy': bad parameter 'width=2' in 'toy:width=2'; accepted: ['depth']"),
        ("toy:depth", "policy 'toy': bad parameter 'depth' in 'toy:depth'; accepted: ['depth']"),
        ("toy:depth=deep", "policy 'toy': depth='deep' is not a int"),
        ("toy:depth=0", "policy 'toy': depth=0 must be >= 1"),
        ("fifo", f"unknown policy 'fifo' in 'fifo'; known policies: {[*SHIPPED, 'toy', 'toy-oracle']}"),
    ],
)
def test_a_registered_policys_errors_read_as_the_shipped_ones(
    extended: PolicyRegistry, spec: str, message: str
) -> None:
    with pytest.raises(UnknownPolicyError) as info:
        create_policy(spec, FLAT)
    assert info.value.message == message
    assert info.value.code == "unknown_policy"


def test_a_simulator_only_policy_is_refused_by_the_gateway(extended: PolicyRegistry) -> None:
    with pytest.raises(UnknownPolicyError) as info:
        validate_gateway_policy("toy-oracle")
    gateway = [n for n in (*SHIPPED, "toy") if n != "oracle"]
    assert info.value.message == (
        f"the toy-oracle policy needs the simulator's true state; the gateway runs one of {gateway}"
    )


def test_a_policy_without_parameters_accepts_none() -> None:
    bare = PolicyRegistry()
    bare.register("bare", lambda spec, models, base: PDPolicy(models, base))
    assert isinstance(bare.create("bare", FLAT), PDPolicy)
    with pytest.raises(UnknownPolicyError) as info:
        bare.create("bare:x=1", FLAT)
    assert info.value.message == "policy 'bare': bad parameter 'x=1' in 'bare:x=1'; accepted: none"
    with pytest.raises(UnknownPolicyError) as info:
        bare.split(" ; ")
    assert info.value.message == "no policy in ' ; '; known policies: ['bare']"


@pytest.mark.parametrize(
    ("command", "listed", "unlisted"), [("sim", "toy-oracle[", None), ("up", "toy[", "toy-oracle")]
)
def test_the_command_lines_help_lists_a_registered_policy(
    extended: PolicyRegistry, command: str, listed: str, unlisted: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    text = "".join(capsys.readouterr().out.split())  # argparse wraps anywhere in a long word
    assert "toy[:depth=N]" in text and listed in text
    assert unlisted is None or unlisted not in text
