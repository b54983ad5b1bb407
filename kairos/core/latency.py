"""Step-latency and KV-transfer models, served from a profile file as plain coefficients.

Algorithm 1 evaluates hundreds of steps per request, so every model here is a hand-written dot
product over a fixed feature vector (well under a microsecond), never ``sklearn.predict``
(about 200 µs). The feature order is the contract in :mod:`kairos.common.contracts`; the profiler
fits exactly these features.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from kairos.common import contracts as c
from kairos.common import defaults
from kairos.common.errors import ProfileError

DEFAULT_PROFILE = defaults.PROFILE


@dataclass(frozen=True, slots=True)
class LinearModel:
    """One fitted linear model: ``intercept + sum(coef_i * feature_i)``."""

    name: str  # one of the contract's model names
    features: tuple[str, ...]  # feature names in evaluation order
    coefficients: tuple[float, ...]  # one per feature, seconds per feature unit
    intercept: float  # seconds
    knee_tokens: float = 0.0  # where the "*_over_knee" feature starts growing (0 = no knee)
    mape: float | None = None  # held-out mean absolute percentage error, None if not measured
    samples: int | None = None  # training rows, None if calibrated rather than fitted

    def __post_init__(self) -> None:
        expected = c.LINEAR_MODEL_FEATURES[self.name]
        if self.features != expected:
            raise ProfileError(f"model {self.name!r}: features {list(self.features)} != {list(expected)}")
        if len(self.coefficients) != len(self.features):
            raise ProfileError(
                f"model {self.name!r}: {len(self.coefficients)} coefficients for {len(self.features)} features"
            )
        if self.name in c.KNEE_MODELS and self.knee_tokens <= 0:
            raise ProfileError(f"model {self.name!r}: knee_tokens must be > 0, got {self.knee_tokens}")

    def coef(self, feature: str) -> float:
        return self.coefficients[self.features.index(feature)]


@dataclass(frozen=True, slots=True)
class TransferModel:
    """KV transfer time = fixed latency + bytes / bandwidth (Splitwise's simulator); the
    simulator adds queueing on the link and waits for decode-side KV capacity."""

    bytes_per_token: float  # KV bytes one token occupies across all layers
    bandwidth_bytes_per_s: float  # effective per-link bandwidth
    latency_s: float  # per-transfer set-up cost (handshake, block metadata)
    mape: float | None = None

    def __post_init__(self) -> None:
        if self.bytes_per_token <= 0 or self.bandwidth_bytes_per_s <= 0 or self.latency_s < 0:
            raise ProfileError(
                f"kv_transfer: bytes_per_token={self.bytes_per_token} and "
                f"bandwidth_bytes_per_s={self.bandwidth_bytes_per_s} must be > 0, "
                f"latency_s={self.latency_s} must be >= 0"
            )

    def seconds(self, tokens: int) -> float:
        return self.latency_s + tokens * self.bytes_per_token / self.bandwidth_bytes_per_s


@dataclass(frozen=True)
class LatencyModels:
    """The four models Algorithm 1, the simulator and the emulated engine share."""

    name: str  # profile name, e.g. "deepseek-v2-lite-a100"
    model: str  # the served LLM the profile describes
    hardware: str  # the accelerator it was measured or calibrated on
    provenance: dict[str, Any]  # where the numbers came from (measured, calibrated, data)
    prefill: LinearModel
    decode: LinearModel
    mixed: LinearModel
    transfer: TransferModel
    # Unpacked coefficients: attribute reads beat tuple indexing on the hot path.
    _p: tuple[float, ...] = field(init=False, repr=False, compare=False)
    _d: tuple[float, ...] = field(init=False, repr=False, compare=False)
    _m: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        p, d, m = self.prefill, self.decode, self.mixed
        object.__setattr__(self, "_p", (p.intercept, *p.coefficients, p.knee_tokens))
        object.__setattr__(self, "_d", (d.intercept, *d.coefficients))
        object.__setattr__(self, "_m", (m.intercept, *m.coefficients, m.knee_tokens))

    @property
    def mixed_monotone(self) -> bool:
        """True when a full chunk's step time never falls as the cached prefill grows, which
        lets the schedule search skip candidates already found unsafe."""
        return self._d[2] >= 0 and self._m[3] + self._m[4] >= 0

    @property
    def mixed_nonnegative(self) -> bool:
        """True when no term of a mixed step (Eq. 4, in :meth:`mixed_step_coefficients`' form)
        can be negative for any B, K, chunk and cached prefill: every step then costs >= 0 and
        costs more with more tokens, which is what lets a decision bound a node's TTFT from
        below and skip the nodes that cannot win. Implies :attr:`mixed_monotone`."""
        d0, d_b, d_k = self._d
        m0, m_p, m_pb, m_pk, m_pc, m_knee, _ = self._m
        return d0 + m0 >= 0 and min(d_b, d_k, m_p, m_pb, m_pk, m_pk + m_pc, m_knee) >= 0

    # -- step models ------------------------------------------------------------------------
    def prefill_step_s(self, tokens: float, cached: float) -> float:
        """A prefill-only step of ``tokens`` new tokens over ``cached`` already-cached ones."""
        b0, b_tok, b_knee, b_cached, knee = self._p
        over = tokens - knee
        return b0 + b_tok * tokens + (b_knee * over if over > 0 else 0.0) + b_cached * tokens * cached

    def prefill_steps_s(self, tokens: int, chunk_tokens: int, attention_tokens: float) -> float:
        """``tokens`` prefill tokens run FIFO in steps of ``chunk_tokens`` packed across prompts
        (the last step carries the rest), whose chunks' attention work (each chunk's tokens times
        its prompt's tokens before it, tokens^2) sums to ``attention_tokens``: the prefill model
        summed over those steps. Exact: a step of several chunks costs its cached term as one over
        their token-weighted cached length (``kairos.core.calibration.predicted_step_s``), which is
        the sum of each chunk's tokens times its cached length."""
        if tokens <= 0:
            return 0.0
        full, rest = divmod(tokens, chunk_tokens)
        steps = full * self.prefill_step_s(chunk_tokens, 0) + (self.prefill_step_s(rest, 0) if rest else 0.0)
        return steps + self._p[3] * attention_tokens

    def decode_step_s(self, decode_tokens: float, kv_tokens: float) -> float:
        """T0(B, K): a decode-only step with B running decodes holding K KV tokens."""
        b0, b_b, b_k = self._d
        return b0 + b_b * decode_tokens + b_k * kv_tokens

    def mixed_increment_s(self, step_tokens: float, cached: float, decode_tokens: float, kv_tokens: float) -> float:
        """Delta T_pf: the extra time of a step of ``step_tokens`` total tokens, of which
        ``step_tokens - decode_tokens`` are prefill tokens over ``cached`` cached ones."""
        b0, b_p, b_pb, b_pk, b_pc, b_knee, knee = self._m
        p = step_tokens - decode_tokens
        if p <= 0:
            return 0.0
        over = step_tokens - knee
        return (
            b0
            + p * (b_p + b_pb * decode_tokens + b_pk * kv_tokens + b_pc * cached)
            + (b_knee * over if over > 0 else 0.0)
        )

    def mixed_step_s(self, step_tokens: float, cached: float, decode_tokens: float, kv_tokens: float) -> float:
        """Eq. 4: T_step(B, K, chi) = T0(B, K) + Delta T_pf(B, K, chi)."""
        return self.decode_step_s(decode_tokens, kv_tokens) + self.mixed_increment_s(
            step_tokens, cached, decode_tokens, kv_tokens
        )

    def mixed_step_coefficients(
        self, decode_tokens: float, kv_tokens: float
    ) -> tuple[float, float, float, float, float, float]:
        """Eq. 4 with B and K fixed, as a function of the step size chi and the deflected
        request's cached tokens c (whose KV adds to K):

            T = a0 + a_c * c + (chi - B) * (b0 + b1 * c) + k_coef * max(0, chi - knee)

        Returns ``(a0, a_c, b0, b1, k_coef, knee)``; the schedule search evaluates this form
        directly (the same numbers as ``mixed_step_s(chi, c, B, K + c)`` for chi > B).
        """
        d0, d_b, d_k = self._d
        m0, m_p, m_pb, m_pk, m_pc, m_knee, knee = self._m
        return (
            d0 + d_b * decode_tokens + d_k * kv_tokens + m0,
            d_k,
            m_p + m_pb * decode_tokens + m_pk * kv_tokens,
            m_pk + m_pc,
            m_knee,
            knee,
        )

    def kv_transfer_s(self, tokens: int) -> float:
        return self.transfer.seconds(tokens)

    # -- serialisation ----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        def linear(m: LinearModel) -> dict[str, Any]:
            out: dict[str, Any] = {
                "features": list(m.features),
                "coefficients": list(m.coefficients),
                "intercept": m.intercept,
                "mape": m.mape,
                "samples": m.samples,
            }
            if m.name in c.KNEE_MODELS:
                out["knee_tokens"] = m.knee_tokens
            return out

        t = self.transfer
        return {
            "schema_version": c.PROFILE_SCHEMA_VERSION,
            "name": self.name,
            "model": self.model,
            "hardware": self.hardware,
            "provenance": self.provenance,
            "units": {"time": "s", "size": "tokens", "bytes": "B"},
            "models": {
                c.PREFILL_STEP: linear(self.prefill),
                c.DECODE_STEP: linear(self.decode),
                c.MIXED_INCREMENT: linear(self.mixed),
                c.KV_TRANSFER: {
                    "bytes_per_token": t.bytes_per_token,
                    "bandwidth_bytes_per_s": t.bandwidth_bytes_per_s,
                    "latency_s": t.latency_s,
                    "mape": t.mape,
                },
            },
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "<dict>") -> LatencyModels:
        try:
            version = data["schema_version"]
            if version != c.PROFILE_SCHEMA_VERSION:
                raise ProfileError(
                    f"{source}: schema_version {version!r} is not supported (expected {c.PROFILE_SCHEMA_VERSION})"
                )
            missing = [k for k in c.PROFILE_KEYS if k not in data]
            if missing:
                raise ProfileError(f"{source}: missing keys {missing}")
            models = data["models"]

            def linear(name: str) -> LinearModel:
                m = models[name]
                return LinearModel(
                    name=name,
                    features=tuple(m["features"]),
                    coefficients=tuple(float(x) for x in m["coefficients"]),
                    intercept=float(m["intercept"]),
                    knee_tokens=float(m.get("knee_tokens", 0.0)),
                    mape=None if m.get("mape") is None else float(m["mape"]),
                    samples=None if m.get("samples") is None else int(m["samples"]),
                )

            t = models[c.KV_TRANSFER]
            return cls(
                name=str(data["name"]),
                model=str(data["model"]),
                hardware=str(data["hardware"]),
                provenance=dict(data["provenance"]),
                prefill=linear(c.PREFILL_STEP),
                decode=linear(c.DECODE_STEP),
                mixed=linear(c.MIXED_INCREMENT),
                transfer=TransferModel(
                    bytes_per_token=float(t["bytes_per_token"]),
                    bandwidth_bytes_per_s=float(t["bandwidth_bytes_per_s"]),
                    latency_s=float(t["latency_s"]),
                    mape=None if t.get("mape") is None else float(t["mape"]),
                ),
            )
        except ProfileError as exc:
            if exc.message.startswith(source):
                raise
            raise ProfileError(f"{source}: {exc.message}") from exc
        except (KeyError, TypeError, ValueError) as exc:
            raise ProfileError(f"{source}: malformed profile ({type(exc).__name__}: {exc})") from exc


# ---------------------------------------------------------------------------------------------
# The operating range: where a profile must predict steps that take time and never get faster
# as they carry more work
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class OperatingRange:
    """The inputs Kairos evaluates a profile at: the reference cluster's engine limits."""

    decode_tokens: int = defaults.MAX_RUNNING_REQUESTS  # B: decodes in one step
    kv_tokens: int = defaults.KV_CAPACITY_TOKENS  # K: KV tokens a node holds
    step_tokens: int = max(defaults.PREFILL_STEP_TOKENS, defaults.DECODE_STEP_TOKENS)  # tokens in one step
    context_tokens: int = defaults.MAX_MODEL_LEN  # a prefilling request's cached tokens

    def describe(self) -> str:
        return (
            f"B <= {self.decode_tokens} decodes, K <= {self.kv_tokens:,} KV tokens, steps of <= "
            f"{self.step_tokens:,} tokens, prefixes of <= {self.context_tokens:,} cached tokens"
        )


OPERATING_RANGE = OperatingRange()


# A step may get faster with more work by less than this over an input's whole range: rounding
# in a fit (plain least squares leaves a coefficient of 1e-23 where the truth is 0), not a model.
MONOTONE_TOLERANCE_S = 1e-6


def _terms(pairs: list[tuple[str, float]]) -> str:
    """The coefficients behind a failed check: the negative ones (a sum of coefficients times
    non-negative inputs falls below zero only through them), or all of them when none is."""
    negative = [(name, v) for name, v in pairs if v < 0]
    return ", ".join(f"{name} = {v:g}" for name, v in negative or pairs)


@dataclass(frozen=True, slots=True)
class _Slope:
    """One input of a model and its slope as a function of a point of the range."""

    model: str
    what: str  # what the step does as the input grows, for the message
    span: float  # the input's range: a slope times it is what the step can lose over it
    unit: str
    at: Callable[[float, float, float, float, bool], float]  # (B, p, K_o, c, past the knee) -> slope
    terms: Callable[[bool], list[tuple[str, float]]]  # the coefficients in it


def check_finite(models: LatencyModels, source: str) -> None:
    """Reject NaN or infinite numbers (JSON parsers accept ``NaN``): every decision would be
    garbage, and silently so."""
    numbers: list[tuple[str, float]] = []
    for m in (models.prefill, models.decode, models.mixed):
        numbers += [(f"{m.name}.intercept", m.intercept), (f"{m.name}.knee_tokens", m.knee_tokens)]
        numbers += [(f"{m.name}.{f}", v) for f, v in zip(m.features, m.coefficients, strict=True)]
    t = models.transfer
    numbers += [
        ("kv_transfer.bytes_per_token", t.bytes_per_token),
        ("kv_transfer.bandwidth_bytes_per_s", t.bandwidth_bytes_per_s),
        ("kv_transfer.latency_s", t.latency_s),
    ]
    bad = [name for name, value in numbers if not math.isfinite(value)]
    if bad:
        raise ProfileError(f"{source}: non-finite numbers in {bad}")


def check_operating_range(models: LatencyModels, source: str, op: OperatingRange = OPERATING_RANGE) -> None:
    """Refuse (:class:`ProfileError`) a profile that predicts a step of zero or negative time, or
    a step that gets faster as it carries more of any input (tokens, decodes, KV, cached prefix),
    anywhere in ``op``; the message names the model, the input, the point and the coefficients.

    Every model is linear in each input once the others are fixed (past a knee its slope moves by
    a constant), so each slope is checked at the corners of the range of the other inputs, on
    each side of a knee the range reaches, and a model whose slopes are all >= 0 is fastest at
    the range's lowest point, where its time is checked. A mixed step is checked as the engine and
    the decider evaluate it: a chunk of p tokens over its prompt's cached prefix c, whose KV is
    part of K (K = c + the other requests' KV K_o)."""
    check_finite(models, source)
    nb, nk, ns, nc = op.decode_tokens, op.kv_tokens, op.step_tokens, op.context_tokens
    d, p, x = models.decode, models.prefill, models.mixed
    d0, d_b, d_k = d.intercept, *d.coefficients
    p0, p_n, p_knee, p_c = p.intercept, *p.coefficients
    m0, m_p, m_pb, m_pk, m_pc, m_knee = x.intercept, *x.coefficients
    fd_b, fd_k = d.features
    fp_n, fp_knee, fp_c = p.features
    f_p, f_pb, f_pk, f_pc, f_knee = x.features

    def refuse(model: str, what: str, value: str, terms: list[tuple[str, float]]) -> None:
        raise ProfileError(
            f"{source}: {model}: {what} ({value}): {_terms(terms)}. A profile must predict steps that take time "
            f"and never get faster with more work, over {op.describe()}"
        )

    def mixed_at(b: float, q: float, k_other: float, cached: float, past: bool = False) -> str:
        kv = k_other + cached
        return f"B = {b:g} decodes, K = {kv:,.0f} KV tokens, a {q:g}-token chunk over {cached:g} cached tokens"

    def prefill_at(b: float, q: float, k_other: float, cached: float, past: bool = False) -> str:
        return f"a {q:g}-token step over {cached:g} cached tokens"

    def decode_at(b: float, q: float, k_other: float, cached: float, past: bool = False) -> str:
        return f"B = {b:g} decodes, K = {k_other:,.0f} KV tokens"

    # The points each model is checked at: (B, p, K_o, c, past its knee), the corners of its
    # range on each side of the knee (for the mixed step, the knee is on B + p).
    decode_points = [(b, 0.0, k, 0.0, False) for b in (1, nb) for k in (0, nk)]
    prefill_points = [(0.0, q, 0.0, cc, q > p.knee_tokens) for q in (1, ns) for cc in (0, nc)]
    knee = x.knee_tokens
    corners = [(b, q) for b in (0, nb) for q in (1, ns)]
    cuts = [(knee - q, q) for q in (1, ns) if 0 <= knee - q <= nb] + [
        (b, knee - b) for b in (0, nb) if 1 <= knee - b <= ns
    ]
    mixed_points = [
        (b, q, ko, cc, past)
        for past in (False, True)
        for b, q in corners + cuts
        if (b + q >= knee if past else b + q <= knee)
        for ko in (0, nk)
        for cc in (0, nc)
    ]
    checks: list[tuple[_Slope, list[tuple[float, float, float, float, bool]], Callable[..., str]]] = [
        (
            _Slope(
                c.DECODE_STEP,
                "the step time falls as the decodes grow",
                nb,
                "s per decode",
                lambda *_: d_b,
                lambda _: [(fd_b, d_b)],
            ),
            decode_points,
            decode_at,
        ),
        (
            _Slope(
                c.DECODE_STEP,
                "the step time falls as the KV tokens grow",
                nk,
                "s per token",
                lambda *_: d_k,
                lambda _: [(fd_k, d_k)],
            ),
            decode_points,
            decode_at,
        ),
        (
            _Slope(
                c.PREFILL_STEP,
                "the step time falls as the cached tokens grow",
                nc,
                "s per token",
                lambda b, q, *_: p_c * q,
                lambda _: [(fp_c, p_c)],
            ),
            prefill_points,
            prefill_at,
        ),
        (
            _Slope(
                c.PREFILL_STEP,
                "the step time falls as the step's tokens grow",
                ns,
                "s per token",
                lambda b, q, ko, cc, past: p_n + p_c * cc + (p_knee if past else 0.0),
                lambda past: [(fp_n, p_n), (fp_c, p_c), *([(fp_knee, p_knee)] if past else [])],
            ),
            prefill_points,
            prefill_at,
        ),
        (
            _Slope(
                c.MIXED_INCREMENT,
                "the step time falls as the chunk's prefill tokens grow",
                ns,
                "s per token",
                lambda b, q, ko, cc, past: m_p + m_pb * b + m_pk * (ko + cc) + m_pc * cc + (m_knee if past else 0.0),
                lambda past: [
                    (f_p, m_p),
                    (f_pb, m_pb),
                    (f_pk, m_pk),
                    (f_pc, m_pc),
                    *([(f_knee, m_knee)] if past else []),
                ],
            ),
            mixed_points,
            mixed_at,
        ),
        (
            _Slope(
                c.MIXED_INCREMENT,
                "the step time falls as the decodes grow",
                nb,
                "s per decode",
                lambda b, q, ko, cc, past: d_b + m_pb * q + (m_knee if past else 0.0),
                lambda past: [(fd_b, d_b), (f_pb, m_pb), *([(f_knee, m_knee)] if past else [])],
            ),
            mixed_points,
            mixed_at,
        ),
        (
            _Slope(
                c.MIXED_INCREMENT,
                "the step time falls as the other requests' KV tokens grow",
                nk,
                "s per token",
                lambda b, q, *_: d_k + m_pk * q,
                lambda _: [(fd_k, d_k), (f_pk, m_pk)],
            ),
            mixed_points,
            mixed_at,
        ),
        (
            _Slope(
                c.MIXED_INCREMENT,
                "the step time falls as the chunk's cached prefix (its KV part of K) grows",
                nc,
                "s per token",
                lambda b, q, *_: d_k + q * (m_pk + m_pc),
                lambda _: [(fd_k, d_k), (f_pk, m_pk), (f_pc, m_pc)],
            ),
            mixed_points,
            mixed_at,
        ),
        (
            # From no chunk to a 1-token chunk: Eq. 4's increment at p = 1 (its slope times one token)
            _Slope(
                c.MIXED_INCREMENT,
                "a 1-token chunk makes the step faster than its decodes alone",
                1,
                "s",
                lambda b, q, ko, cc, past: (
                    m0 + m_p + m_pb * b + m_pk * (ko + cc) + m_pc * cc + (m_knee * max(0.0, b + 1 - knee))
                ),
                lambda _: [("intercept", m0), (f_p, m_p), (f_pb, m_pb), (f_pk, m_pk), (f_pc, m_pc), (f_knee, m_knee)],
            ),
            [(b, 1.0, ko, cc, False) for b in (0, nb) for ko in (0, nk) for cc in (0, nc)]
            + ([(knee - 1, 1.0, ko, cc, False) for ko in (0, nk) for cc in (0, nc)] if 1 <= knee <= nb else []),
            mixed_at,
        ),
    ]
    for slope, points, where in checks:
        worst = min(points, key=lambda pt: slope.at(*pt))
        value = slope.at(*worst)
        if value * slope.span < -MONOTONE_TOLERANCE_S:
            refuse(
                slope.model,
                f"{slope.what} at {where(*worst)}",
                f"{value:.3g} {slope.unit}",
                slope.terms(worst[4]),
            )
    for model, seconds, at, terms in (
        # A decode holds its own token at least: the smallest decode-only step has B = K = 1.
        (
            c.DECODE_STEP,
            models.decode_step_s(1, 1),
            "B = 1 decodes, K = 1 KV tokens",
            [("intercept", d0), (fd_b, d_b), (fd_k, d_k)],
        ),
        (
            c.PREFILL_STEP,
            models.prefill_step_s(1, 0),
            "a 1-token step over 0 cached tokens",
            [("intercept", p0), (fp_n, p_n)],
        ),
        (
            c.MIXED_INCREMENT,
            models.mixed_step_s(1, 0, 0, 0),
            mixed_at(0, 1, 0, 0),
            [("decode_step intercept", d0), ("intercept", m0), (f_p, m_p)],
        ),
    ):
        if not seconds > 0:
            refuse(model, f"a step with {at} is predicted to take {seconds:.3g} s", "must be > 0", terms)


def profile_path(name_or_path: str | Path) -> Path | None:
    """The file ``name_or_path`` names when it is a path (ends in ``.json`` or exists), or None
    for a packaged profile name (the same rule :func:`load_profile` applies)."""
    path = Path(name_or_path)
    return path if path.suffix == ".json" or path.exists() else None


def parse_profile(text: str | bytes, source: str) -> LatencyModels:
    """A profile from its JSON text, validated in full; ``source`` names it in error messages."""
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ProfileError(f"{source}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ProfileError(f"{source}: a profile is a JSON object, got {type(data).__name__}")
    models = LatencyModels.from_dict(data, source)
    check_operating_range(models, source)
    return models


def load_profile(name_or_path: str | Path = DEFAULT_PROFILE) -> LatencyModels:
    """Load a profile by packaged name (e.g. ``deepseek-v2-lite-a100``) or by file path."""
    return parse_profile(*read_profile_text(name_or_path))


def read_profile_text(name_or_path: str | Path = DEFAULT_PROFILE) -> tuple[str, str]:
    """The JSON text of a profile (packaged name or file path) and its source for messages."""
    path = profile_path(name_or_path)
    if path is not None:
        if not path.is_file():
            raise ProfileError(f"profile file {path} does not exist")
        text, source = path.read_text(), str(path)
    else:
        profiles = resources.files("kairos.core") / "profiles"
        packaged = profiles / f"{name_or_path}.json"
        if not packaged.is_file():
            known = sorted(p.name.removesuffix(".json") for p in profiles.iterdir())
            raise ProfileError(f"unknown profile {str(name_or_path)!r}; packaged profiles: {known}")
        text, source = packaged.read_text(), f"packaged:{name_or_path}"
    return text, source


def largest_chunk_within(
    models: LatencyModels,
    tokens: int,
    cached: int,
    decode_tokens: int,
    kv_tokens: int,
    limit_s: float,
    other_tokens: int = 0,
    other_weighted_cached: int = 0,
) -> int:
    """The largest chunk <= ``tokens`` whose mixed step (``decode_tokens`` decodes holding
    ``kv_tokens``, a prefill over ``cached`` cached tokens) the models keep within ``limit_s``;
    0 when not even one token fits. A decode node runs this on the batch it actually has, since
    the dispatcher planned the schedule on a heartbeat and decodes may have joined since.

    ``other_tokens``: prefill tokens of the step's other chunks, and ``other_weighted_cached``
    the sum of each one's tokens times its cached length: the step is costed with every token it
    carries, several chunks as one over their token-weighted cached length (as
    :func:`kairos.core.calibration.predicted_step_s` and the simulator cost it)."""

    def fits(n: int) -> bool:
        p = other_tokens + n
        mean_cached = (other_weighted_cached + n * cached) / p if p else 0.0
        return models.mixed_step_s(decode_tokens + p, mean_cached, decode_tokens, kv_tokens) <= limit_s

    if fits(tokens):
        return tokens
    lo, hi = 0, tokens  # fits(lo) or lo == 0; not fits(hi); step time grows with the chunk
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo if lo > 0 and fits(lo) else 0


class StepGuard:
    """A decode node's guard over one step as the step is composed, chunk by chunk (the
    simulator's and emulated node's engine, the vLLM plugin's scheduler): a chunk joins the step
    only as far as the whole step, every token of it (the decodes and every prefill chunk in it,
    scheduled or not), keeps within the tightest step budget among the step's deflected chunks,
    its own included. A chunk ahead of the first budgeted one is not held (it carries no budget),
    but it counts against the ones after it. With no decode in the step there is no TBT to
    protect: every chunk takes what it asks."""

    __slots__ = ("decode_tokens", "kv_tokens", "limit_s", "models", "prefill_tokens", "weighted_cached")

    def __init__(self, models: LatencyModels, decode_tokens: int, kv_tokens: int) -> None:
        self.models = models
        self.decode_tokens = decode_tokens
        self.kv_tokens = kv_tokens
        self.prefill_tokens = 0  # the step's chunks so far
        self.weighted_cached = 0  # their sum of tokens x cached length
        self.limit_s = math.inf  # the tightest budget of a chunk in the step so far

    def room(self, tokens: int, cached: int, budget_s: float | None) -> int:
        """How many of ``tokens`` a chunk over ``cached`` cached tokens, with ``budget_s`` (None:
        none of its own), could add to the step now; nothing is taken."""
        limit = self.limit_s if budget_s is None else min(self.limit_s, budget_s)
        if self.decode_tokens == 0 or limit == math.inf:
            return tokens
        return largest_chunk_within(
            self.models,
            tokens,
            cached,
            self.decode_tokens,
            self.kv_tokens,
            limit,
            self.prefill_tokens,
            self.weighted_cached,
        )

    def take(self, tokens: int, cached: int, budget_s: float | None) -> int:
        """``room``, then the chunk joins the step with what it got (nothing when 0)."""
        n = self.room(tokens, cached, budget_s)
        if n > 0:
            self.prefill_tokens += n
            self.weighted_cached += n * cached
            if budget_s is not None:
                self.limit_s = min(self.limit_s, budget_s)
        return n
