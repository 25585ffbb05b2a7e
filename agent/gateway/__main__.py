"""`python -m agent.gateway --config cluster.yaml`: serve the cluster's gateway."""

from __future__ import annotations

import argparse
import asyncio
import logging
import ssl
import sys
from collections.abc import Sequence

import uvicorn
from pydantic import ValidationError

from agent.gateway.app import build_app
from agent.gateway.peers import mark_peer_listener
from fleet_base import heap_trim, tracing
from fleet_base.cluster_config import ClusterConfig
from fleet_base.listener import uvicorn_options


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
    logging.getLogger("agent.gateway.access").setLevel(
        logging.INFO if config.gateway.access_log else logging.WARNING
    )
    try:
        listener = uvicorn_options()
        heap_trim.start()  # before any thread (the span exporter's) takes an arena of its own
    except ValueError as err:
        print(f"gateway: {err}", file=sys.stderr)
        return 2
    tracing.setup("fleet-gateway", attributes={tracing.CLUSTER: config.cluster})
    app = build_app(config)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=config.gateway.host,
            port=config.gateway.port,
            log_level=ns.log_level,
            access_log=False,
            timeout_graceful_shutdown=5,
            lifespan="on",
            **listener,
        )
    )
    peer = peer_server(config, app, ns.log_level)
    logging.getLogger("agent.gateway").info(
        "gateway of cluster %s on %s%s (state %s)",
        config.cluster,
        config.gateway.url,
        f", peers on {config.gateway.peer_url} (mutual TLS)" if peer else "",
        config.state_dir,
    )
    if peer is None:
        server.run()
    else:
        asyncio.run(serve_both(server, peer))
    return 0


def peer_server(config: ClusterConfig, app, log_level: str) -> uvicorn.Server | None:
    """The HTTPS listener for peer gateways: the fleet CA must have issued the client's
    certificate (mutual TLS); which gateway it is comes from its peer token. Only peers'
    pools connect here, so it keeps idle connections longer than they do (`behind_pool`)."""
    creds, gwc = config.security, config.gateway
    if not (gwc.peer_port and creds.enabled and creds.gateway_cert and creds.gateway_key):
        return None
    return uvicorn.Server(
        uvicorn.Config(
            mark_peer_listener(app),
            host=gwc.host,
            port=gwc.peer_port,
            log_level=log_level,
            access_log=False,
            timeout_graceful_shutdown=5,
            lifespan="off",  # the client listener's server runs the app's lifespan
            ssl_certfile=str(creds.gateway_cert),
            ssl_keyfile=str(creds.gateway_key),
            ssl_ca_certs=str(creds.ca_file),
            ssl_cert_reqs=ssl.CERT_REQUIRED,
            **uvicorn_options(behind_pool=True),
        )
    )


async def serve_both(server: uvicorn.Server, peer: uvicorn.Server) -> None:
    """The client listener owns signals and lifespan; the peer listener stops with it."""
    peer.config.load()
    peer_task = asyncio.create_task(peer._serve())
    try:
        await server.serve()
    finally:
        peer.should_exit = True
        await peer_task


if __name__ == "__main__":
    sys.exit(main())
