"""TLS for the HTTP API: which certificate a node serves, and whom its clients trust, as ``ssl`` contexts.

Three modes, from the config (``tls``, ``tls_cert``, ``tls_key``, ``tls_ca``):

- ``off``: plain HTTP.
- ``auto``: the node issues its own certificate from the cluster CA
  (``tlsca.py``: derived from the secret, so clients trust one file that
  ``ringctl tls-ca`` prints).
- ``cert``: the user's certificate and key (mkcert's, a company CA's); their
  clients trust ``tls_ca`` if it is set, else the system's store. (``tls_ca``
  is trusted in any mode when set.)

A client context of any mode also trusts the cluster CA: every node holds the
secret, so a follower checks a leader in ``auto`` mode whatever its own mode.
What this ignores: how a listener tells TLS from plain HTTP (``http/tlslisten.py``),
client certificates (API keys and signed control requests do that job).
"""

from __future__ import annotations

import datetime
import logging
import os
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ringd.security import tlsca

MODES = ("off", "auto", "cert")

log = logging.getLogger(__name__)


def trust_hint(cluster: str) -> str:
    """What a client of a node with tls: auto is told to run to trust it."""
    return f"ringctl --secret-file SECRET_FILE --cluster {cluster} tls-ca > ringd-ca.pem"


class TlsError(ValueError):
    """A certificate, key or CA file that cannot be used; the message names the key and the file."""


@dataclass(frozen=True)
class TlsSettings:
    mode: str  # one of MODES
    cluster: str
    secret: bytes
    cert_file: str | None = None
    key_file: str | None = None
    ca_file: str | None = None

    @property
    def on(self) -> bool:
        return self.mode != "off"

    @property
    def scheme(self) -> str:
        return "https" if self.on else "http"


def cluster_ca_pem(secret: bytes, cluster: str) -> bytes:
    return tlsca.derive_ca(secret, cluster).pem


def server_context(s: TlsSettings, node: str, host: str, addresses: list[str]) -> ssl.SSLContext:
    """What a TLS node serves: a certificate issued now for ``node`` at ``host`` and ``addresses``
    (auto), or the user's (cert)."""
    if not s.on:
        raise ValueError("server_context: TLS is off")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if s.mode == "cert":
        _load_chain(ctx, s.cert_file, s.key_file)
        return ctx
    now = datetime.datetime.now(datetime.timezone.utc)
    names, left_out = tlsca.san_names(node, host, addresses)
    # A bare name (a Mac's "mini1") is left out on most Macs at every start, its .local name kept:
    # said once, quietly; a public name or address a client may well use, loudly.
    bare = [n for n in left_out if "." not in n and ":" not in n]
    for level, which in ((logging.INFO, bare), (logging.WARNING, [n for n in left_out if n not in bare])):
        if which:
            log.log(
                level, "tls: auto: this node's certificate leaves out %s: the cluster CA vouches for LAN names and "
                "private addresses only (tlsca.PERMITTED_DOMAINS, PERMITTED_NETWORKS); reach it by its .local name or "
                "a private address, or serve your own certificate (tls_cert, tls_key)", ", ".join(which),
            )  # fmt: skip
    if now > tlsca.CA_NOT_AFTER - tlsca.CA_RENEW_BEFORE:
        log.warning(
            "tls: auto: the cluster CA expires on %s: change the cluster secret on every node, then export the new CA (%s)",
            tlsca.CA_NOT_AFTER.date(), trust_hint(s.cluster),
        )  # fmt: skip
    leaf = tlsca.issue(tlsca.derive_ca(s.secret, s.cluster), node, names, now)
    # ssl loads a certificate chain from files only: a directory of the owner's alone, gone
    # once loaded (the key never outlives this call on disk).
    with tempfile.TemporaryDirectory(prefix="ringd-tls-") as d:
        cert, key = Path(d) / "cert.pem", Path(d) / "key.pem"
        cert.write_bytes(leaf.cert_pem)
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(leaf.key_pem)
        ctx.load_cert_chain(cert, key)
    return ctx


def client_context(s: TlsSettings) -> ssl.SSLContext:
    """What a node (a follower forwarding to its leader, a fetcher reading a peer's files) trusts:
    the cluster CA always, ``tls_ca`` when set, and in cert mode without ``tls_ca`` the system's store."""
    # The system's store only where the user's certificate may come from a public CA.
    ctx = ssl.create_default_context() if s.mode == "cert" and s.ca_file is None else trusting(b"")
    ctx.load_verify_locations(cadata=cluster_ca_pem(s.secret, s.cluster).decode())
    if s.ca_file is not None:  # any mode: a plain node may forward to a leader with its own certificate
        _load_ca(ctx, s.ca_file, "tls_ca")
    return ctx


def trusting(ca_pem: bytes) -> ssl.SSLContext:
    """A client context that trusts ``ca_pem`` only (ringctl with the cluster CA or --ca)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # checks the host name and the chain
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if not ca_pem:
        return ctx
    try:
        ctx.load_verify_locations(cadata=ca_pem.decode("ascii", "replace"))
    except ssl.SSLError as e:
        raise TlsError(f"not a PEM certificate ({e.reason or e})") from None
    return ctx


def _load_chain(ctx: ssl.SSLContext, cert_file: str | None, key_file: str | None) -> None:
    cert, key = Path(cert_file).expanduser(), Path(key_file).expanduser()
    for name, path in (("tls_cert", cert), ("tls_key", key)):
        try:
            path.read_bytes()
        except OSError as e:
            raise TlsError(f"{name}: cannot read {path}: {e.strerror}") from None
    try:
        ctx.load_cert_chain(cert, key)
    except ssl.SSLError as e:
        if "KEY_VALUES_MISMATCH" in str(e):
            raise TlsError(f"tls_cert and tls_key do not match: {key} is not the key of the certificate in {cert}") from None
        raise TlsError(
            f"tls_cert / tls_key: cannot use {cert} with {key} ({e.reason or e}); both must be PEM, "
            "the certificate first in its file, the key unencrypted"
        ) from None


def _load_ca(ctx: ssl.SSLContext, ca_file: str, key: str) -> None:
    path = Path(ca_file).expanduser()
    try:
        ctx.load_verify_locations(cafile=path)
    except ssl.SSLError as e:  # an OSError too: first
        raise TlsError(f"{key}: {path} holds no PEM certificate ({e.reason or e})") from None
    except OSError as e:
        raise TlsError(f"{key}: cannot read {path}: {e.strerror}") from None
