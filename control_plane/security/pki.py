"""The fleet CA and the certificates it issues, with the `cryptography` package.

Layout under `<FLEET_HOME>/pki` (every key and secret 0600, the directory 0700):
- `ca.pem`, `ca.key`: the fleet CA (ECDSA P-256, 10 years). Only `fleetctl` on the
  operator's machine needs `ca.key`; it never goes into a cluster bundle.
- `nats-server.pem/.key`: nats-server's TLS certificate.
- `control-plane.pem/.key`: the control plane's NATS identity.
- `clusters/<cluster>/`: one cluster's bundle (`agent`, `gateway`, `replica` certificates
  and keys, `replica-token`, a copy of `ca.pem`), what `fleetctl clusters enroll` hands out.
- `webhook-master`: the fleet's webhook master secret (`fleet_base.batch.webhook_signing`),
  copied into every cluster's bundle: every gateway signs a key's webhooks alike.

Everything is created once and reused on later runs; a certificate close to expiry (or
missing) is issued again. Rotation is described in docs/security.md.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import secrets
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fleet_base.batch.webhook_signing import MASTER_FILE, encode_master, new_master
from fleet_base.security.ca_bundle import load_bundle
from fleet_base.security.identity import Role, common_name, spiffe_id
from fleet_base.security.tls import Credentials

CA_DAYS = 3650
LEAF_DAYS = 365
RENEW_BEFORE = dt.timedelta(days=30)
LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")


def write_private(path: Path, data: bytes) -> None:
    """Atomic write with mode 0600 (keys, tokens, bundles)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def ensure_webhook_master(path: Path) -> Path:
    """The fleet's webhook master secret at `path`, created once (0600): processes starting
    together agree on the first one written (a hard link never replaces a file)."""
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(encode_master(new_master()))
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    return path


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _load_pair(cert_path: Path, key_path: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None:
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except (FileNotFoundError, ValueError):
        return None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        return None
    return cert, key


def _fresh(cert: x509.Certificate) -> bool:
    return cert.not_valid_after_utc - _now() > RENEW_BEFORE


def _sans(hosts: list[str], uri: str | None) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    if uri:
        names.append(x509.UniformResourceIdentifier(uri))
    return x509.SubjectAlternativeName(names)


class FleetCA:
    """Loads or creates the CA under `dir` and issues leaf certificates from it."""

    def __init__(self, dir: Path) -> None:
        self.dir = Path(dir)
        self.cert_path = self.dir / "ca.pem"
        self.key_path = self.dir / "ca.key"
        pair = self._load()
        if pair is None or not _fresh(pair[0]):
            pair = self._create()
        self.cert, self.key = pair

    def _load(self) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None:
        """The CA certificate that `ca.key` signs for. `ca.pem` is the trust file and may
        hold other CAs too (the old one during a rotation); they stay in it, trusted."""
        try:
            certs = load_bundle(self.cert_path)
            key = serialization.load_pem_private_key(self.key_path.read_bytes(), password=None)
        except (FileNotFoundError, ValueError):
            return None
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            return None
        mine = key.public_key().public_numbers()
        for cert in certs:
            public = cert.public_key()
            if isinstance(public, ec.EllipticCurvePublicKey) and public.public_numbers() == mine:
                return cert, key
        raise ValueError(
            f"{self.cert_path} holds no certificate for the key in {self.key_path}; "
            "put the CA that key belongs to into the trust file (docs/security.md, rotating the CA)"
        )

    def _create(self) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name(
            [
                x509.NameAttribute(NameOID.COMMON_NAME, "fleet-ca"),
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fleet"),
            ]
        )
        now = _now()
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256())
        )
        write_private(self.key_path, _key_pem(key))
        write_private(self.cert_path, cert.public_bytes(serialization.Encoding.PEM))
        return cert, key

    def issue(
        self,
        cert_path: Path,
        key_path: Path,
        role: Role,
        cluster: str | None = None,
        hosts: list[str] | None = None,
        days: int = LEAF_DAYS,
    ) -> x509.Certificate:
        """A leaf for `role` (client and server auth), kept when it exists, is ours and is fresh."""
        pair = _load_pair(cert_path, key_path)
        if pair is not None and _fresh(pair[0]) and pair[0].issuer == self.cert.subject:
            try:
                pair[0].verify_directly_issued_by(self.cert)
                return pair[0]
            except (ValueError, TypeError, Exception):
                pass
        key = ec.generate_private_key(ec.SECP256R1())
        now = _now()
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name(role, cluster))])
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .add_extension(_sans(list(hosts or LOCAL_NAMES), spiffe_id(role, cluster)), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.cert.public_key()), critical=False
            )
            .sign(self.key, hashes.SHA256())
        )
        write_private(key_path, _key_pem(key))
        write_private(cert_path, cert.public_bytes(serialization.Encoding.PEM))
        return cert


class FleetPki:
    """Everything `fleetctl up` and `fleetctl clusters enroll` need, under `<home>/pki`."""

    def __init__(self, home: Path) -> None:
        self.dir = Path(home).expanduser() / "pki"
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)
        self.ca = FleetCA(self.dir)

    @property
    def ca_file(self) -> Path:
        return self.ca.cert_path

    def nats_server(self, hosts: list[str] | None = None) -> tuple[Path, Path]:
        cert, key = self.dir / "nats-server.pem", self.dir / "nats-server.key"
        self.ca.issue(cert, key, "nats", None, hosts)
        return cert, key

    def control_plane(self) -> tuple[Path, Path]:
        cert, key = self.dir / "control-plane.pem", self.dir / "control-plane.key"
        self.ca.issue(cert, key, "control-plane")
        return cert, key

    def webhook_master(self) -> Path:
        return ensure_webhook_master(self.dir / MASTER_FILE)

    def cluster_dir(self, cluster: str) -> Path:
        return self.dir / "clusters" / cluster

    def cluster(self, cluster: str, hosts: list[str] | None = None) -> Credentials:
        """The cluster's bundle, created on first use; `hosts` name its gateway and replicas."""
        d = self.cluster_dir(cluster)
        d.mkdir(parents=True, exist_ok=True)
        os.chmod(d.parent, 0o700)
        os.chmod(d, 0o700)
        ca_copy = d / "ca.pem"
        if not ca_copy.exists() or ca_copy.read_bytes() != self.ca_file.read_bytes():
            write_private(ca_copy, self.ca_file.read_bytes())
        for role in ("agent", "gateway", "replica"):
            self.ca.issue(d / f"{role}.pem", d / f"{role}.key", role, cluster, hosts)  # type: ignore[arg-type]
        token = d / "replica-token"
        if not token.exists():
            write_private(token, (secrets.token_urlsafe(32) + "\n").encode())
        master, master_copy = self.webhook_master().read_bytes(), d / MASTER_FILE
        if not master_copy.exists() or master_copy.read_bytes() != master:
            write_private(master_copy, master)
        return Credentials(
            ca_file=ca_copy,
            agent_cert=d / "agent.pem",
            agent_key=d / "agent.key",
            gateway_cert=d / "gateway.pem",
            gateway_key=d / "gateway.key",
            replica_cert=d / "replica.pem",
            replica_key=d / "replica.key",
            replica_token_file=token,
            webhook_master_file=master_copy,
        )
