"""fleetctl's command groups; each module registers its commands on the Typer app."""
