"""What a cached prefix is worth to a replica, by the tier that holds it: the one scoring
function the gateway's routing plan and `fleetctl simulate` both call, so the two cannot
value a host-tier hit differently.

A device hit saves its prefill outright. A host-tier hit saves the prefill too, but must be
copied back to the device first, so it is worth what that copy leaves of the prefill it
replaces: `1 - load_s / prefill_s` per token, never below a miss (0) and never above a
device hit (1). The prefill side is the profile's cheapest per-token prefill (a full
prefill batch), so the host tier is valued low rather than high when the curve is unsure.
"""

from __future__ import annotations

from dataclasses import dataclass

from fleet_base.profile import PerfProfile

# A replica whose host tier is known to exist but whose profile says nothing of its cost
# (a live engine started with `--kv-offloading-size` and no profile): half a device hit.
# Below a device hit on purpose, so an unmeasured tier never outranks a device copy.
UNKNOWN_HOST_TOKEN_VALUE = 0.5


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


# The prefill a replica must do for a prompt costs twice: the request waits for it (its time to
# first token), and it is work that every later request there waits behind; a prefix found
# elsewhere is computed again, so the fleet does that work twice. The work queued ahead costs
# once (it is there wherever the request goes).
NEW_PREFILL_WEIGHT = 2.0


def prefix_cost(hit: PrefixHit, prompt_tokens: int, queued_tokens: int, host_value: float) -> float:
    """A replica's cost for a prompt, in prefill-token equivalents, lower is better: the
    prefill its cache does not save (`NEW_PREFILL_WEIGHT`) plus the prefill queued ahead."""
    return NEW_PREFILL_WEIGHT * (float(prompt_tokens) - hit.value(host_value)) + queued_tokens


def load_seconds(profile: PerfProfile, host_tokens: int) -> float:
    """Time to copy `host_tokens` tokens' KV from the host tier back to the device (the
    load a host hit pays instead of their prefill)."""
    if host_tokens <= 0 or profile.kv_bytes_per_token <= 0:
        return 0.0
    return host_tokens * profile.kv_bytes_per_token / profile.h2d_bytes_per_s
