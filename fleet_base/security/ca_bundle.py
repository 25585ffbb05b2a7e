"""The fleet's trust file (`ca.pem`) as a bundle: every CA certificate in it is trusted.

A CA rotation puts the old and the new CA in one file (docs/security.md), so whatever
checks a certificate against the fleet CA in Python must try each of them, as OpenSSL
does for TLS (`ssl` loads the whole file). Reading only the first certificate would
silently distrust every identity the second CA issued.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from cryptography import x509


def load_bundle(path: Path) -> tuple[x509.Certificate, ...]:
    """Every certificate in a PEM file, in order; ValueError when it holds none."""
    try:
        certs = x509.load_pem_x509_certificates(Path(path).read_bytes())
    except ValueError as err:
        raise ValueError(f"{path}: no PEM certificate ({err})") from None
    if not certs:
        raise ValueError(f"{path}: no PEM certificate")
    return tuple(certs)


def issuer_in(cert: x509.Certificate, cas: tuple[x509.Certificate, ...]) -> x509.Certificate | None:
    """The CA of `cas` that issued `cert` (name, signature, and the CA valid now), or None."""
    now = dt.datetime.now(dt.timezone.utc)
    for ca in cas:
        if not ca.not_valid_before_utc <= now <= ca.not_valid_after_utc:
            continue
        try:
            cert.verify_directly_issued_by(ca)
        except Exception:  # another issuer name, a bad signature, an unsupported key: not this CA
            continue
        return ca
    return None
