"""The fleet as the control plane reasons about it: the snapshot read from the database in
one go (`snapshot`), and the pure functions that turn it into the placer's inputs, the next
assignments and the routes (`plan`), the active-passive standby (`standby`), where demand
comes from (`demand_regions`) and how a key's budget is split (`shares`).

Everything here is synchronous and free of NATS; `control_plane.loops` holds the asyncio
loops that read, publish and store around it."""
