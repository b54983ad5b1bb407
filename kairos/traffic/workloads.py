"""Seeded synthetic workloads: the bursty production-like mix, the four Table 1 strata, and a
conversation workload shaped after the Azure LLM inference trace 2023.

Every generator is a pure function of its arguments: ``numpy.random.default_rng([seed, crc32(name)])``
spawns three child streams that drive arrivals, prompt lengths and completion lengths separately.
Mixing in the name keeps two workloads run with the same seed and rate (e.g. HPLD and HPHD, both
1 RPS) from sharing identical arrival instants when a simulation overlays them.
Keeping the streams apart means a run sized by ``duration_s`` is exactly a prefix-compatible twin of
one sized by ``num_requests``, and changing the rate never reshuffles the token lengths.

The conversation workload (``multiturn``, :class:`ConversationSpec`) is closed-loop: sessions
arrive by the Gamma process, and each later turn is sent a think time after the previous turn's
answer ends (``RequestSpec.after`` / ``think_s``). Its requests carry block hashes, so the
engines' prefix caches see each turn resend the conversation so far.

Arrivals are a Gamma renewal process with shape ``k = 1 / CV**2`` and scale ``1 / (rate * k)``, the
convention of vLLM's benchmark ``--burstiness`` flag (burstiness = k): CV = 1 is Poisson, CV > 1 is
burstier. The first request arrives at t = 0, so the realised rate is count / span up to a factor
``n / (n - 1)``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import zlib
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from kairos.common import defaults
from kairos.traffic.requests import BLOCK_TOKENS, RequestSpec, chain_hashes

__all__ = [
    "AZURE_CONV_COMPLETION",
    "AZURE_CONV_PROMPT",
    "COMPLETION_P25",
    "COMPLETION_P90",
    "CONVERSATIONS",
    "CONVERSATION_NAMES",
    "DEFAULT_MAX_CONTEXT",
    "PROMPT_P25",
    "PROMPT_P90",
    "SLO_CLASS_MIXES",
    "SLO_CLASS_MIX_NAMES",
    "WORKLOADS",
    "WORKLOAD_NAMES",
    "ClassShare",
    "ConversationSpec",
    "Geometric",
    "LogNormal",
    "Quantiles",
    "TokenDist",
    "WorkloadSpec",
    "gamma_arrivals",
    "generate_conversations",
    "generate_workload",
    "make_class_mix",
    "make_workload",
]

DEFAULT_MAX_CONTEXT = defaults.MAX_MODEL_LEN  # prompts are truncated to the context

# Quantiles of the production distribution that define the strata of Table 1 ("low" = below P25,
# "high" = above P90). Prompt quantiles are the paper's; completion quantiles are those of the fitted
# geometric (p = 1/72) the bursty workload uses, since they are what "LD"/"HD" cut against here.
PROMPT_P25 = 2071
PROMPT_P90 = 10336
COMPLETION_P25 = 21
COMPLETION_P90 = 165

_STD_NORMAL = NormalDist()
# Refuse distributions whose truncation band holds so little mass that rejection sampling would
# need more than ~1000 draws per accepted value.
_MIN_ACCEPTANCE = 1e-3


@dataclass(frozen=True, slots=True)
class LogNormal:
    """Lognormal token length ``exp(N(mu, sigma))`` conditioned on ``lo <= x < hi``, rounded to int.

    The bounds are on the continuous value; half-integer bounds (e.g. ``hi = 20.5``) make the rounded
    integer land in a closed integer range ([1, 20]). Sampling is rejection from the parent, which is
    exact for the truncated law and stays vectorised.
    """

    mu: float
    sigma: float
    lo: float = 0.5  # keeps rint(x) >= 1
    hi: float = math.inf

    def __post_init__(self) -> None:
        if not math.isfinite(self.mu):
            raise ValueError(f"LogNormal mu must be finite, got {self.mu!r}")
        if not (math.isfinite(self.sigma) and self.sigma > 0):
            raise ValueError(f"LogNormal sigma must be finite and > 0, got {self.sigma!r}")
        if not (self.lo >= 0.5 and self.hi > self.lo):
            raise ValueError(f"LogNormal needs 0.5 <= lo < hi, got lo={self.lo!r}, hi={self.hi!r}")
        if self.acceptance < _MIN_ACCEPTANCE:
            raise ValueError(
                f"LogNormal(mu={self.mu}, sigma={self.sigma}) keeps only {self.acceptance:.2e} of its mass "
                f"in [{self.lo}, {self.hi}); refit mu"
            )

    @classmethod
    def with_median(cls, median: float, sigma: float, lo: float = 0.5, hi: float = math.inf) -> LogNormal:
        """The truncated lognormal whose *truncated* median is ``median`` (mu found by bisection).

        Fitting after truncation is what makes a stratum's observable median match the published one:
        the parent's median shifts away from a bound the stratum hugs (e.g. completions > P90).
        """
        if not (lo < median < hi):
            raise ValueError(f"median must lie inside ({lo}, {hi}), got {median!r}")
        target = math.log(median)
        # The truncated median is increasing in mu; +-12 sigma around the target brackets every
        # solution whose acceptance is above _MIN_ACCEPTANCE.
        low, high = target - 12.0 * sigma, target + 12.0 * sigma
        for _ in range(200):
            mid = 0.5 * (low + high)
            if _truncated_log_median(mid, sigma, lo, hi) < target:
                low = mid
            else:
                high = mid
        return cls(mu=0.5 * (low + high), sigma=sigma, lo=lo, hi=hi)

    @property
    def acceptance(self) -> float:
        """Parent probability mass inside [lo, hi)."""
        lo_cdf, hi_cdf = _band_cdfs(self.mu, self.sigma, self.lo, self.hi)
        return hi_cdf - lo_cdf

    @property
    def median(self) -> float:
        """Median of the truncated continuous law (before rounding)."""
        return math.exp(_truncated_log_median(self.mu, self.sigma, self.lo, self.hi))

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` integer lengths; the accepted values are the in-band draws of the stream, in order,
        so the first ``m`` of a larger sample equal a sample of size ``m`` from the same stream state."""
        out = np.empty(0, dtype=np.float64)
        chunk = max(1024, math.ceil(1.1 * n / self.acceptance))
        while out.size < n:
            draws = np.exp(rng.normal(self.mu, self.sigma, chunk))
            out = np.concatenate([out, draws[(draws >= self.lo) & (draws < self.hi)]])
        return np.rint(out[:n]).astype(np.int64)


@dataclass(frozen=True, slots=True)
class Geometric:
    """Geometric length on {1, 2, ...} with success probability ``p`` (median ceil(ln 2 / -ln(1-p)))."""

    p: float

    def __post_init__(self) -> None:
        if not (0 < self.p <= 1):
            raise ValueError(f"Geometric p must be in (0, 1], got {self.p!r}")

    @property
    def median(self) -> float:
        return float(max(1, math.ceil(math.log(0.5) / math.log1p(-self.p)))) if self.p < 1 else 1.0

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.geometric(self.p, n).astype(np.int64)


@dataclass(frozen=True, slots=True)
class Quantiles:
    """A token length drawn from a published quantile table: ``knots`` are (percent, tokens)
    pairs from 0 to 100, and a uniform percent is mapped through them, log-linearly between
    neighbouring knots (a heavy tail stays heavy), rounded to int. Every knot is hit exactly, so
    a multimodal trace keeps its modes where a single lognormal would smear them."""

    knots: tuple[tuple[float, int], ...]

    def __post_init__(self) -> None:
        pcts = [q for q, _ in self.knots]
        tokens = [t for _, t in self.knots]
        if len(self.knots) < 2 or pcts[0] != 0 or pcts[-1] != 100:
            raise ValueError(f"Quantiles knots must run from percent 0 to 100, got {pcts}")
        if any(a >= b for a, b in itertools.pairwise(pcts)):
            raise ValueError(f"Quantiles percents must be strictly increasing, got {pcts}")
        if tokens[0] < 1 or any(a > b for a, b in itertools.pairwise(tokens)):
            raise ValueError(f"Quantiles tokens must be >= 1 and non-decreasing, got {tokens}")

    @property
    def median(self) -> float:
        return float(self._values(np.array([50.0]))[0])

    def _values(self, pcts: np.ndarray) -> np.ndarray:
        qs = np.array([q for q, _ in self.knots], dtype=np.float64)
        logs = np.log(np.array([t for _, t in self.knots], dtype=np.float64))
        return np.exp(np.interp(pcts, qs, logs))

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.rint(self._values(rng.random(n) * 100.0)).astype(np.int64)


TokenDist = LogNormal | Geometric | Quantiles


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """A named synthetic workload: token-length laws plus a Gamma renewal arrival process."""

    name: str
    prompt: TokenDist
    completion: TokenDist
    default_rps: float
    default_cv: float  # CV of inter-arrival times; 1.0 is Poisson
    description: str = ""


def _band_cdfs(mu: float, sigma: float, lo: float, hi: float) -> tuple[float, float]:
    lo_cdf = _STD_NORMAL.cdf((math.log(lo) - mu) / sigma)
    hi_cdf = 1.0 if math.isinf(hi) else _STD_NORMAL.cdf((math.log(hi) - mu) / sigma)
    return lo_cdf, hi_cdf


def _truncated_log_median(mu: float, sigma: float, lo: float, hi: float) -> float:
    lo_cdf, hi_cdf = _band_cdfs(mu, sigma, lo, hi)
    mid = 0.5 * (lo_cdf + hi_cdf)
    if not 0.0 < mid < 1.0:  # band entirely in a tail that underflows: clamp to the nearer bound
        return math.log(lo) if mid <= 0.0 else math.log(hi)
    return mu + sigma * _STD_NORMAL.inv_cdf(mid)


# Table 1 strata as integer bands on the continuous value (half-integer edges survive rounding).
_LOW_PROMPT = {"lo": 0.5, "hi": PROMPT_P25 - 0.5}  # prompt in [1, 2070]
_HIGH_PROMPT = {"lo": PROMPT_P90 + 0.5}  # prompt >= 10337 (then clipped to the context)
_LOW_COMPLETION = {"lo": 0.5, "hi": COMPLETION_P25 - 0.5}  # completion in [1, 20]
_HIGH_COMPLETION = {"lo": COMPLETION_P90 + 0.5}  # completion >= 166
# Within-stratum spread of the parent lognormal. The paper gives only medians; 0.3 keeps every
# stratum well inside its band on the open side (P99/P50 ~ 2) while the truncation fixes the other.
_STRATUM_SIGMA = 0.3


def _stratum(
    name: str,
    prompt_median: float,
    completion_median: float,
    rps: float,
    *,
    high_prompt: bool,
    high_decode: bool,
) -> WorkloadSpec:
    prompt_band = _HIGH_PROMPT if high_prompt else _LOW_PROMPT
    completion_band = _HIGH_COMPLETION if high_decode else _LOW_COMPLETION
    return WorkloadSpec(
        name=name,
        prompt=LogNormal.with_median(prompt_median, _STRATUM_SIGMA, **prompt_band),
        completion=LogNormal.with_median(completion_median, _STRATUM_SIGMA, **completion_band),
        default_rps=rps,
        default_cv=1.0,
        description=(
            f"Table 1 {name.upper()}: median prompt {prompt_median:g}, median completion "
            f"{completion_median:g}, {rps:g} RPS, Poisson arrivals"
        ),
    )


# The Azure LLM inference trace 2023, conversation service (Splitwise, ISCA 2024; the public file
# AzurePublicDataset data/AzureLLMInferenceTrace_conv.csv: 19,366 requests in one hour,
# 2023-11-16 18:15-19:14, 5.5 RPS, inter-arrival CV 1.09). Percentiles of its ContextTokens and
# GeneratedTokens columns (numpy "inverted_cdf", i.e. values that occur in the file). Prompts:
# median 1,020 (mean 1,155), a mode near 400 and one near 4,100, a tail to 14,050. Completions:
# median 129 but a second mode near 400 (P75 395, mean 211): long outputs, the decode side's
# load. The two columns are nearly independent there (correlation of their logs 0.09), so they
# are drawn independently here.
AZURE_CONV_PROMPT = Quantiles(
    (
        (0, 2), (1, 29), (5, 181), (10, 207), (20, 387), (30, 403), (40, 703), (50, 1020), (60, 1071),
        (70, 1130), (75, 1189), (80, 1315), (85, 1877), (90, 2735), (95, 4083), (99, 4142), (100, 14050),
    )
)  # fmt: skip
AZURE_CONV_COMPLETION = Quantiles(
    (
        (0, 7), (1, 16), (5, 41), (10, 54), (20, 77), (30, 91), (40, 103), (50, 129), (60, 177),
        (70, 384), (75, 395), (80, 400), (85, 411), (90, 424), (95, 451), (99, 601), (100, 1000),
    )
)  # fmt: skip

WORKLOADS: dict[str, WorkloadSpec] = {
    "bursty": WorkloadSpec(
        name="bursty",
        # Fit to the production P25/P50/P90 = 2071/3569/10336 (lognormal quantiles 2062/3592/10310).
        prompt=LogNormal(mu=8.1866, sigma=0.8229),
        # p = 1/72 gives P25/P50/P90 = 21/50/165.
        completion=Geometric(p=1.0 / 72.0),
        default_rps=4.0,
        # The paper does not publish the burstiness of its production trace; CV = 2 (vLLM
        # burstiness 0.25) is our assumption for a clearly super-Poisson arrival process.
        default_cv=2.0,
        description="production-like mix: lognormal prompts, geometric completions, Gamma CV=2 arrivals",
    ),
    "lpld": _stratum("lpld", 842, 15, 22.0, high_prompt=False, high_decode=False),
    "lphd": _stratum("lphd", 998, 191, 20.0, high_prompt=False, high_decode=True),
    "hpld": _stratum("hpld", 14013, 9, 1.0, high_prompt=True, high_decode=False),
    "hphd": _stratum("hphd", 13968, 198, 1.0, high_prompt=True, high_decode=True),
    "azure_conv": WorkloadSpec(
        name="azure_conv",
        prompt=AZURE_CONV_PROMPT,
        completion=AZURE_CONV_COMPLETION,
        default_rps=5.5,  # the trace's own hour; sweeps rescale it
        default_cv=1.09,  # the trace's inter-arrival CV over that hour
        description=(
            "Azure LLM inference trace 2023 (conversation) shape: prompts median 1,020 with modes near "
            "400 and 4,100 and a tail to 14K, completions median 129 with a mode near 400 (mean 211)"
        ),
    ),
}
WORKLOAD_NAMES: tuple[str, ...] = tuple(WORKLOADS)


def gamma_arrivals(
    rng: np.random.Generator,
    rate: float,
    cv: float,
    *,
    num_requests: int | None = None,
    duration_s: float | None = None,
) -> np.ndarray:
    """Arrival times (s) of a Gamma renewal process starting at 0, sized by count or by duration.

    Both sizings consume the gap stream identically and cumulate it in one pass, so the duration
    variant is bit-for-bit a prefix of a long enough count variant.
    """
    shape = 1.0 / cv**2
    scale = 1.0 / (rate * shape)
    if num_requests is not None:
        gaps = rng.gamma(shape, scale, num_requests - 1)
        return np.concatenate([[0.0], np.cumsum(gaps)])
    assert duration_s is not None
    chunk = max(1024, math.ceil(1.2 * rate * duration_s))
    gaps = np.empty(0, dtype=np.float64)
    while True:
        gaps = np.concatenate([gaps, rng.gamma(shape, scale, chunk)])
        arrivals = np.concatenate([[0.0], np.cumsum(gaps)])
        if arrivals[-1] >= duration_s:
            return arrivals[arrivals < duration_s]


def _check_positive(name: str, value: float) -> None:
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    if not (is_number and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def generate_workload(
    spec: WorkloadSpec,
    *,
    rps: float | None = None,
    duration_s: float | None = None,
    num_requests: int | None = None,
    seed: int = 0,
    cv: float | None = None,
    max_context: int = DEFAULT_MAX_CONTEXT,
) -> list[RequestSpec]:
    """Requests of ``spec`` sorted by arrival; see :func:`make_workload` for the parameters.

    Lengths are clipped so ``prompt + output <= max_context``: the completion first to
    ``max_context - 1``, then the prompt to ``max_context - output``. Clipping (not resampling) keeps
    the one-draw-per-request stream alignment; at the default 32768 it touches ~0.4% of bursty
    prompts and ~0.1% of HPLD/HPHD prompts, and no completions.
    """
    rate = spec.default_rps if rps is None else rps
    arrival_cv = spec.default_cv if cv is None else cv
    _check_positive("rps", rate)
    _check_positive("cv", arrival_cv)
    if (duration_s is None) == (num_requests is None):
        raise ValueError(
            f"pass exactly one of duration_s and num_requests, got duration_s={duration_s!r}, "
            f"num_requests={num_requests!r}"
        )
    if duration_s is not None:
        _check_positive("duration_s", duration_s)
    if num_requests is not None and (
        isinstance(num_requests, bool) or not isinstance(num_requests, int) or num_requests < 1
    ):
        raise ValueError(f"num_requests must be an int >= 1, got {num_requests!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    if isinstance(max_context, bool) or not isinstance(max_context, int) or max_context < 2:
        raise ValueError(f"max_context must be an int >= 2, got {max_context!r}")

    name_key = zlib.crc32(spec.name.encode())
    arrival_rng, prompt_rng, completion_rng = np.random.default_rng([seed, name_key]).spawn(3)
    arrivals = gamma_arrivals(
        arrival_rng, float(rate), float(arrival_cv), num_requests=num_requests, duration_s=duration_s
    )
    n = arrivals.size
    outputs = np.minimum(spec.completion.sample(completion_rng, n), max_context - 1)
    prompts = np.minimum(spec.prompt.sample(prompt_rng, n), max_context - outputs)
    return [
        RequestSpec(
            request_id=f"{spec.name}-{i:06d}",
            arrival_s=float(arrivals[i]),
            prompt_tokens=int(prompts[i]),
            output_tokens=int(outputs[i]),
        )
        for i in range(n)
    ]


@dataclass(frozen=True, slots=True)
class ClassShare:
    """One SLO class of a mixed workload: the registered workload its requests are shaped after,
    its share of the requests, the SLOs each of them sends (as x-slo-ttft-ms / x-slo-tpot-ms)
    and vLLM's priority (lower is served first)."""

    name: str
    workload: str
    share: float
    ttft_s: float
    tpot_s: float
    priority: int = 0


# Mixed-class workloads: each class's requests arrive as its own stream of a registered workload,
# at its share of the total rate, with its SLOs and priority; the streams are merged by arrival.
# "interactive_batch", the example of a tight minority sharing the nodes:
# - 30% interactive chat shaped after the Azure conversation trace, TTFT 1 s, TPOT 60 ms,
#   priority 0. Its prompts (median 1,020, at most 14,050 tokens) can all meet 1 s on an idle
#   cluster, where Bursty's P99 prompt alone takes 2.4 s to prefill and transfer; 60 ms rather than
#   50: the profile's decode-only step is 46-53 ms (kairos.core.slo.DEFAULT_CLASSES).
# - 70% batch jobs shaped after Bursty, TTFT 20 s, TPOT 150 ms, priority 1.
# The names and SLOs are kairos.core.slo.DEFAULT_CLASSES'.
SLO_CLASS_MIXES: dict[str, tuple[ClassShare, ...]] = {
    "interactive_batch": (
        ClassShare("interactive", "azure_conv", 0.3, 1.0, 0.060, 0),
        ClassShare("batch", "bursty", 0.7, 20.0, 0.150, 1),
    ),
}
SLO_CLASS_MIX_NAMES = tuple(SLO_CLASS_MIXES)


def make_class_mix(
    mix: str, *, rps: float, duration_s: float, seed: int = 0, max_context: int = DEFAULT_MAX_CONTEXT
) -> list[RequestSpec]:
    """The requests of mixed-class workload ``mix`` (``SLO_CLASS_MIXES``) at ``rps`` in total over
    ``duration_s``, sorted by arrival: each class a stream of its workload at ``share x rps`` (its
    own arrival process, its default CV), each request carrying the class's SLOs and priority and
    an id prefixed with the class's name."""
    classes = SLO_CLASS_MIXES.get(mix)
    if classes is None:
        raise ValueError(f"unknown SLO class mix {mix!r}; known mixes: {', '.join(SLO_CLASS_MIXES)}")
    _check_positive("rps", rps)
    total = sum(k.share for k in classes)
    out: list[RequestSpec] = []
    for k in classes:
        stream = make_workload(
            k.workload, rps=rps * k.share / total, duration_s=duration_s, seed=seed, max_context=max_context
        )
        out.extend(
            dataclasses.replace(
                r,
                request_id=f"{k.name}-{r.request_id}",
                ttft_slo_s=k.ttft_s,
                tpot_slo_s=k.tpot_s,
                priority=k.priority,
            )
            for r in stream
        )
    out.sort(key=lambda r: (r.arrival_s, r.request_id))
    return out


def make_workload(
    name: str,
    *,
    rps: float | None = None,
    duration_s: float | None = None,
    num_requests: int | None = None,
    seed: int = 0,
    cv: float | None = None,
    max_context: int = DEFAULT_MAX_CONTEXT,
) -> list[RequestSpec]:
    """Generate the registered workload ``name`` (case-insensitive), sorted by arrival.

    ``rps``/``cv`` default to the workload's own values; size the run with exactly one of
    ``duration_s`` (arrivals in [0, duration_s)) or ``num_requests``. Raises ``ValueError`` on an
    unknown name or an invalid parameter, naming the offending value.
    """
    conversation = CONVERSATIONS.get(name.lower()) if isinstance(name, str) else None
    if conversation is not None:
        return generate_conversations(
            conversation, rps=rps, duration_s=duration_s, num_requests=num_requests, seed=seed, cv=cv,
            max_context=max_context,
        )  # fmt: skip
    spec = WORKLOADS.get(name.lower()) if isinstance(name, str) else None
    if spec is None:
        known = ", ".join((*WORKLOAD_NAMES, *CONVERSATION_NAMES))
        raise ValueError(f"unknown workload {name!r}; known workloads: {known}")
    return generate_workload(
        spec,
        rps=rps,
        duration_s=duration_s,
        num_requests=num_requests,
        seed=seed,
        cv=cv,
        max_context=max_context,
    )


# ---------------------------------------------------------------------------------------------
# Multi-turn conversations
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ConversationSpec:
    """Chat sessions of several turns, each turn resending the whole conversation so far.

    A session starts, with probability ``system_share``, with one of the shared system prompts
    (each session picks one uniformly; equal prompts are equal tokens across sessions), then
    turn 1's user message. Turn k's prompt is turn k-1's prompt + its answer + a new user
    message; its answer follows. A session has ``turns`` turns (clipped to ``max_turns``) and
    ends early at the turn whose prompt + answer would pass the context. Turn k+1 is sent
    ``think`` seconds (exponential, mean ``think_mean_s``) after turn k's last token.

    Defaults: a first turn shaped like the paper's production mix (median prompt near 3.5K with
    a system prompt, the bursty workload's geometric completions of mean 72), so the prefill
    pool, not the decode nodes, saturates first, as in the paper; follow-ups are short (median
    400), four turns on average and 10 s of think time (assumptions: no trace published these
    for a chat service); three system prompts of 2,048, 1,024 and 512 tokens in three sessions
    of four.
    """

    name: str
    turns: Geometric = Geometric(p=0.25)  # turns per session, mean 4 before the clip
    max_turns: int = 12
    first_message: TokenDist = LogNormal(mu=math.log(3000), sigma=0.8, hi=16384.5)
    next_message: TokenDist = LogNormal(mu=math.log(400), sigma=0.8, hi=8192.5)
    answer: TokenDist = Geometric(p=1.0 / 72.0)
    think_mean_s: float = 10.0
    system_prompts: tuple[int, ...] = (2048, 1024, 512)  # shared system prompts' lengths
    system_share: float = 0.75  # sessions that start with one of them
    default_rps: float = 8.0  # requests (turns) per second
    default_cv: float = 1.0  # CV of the sessions' inter-arrival times
    description: str = ""

    def __post_init__(self) -> None:
        if self.max_turns < 1 or not (0.0 <= self.system_share <= 1.0) or self.think_mean_s < 0:
            raise ValueError(
                f"conversation {self.name}: max_turns={self.max_turns} must be >= 1, system_share="
                f"{self.system_share} in [0, 1], think_mean_s={self.think_mean_s} >= 0"
            )
        if any(n < 1 for n in self.system_prompts):
            raise ValueError(f"conversation {self.name}: system prompt lengths must be >= 1, got {self.system_prompts}")

    @property
    def mean_turns(self) -> float:
        """E[min(turns, max_turns)] for the geometric turn count: sessions per second x this =
        turns per second (before sessions cut short by the context)."""
        q = 1.0 - self.turns.p
        return (1.0 - q**self.max_turns) / self.turns.p


# The time one turn takes, for the arrival estimate of the next (a driver that releases
# requests open-loop uses it; the simulator waits for the real end): about a TTFT, then the
# answer at a decode node's typical step.
_EST_TTFT_S = 1.0
_EST_TOKEN_S = 0.03

CONVERSATIONS: dict[str, ConversationSpec] = {
    "multiturn": ConversationSpec(
        name="multiturn",
        description=(
            "multi-turn chat: Gamma session arrivals, 4 turns on average, each prompt the conversation so far "
            "+ a new message, 10 s think time, shared system prompts in 3 sessions of 4"
        ),
    ),
}
CONVERSATION_NAMES: tuple[str, ...] = tuple(CONVERSATIONS)


def generate_conversations(
    spec: ConversationSpec,
    *,
    rps: float | None = None,
    duration_s: float | None = None,
    num_requests: int | None = None,
    seed: int = 0,
    cv: float | None = None,
    max_context: int = DEFAULT_MAX_CONTEXT,
    block_tokens: int = BLOCK_TOKENS,
) -> list[RequestSpec]:
    """The requests of ``spec``'s sessions, sorted by (estimated) arrival.

    ``rps`` is turns per second: sessions arrive at ``rps / spec.mean_turns``. ``duration_s``
    bounds the sessions' arrivals (their later turns may come after it); ``num_requests`` keeps
    the first sessions' turns up to that count. Every turn carries the chained hashes of the
    session's full blocks up to the end of its answer: a system prompt's blocks are keyed by the
    prompt, every later block by its session, so equal prefixes hash equal and nothing else does.
    """
    rate = spec.default_rps if rps is None else rps
    arrival_cv = spec.default_cv if cv is None else cv
    _check_positive("rps", rate)
    _check_positive("cv", arrival_cv)
    if (duration_s is None) == (num_requests is None):
        raise ValueError(
            f"pass exactly one of duration_s and num_requests, got duration_s={duration_s!r}, "
            f"num_requests={num_requests!r}"
        )
    if num_requests is not None and (
        isinstance(num_requests, bool) or not isinstance(num_requests, int) or num_requests < 1
    ):
        raise ValueError(f"num_requests must be an int >= 1, got {num_requests!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    session_rate = float(rate) / spec.mean_turns
    rngs = np.random.default_rng([seed, zlib.crc32(spec.name.encode())]).spawn(6)
    arrival_rng, turn_rng, first_rng, next_rng, answer_rng, misc_rng = rngs
    if duration_s is not None:
        _check_positive("duration_s", duration_s)
        starts = gamma_arrivals(arrival_rng, session_rate, float(arrival_cv), duration_s=duration_s)
    else:
        assert num_requests is not None
        starts = gamma_arrivals(arrival_rng, session_rate, float(arrival_cv), num_requests=num_requests)
    n = starts.size
    turns = np.minimum(spec.turns.sample(turn_rng, n), spec.max_turns)
    total = int(turns.sum())
    firsts = spec.first_message.sample(first_rng, n)
    nexts = spec.next_message.sample(next_rng, total)
    answers = spec.answer.sample(answer_rng, total)
    thinks = misc_rng.exponential(spec.think_mean_s, total) if spec.think_mean_s > 0 else np.zeros(total)
    has_system = misc_rng.random(n) < spec.system_share
    system_pick = misc_rng.integers(len(spec.system_prompts), size=n) if spec.system_prompts else np.zeros(n, int)

    out: list[RequestSpec] = []
    offset = 0  # into the per-turn draws
    for i in range(n):
        k = int(turns[i])
        sys_id = int(system_pick[i]) if has_system[i] and spec.system_prompts else -1
        sys_len = spec.system_prompts[sys_id] if sys_id >= 0 else 0
        session = f"{spec.name}-{i:05d}"
        # Each turn's (prompt, answer, think before the next), cut where the context ends.
        plan: list[tuple[int, int, float]] = []
        prompt = sys_len + int(firsts[i])
        for t in range(k):
            answer = min(int(answers[offset + t]), max_context - 1)
            if t > 0:
                prompt = plan[-1][0] + plan[-1][1] + int(nexts[offset + t])
            if prompt + answer > max_context:
                if t > 0:
                    break
                prompt = max(1, max_context - answer)  # a first turn is clipped, not dropped
            plan.append((prompt, answer, float(thinks[offset + t])))
        offset += k
        end = plan[-1][0] + plan[-1][1]
        sys_blocks = sys_len // block_tokens
        chain = chain_hashes((0, sys_id, b) if b < sys_blocks else (1, seed, i, b) for b in range(end // block_tokens))
        at, previous = float(starts[i]), None
        for t, (prompt, answer, think) in enumerate(plan):
            rid = f"{session}-t{t + 1}"
            out.append(
                RequestSpec(
                    request_id=rid,
                    arrival_s=at,
                    prompt_tokens=prompt,
                    output_tokens=answer,
                    block_hashes=chain[: (prompt + answer) // block_tokens],
                    session_id=session,
                    turn=t + 1,
                    after=previous,
                    think_s=plan[t - 1][2] if t > 0 else 0.0,
                )
            )
            previous = rid
            at += _EST_TTFT_S + _EST_TOKEN_S * answer + think
        if num_requests is not None and len(out) >= num_requests:
            del out[num_requests:]
            break
    out.sort(key=lambda r: r.arrival_s)
    return out
