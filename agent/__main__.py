"""`python -m agent --config cluster.yaml [--runtime process|sim|kubernetes]`: run this
cluster's agent in the foreground.

Logs go to stderr. SIGTERM or SIGINT drains the replicas and exits 0; a second signal
exits at once, leaving replicas running for the next agent to adopt. Exit 2 on a bad
config or when another agent already runs on the same state_dir.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence
from typing import get_args

import yaml
from pydantic import ValidationError

from agent.daemon import Agent, AgentLocked
from fleet_base import heap_trim
from fleet_base.cluster_config import ClusterConfig, RuntimeName

log = logging.getLogger("agent")


async def serve(config: ClusterConfig) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    main_task = asyncio.current_task()

    def on_signal(sig: int) -> None:
        if stop.is_set():
            log.warning("second %s: exiting without draining", signal.Signals(sig).name)
            if main_task is not None:
                main_task.cancel()
            return
        log.info("%s: draining replicas, then exiting", signal.Signals(sig).name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        agent = Agent(config)
    except ValueError as err:  # a runtime that cannot work with this config
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        await agent.run(stop)
    except AgentLocked as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except asyncio.CancelledError:
        return 130
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agent", description="Fleet cluster agent.")
    parser.add_argument("--config", required=True, help="cluster.yaml")
    parser.add_argument(
        "--runtime",
        default=None,
        choices=list(get_args(RuntimeName)),
        help="how replicas run (overrides cluster.yaml `runtime`): local processes, simulated, or pods",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    ns = parser.parse_args(argv)
    logging.basicConfig(
        stream=sys.stderr,
        level=ns.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        config = ClusterConfig.load(ns.config)
    except (OSError, yaml.YAMLError, ValidationError) as err:
        print(f"error: cannot use config {ns.config}: {err}", file=sys.stderr)
        return 2
    if ns.runtime is not None:
        config.runtime = ns.runtime
    try:
        heap_trim.start()
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return asyncio.run(serve(config))


if __name__ == "__main__":
    sys.exit(main())
