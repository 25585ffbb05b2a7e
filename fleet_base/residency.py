"""Data residency: the one rule for which jurisdictions a request may be processed in.

A region (a cluster) carries a jurisdiction, a free-form label such as `ca`, `us` or `eu`.
A policy (a deployment's `residency`, an API key's `residency`) names the jurisdictions
allowed; where both apply the request may go only where both allow. The rule fails
closed: an empty intersection allows nothing, and a region with no jurisdiction is outside
every policy. Placement, the gateway's routing plan and the control plane's API all ask
these functions, so they cannot disagree on what a policy means.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Annotated

from pydantic import StringConstraints

from fleet_base.domain import is_cluster_id

JURISDICTION_PATTERN = r"^[a-z0-9-]{1,32}$"
# A jurisdiction label: lower-case letters, digits and dashes, 1-32 characters.
Jurisdiction = Annotated[str, StringConstraints(pattern=JURISDICTION_PATTERN)]
# More labels than any real policy names; bounds what one API call or flag may carry.
MAX_JURISDICTIONS = 64


def is_jurisdiction(value: str) -> bool:
    """Whether `value` is a valid jurisdiction label (already normalised)."""
    return re.fullmatch(JURISDICTION_PATTERN, value) is not None


def normalize(label: str) -> str:
    """A label trimmed and lower-cased, or ValueError saying why it is not a jurisdiction."""
    if not isinstance(label, str):
        raise ValueError(f"a jurisdiction must be a string, not {type(label).__name__}")
    value = label.strip().lower()
    if not value:
        raise ValueError("a jurisdiction label is empty")
    if not is_jurisdiction(value):
        raise ValueError(
            f"jurisdiction {label!r} is not a label of 1-32 lower-case letters, digits and dashes"
        )
    return value


def allowed(*policies: Sequence[str] | None) -> frozenset[str] | None:
    """The jurisdictions every set policy allows (their intersection); None when no policy
    is set. An empty set allows nothing: a key and a deployment that share no jurisdiction
    can never be served."""
    result: frozenset[str] | None = None
    for policy in policies:
        if policy is None:
            continue
        labels = frozenset(policy)
        result = labels if result is None else result & labels
    return result


def permits(allowed: frozenset[str] | None, jurisdiction: str) -> bool:
    """Whether a region of `jurisdiction` may process a request under `allowed`. With no
    policy everything is permitted; with one, a region without a jurisdiction is not."""
    if allowed is None:
        return True
    return bool(jurisdiction) and jurisdiction in allowed


def describe(allowed: Iterable[str] | None) -> str:
    """A policy for messages: `ca, us`, `none` (empty: nothing allowed) or `any` (no policy)."""
    if allowed is None:
        return "any"
    labels = sorted(allowed)
    return ", ".join(labels) if labels else "none"


def parse_residency(value: str | Sequence[str]) -> list[str]:
    """A policy from `ca` or `ca,us` (a flag) or a list of labels (an API field): normalised,
    de-duplicated, in the order given. ValueError when it is empty or a label is invalid; a
    caller that means "no policy" passes None around this, never an empty list."""
    items = value.split(",") if isinstance(value, str) else list(value)
    if len(items) > MAX_JURISDICTIONS:
        raise ValueError(f"a residency policy names at most {MAX_JURISDICTIONS} jurisdictions")
    labels: list[str] = []
    for item in items:
        label = normalize(item)
        if label not in labels:
            labels.append(label)
    if not labels:
        raise ValueError("a residency policy names at least one jurisdiction")
    return labels


def parse_jurisdictions(text: str) -> dict[str, str]:
    """Cluster -> jurisdiction from `local-east=ca,local-west=us`. ValueError on an entry
    without `=`, an invalid cluster id or label, or a cluster named twice."""
    result: dict[str, str] = {}
    entries = [entry.strip() for entry in text.split(",")]
    if not any(entries):
        raise ValueError("no CLUSTER=JURISDICTION pairs given")
    for entry in entries:
        if not entry:
            raise ValueError(f"an empty entry in {text!r}; expected CLUSTER=JURISDICTION,...")
        cluster, sep, label = entry.partition("=")
        cluster = cluster.strip()
        if not sep:
            raise ValueError(f"{entry!r} is not CLUSTER=JURISDICTION")
        if not is_cluster_id(cluster):
            raise ValueError(f"{cluster!r} is not a cluster id (lower-case letters, digits, dashes)")
        if cluster in result:
            raise ValueError(f"cluster {cluster!r} is given a jurisdiction twice")
        result[cluster] = normalize(label)
    return result
