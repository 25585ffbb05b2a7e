"""Identities and TLS contexts every component shares."""
