"""The cluster's gateway: OpenAI-compatible ingress in front of the cluster's replicas.

It reads everything it acts on (replicas, keys, routes) from the files the agent writes
under the cluster's state_dir, so it serves while the agent, NATS or the control plane
is down. It never imports torch; it talks to replicas and peer gateways over HTTP.
`python -m agent.gateway --config cluster.yaml` runs it.
"""
