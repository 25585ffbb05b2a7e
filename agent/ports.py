"""Local TCP ports for the agent, the local fleet and the tests: a re-export of
`fleet_base.ports`, their one home (the engine imports them from there too)."""

from fleet_base.ports import free_port, wait_port

__all__ = ["free_port", "wait_port"]
