"""Step-latency and KV-transfer models, served from a profile file as plain coefficients.

Algorithm 1 evaluates hundreds of steps per request, so every model here is a hand-written dot
product over a fixed feature vector (well under a microsecond), never ``sklearn.predict``
(about 200 µs). The feature order is the contract in :mod:`kairos.common.contracts`; the profiler
fits exactly these features.
"""

from __future__ import annotations

import json
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
    return LatencyModels.from_dict(data, source)


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
    models: LatencyModels, tokens: int, cached: int, decode_tokens: int, kv_tokens: int, limit_s: float
) -> int:
    """The largest chunk <= ``tokens`` whose mixed step (``decode_tokens`` decodes holding
    ``kv_tokens``, a prefill over ``cached`` cached tokens) the models keep within ``limit_s``;
    0 when not even one token fits. A decode node runs this on the batch it actually has, since
    the dispatcher planned the schedule on a heartbeat and decodes may have joined since."""

    def fits(n: int) -> bool:
        return models.mixed_step_s(decode_tokens + n, cached, decode_tokens, kv_tokens) <= limit_s

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
