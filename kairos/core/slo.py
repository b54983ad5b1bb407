"""Per-request SLOs and the classes they fall in.

A request may carry its own TTFT and TPOT SLOs (llm-d's ``x-slo-ttft-ms`` / ``x-slo-tpot-ms``
headers, :data:`kairos.common.contracts.SLO_HEADERS`) and vLLM's ``priority``; a request without
them is judged by the cluster's defaults. Algorithm 1 bounds a deflection by the request's own
TTFT SLO (Eq. 7) and plans each decode node's steps to the tightest TPOT SLO among the node's
in-flight requests and the request's own (Eq. 5's tau).

Classes name SLO pairs for what is counted and shown (metrics labels, per-class attainment and
goodput): a request's class is read off its SLO pair against a configured list
(:func:`classify`), never taken from what a client sends, so a label has as many values as the list
has classes. Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kairos.common import contracts as c
from kairos.common import defaults
from kairos.common.config import setting
from kairos.common.errors import ConfigError, InvalidRequestError

# An SLO header's value: milliseconds, within [MIN_SLO_MS, MAX_SLO_MS]. Below a millisecond no step
# of any engine fits; past an hour a TTFT or TPOT SLO is no SLO, and a float past it only
# overflows a budget's arithmetic.
MIN_SLO_MS = 1.0
MAX_SLO_MS = 3_600_000.0


@dataclass(frozen=True, slots=True)
class RequestSLO:
    """The SLOs one request is decided and judged by."""

    ttft_s: float  # its time to first token SLO (Eq. 7's TTFT_slo)
    tpot_s: float  # its time per output token SLO (its share of Eq. 5's tau)
    priority: int = 0  # vLLM's priority: lower is served first by a node that schedules by priority

    def __post_init__(self) -> None:
        if not (0 < self.ttft_s < math.inf and 0 < self.tpot_s < math.inf):
            raise ValueError(f"ttft_s={self.ttft_s} and tpot_s={self.tpot_s} must be finite and > 0")

    def is_tighter_than(self, other: RequestSLO) -> bool:
        """Served first when both must wait: the tighter TTFT, then the lower priority value."""
        return (self.ttft_s, self.priority) < (other.ttft_s, other.priority)


DEFAULT_SLO = RequestSLO(defaults.TTFT_SLO_S, defaults.TBT_SLO_S)


@dataclass(frozen=True, slots=True)
class SloClass:
    """A named SLO pair: a request whose SLOs are within both is of this class (or a tighter one)."""

    name: str
    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("_", "").replace("-", "").isalnum() or not self.name.isascii():
            raise ConfigError(f"an SLO class name must be letters, digits, '-' or '_', got {self.name!r}")
        if not (0 < self.ttft_s < math.inf and 0 < self.tpot_s < math.inf):
            raise ConfigError(f"SLO class {self.name!r}: ttft_s={self.ttft_s} and tpot_s={self.tpot_s} must be > 0")


def check_classes(classes: Sequence[SloClass]) -> tuple[SloClass, ...]:
    """``classes`` ordered tightest first (by TTFT, then TPOT), with distinct names; at least one."""
    if not classes:
        raise ConfigError("at least one SLO class is needed")
    names = [k.name for k in classes]
    if len(set(names)) != len(names):
        raise ConfigError(f"SLO class names must be distinct, got {names}")
    return tuple(sorted(classes, key=lambda k: (k.ttft_s, k.tpot_s, k.name)))


# The classes the gateway and the simulator count by, unless configured: the mixed-class workload's
# two (kairos.traffic.workloads.SLO_CLASS_MIXES) and the cluster default between them. Interactive's
# TPOT is 60 ms, not the 50 ms often quoted: the packaged profile's decode-only step alone is 46 to
# 53 ms over the batches the reference cluster runs (B 1 to 32), so a 50 ms TPOT fails on decode
# steps whatever routes the prefills (P/D met it for 93% of interactive requests at 3 RPS).
DEFAULT_CLASSES = check_classes(
    (
        SloClass("interactive", 1.0, 0.060),
        SloClass("standard", defaults.TTFT_SLO_S, defaults.TBT_SLO_S),
        SloClass("batch", 20.0, 0.150),
    )
)


def classify(ttft_s: float, tpot_s: float, classes: Sequence[SloClass] = DEFAULT_CLASSES) -> str:
    """The name of the first class (tightest first) whose TTFT and TPOT SLOs are both at least the
    request's: the class whose bounds the request asks no less than. A request tighter than every
    class is of the tightest; one looser in either SLO than every class, of the loosest (the last)."""
    for k in classes:
        if ttft_s <= k.ttft_s and tpot_s <= k.tpot_s:
            return k.name
    return classes[-1].name


def class_names(classes: Iterable[SloClass] = DEFAULT_CLASSES) -> tuple[str, ...]:
    return tuple(k.name for k in classes)


def parse_classes(text: str) -> tuple[SloClass, ...]:
    """``"interactive=1000/50,batch=20000/150"`` (name=TTFT ms/TPOT ms, comma-separated), as
    ``--slo-classes`` and ``KAIROS_SLO_CLASSES`` take them."""
    out: list[SloClass] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, sep, pair = item.partition("=")
        ttft, slash, tpot = pair.partition("/")
        try:
            if not sep or not slash:
                raise ValueError
            out.append(SloClass(name.strip(), float(ttft) / 1e3, float(tpot) / 1e3))
        except ValueError:
            raise ConfigError(f"SLO class {item!r} must be name=TTFT_MS/TPOT_MS, e.g. interactive=1000/50") from None
    return check_classes(out)


def format_classes(classes: Iterable[SloClass]) -> str:
    return ",".join(f"{k.name}={k.ttft_s * 1e3:g}/{k.tpot_s * 1e3:g}" for k in classes)


def classes_setting() -> Any:
    """The setting ``slo_classes`` as every service declares it (the dispatcher's and the
    sidecars', one setting where kairos up nests both): its default, help text and codec."""
    return setting(
        DEFAULT_CLASSES,
        help="the SLO classes requests are counted by, name=TTFT_MS/TPOT_MS comma-separated",
        parse=parse_classes,
        format=format_classes,
    )


def _slo_ms(name: str, raw: str) -> float:
    try:
        value = float(raw.strip()) if raw.strip().isascii() else math.nan
    except ValueError:
        value = math.nan
    if not (MIN_SLO_MS <= value <= MAX_SLO_MS):  # "not" so that NaN fails too
        raise InvalidRequestError(
            f"header {name} must be a number of milliseconds in [{MIN_SLO_MS:g}, {MAX_SLO_MS:g}], got {raw!r}"
        )
    return value


def request_slo(
    ttft_ms: str | None,
    tpot_ms: str | None,
    priority: int = 0,
    default_ttft_s: float = defaults.TTFT_SLO_S,
    default_tpot_s: float = defaults.TBT_SLO_S,
) -> RequestSLO:
    """A request's SLOs from its :data:`~kairos.common.contracts.H_SLO_TTFT_MS` and
    :data:`~kairos.common.contracts.H_SLO_TPOT_MS` header values (None: absent, the cluster's
    default); a value that is not a number of milliseconds in range is the client's error (400)."""
    ttft_s = default_ttft_s if ttft_ms is None else _slo_ms(c.H_SLO_TTFT_MS, ttft_ms) / 1e3
    tpot_s = default_tpot_s if tpot_ms is None else _slo_ms(c.H_SLO_TPOT_MS, tpot_ms) / 1e3
    return RequestSLO(ttft_s, tpot_s, priority)


# A request meets its TPOT SLO when its own P95 inter-token gap is within it: at most this share of
# its gaps may be over the SLO.
TBT_OVER_SLO_SHARE = 0.05


def meets_slo(ttft_s: float | None, ttft_slo_s: float, gaps_over_tpot: int, gaps: int) -> bool:
    """Whether one request met its SLOs: its TTFT within its TTFT SLO (None: it got no first
    token), and at most :data:`TBT_OVER_SLO_SHARE` of its ``gaps`` inter-token gaps over its TPOT
    SLO (``gaps_over_tpot`` of them; none at all holds). The one definition the simulator,
    ``kairos replay`` and the sidecar's live counters judge by."""
    return ttft_s is not None and ttft_s <= ttft_slo_s and gaps_over_tpot <= TBT_OVER_SLO_SHARE * gaps


def tpot_or_default(tpot_s: float | None) -> float:
    """A request's TPOT SLO as a node counts it: its own, else the cluster's default."""
    return defaults.TBT_SLO_S if tpot_s is None else tpot_s


def tightest_tpot_s(tpots: Iterable[float | None]) -> float | None:
    """The tightest TPOT SLO among a node's requests (each ``tpot_or_default``); None for none:
    what a node's heartbeat reports (HeartbeatField.TPOT_SLO_MS)."""
    return min(map(tpot_or_default, tpots), default=None)


def tau_scaled_budget_s(budget_s: float | None, own_tpot_s: float | None, running_tpot_s: float | None) -> float | None:
    """A deflected chunk's step budget on its node at one step: the budget it carries (planned to
    the tighter of its own TPOT, ``own_tpot_s``, and the node's tightest when it was decided),
    times the tightest TPOT of the decodes running in that step over its own, when tighter. Never
    looser than planned, and as tight as the decodes beside it need, those that joined since the
    heartbeat included (it may be tighter than they need where the plan had tightened it already:
    the safe side). None (no budget) stays None; no running decode (None) leaves it as carried."""
    if budget_s is None or running_tpot_s is None:
        return budget_s
    own = tpot_or_default(own_tpot_s)
    return budget_s if running_tpot_s >= own else budget_s * running_tpot_s / own
