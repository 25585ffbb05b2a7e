"""Canary rollouts: a plain policy (`policy`), the gateway telemetry it reads
(`telemetry`), the persisted state (`store`) and the asyncio loop around them (`loop`)."""
