"""Throwaway TLS certificates for tests and local topologies, made with the ``openssl`` CLI.

:func:`make_ca` makes a self-signed CA, :func:`make_leaf` a certificate signed by it;
:func:`make_topology_certs` makes the set a local TLS deployment needs: a CA, one node
certificate every ``redis-server`` and sentinel presents (``serverAuth`` and
``clientAuth``: replicas, sentinels and cluster nodes also use it as their client
certificate towards each other) and a client certificate for applications. Keys are
P-256 (made in milliseconds, unlike RSA), unencrypted, valid for two days.

Never use these for anything but tests and demos: the keys sit unencrypted in a
temporary directory.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Certs", "have_openssl", "make_ca", "make_leaf", "make_topology_certs"]

#: P-256 keys: made in milliseconds, unlike RSA.
_KEY = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1")


@dataclass(frozen=True)
class Certs:
    """A directory of ``NAME.crt`` / ``NAME.key`` pairs."""

    dir: Path

    def crt(self, name: str) -> str:
        return str(self.dir / f"{name}.crt")

    def key(self, name: str) -> str:
        return str(self.dir / f"{name}.key")


def have_openssl() -> bool:
    """True if the ``openssl`` CLI is on PATH."""
    return shutil.which("openssl") is not None


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def make_ca(d: Path, name: str) -> None:
    """A self-signed CA: ``d/NAME.crt`` and ``d/NAME.key``."""
    _openssl("req", "-x509", *_KEY, "-nodes", "-days", "2", "-subj", f"/CN=felix-redis test {name}",
             "-keyout", str(d / f"{name}.key"), "-out", str(d / f"{name}.crt"),
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             "-addext", "subjectKeyIdentifier=hash")


def make_leaf(d: Path, name: str, ca: str, *, usage: str, san: str | None) -> None:
    """``d/NAME.crt`` signed by the CA ``d/CA.crt``; ``usage`` is the extendedKeyUsage
    (``serverAuth``, ``clientAuth`` or both, comma separated), ``san`` the
    subjectAltName (``IP:127.0.0.1,DNS:localhost``) or None."""
    _openssl("req", *_KEY, "-nodes", "-subj", f"/CN={name}",
             "-keyout", str(d / f"{name}.key"), "-out", str(d / f"{name}.csr"))
    lines = ["basicConstraints=critical,CA:FALSE", "keyUsage=critical,digitalSignature",
             f"extendedKeyUsage={usage}", "subjectKeyIdentifier=hash", "authorityKeyIdentifier=keyid"]
    if san:
        lines.append(f"subjectAltName={san}")
    (d / f"{name}.ext").write_text("\n".join(lines) + "\n")
    _openssl("x509", "-req", "-in", str(d / f"{name}.csr"), "-CA", str(d / f"{ca}.crt"), "-CAkey",
             str(d / f"{ca}.key"), "-CAcreateserial", "-days", "2", "-out", str(d / f"{name}.crt"),
             "-extfile", str(d / f"{name}.ext"))


def make_topology_certs(d: Path) -> Certs:
    """``ca``, ``node`` (every server and sentinel, for 127.0.0.1 and localhost) and
    ``client`` in ``d``; files already there are kept, so a directory can be reused."""
    d.mkdir(parents=True, exist_ok=True)
    if not (d / "ca.crt").exists() or not (d / "ca.key").exists():
        make_ca(d, "ca")
    if not (d / "node.crt").exists() or not (d / "node.key").exists():
        make_leaf(d, "node", "ca", usage="serverAuth,clientAuth", san="IP:127.0.0.1,DNS:localhost")
    if not (d / "client.crt").exists() or not (d / "client.key").exists():
        make_leaf(d, "client", "ca", usage="clientAuth", san=None)
    return Certs(d)
