"""Several control planes on one database, one leader: the election policy (`election`),
the lease and members in the database (`lease_store`), sessions whose commits are refused
once the leader's epoch is over (`fencing`), and the task that ties them to the control
loops (`elector`). See docs/control-plane.md."""

LEASE_NAME = "control-plane"
