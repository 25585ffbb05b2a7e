"""Runtime `sim`: replicas are `python -m agent.sim.server` children (simulated replicas
whose timing follows a performance profile; see agent/sim/). Everything else (ports, logs,
process groups, health, draining, adoption) is the process runtime's.

The spec's `engine_args` become the simulated replica's flags: `profile` (a name in
fleet_base/profiles or a JSON path), `cold_start` (seconds), `error_rate` (0..1, a "bad
version"), `max_num_seqs`, `seed`, `text_diverge_at` (a test device: its text differs from
that token on). Other engine flags are passed and ignored by the
server, so one deployment spec serves both runtimes."""

from __future__ import annotations

from agent.runtime.command import replica_argv
from agent.runtime.process import ProcessRuntime
from fleet_base.protocol import ReplicaSpec

SIM_MODULE = "agent.sim.server"


class SimRuntime(ProcessRuntime):
    name = "sim"
    module = SIM_MODULE
    runs_foreign_engines = False  # a simulated replica stands in for any engine

    def gpu_inventory(self) -> list[int]:
        return []

    def replica_argv(self, spec: ReplicaSpec, port: int) -> list[str]:
        return replica_argv(spec, self.config, port=port, module=SIM_MODULE, lora=False)
