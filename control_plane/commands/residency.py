"""The residency flags fleetctl shares: `--residency ca,us` (deploy, keys) and
`--jurisdiction ca` (clusters), checked here with `fleet_base.residency` so a bad label
fails before any API call, with the reason."""

from __future__ import annotations

from control_plane.commands.output import fail
from fleet_base.residency import normalize, parse_residency

RESIDENCY_HELP = (
    'jurisdictions its requests may be processed in, comma-separated (e.g. "ca,us"); "" clears it'
)
JURISDICTION_HELP = 'the cluster\'s jurisdiction, a label such as "ca", "us" or "eu" ("" clears it)'


def residency_flag(value: str) -> list[str] | None:
    """A `--residency` value as the API takes it: a list of labels, or None ("") for no policy."""
    if not value.strip():
        return None
    try:
        return parse_residency(value)
    except ValueError as err:
        fail(f"--residency {value!r}: {err}")


def jurisdiction_flag(value: str) -> str:
    """A `--jurisdiction` value, normalised; "" (none) stays ""."""
    if not value.strip():
        return ""
    try:
        return normalize(value)
    except ValueError as err:
        fail(f"--jurisdiction {value!r}: {err}")
