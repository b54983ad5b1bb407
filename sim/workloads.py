"""Seeded synthetic workloads: the bursty production-like mix, the four Table 1 strata, and a
conversation workload shaped after the Azure LLM inference trace 2023.

Every generator is a pure function of its arguments: ``numpy.random.default_rng([seed, crc32(name)])``
spawns three child streams that drive arrivals, prompt lengths and completion lengths separately.
Mixing in the name keeps two workloads run with the same seed and rate (e.g. HPLD and HPHD, both
1 RPS) from sharing identical arrival instants when a simulation overlays them.
Keeping the streams apart means a run sized by ``duration_s`` is exactly a prefix-compatible twin of
one sized by ``num_requests``, and changing the rate never reshuffles the token lengths.

Arrivals are a Gamma renewal process with shape ``k = 1 / CV**2`` and scale ``1 / (rate * k)``, the
convention of vLLM's benchmark ``--burstiness`` flag (burstiness = k): CV = 1 is Poisson, CV > 1 is
burstier. The first request arrives at t = 0, so the realised rate is count / span up to a factor
``n / (n - 1)``.
"""

from __future__ import annotations

import itertools
import math
import zlib
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from kairos.common import defaults
from kairos.sim.requests import RequestSpec

__all__ = [
    "AZURE_CONV_COMPLETION",
    "AZURE_CONV_PROMPT",
    "COMPLETION_P25",
    "COMPLETION_P90",
    "DEFAULT_MAX_CONTEXT",
    "PROMPT_P25",
    "PROMPT_P90",
    "WORKLOADS",
    "WORKLOAD_NAMES",
    "Geometric",
    "LogNormal",
    "Quantiles",
    "TokenDist",
    "WorkloadSpec",
    "gamma_arrivals",
    "generate_workload",
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
    spec = WORKLOADS.get(name.lower()) if isinstance(name, str) else None
    if spec is None:
        raise ValueError(f"unknown workload {name!r}; known workloads: {', '.join(WORKLOAD_NAMES)}")
    return generate_workload(
        spec,
        rps=rps,
        duration_s=duration_s,
        num_requests=num_requests,
        seed=seed,
        cv=cv,
        max_context=max_context,
    )
