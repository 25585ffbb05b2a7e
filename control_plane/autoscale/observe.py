"""From what agents and gateways report to one `Observation` per deployment (pure).

- replicas: the latest heartbeat of each cluster (stale ones, older than `stale_s`, are
  left out): ready replicas' running and waiting sequences, ready and starting counts,
  and their work: admitted prompt tokens/s, generated tokens/s, requests starting per
  second, KV usage and the mean TTFT of the requests that started, and the prompt lengths
  the replicas sampled of those requests (the mix: `OBSERVED_PROMPTS` quantiles over all
  ready replicas, each replica's lengths weighted by its requests); the measured cold start
  (the slowest of its replicas' latest starts, as agents report them), which the SLO policy
  prefers to the profile's;
- gateway queues: the latest `Demand` per (cluster, deployment) younger than `demand_ttl_s`,
  their own waiting requests summed over clusters; the batch backlog, one shared work queue
  every gateway reads, counted once: the largest of those reports;
- every reported figure is clamped (counts to `MAX_COUNT`, rates to `MAX_RATE`, KV usage to
  0..1), so sums over clusters stay finite whatever a cluster claims;
- settings: a deployment version's scaling columns as `AutoscaleSettings`, with the
  performance profile its `engine_args` name and, when its pools offer several GPU types
  with a profile each, one `Variant` per type; and the engine the version runs."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache

from control_plane.autoscale.capacity import Variant
from control_plane.autoscale.policy import (
    DEFAULT_SLO_ITL_S,
    DEFAULT_SLO_TTFT_S,
    AutoscaleSettings,
    Observation,
    make_policy,
    version_scale_down_delay,
)
from fleet_base import residency
from fleet_base.bounds import MAX_COUNT
from fleet_base.profile import PerfProfile, load_profile
from fleet_base.protocol import Demand, Heartbeat, ReplicaState
from fleet_base.quantiles import evenly_spaced

STARTING = (ReplicaState.pending, ReplicaState.starting)
# Tokens or requests per second one replica may claim; sums of reported figures stay finite.
MAX_RATE = 1e9
MAX_COLD_START_S = 3600.0  # a longer measured cold start is taken for a broken report
STALE_S = 10.0  # a heartbeat older than this is left out
DEMAND_TTL_S = 3.0  # a gateway's demand counts this long
OBSERVED_PROMPTS = 64  # prompt lengths one observation carries, over all replicas


def _rate(value: float) -> float:
    return min(max(value, 0.0), MAX_RATE)


def _count(value: int) -> int:
    return min(max(int(value), 0), MAX_COUNT)


def observe(
    deployment: str,
    heartbeats: Iterable[Heartbeat],
    demands: Mapping[tuple[str, str], Demand],
    *,
    now: float,
    current: int,
    stale_s: float = STALE_S,
    demand_ttl_s: float = DEMAND_TTL_S,
    shadow_versions: frozenset[int] = frozenset(),
) -> Observation:
    """The deployment's load now. Replicas of `shadow_versions` (a rollout's shadow phase)
    run copies, not user requests: their load is no demand and they serve no user."""
    running = waiting = 0.0
    ready = starting = 0
    prompt = output = started = kv = ttft_weighted = 0.0
    colds: list[float] = []
    prompts: list[tuple[int, float]] = []  # (length, the requests/s it stands for)
    for hb in heartbeats:
        if now - hb.sent_at > stale_s:
            continue
        for r in hb.replicas:
            if r.deployment != deployment or r.version in shadow_versions:
                continue
            if r.cold_start_s is not None and 0 < r.cold_start_s <= MAX_COLD_START_S:
                colds.append(r.cold_start_s)
            if r.state == ReplicaState.ready:
                ready += 1
                running += _count(r.load.running)
                waiting += _count(r.load.waiting)
                prompt += _rate(r.load.prompt_tokens_per_s)
                output += _rate(r.load.tokens_per_s)
                started += _rate(r.load.requests_per_s)
                share = max(_rate(r.load.requests_per_s), 1e-9) / max(1, len(r.load.prompt_sample))
                prompts.extend((x, share) for x in r.load.prompt_sample)
                kv += min(max(r.load.kv_cache_usage, 0.0), 1.0)
                if r.load.ttft_s is not None:
                    ttft_weighted += _rate(r.load.ttft_s) * _rate(r.load.requests_per_s)
            elif r.state in STARTING:
                starting += 1
    fresh = [d for (_, dep), d in list(demands.items()) if dep == deployment and now - d.at <= demand_ttl_s]
    queued = sum(_count(d.queued) for d in fresh)
    backlog = max((_count(d.batch_backlog) for d in fresh), default=0)
    return Observation(
        at=now,
        in_flight=running,
        queued=waiting + queued + backlog,
        ready=ready,
        starting=starting,
        current=current,
        requests_per_s=started,
        prompt_tokens_per_s=prompt,
        output_tokens_per_s=output,
        kv_usage=kv / ready if ready else 0.0,
        ttft_s=ttft_weighted / started if started > 0 else None,
        cold_start_s=max(colds) if colds else None,
        prompt_sample=tuple(evenly_spaced(sorted(prompts), min(len(prompts), OBSERVED_PROMPTS))),
    )


@lru_cache(maxsize=128)
def _profile(name: str) -> PerfProfile:
    """Profiles by name, read once per process (the loop asks every tick)."""
    return load_profile(name)


def profiles_of(engine_args: Mapping[str, object]) -> dict[str, PerfProfile]:
    """GPU type (upper case) -> profile: `profile` and any `profile_<GPU>` engine args that
    name a stored profile (or a JSON path). Unknown names are left out."""
    out: dict[str, PerfProfile] = {}
    for key, value in engine_args.items():
        if key != "profile" and not key.startswith("profile_"):
            continue
        try:
            prof = _profile(str(value))
        except ValueError:
            continue
        gpu = key.removeprefix("profile_").upper() if key != "profile" else prof.gpu_model.upper()
        out.setdefault(gpu, prof)
    cold = engine_args.get("cold_start")
    if isinstance(cold, (int, float)) and cold >= 0:  # the sim runtime's own cold start
        out = {g: p.model_copy(update={"cold_start_s": float(cold)}) for g, p in out.items()}
    return out


def variants_of(
    profiles: Mapping[str, PerfProfile], pools: Sequence[object], allowed: Sequence[str], gpus: int
) -> list[Variant]:
    """One variant per GPU type that has a profile, is allowed, and has pools: priced at its
    cheapest pool's GPU price x the replica's GPUs, with room for what its pools hold."""
    allow = {a.upper() for a in allowed}
    out = []
    for gpu, prof in sorted(profiles.items()):
        mine = [p for p in pools if str(getattr(p, "gpu_model", "")).upper() == gpu]
        if not mine or (allow and gpu not in allow):
            continue
        price = min(float(p.hourly_price) / max(1, int(p.gpus_per_node)) for p in mine) * max(1, gpus)
        room = sum(int(p.gpus_per_node) * int(p.nodes) // max(1, gpus) for p in mine)
        out.append(Variant(name=gpu, profile=prof, hourly_price=price, max_replicas=room))
    return out


def within_residency(pools: Sequence[object], policy: Sequence[str] | None) -> list[object]:
    """The pools a deployment under `policy` may use (their cluster's jurisdiction): the
    GPU mix is priced and bounded by those alone, as the placer will place."""
    allowed = residency.allowed(policy)
    if allowed is None:
        return list(pools)
    return [
        p
        for p in pools
        if residency.permits(allowed, getattr(getattr(p, "cluster", None), "jurisdiction", "") or "")
    ]


def settings_of(version: object, policy: str = "ours", pools: Sequence[object] = ()) -> AutoscaleSettings:
    """A `DeploymentVersion` row's scaling columns (window, delay, target, bounds, SLO
    targets) and what its replicas can do (profiles, variants over `pools`)."""
    window = float(getattr(version, "autoscale_window_s", 60.0))
    profiles = profiles_of(dict(getattr(version, "engine_args", None) or {}))
    variants = variants_of(
        profiles,
        pools,
        list(getattr(version, "gpu_models", None) or []),
        int(getattr(version, "gpu_count", 1) or 1),
    )
    primary = next(iter(profiles.values()), None)
    ttft = getattr(version, "slo_ttft_s", None)
    itl = getattr(version, "slo_itl_s", None)
    return AutoscaleSettings(
        policy=policy,
        min_replicas=int(getattr(version, "min_replicas", 1)),
        max_replicas=int(getattr(version, "max_replicas", 1)),
        target_concurrency=float(getattr(version, "target_concurrency", 8.0)),
        stable_window_s=window,
        panic_window_s=max(min(window, 1.0), window / 10),
        scale_down_delay_s=version_scale_down_delay(
            getattr(version, "scale_down_delay_s", None), make_policy(policy)
        ),
        scale_to_zero=bool(getattr(version, "scale_to_zero", False))
        or int(getattr(version, "min_replicas", 1)) == 0,
        scale_to_zero_grace_s=min(window, 60.0),
        slo_ttft_s=float(ttft) if ttft else DEFAULT_SLO_TTFT_S,
        slo_itl_s=float(itl) if itl else DEFAULT_SLO_ITL_S,
        profile=primary,
        engine=getattr(version, "engine", None) or "fleet",
        variants=variants if len(variants) > 1 else [],
    )
