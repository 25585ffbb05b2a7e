"""What a cached prefix is worth to a replica, by the tier that holds it: the one scoring
function the gateway's routing plan and `fleetctl simulate` both call, so the two cannot
value a host-tier hit differently.

A device hit saves its prefill outright. A host-tier hit saves the prefill too, but must be
copied back to the device first, so it is worth what that copy leaves of the prefill it
replaces: `1 - load_s / prefill_s` per token, never below a miss (0) and never above a
device hit (1). The prefill side is the profile's cheapest per-token prefill (a full
prefill batch), so the host tier is valued low rather than high when the curve is unsure.

A replica is scored by the request's expected time to first token there, in seconds
(`expected_ttft_s`): the wait before its prefill can start (the prefills sent there ahead
of it, less what of them is done: `queue_wait_s`, plus the step in flight) and its own
prefill less what the replica's tiers save. Queued work and saved work are one unit, so a
holder wins exactly while its queue costs less than the recompute its cache saves.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from fleet_base.profile import PerfProfile

# A replica whose host tier is known to exist but whose profile says nothing of its cost
# (a live engine started with `--kv-offloading-size` and no profile): half a device hit.
# Below a device hit on purpose, so an unmeasured tier never outranks a device copy.
UNKNOWN_HOST_TOKEN_VALUE = 0.5
EPS = 1e-9  # a queue that ends on a step's edge does not start another


def host_token_value(kv_bytes_per_token: float, h2d_bytes_per_s: float, prefill_s_per_token: float) -> float:
    """Share of one token's prefill a host-tier hit saves after its load, in [0, 1]."""
    if kv_bytes_per_token <= 0 or h2d_bytes_per_s <= 0 or prefill_s_per_token <= 0:
        return 0.0
    load_s = kv_bytes_per_token / h2d_bytes_per_s
    return min(1.0, max(0.0, 1.0 - load_s / prefill_s_per_token))


def load_token_value(profile: PerfProfile) -> float:
    """What a host hit saves on the profile's hardware, whatever its host tier's size (a
    live replica's tier is known from its KV events, not from the profile)."""
    batch = float(profile.max_prefill_tokens)
    return host_token_value(
        profile.kv_bytes_per_token, profile.h2d_bytes_per_s, profile.prefill_time(batch) / batch
    )


def profile_host_token_value(profile: PerfProfile) -> float:
    """The profile's host-hit value; 0 when it has no host tier."""
    return load_token_value(profile) if profile.host_kv_bytes > 0 else 0.0


@dataclass(frozen=True)
class PrefixHit:
    """A replica's cached share of one prompt, in tokens, by tier."""

    device_tokens: int = 0
    host_tokens: int = 0

    @property
    def tokens(self) -> int:
        """Prompt tokens the replica need not prefill (loaded or already on the device)."""
        return self.device_tokens + self.host_tokens

    def value(self, host_value: float) -> float:
        """Prefill saved, in token equivalents: device hits in full, host hits after their load."""
        return self.device_tokens + self.host_tokens * host_value


def prefix_hit(device_blocks: int, host_blocks: int, block_tokens: int, prompt_tokens: int) -> PrefixHit:
    """The leading `device_blocks` then `host_blocks` of a prompt as tokens. The last prompt
    token is always computed (as the engine does), so the hit stops one short of the prompt;
    the device part comes first."""
    cap = max(0, prompt_tokens - 1)
    device = max(0, min(device_blocks * block_tokens, cap))
    both = max(0, min((device_blocks + host_blocks) * block_tokens, cap))
    return PrefixHit(device, both - device)


@dataclass(frozen=True)
class PrefillTiming:
    """A replica's speed as the routing cost reads it: seconds a prompt token's prefill
    takes at a full prefill batch (the profile's cheapest, linear past a few thousand
    tokens), and one step (a new prompt waits for the step in flight to end)."""

    s_per_token: float
    step_s: float = 0.0
    # The engine's long-prefill cap (0: off): a long prompt takes this many tokens of every
    # step, so a short prompt beside it is prefilled in a step that also carries them; and
    # the room such a step leaves the short ones (the step's budget less the cap).
    long_threshold: int = 0
    long_room: int = 0

    def prefill_s(self, tokens: float) -> float:
        return max(0.0, tokens) * self.s_per_token

    def is_short(self, new_tokens: float) -> bool:
        """Whether a prompt needing `new_tokens` of prefill goes past long ones."""
        return self.long_threshold > 0 and new_tokens <= self.long_threshold


def long_prefill_timing(timing: PrefillTiming, threshold: int, budget: int) -> PrefillTiming:
    """`timing` with the engine's long-prefill cap (`threshold` tokens of a `budget`-token
    step; a cap at or past the step's budget caps nothing)."""
    if not 0 < threshold < budget:
        return replace(timing, long_threshold=0, long_room=0)
    return replace(timing, long_threshold=threshold, long_room=budget - threshold)


def profile_timing(profile: PerfProfile) -> PrefillTiming:
    batch = profile.max_prefill_tokens
    timing = PrefillTiming(profile.prefill_time(float(batch)) / batch, profile.decode_time(1.0))
    return long_prefill_timing(timing, profile.long_prefill_token_threshold, batch)


def queue_wait_s(
    pending: Sequence[tuple[float, int]], now: float, timing: PrefillTiming, *, short: bool = False
) -> float:
    """Seconds until a replica could start a new prompt's prefill: its pending prefills
    (sent at, new prefill tokens) run one after another in the order sent, each starting when
    it arrived or when the one before ended, whichever is later; what is left of that at
    `now`. The part of a long prefill already done is not waited for again.

    `short`: the wait of a prompt the engine lets past long ones (`timing.is_short`): only the
    short prefills ahead count, and while a long one is pending each step, the prompt's own
    included, also carries `long_threshold` of its tokens (one step per `long_room` short
    tokens)."""
    if short and timing.long_threshold > 0:
        end = -math.inf
        for at, tokens in sorted(p for p in pending if timing.is_short(p[1])):
            end = max(end, at) + timing.prefill_s(tokens)
        queued = max(0.0, end - now)
        if all(timing.is_short(tokens) for _, tokens in pending):
            return queued
        tokens_left = queued / timing.s_per_token if timing.s_per_token > 0 else 0.0
        steps = math.ceil(tokens_left / max(1, timing.long_room) - EPS) + 1
        return queued + steps * timing.prefill_s(timing.long_threshold)
    end = -math.inf
    for at, tokens in sorted(pending):
        end = max(end, at) + timing.prefill_s(tokens)
    return max(0.0, end - now)


def expected_ttft_s(
    hit: PrefixHit, prompt_tokens: int, wait_s: float, host_value: float, timing: PrefillTiming
) -> float:
    """A replica's expected time to first token for a prompt, lower is better: the wait
    before its prefill starts, then the prefill its cache does not save (a device hit is
    free, a host hit costs its load: `host_value` of a token saved)."""
    return wait_s + timing.prefill_s(float(prompt_tokens) - hit.value(host_value))


def load_seconds(profile: PerfProfile, host_tokens: int) -> float:
    """Time to copy `host_tokens` tokens' KV from the host tier back to the device (the
    load a host hit pays instead of their prefill)."""
    if host_tokens <= 0 or profile.kv_bytes_per_token <= 0:
        return 0.0
    return host_tokens * profile.kv_bytes_per_token / profile.h2d_bytes_per_s
