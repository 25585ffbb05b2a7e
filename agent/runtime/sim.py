"""Runtime `sim`: replicas are `python -m agent.sim.server` children (simulated replicas
whose timing follows a performance profile; see agent/sim/). Everything else (ports, logs,
process groups, health, draining, adoption) is the process runtime's.

The spec's `engine_args` become the simulated replica's flags: `profile` (a name in
fleet_base/profiles or a JSON path), `cold_start` (seconds), `error_rate` (0..1, a "bad
version"), `max_num_seqs`, `seed`. Other engine flags are passed and ignored by the
server, so one deployment spec serves both runtimes."""

from __future__ import annotations

import sys

from agent.runtime.process import ProcessRuntime, _check_text, engine_flags
from fleet_base.protocol import ReplicaSpec

SIM_MODULE = "agent.sim.server"


class SimRuntime(ProcessRuntime):
    name = "sim"
    module = SIM_MODULE

    def replica_argv(self, spec: ReplicaSpec, port: int) -> list[str]:
        argv = [
            sys.executable,
            "-m",
            SIM_MODULE,
            "--model",
            _check_text("model", spec.model),
            "--served-model-name",
            _check_text("deployment", spec.deployment),
            "--host",
            self.config.replica.host,
            "--port",
            str(port),
        ]
        argv += engine_flags(spec.engine_args)
        argv += list(self.config.replica.extra_args)
        if "--drain-timeout" not in argv:
            argv += ["--drain-timeout", repr(float(self.config.replica.drain_timeout_s))]
        return argv
