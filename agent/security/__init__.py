"""The fleet's trust material as the agent, gateway and replicas use it: credential file
paths, TLS contexts from the fleet CA, and signed peer tokens between gateways.

Issuing (the CA, certificates, NATS users) is the control plane's job
(`control_plane.security`); this package only loads and verifies.
"""
