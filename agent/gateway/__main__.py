"""`python -m agent.gateway --config cluster.yaml`: serve the cluster's gateway."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

import uvicorn
from pydantic import ValidationError

from agent.config import ClusterConfig
from agent.gateway.app import build_app


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m agent.gateway", description=__doc__)
    p.add_argument("--config", required=True, help="the cluster's cluster.yaml")
    p.add_argument("--host", default=None, help="override gateway.host")
    p.add_argument("--port", type=int, default=None, help="override gateway.port")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    ns = p.parse_args(argv)
    try:
        config = ClusterConfig.load(ns.config)
    except (OSError, ValidationError, ValueError) as err:
        print(f"gateway: cannot load {ns.config}: {err}", file=sys.stderr)
        return 2
    if ns.host is not None:
        config.gateway.host = ns.host
    if ns.port is not None:
        config.gateway.port = ns.port
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("nats").setLevel(logging.WARNING)
    server = uvicorn.Server(
        uvicorn.Config(
            build_app(config),
            host=config.gateway.host,
            port=config.gateway.port,
            log_level=ns.log_level,
            access_log=False,
            timeout_graceful_shutdown=5,
            lifespan="on",
        )
    )
    logging.getLogger("agent.gateway").info(
        "gateway of cluster %s on %s (state %s)", config.cluster, config.gateway.url, config.state_dir
    )
    server.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
