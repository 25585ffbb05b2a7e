"""How far the autoscaler's forecasts were from what came: each decision's predicted load
(`Decision.predicted`: the load sized for one horizon ahead) is kept in a bounded ring per
deployment until its target time, then matched with the first observation at or after it.

A policy that forecasts nothing (no `predicted` load, or no horizon) is not tracked. The
horizon is the record's `horizon_s` where the policy says it, else its `cold_start_s` (the
SLO policy forecasts one cold start ahead). A prediction whose target passed more than
`max_late_s` before any observation (the loop stalled, the deployment was paused) is
dropped, not matched with a far later load.

Per signal, an outcome carries the error in the signal's unit and as a ratio of what was
observed (none when nothing was observed); the smoothed error is a decaying,
observation-weighted mean absolute percentage error (sum |predicted - observed| / sum
observed, each term weighted by 0.5 ** (age / half_life_s)): a lull's near-zero
observations do not blow it up, and an old burst fades out of it. Plain and synchronous:
the autoscale loop feeds it, `/metrics` and the console read it."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

SIGNALS = ("prompt_tokens_per_s", "requests_per_s")
MAX_PENDING = 512  # predictions waiting for their target time, per deployment
MAX_OUTCOMES = 900  # matched predictions kept per deployment, both signals: the console's 15 min
HALF_LIFE_S = 600.0
MAX_LATE_S = 60.0


@dataclass(frozen=True)
class Prediction:
    made_at: float
    due_at: float
    values: dict[str, float]


@dataclass(frozen=True)
class Outcome:
    """One prediction and what was observed at its target time."""

    made_at: float
    due_at: float
    observed_at: float
    signal: str
    predicted: float
    observed: float
    mape: float | None = None  # the smoothed error of the signal's forecasts after this one

    @property
    def error(self) -> float:
        """Predicted minus observed: positive when it over-predicted."""
        return self.predicted - self.observed

    @property
    def ratio(self) -> float | None:
        return self.error / self.observed if self.observed > 0 else None


@dataclass
class _Smoothed:
    """Decaying sums of |error| and of observed, for the weighted MAPE."""

    abs_error: float = 0.0
    observed: float = 0.0
    at: float | None = None

    def add(self, at: float, abs_error: float, observed: float, half_life_s: float) -> None:
        if self.at is not None and at > self.at:
            decay = 0.5 ** ((at - self.at) / half_life_s)
            self.abs_error *= decay
            self.observed *= decay
        self.at = at if self.at is None else max(self.at, at)
        self.abs_error += abs_error
        self.observed += observed

    @property
    def mape(self) -> float | None:
        return self.abs_error / self.observed if self.observed > 0 else None


@dataclass
class DeploymentErrors:
    pending: deque[Prediction] = field(default_factory=lambda: deque(maxlen=MAX_PENDING))
    outcomes: deque[Outcome] = field(default_factory=lambda: deque(maxlen=MAX_OUTCOMES))
    last: dict[str, Outcome] = field(default_factory=dict)  # signal -> latest outcome
    smoothed: dict[str, _Smoothed] = field(default_factory=dict)

    def mape(self, signal: str) -> float | None:
        s = self.smoothed.get(signal)
        return s.mape if s is not None else None


def horizon_of(predicted: Mapping[str, object]) -> float | None:
    for key in ("horizon_s", "cold_start_s"):
        value = _number(predicted.get(key))
        if value is not None and value > 0:
            return value
    return None


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


class PredictionErrors:
    """Past predictions per deployment, matched to the observations at their targets."""

    def __init__(self, half_life_s: float = HALF_LIFE_S, max_late_s: float = MAX_LATE_S) -> None:
        self.half_life_s = half_life_s
        self.max_late_s = max_late_s
        self.deployments: dict[str, DeploymentErrors] = {}

    def record(
        self, deployment: str, at: float, predicted: Mapping[str, object], observed: Mapping[str, float]
    ) -> list[Outcome]:
        """One tick: match the predictions now due with `observed` (the load at `at`), then
        keep this tick's prediction until its target. Returns the outcomes matched now."""
        d = self.deployments.setdefault(deployment, DeploymentErrors())
        matched: list[Outcome] = []
        while d.pending and d.pending[0].due_at <= at:
            p = d.pending.popleft()
            if at - p.due_at > self.max_late_s:
                continue
            for signal, value in p.values.items():
                seen = _number(observed.get(signal))
                if seen is None:
                    continue
                o = Outcome(p.made_at, p.due_at, at, signal, value, max(0.0, seen))
                smoothed = d.smoothed.setdefault(signal, _Smoothed())
                smoothed.add(at, abs(o.error), o.observed, self.half_life_s)
                o = replace(o, mape=smoothed.mape)
                matched.append(o)
                d.outcomes.append(o)
                d.last[signal] = o
        horizon = horizon_of(predicted)
        values = {s: v for s in SIGNALS if (v := _number(predicted.get(s))) is not None}
        if horizon is not None and values:
            p = Prediction(at, at + horizon, values)
            if d.pending and p.due_at < d.pending[-1].due_at:
                # a shorter horizon than the last (a faster cold start measured): keep the ring in order
                d.pending = deque(sorted([*d.pending, p], key=lambda q: q.due_at), maxlen=MAX_PENDING)
            else:
                d.pending.append(p)
        return matched

    def get(self, deployment: str) -> DeploymentErrors | None:
        return self.deployments.get(deployment)

    def keep_only(self, deployments: set[str]) -> None:
        """Forget deployments that no longer exist."""
        for name in list(self.deployments):
            if name not in deployments:
                del self.deployments[name]
