"""The admin HTTP API (FastAPI): deployments, versions, clusters, pools, keys, events, audit."""
