"""Running Fleet's components as local processes (`fleetctl up`, tests)."""
