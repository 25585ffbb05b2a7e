"""What shadow traffic decides, without I/O: which requests are copied, where a copy may
go (or why it is dropped), which replicas users never reach, and how a greedy copy's
output compares with the original's. `agent.gateway.shadow` does the I/O.

- The share: each request draws once from a hash of its id and a salt the gateway picks
  at start (a client that chooses its request ids cannot choose to be copied); it is
  copied when the draw is below `ShadowTarget.share`.
- A copy goes only to a replica of the shadow version in this cluster with a free slot
  (this gateway's requests in flight there below its concurrency target), never waits;
  otherwise it is dropped (`dropped_busy`). It obeys the original's residency (the
  cluster's jurisdiction must be in the request's allowed set, else `dropped_residency`)
  and its LoRA adapter (a replica that has it, or room to load it without evicting one).
- Users never reach the shadow version while it has no weight of its own.
- Comparison: a request is greedy when it asks for temperature 0 or top_k 1 (one
  sequence). Outputs compare as token ids when both sides have them, else as text split
  by the deployment's tokenizer (else 4-character pieces, the gateway's estimate of a
  token). Each side is held up to a bound; past it only the common prefix is compared.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from agent.gateway.plan import ReplicaFacts
from fleet_base.protocol import RoutingTable
from fleet_base.residency import permits

Outcome = Literal["sent", "dropped_busy", "dropped_residency", "error", "completed"]
OUTCOMES: tuple[Outcome, ...] = ("sent", "dropped_busy", "dropped_residency", "error", "completed")
MAX_OUTPUT_TOKENS = 16384  # token ids held per side for the comparison
MAX_OUTPUT_CHARS = 64 * 1024  # characters held per side when ids are not available
ESTIMATE_CHARS = 4  # characters per token when no tokenizer is available


def draw(request_id: str, salt: str) -> float:
    """A uniform draw in [0, 1), fixed per (request, salt)."""
    digest = hashlib.sha256(f"fleet-shadow:{salt}:{request_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def copied(share: float, value: float) -> bool:
    """Whether a request with this draw is copied at `share` (0 < share <= 1)."""
    return value < share


def shadow_version(route: RoutingTable | None) -> int | None:
    """The version the route copies requests to (None: no shadow)."""
    target = getattr(route, "shadow", None) if route is not None else None
    return target.version if target is not None and target.share > 0 else None


def serves_users(route: RoutingTable | None, version: int) -> bool:
    """False for the shadow version's replicas while it has no weight for users."""
    if shadow_version(route) != version or route is None:
        return True
    return any(w.version == version and w.weight > 0 for w in route.versions)


@dataclass(frozen=True)
class Choice:
    outcome: Outcome  # "sent" (to `replica`), "dropped_busy" or "dropped_residency"
    replica: ReplicaFacts | None = None


def choose_replica(
    replicas: Sequence[ReplicaFacts],
    version: int,
    slots: int,
    *,
    allowed: frozenset[str] | None,
    jurisdiction: str,
    adapter: str | None = None,
) -> Choice:
    """Where a copy goes: the least busy replica of `version` here with a free slot (fewer
    than `slots` of this gateway's requests in flight) that can take `adapter` without an
    eviction; dropped when residency forbids this cluster or no such replica is free."""
    if not permits(allowed, jurisdiction):
        return Choice("dropped_residency")
    free = [
        r
        for r in replicas
        if r.version == version
        and r.in_flight < slots
        and not r.recently_failed
        and (adapter is None or adapter in r.adapters or len(r.adapters) < r.max_adapters)
    ]
    if not free:
        return Choice("dropped_busy")
    return Choice("sent", min(free, key=lambda r: (r.in_flight, r.outstanding_tokens, r.replica_id)))


def greedy(body: dict[str, Any], sequences: int = 1) -> bool:
    """A request whose output is deterministic: temperature 0 or top_k 1, one sequence."""
    if sequences != 1:
        return False
    temperature, top_k = body.get("temperature"), body.get("top_k")
    zero = isinstance(temperature, int | float) and not isinstance(temperature, bool) and temperature == 0
    return zero or (isinstance(top_k, int) and not isinstance(top_k, bool) and top_k == 1)


@dataclass
class Output:
    """One side's generated output, held up to a bound: token ids when the replica sent
    them, and the text."""

    ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    chars: int = 0
    truncated: bool = False
    has_ids: bool = False

    def add_ids(self, ids: Sequence[int]) -> None:
        self.has_ids = True
        room = MAX_OUTPUT_TOKENS - len(self.ids)
        if len(ids) > room:
            self.truncated = True
        self.ids.extend(ids[: max(0, room)])

    def add_text(self, text: str) -> None:
        room = MAX_OUTPUT_CHARS - self.chars
        if len(text) > room:
            self.truncated = True
            text = text[: max(0, room)]
        if text:
            self.text.append(text)
            self.chars += len(text)

    @property
    def joined(self) -> str:
        return "".join(self.text)


@dataclass(frozen=True)
class Comparison:
    greedy_match: bool | None = None
    first_diff_token: int | None = None


def first_difference(a: Sequence[Any], b: Sequence[Any]) -> int | None:
    """The index of the first token that differs (a shorter output differs where it
    ended); None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def estimate_pieces(text: str) -> list[str]:
    """Text as ~token pieces when no tokenizer is available (4 characters each)."""
    return [text[i : i + ESTIMATE_CHARS] for i in range(0, len(text), ESTIMATE_CHARS)]


def compare(
    original: Output, copy: Output, tokenize: Callable[[str], Sequence[Any]] | None = None
) -> Comparison:
    """Whether the copy's output equals the original's, and the first token where not.
    Past either side's bound only the common prefix counts: a difference there is
    reported, an equal prefix is not comparable (None)."""
    if original.has_ids and copy.has_ids:
        a: Sequence[Any] = original.ids
        b: Sequence[Any] = copy.ids
    else:
        split = tokenize or estimate_pieces
        a, b = split(original.joined), split(copy.joined)
    if original.truncated or copy.truncated:
        n = min(len(a), len(b))
        diff = first_difference(a[:n], b[:n])
        return Comparison() if diff is None else Comparison(False, diff)
    diff = first_difference(a, b)
    return Comparison(diff is None, diff)
