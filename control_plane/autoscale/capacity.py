"""What one replica can serve, from its performance profile: predicted TTFT attainment and
inter-token latency of a replica count at a given load (pure, no state).

The model (docs/autoscaling.md has its assumptions):
- load is work, not requests: requests/s, prompt tokens/s and output tokens/s, spread
  evenly over the replicas (the gateway routes by least outstanding tokens);
- prefix reuse: the share of prompt tokens expected to be found in the replicas' prefix
  caches is not prefilled (0: every prompt token is); cached tokens still hold KV;
- prefill runs first and pauses decode (as the engine and the simulated replica do); a
  replica's prefill share is rho = lambda x S, S the prefill time per request of the mean
  prompt length in the batch it shares at that load;
- waiting for prefill: the replicas wait like one queue served by n (M/G/n, Allen-Cunneen):
  P(wait > x) ~ C(n, rho n) exp(-x / theta), theta = E[S^2] / (2 E[S] n (1 - rho)), with
  service times in proportion to the prompt lengths of the recent mix (without one, an
  exponential spread around the mean);
- TTFT attainment: the share of the mix whose own prefill plus wait fits the target;
  attainable: the share whose own prefill fits at all;
- decode: the running batch B makes B / step(B) tokens/s in the (1 - rho) share of time
  prefill leaves, so B solves B / step(B) x (1 - rho) = output tokens/s, and ITL =
  step(B) / (1 - rho);
- slots: requests in flight (Little's law) within SLOT_SHARE of the batch limit and of the
  KV capacity, else requests queue for a slot and TTFT is unbounded;
- `correction` multiplies prefill and decode times: the live fix when replicas turn out
  slower (or faster) than the profile said."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from fleet_base.profile import PerfProfile

SLOT_SHARE = 0.85  # of the batch limit and KV capacity a replica may plan to use
PROMPT_CV2 = 1.0  # squared coefficient of variation of prompt lengths (exponential-like)


class Variant(BaseModel):
    """One kind of replica a deployment may run on (a GPU type or tier of its pools):
    its profile, its price per replica-hour, and how many replicas its pools can hold."""

    model_config = ConfigDict(extra="forbid")

    name: str
    profile: PerfProfile
    hourly_price: float = Field(ge=0)
    max_replicas: int | None = Field(None, ge=0)


@dataclass(frozen=True)
class Load:
    """Work arriving at a deployment per second (all replicas together)."""

    requests_per_s: float = 0.0
    prompt_tokens_per_s: float = 0.0
    output_tokens_per_s: float = 0.0
    prefix_reuse: float = 0.0  # share of prompt tokens served from prefix caches (not prefilled)

    def __post_init__(self) -> None:
        if not 0.0 <= self.prefix_reuse < 1.0:
            raise ValueError(f"prefix_reuse must be in [0, 1), not {self.prefix_reuse}")

    @property
    def mean_prompt(self) -> float:
        return self.prompt_tokens_per_s / self.requests_per_s if self.requests_per_s > 0 else 0.0

    @property
    def mean_prefill(self) -> float:
        """Prompt tokens a mean request prefills: the part not found cached."""
        return self.mean_prompt * (1.0 - self.prefix_reuse)

    @property
    def mean_output(self) -> float:
        return self.output_tokens_per_s / self.requests_per_s if self.requests_per_s > 0 else 0.0

    def scaled(self, factor: float) -> Load:
        return Load(
            self.requests_per_s * factor,
            self.prompt_tokens_per_s * factor,
            self.output_tokens_per_s * factor,
            self.prefix_reuse,
        )


@dataclass(frozen=True)
class Prediction:
    """Per replica, at `replicas` replicas sharing the load."""

    replicas: int
    feasible: bool  # finite queues: prefill share < 1, decode and slots keep up
    ttft_s: float  # mean TTFT: prefill wait + own prefill
    wait_s: float  # mean wait for prefill
    prefill_s: float  # own prefill of a mean-length prompt
    itl_s: float
    prefill_share: float
    batch: float  # running sequences in decode
    concurrency: float  # requests holding a slot
    slot_limit: float
    attainment: float = 1.0  # predicted share of requests within the TTFT target
    attainable: float = 1.0  # the share whose own prefill fits the target (any replica count)
    why: str = ""

    def as_dict(self) -> dict[str, object]:
        r = lambda x: round(x, 4) if math.isfinite(x) else None  # noqa: E731
        return {
            "replicas": self.replicas,
            "feasible": self.feasible,
            "ttft_s": r(self.ttft_s),
            "itl_s": r(self.itl_s),
            "prefill_share": r(self.prefill_share),
            "concurrency": r(self.concurrency),
            "slot_limit": r(self.slot_limit),
            "attainment": r(self.attainment),
            "attainable": r(self.attainable),
        }


class ReplicaCapacity:
    """One replica of a profile; `batch_limit` may be lowered below the profile's
    `max_num_seqs` (a deployment's concurrency target)."""

    def __init__(self, profile: PerfProfile, batch_limit: float | None = None) -> None:
        self.profile = profile
        self.batch_limit = float(min(profile.max_num_seqs, batch_limit or profile.max_num_seqs))
        self._memo: tuple[tuple, tuple[list[float], list[float], float]] | None = None

    def _mix(
        self, prompts: Sequence[float], mean: float, correction: float
    ) -> tuple[list[float], list[float], float]:
        """(prompt lengths at the load's mean, each one's own prefill time, E[x^2] / E[x]^2),
        remembered for the last arguments: one decision asks for many replica counts."""
        key = (id(prompts), len(prompts), mean, correction)
        if self._memo is not None and self._memo[0] == key:
            return self._memo[1]
        mix = _normalized(prompts, mean)
        own = [self.profile.prefill_time(x) * correction for x in mix]
        m2 = sum(x * x for x in mix) / len(mix) / (mean * mean) if mix and mean > 0 else 2.0
        self._memo = (key, (mix, own, m2))
        return mix, own, m2

    def prefill_cost(self, prompt: float, rate: float, correction: float = 1.0) -> float:
        """Seconds of prefill per request of `prompt` tokens at `rate` requests/s: the
        requests that arrive during a prefill batch share the next one (fixed point)."""
        p = self.profile
        prompt = max(1.0, prompt)
        max_batch = max(1.0, p.max_prefill_tokens / prompt)
        k = 1.0
        for _ in range(8):
            t = p.prefill_time(k * prompt) * correction
            k = min(max_batch, max(1.0, rate * t))
        return p.prefill_time(k * prompt) * correction / k

    def decode_rate(self, batch: float, correction: float = 1.0) -> float:
        return batch / (self.profile.decode_time(batch) * correction)

    def predict(
        self,
        load: Load,
        replicas: int,
        correction: float = 1.0,
        prompts: Sequence[float] = (),
        ttft_target_s: float = math.inf,
    ) -> Prediction:
        """TTFT and ITL at `replicas` replicas (>= 1) sharing `load`. `prompts`: the mix of
        the load, scaled to its mean prefill (recent prompt lengths, or what each request
        prefills where that is known; without them, exponential around the mean);
        `ttft_target_s`: for the share of requests predicted within it."""
        n = max(1, replicas)
        lam = load.requests_per_s / n
        prompt, output = load.mean_prompt, max(1.0, load.mean_output)
        fresh = load.mean_prefill  # a request's KV holds its whole prompt; it prefills this
        kv_slots = self.profile.kv_capacity_tokens / max(1.0, prompt + output)
        slot_limit = SLOT_SHARE * min(self.batch_limit, kv_slots)
        _, own_each, m2 = self._mix(prompts, fresh, correction)
        own = sum(own_each) / len(own_each) if own_each else 0.0
        attainable = _share(own_each, ttft_target_s)
        step1 = self.profile.decode_time(1) * correction
        if lam <= 0:
            return Prediction(
                n, True, own, 0.0, own, step1, 0.0, 0.0, 0.0, slot_limit, attainable, attainable
            )
        s = self.prefill_cost(fresh, lam, correction)
        rho = lam * s
        if rho >= 1:
            return Prediction(n, False, math.inf, math.inf, own, math.inf, rho, 0, math.inf, slot_limit, 0.0,
                              attainable, f"prefill needs {rho:.2f} of a replica")  # fmt: skip
        # Service times in proportion to prompt tokens (at the batching this load gets); the
        # router sends work to the replica with the least outstanding, so the replicas wait
        # like one queue served by n (M/G/n, Allen-Cunneen): P(wait > x) ~ C exp(-x / theta).
        c_wait, theta = wait_tail(n, rho * n, s, m2)
        wait = c_wait * theta
        attainment = (
            sum(1 - c_wait * math.exp(-(ttft_target_s - o) / theta) for o in own_each if o <= ttft_target_s)
            / len(own_each)
            if own_each and theta > 0 and math.isfinite(ttft_target_s)
            else attainable
        )
        need = lam * (output - 1) / (1 - rho)  # decode tokens/s while decoding
        batch = self._batch_for(need, correction)
        if batch is None:
            return Prediction(n, False, math.inf, wait, own, math.inf, rho, math.inf, math.inf, slot_limit, 0.0,
                              attainable, f"decode needs {need:.0f} tokens/s")  # fmt: skip
        itl = self.profile.decode_time(max(1.0, batch)) * correction / (1 - rho)
        concurrency = lam * (own + wait + (output - 1) * itl)
        feasible = concurrency <= slot_limit
        why = "" if feasible else f"{concurrency:.1f} requests in flight for {slot_limit:.1f} slots"
        return Prediction(
            n,
            feasible,
            wait + own,
            wait,
            own,
            itl,
            rho,
            batch,
            concurrency,
            slot_limit,
            attainment,
            attainable,
            why,
        )

    def _batch_for(self, tokens_per_s: float, correction: float) -> float | None:
        """The smallest decode batch (<= the batch limit) producing `tokens_per_s`."""
        if tokens_per_s <= 0:
            return 0.0
        hi = self.batch_limit
        if self.decode_rate(hi, correction) < tokens_per_s:
            return None
        lo = 0.0
        for _ in range(16):
            mid = (lo + hi) / 2
            if self.decode_rate(max(mid, 1e-6), correction) >= tokens_per_s:
                hi = mid
            else:
                lo = mid
        return hi


EXPONENTIAL_POINTS = 32


def _normalized(prompts: Sequence[float], mean: float) -> list[float]:
    """The prompt mix scaled to the load's mean length; without a sample, the quantiles of
    an exponential distribution around the mean (a deliberately pessimistic spread)."""
    if mean <= 0:
        return []
    if not prompts:
        m = EXPONENTIAL_POINTS
        return [max(1.0, -mean * math.log(1 - (i + 0.5) / m)) for i in range(m)]
    avg = sum(prompts) / len(prompts)
    return [max(1.0, x * mean / avg) for x in prompts] if avg > 0 else [mean]


def _share(times: Sequence[float], limit: float) -> float:
    return sum(1 for t in times if t <= limit) / len(times) if times else 1.0


def wait_tail(servers: int, offered: float, service_s: float, m2: float) -> tuple[float, float]:
    """(C, theta) of P(wait > x) ~ C exp(-x / theta) for `servers` serving one queue at
    `offered` = lambda x E[S] (< servers), E[S] = `service_s` and E[S^2] = m2 E[S]^2
    (M/G/n, Allen-Cunneen: Erlang C's chance to wait, the M/M/n tail stretched by the
    service times' spread)."""
    rho = offered / servers
    theta = service_s * m2 / (2 * servers * (1 - rho)) if service_s > 0 and rho < 1 else 0.0
    return erlang_c(servers, offered), theta


def erlang_c(servers: int, offered: float) -> float:
    """Probability that an arrival waits in M/M/c with `offered` = lambda x E[S] (< c)."""
    if offered <= 0:
        return 0.0
    if offered >= servers:
        return 1.0
    b = 1.0
    for k in range(1, servers + 1):
        b = offered * b / (k + offered * b)
    rho = offered / servers
    return b / (1 - rho * (1 - b))
