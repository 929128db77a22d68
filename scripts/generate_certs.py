#!/usr/bin/env python3
"""Generate the files a secure Flower deployment (TLS + SuperNode authentication) needs, with the
`cryptography` package (a Flower dependency): no openssl, no ssh-keygen, no downloads.

    python scripts/generate_certs.py certs --san coordinator.example --nodes 2

writes into `certs/`:

- `ca.crt`: self-signed CA certificate (ECDSA P-256). SuperLink, SuperNodes, `flwr` users.
- `ca.key`: the CA's private key, signs server certificates. SECRET: keep it offline.
- `server.pem`: the SuperLink's TLS certificate, signed by the CA; SAN = localhost, 127.0.0.1,
  ::1 and every `--san`. SuperLink.
- `server.key`: the SuperLink's TLS private key. SECRET: SuperLink only.
- `nodes/node-<i>`: SuperNode i's authentication key (ECDSA P-384, OpenSSH private-key format:
  `flower-supernode --auth-supernode-private-key`). SECRET: that SuperNode only.
- `nodes/node-<i>.pub`: its public key (OpenSSH format: `flwr supernode register`). Operator.

Private keys are written with mode 0600. See docs/deployment.md, "Secure deployment".

The SuperLink's own SuperExec connects to it on 127.0.0.1 (also with `--host 0.0.0.0`), so the
server certificate always carries 127.0.0.1/localhost; add the name or address the SuperNodes and
the `flwr` CLI use with `--san`. A node key is best generated on the node's machine
(`--node-keys-only --node NAME`): only its `.pub` file has to travel to the operator.

Existing files are never overwritten (exit status 1) unless `--force`.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

#: Always in the server certificate: the SuperLink's SuperExec and local tools use these.
DEFAULT_SANS = ("localhost", "127.0.0.1", "::1")


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _write(path: Path, data: bytes, *, secret: bool, force: bool) -> Path:
    """Write `data` to `path` (mode 0600 for secrets, 0644 otherwise); refuse to overwrite."""
    if path.exists() and not force:
        raise FileExistsError(f"{path} exists (use --force to overwrite)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if secret else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, 0o600 if secret else 0o644)  # umask-independent
    os.replace(tmp, path)
    return path


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _san_entries(names: Iterable[str]) -> list[x509.GeneralName]:
    entries: list[x509.GeneralName] = []
    seen: set[str] = set()
    for name in names:
        name = name.strip()
        if not name or name in seen:
            continue
        seen.add(name)
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return entries


def _key_usage(cert_sign: bool) -> x509.KeyUsage:
    """Digital signature (ECDHE handshakes), plus certificate and CRL signing for a CA."""
    return x509.KeyUsage(
        digital_signature=True, content_commitment=False, key_encipherment=False,
        data_encipherment=False, key_agreement=False, key_cert_sign=cert_sign, crl_sign=cert_sign,
        encipher_only=False, decipher_only=False,
    )


def _builder(subject: x509.Name, issuer: x509.Name, key: ec.EllipticCurvePrivateKey, days: int,
             ca: bool) -> x509.CertificateBuilder:
    """What both certificates share: subject, issuer, public key, a random serial, validity from
    one hour ago (clock skew) for `days` days, basic constraints and key usage."""
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now() - datetime.timedelta(hours=1))
        .not_valid_after(_now() + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), critical=True)
        .add_extension(_key_usage(cert_sign=ca), critical=True)
    )


def make_ca(
    common_name: str = "lordo-fed CA", days: int = 365
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A self-signed CA (ECDSA P-256, SHA-256), valid from one hour ago for `days` days."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        _builder(name, name, key, days, ca=True)
        .add_extension(ski, critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def make_server_cert(
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    sans: Sequence[str] = (),
    days: int = 365,
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A TLS server certificate (ECDSA P-256) signed by the CA, for DEFAULT_SANS + `sans`
    (IP addresses become IP SANs, anything else DNS SANs); CN = the first extra name."""
    key = ec.generate_private_key(ec.SECP256R1())
    names = [*sans, *DEFAULT_SANS]
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    cert = (
        _builder(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]), ca_cert.subject, key, days, ca=False)
        .add_extension(x509.SubjectAlternativeName(_san_entries(names)), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


def make_node_key() -> tuple[bytes, bytes]:
    """A SuperNode authentication key pair as Flower 1.41 and 1.42 read it: (private key in OpenSSH
    format, public key in OpenSSH format 'ecdsa-sha2-nistp384 AAAA...'), ECDSA P-384 (what
    Flower generates itself; any NIST curve is accepted)."""
    key = ec.generate_private_key(ec.SECP384R1())
    private = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    )
    public = key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    return private, public + b"\n"


def write_tls(
    out_dir: str | os.PathLike, sans: Sequence[str] = (), days: int = 365, force: bool = False
) -> dict[str, Path]:
    """Write ca.crt, ca.key, server.pem, server.key into `out_dir`; returns their paths."""
    out = Path(out_dir)
    targets = {name: out / name for name in ("ca.crt", "ca.key", "server.pem", "server.key")}
    if not force:
        for path in targets.values():
            if path.exists():
                raise FileExistsError(f"{path} exists (use --force to overwrite)")
    ca_key, ca_cert = make_ca(days=days)
    server_key, server_cert = make_server_cert(ca_key, ca_cert, sans, days=days)
    _write(targets["ca.key"], _pem_key(ca_key), secret=True, force=force)
    _write(targets["ca.crt"], ca_cert.public_bytes(serialization.Encoding.PEM), secret=False, force=force)
    _write(targets["server.key"], _pem_key(server_key), secret=True, force=force)
    server_pem = server_cert.public_bytes(serialization.Encoding.PEM)
    _write(targets["server.pem"], server_pem, secret=False, force=force)
    return targets


def write_node_key(path: str | os.PathLike, force: bool = False) -> tuple[Path, Path]:
    """Write a node key pair: `path` (private, 0600) and `path`.pub; returns both paths."""
    private_path = Path(path)
    public_path = private_path.with_name(private_path.name + ".pub")
    if not force:
        for p in (private_path, public_path):
            if p.exists():
                raise FileExistsError(f"{p} exists (use --force to overwrite)")
    private, public = make_node_key()
    _write(private_path, private, secret=True, force=force)
    _write(public_path, public, secret=False, force=force)
    return private_path, public_path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="CA, SuperLink TLS certificate and SuperNode authentication keys for Flower.",
        epilog="Files: DIR/ca.crt ca.key server.pem server.key, DIR/nodes/<name> and <name>.pub.",
    )
    parser.add_argument("out_dir", type=Path, help="output directory (created)")
    parser.add_argument("--san", action="append", default=[], metavar="NAME",
                        help="host name or IP address the SuperLink is reached at (repeatable); "
                             f"{', '.join(DEFAULT_SANS)} are always included")
    parser.add_argument("--nodes", type=int, default=0, metavar="N",
                        help="also write node keys nodes/node-0 .. node-(N-1)")
    parser.add_argument("--node", action="append", default=[], metavar="NAME",
                        help="also write the node key nodes/NAME (repeatable)")
    parser.add_argument("--node-keys-only", action="store_true",
                        help="write only node keys (on a SuperNode's machine), no CA/server files")
    parser.add_argument("--days", type=int, default=365, help="certificate validity (default 365)")
    parser.add_argument("--force", action="store_true", help="overwrite existing files")
    args = parser.parse_args(argv)
    if args.nodes < 0 or args.days < 1:
        parser.error("--nodes must be >= 0 and --days >= 1")
    names = [f"node-{i}" for i in range(args.nodes)] + list(args.node)
    for name in names:
        if not name or "/" in name or name.startswith("."):
            parser.error(f"bad node name: {name!r}")
    if args.node_keys_only and not names:
        parser.error("--node-keys-only needs --nodes N or --node NAME")
    try:
        if not args.node_keys_only:
            for name, path in write_tls(args.out_dir, args.san, args.days, args.force).items():
                print(f"{path}{'  (secret)' if name.endswith('.key') else ''}")
        for name in names:
            private, public = write_node_key(args.out_dir / "nodes" / name, args.force)
            print(f"{private}  (secret)\n{public}")
    except FileExistsError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
