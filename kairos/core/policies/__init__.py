"""Routing policies: the Kairos decision and the baselines it is compared with.

Every policy maps (prompt tokens, cluster view, now) to a :class:`Decision`. Build one from a
spec string such as ``kairos:alpha=1.3,beta=0.9`` with :func:`create_policy`, which raises on
unknown names and parameters.

One module per policy: its class, its defaults (the class's field defaults), and a factory that
parses and checks its own parameters, registered by name (:mod:`.registry`). A new policy is a
new module here and one import line below.
"""

from kairos.core.policies.registry import (
    REGISTRY,
    Policy,
    PolicyPlugin,
    PolicyRegistry,
    create_policy,
    parse_policy_spec,
    policy_synopsis,
    register,
    split_policy_list,
    validate_gateway_policy,
)
from kairos.core.policies.spec import CHUNKS_SEPARATOR, PolicySpec, format_chunks, parse_chunks

# Imported for their registration, in the order error messages and help list the policies.
# isort: off
from kairos.core.policies.pd import PDPolicy
from kairos.core.policies.static import StaticPolicy
from kairos.core.policies.kairos import KairosPolicy
from kairos.core.policies.llmd import LlmdPolicy
from kairos.core.policies.dynamo import DYNAMO_MODES, DynamoPolicy
from kairos.core.policies.aibrix import AibrixPolicy
from kairos.core.policies.no_prefill_pool import NoPrefillPoolPolicy
# isort: on

POLICY_NAMES = REGISTRY.names()  # the policies Kairos ships: pd, sq, sl, kairos, oracle, llmd, dynamo, aibrix

__all__ = [
    "CHUNKS_SEPARATOR",
    "DYNAMO_MODES",
    "POLICY_NAMES",
    "REGISTRY",
    "AibrixPolicy",
    "DynamoPolicy",
    "KairosPolicy",
    "LlmdPolicy",
    "NoPrefillPoolPolicy",
    "PDPolicy",
    "Policy",
    "PolicyPlugin",
    "PolicyRegistry",
    "PolicySpec",
    "StaticPolicy",
    "create_policy",
    "format_chunks",
    "parse_chunks",
    "parse_policy_spec",
    "policy_synopsis",
    "register",
    "split_policy_list",
    "validate_gateway_policy",
]
