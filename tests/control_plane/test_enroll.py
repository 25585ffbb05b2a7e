"""The fleet CA and `fleetctl clusters enroll`: files, modes, reuse, what a bundle holds
(and never holds), and that the certificates chain to the CA with the right identities."""

from __future__ import annotations

import json
import stat
import subprocess
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from agent.security.peer_token import PeerSigner, PeerTokenError, PeerVerifier
from control_plane.security.enroll import Enrolment, NatsListen
from control_plane.security.pki import FleetPki
from fleet_base.nats_io import redact_url
from fleet_base.security.identity import spiffe_id
from tests.fleetctl import fleetctl as run_fleetctl

ROOT = Path(__file__).resolve().parents[2]


def fleetctl(home: Path, *args: str) -> subprocess.CompletedProcess:
    return run_fleetctl(home, *args, timeout=120, check=False)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_enroll_writes_a_private_bundle_and_a_nats_user(tmp_path):
    home = tmp_path / "home"
    enrolment = Enrolment(home)
    enrolment.write_nats_config(NatsListen(port=4999, store_dir=str(tmp_path / "js"), clusters=["east"]))
    out = tmp_path / "bundle"
    result = fleetctl(home, "clusters", "enroll", "eu-1", "--no-register", "--out", str(out), "-o", "json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert set(data["files"]) == {
        "ca.pem", "agent.pem", "agent.key", "gateway.pem", "gateway.key", "replica.pem", "replica.key", "replica-token",
        "webhook-master",
    }  # fmt: skip
    assert "ca.key" not in data["files"] and all("CA" not in f or f == "ca.pem" for f in data["files"])
    for name in data["files"]:
        assert mode(out / name) == 0o600, name
    for path in (home / "pki").rglob("*"):
        assert mode(path) == (0o700 if path.is_dir() else 0o600), path
    assert data["security"]["gateway_cert"] == str(out / "gateway.pem")
    assert data["security"]["webhook_master_file"] == str(out / "webhook-master")
    assert (out / "webhook-master").read_bytes() == (home / "pki" / "webhook-master").read_bytes()
    conf = (home / "pki" / "nats-server.conf").read_text()
    assert (
        "CN=fleet-agent.eu-1" in conf and "fleet.v1.heartbeat.eu-1" in conf and "CN=fleet-agent.east" in conf
    )

    ca = x509.load_pem_x509_certificate((out / "ca.pem").read_bytes())
    for role in ("agent", "gateway", "replica"):
        cert = x509.load_pem_x509_certificate((out / f"{role}.pem").read_bytes())
        cert.verify_directly_issued_by(ca)
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert spiffe_id(role, "eu-1") in sans.get_values_for_type(x509.UniformResourceIdentifier)

    # a second run reuses the CA and the certificates (nothing rotates by accident)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert fleetctl(home, "clusters", "enroll", "eu-1", "--no-register", "--out", str(out)).returncode == 0
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_peer_tokens_name_the_gateway_and_only_from_the_fleet_ca(tmp_path):
    pki = FleetPki(tmp_path / "a")
    east, west = pki.cluster("east"), pki.cluster("west")
    verifier = PeerVerifier(west.ca_file, "west")
    signer = PeerSigner(east.gateway_cert, east.gateway_key)
    token = signer.sign("west", "req-1", key_id="k1", hops=1)
    claim = verifier.verify(token, "req-1")
    assert (claim.cluster, claim.key_id, claim.hops) == ("east", "k1", 1)
    for bad, rid in (
        (token, "req-2"),  # another request's token
        (signer.sign("north", "req-1", key_id="k1", hops=1), "req-1"),  # for another peer
        (signer.sign("west", "req-1", key_id="k1", hops=1, now=0), "req-1"),  # expired
        (token[:-4] + "AAAA", "req-1"),  # tampered signature
    ):
        try:
            verifier.verify(bad, rid)
        except PeerTokenError:
            continue
        raise AssertionError(f"accepted {bad[:20]}... for {rid}")
    other = FleetPki(tmp_path / "b").cluster("east")  # same names, another CA
    try:
        verifier.verify(
            PeerSigner(other.gateway_cert, other.gateway_key).sign("west", "r", key_id="k1", hops=1), "r"
        )
        raise AssertionError("a foreign CA's gateway was accepted")
    except PeerTokenError:
        pass
    try:  # an agent certificate is no gateway
        PeerSigner(east.agent_cert, east.agent_key)
        raise AssertionError("an agent certificate signed a peer token")
    except PeerTokenError:
        pass


def test_peer_tokens_from_every_ca_of_a_rotation_bundle_verify(tmp_path):
    """The documented CA rotation: old and new CA in one trust file. A gateway issued by
    either verifies; a third CA's does not."""
    old, new, other = (FleetPki(tmp_path / n) for n in ("old", "new", "other"))
    bundle = tmp_path / "ca.pem"
    bundle.write_bytes(old.ca_file.read_bytes() + new.ca_file.read_bytes())
    verifier = PeerVerifier(bundle, "west")
    for pki in (old, new):
        east = pki.cluster("east")
        token = PeerSigner(east.gateway_cert, east.gateway_key).sign("west", "r", key_id="k1", hops=1)
        assert verifier.verify(token, "r").cluster == "east"
    foreign = other.cluster("east")
    token = PeerSigner(foreign.gateway_cert, foreign.gateway_key).sign("west", "r", key_id="k1", hops=1)
    try:
        verifier.verify(token, "r")
        raise AssertionError("a CA outside the bundle was trusted")
    except PeerTokenError:
        pass


def test_a_rotation_trust_file_keeps_both_cas_and_issues_from_the_key_it_holds(tmp_path):
    """`pki/ca.pem` holding the old CA first and the new one (whose key `ca.key` is):
    enrolment signs with the new CA, hands out both, and never rewrites the CA."""
    old = FleetPki(tmp_path / "old")
    home = tmp_path / "new"
    new = FleetPki(home)
    new_ca = new.ca_file.read_bytes()
    new.ca_file.write_bytes(old.ca_file.read_bytes() + new_ca)
    rotated = FleetPki(home)
    assert rotated.ca.cert.public_bytes(serialization.Encoding.PEM) == new_ca
    creds = rotated.cluster("east")
    assert creds.ca_file.read_bytes() == old.ca_file.read_bytes() + new_ca
    assert rotated.ca_file.read_bytes() == old.ca_file.read_bytes() + new_ca
    cert = x509.load_pem_x509_certificate(creds.gateway_cert.read_bytes())
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate(new_ca))
    assert (
        PeerVerifier(creds.ca_file, "west")
        .verify(PeerSigner(creds.gateway_cert, creds.gateway_key).sign("west", "r", key_id="k", hops=1), "r")
        .cluster
        == "east"
    )


def test_nats_urls_are_redacted():
    assert redact_url("tls://user:secret@nats.example:4222") == "tls://***@nats.example:4222"
    assert redact_url("nats://tok@a:1,nats://b:2") == "nats://***@a:1,nats://b:2"
    assert redact_url("tls://127.0.0.1:4222") == "tls://127.0.0.1:4222"
