"""A small private CA for one runwarden cluster: the CA, server certificates, client certificates.

Used by `controllerctl certs init|issue` (controller/ctl/certs.py) and by tests. Keys are ECDSA
P-256, written PKCS#8 without a passphrase with mode 0600 (the deploy note says where they go and
who may read them); certificates are PEM. A certificate's role decides its extensions:

  server  — SERVER_AUTH and CLIENT_AUTH, subjectAltNames from `hosts` (the controller uses one such
            certificate for its API and as the client of the agents and of etcd; agents and etcd use
            one for their listeners).
  admin   — CLIENT_AUTH, O=runwarden:admin: controllerctl may quarantine, release and stop.
  reader  — CLIENT_AUTH, no admin organization: controllerctl may only read.

Nothing here prints or logs key material; errors name files, never their contents.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

ADMIN_ORGANIZATION = "runwarden:admin"  # controller/api/service.py AccessPolicy's default admin organization
ROLES = ("server", "admin", "reader")
CA_STEM = "ca"
_STEM = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class CertError(ValueError):
    """A one-line, secret-free reason a CA or certificate could not be made."""


@dataclass(frozen=True, slots=True, kw_only=True)
class IssuedFiles:
    cert: Path
    key: Path


def _name(cn: str, org: str = "") -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
    if org:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
    return x509.Name(attrs)


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    data = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    # Created 0600 from the start: never world-readable, not even for a moment.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _check_stem(stem: str) -> None:
    if not _STEM.match(stem):
        raise CertError(f"name {stem!r}: use letters, digits, '.', '_' or '-' (at most 64)")


def create_ca(
    directory: Path, *, name: str = "runwarden cluster CA", days: int = 3650, overwrite: bool = False
) -> IssuedFiles:
    """Write ca.pem and ca.key into `directory`; refuses to replace an existing CA unless asked."""
    directory.mkdir(parents=True, exist_ok=True)
    files = IssuedFiles(cert=directory / f"{CA_STEM}.pem", key=directory / f"{CA_STEM}.key")
    if not overwrite and (files.cert.exists() or files.key.exists()):
        raise CertError(f"{files.cert} already exists; pass --force to replace the cluster CA")
    if days < 1:
        raise CertError("days must be at least 1")
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    subject = _name(name)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    _write_key(files.key, key)
    files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return files


def _load_ca(directory: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert_path, key_path = directory / f"{CA_STEM}.pem", directory / f"{CA_STEM}.key"
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except FileNotFoundError as exc:
        raise CertError(
            f"no CA in {directory} ({Path(exc.filename).name} missing); run `certs init` first"
        ) from None
    except (ValueError, TypeError):
        # never echo the file's bytes: it is a private key
        raise CertError(f"{cert_path} / {key_path}: not a PEM CA certificate and unencrypted key") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise CertError(f"{key_path}: expected an ECDSA key")
    return cert, key


def _san(hosts: Sequence[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            if not re.match(r"^[A-Za-z0-9*]([A-Za-z0-9.-]{0,252})$", host):
                raise CertError(f"host {host!r} is neither an IP address nor a DNS name") from None
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def issue(
    ca_dir: Path,
    stem: str,
    *,
    role: str,
    common_name: str = "",
    hosts: Sequence[str] = (),
    days: int = 365,
    out_dir: Path | None = None,
) -> IssuedFiles:
    """Sign a new key for `role` with the CA in `ca_dir`; writes <stem>.pem and <stem>.key."""
    _check_stem(stem)
    if role not in ROLES:
        raise CertError(f"role {role!r}: choose one of {', '.join(ROLES)}")
    if role == "server" and not hosts:
        raise CertError("a server certificate needs at least one --host (DNS name or IP address)")
    if days < 1:
        raise CertError("days must be at least 1")
    ca_cert, ca_key = _load_ca(ca_dir)
    out = out_dir or ca_dir
    out.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH] + (
        [ExtendedKeyUsageOID.SERVER_AUTH] if role == "server" else []
    )
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name or stem, ADMIN_ORGANIZATION if role == "admin" else ""))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    )
    if hosts:
        builder = builder.add_extension(_san(hosts), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    files = IssuedFiles(cert=out / f"{stem}.pem", key=out / f"{stem}.key")
    _write_key(files.key, key)
    files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return files
