"""The fleet's root of trust: the CA, the certificates and secrets it issues, and the
NATS server configuration (users and permissions) derived from the enrolled clusters."""
