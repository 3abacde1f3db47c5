"""The cluster's certificate authority, derived from the cluster secret; node certificates it issues.

``tls: auto`` must give every node a certificate that clients can check
without anyone running a CA. Every node and ``ringctl`` already hold the
cluster secret, so the CA's private key is derived from it (HKDF-SHA256 over
the secret, with the cluster's name), and its certificate has a fixed subject,
serial and validity and a deterministic (RFC 6979) ECDSA signature: whoever
holds the secret derives the same CA, byte for byte, so any node can issue
its own certificate and a client trusts one exported file
(``ringctl tls-ca``). Whoever holds the secret can also impersonate any node:
the CA is exactly as strong as the secret, which already lets its holder join
the ring.

A user may put that file in a system's trust store, so the CA vouches for a LAN's
names only: its (critical) name constraints permit the names of special-use and
private-use domains (``.local``, ``localhost``, ``.home.arpa``, ``.internal``, and the
``.lan``, ``.home``, ``.localdomain`` that routers hand out) and private, loopback,
link-local and shared (CGNAT, Tailscale's) addresses. Whoever holds the secret cannot
mint a certificate a client would take for a public site. A node's certificate leaves
out its names outside them (a bare ``mini1``, a public address), and the node says so.

Sans-I/O: bytes in, PEM bytes out; what loads them into ``ssl`` contexts is
``tls.py``. What this ignores: revocation (change the secret, and every
certificate and the CA change with it), client certificates.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from wire import labels

# P-256's group order: the derived scalar is reduced into [1, n-1].
_P256_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551
# 16 bytes past the order's 32 make the reduction's bias negligible (FIPS 186-5 A.2.1).
_KDF_BYTES = 48
# The CA certificate's fixed validity: the same on every node and in every
# ringctl, so the exported file never changes while the secret does not.
# Ten years, as mkcert's CA: no cluster is cut off by surprise (a node warns in the CA's last
# year: CA_RENEW_BEFORE), and a file trusted somewhere and forgotten does not vouch forever.
# Before then, changing the secret replaces it.
CA_NOT_BEFORE = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
CA_NOT_AFTER = datetime.datetime(2036, 1, 1, tzinfo=datetime.timezone.utc)
CA_RENEW_BEFORE = datetime.timedelta(days=365)
# A node's certificate is issued at every start; it stays valid for 397 days,
# under the 398 that Apple's and browsers' TLS stacks accept for a server
# certificate. Backdated an hour so a peer whose clock is a little behind accepts it.
LEAF_VALIDITY = datetime.timedelta(days=397)
LEAF_BACKDATE = datetime.timedelta(hours=1)
# The DNS names the CA may vouch for (each with every name under it): RFC 6762's, 6761's and
# 8375's special-use domains, ICANN's private-use .internal, and names home routers give out
# that ICANN will not delegate.
PERMITTED_DOMAINS = ("local", "localhost", "home.arpa", "internal", "lan", "home", "localdomain")
# The addresses it may vouch for: private (RFC 1918, IPv6 unique local), loopback, link-local,
# and shared address space (RFC 6598: carrier NAT, and Tailscale's addresses).
PERMITTED_NETWORKS = tuple(
    ipaddress.ip_network(n)
    for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "169.254.0.0/16", "127.0.0.0/8", "::1/128", "fc00::/7", "fe80::/10")
)  # fmt: skip


def ca_subject(cluster: str) -> str:
    return f"ringd cluster CA {cluster}"


@dataclass(frozen=True)
class ClusterCA:
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    @property
    def pem(self) -> bytes:
        """The CA certificate, PEM: the one file clients trust."""
        return self.cert.public_bytes(serialization.Encoding.PEM)


def derive_ca(secret: bytes, cluster: str) -> ClusterCA:
    """The CA of ``cluster`` with cluster secret ``secret``: the same for everyone who holds both."""
    okm = HKDF(algorithm=hashes.SHA256(), length=_KDF_BYTES, salt=labels.CLUSTER_CA_KEY, info=cluster.encode()).derive(secret)
    key = ec.derive_private_key(int.from_bytes(okm, "big") % (_P256_ORDER - 1) + 1, ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "ringd"), x509.NameAttribute(NameOID.COMMON_NAME, ca_subject(cluster))])
    public = key.public_key()
    ski = x509.SubjectKeyIdentifier.from_public_key(public)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(public)
        # From the key, so two secrets' CAs never share issuer and serial (clients
        # that cache certificates by the pair would confuse them).
        .serial_number(int.from_bytes(ski.digest[:16], "big") >> 1 | 1)
        .not_valid_before(CA_NOT_BEFORE)
        .not_valid_after(CA_NOT_AFTER)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(signs_certificates=True), critical=True)
        .add_extension(
            x509.NameConstraints(
                permitted_subtrees=[*(x509.DNSName(d) for d in PERMITTED_DOMAINS), *(x509.IPAddress(n) for n in PERMITTED_NETWORKS)],
                excluded_subtrees=None,
            ),
            critical=True,
        )
        .add_extension(ski, critical=False)
        # RFC 6979: the signature, and so the certificate's bytes, depend on the key and the content only.
        .sign(key, hashes.SHA256(), ecdsa_deterministic=True)
    )
    return ClusterCA(key, cert)


def _key_usage(signs_certificates: bool) -> x509.KeyUsage:
    """A CA's key signs certificates (and CRLs) only; a node's key signs its TLS handshakes only."""
    return x509.KeyUsage(
        digital_signature=not signs_certificates, content_commitment=False, key_encipherment=False, data_encipherment=False,
        key_agreement=False, key_cert_sign=signs_certificates, crl_sign=signs_certificates, encipher_only=False, decipher_only=False,
    )  # fmt: skip


def _san(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name.strip("[]").split("%")[0]))
    except ValueError:
        return x509.DNSName(name.lower().rstrip("."))


def permitted(name: str) -> bool:
    """Whether the CA's name constraints let it vouch for ``name`` (a host name or an address)."""
    general = _san(name)
    if isinstance(general, x509.IPAddress):
        return any(general.value in n for n in PERMITTED_NETWORKS)
    return any(general.value == d or general.value.endswith("." + d) for d in PERMITTED_DOMAINS)


def san_names(node: str, host: str, addresses: list[str]) -> tuple[list[str], list[str]]:
    """What a node's certificate is valid for: its name, the host's name and its ``.local`` (Bonjour)
    name, its addresses, and loopback, without repeats, in that order; and, apart, those of them
    the CA may not vouch for (``permitted``), which the certificate leaves out."""
    names = [node, host, host.split(".")[0] + ".local", *addresses, "localhost", "127.0.0.1", "::1"]
    seen: dict[str, None] = {}
    for n in names:
        if n and n not in ("0.0.0.0", "::"):
            seen.setdefault(n.lower(), None)
    return [n for n in seen if permitted(n)], [n for n in seen if not permitted(n)]


@dataclass(frozen=True)
class Leaf:
    key_pem: bytes
    cert_pem: bytes


def issue(ca: ClusterCA, node: str, names: list[str], now: datetime.datetime) -> Leaf:
    """A server certificate for ``node``, valid for ``names`` (host names and IP addresses), signed by ``ca``."""
    if not names:
        raise ValueError("a node's certificate needs at least one name or address")
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "ringd"), x509.NameAttribute(NameOID.COMMON_NAME, node)]))
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - LEAF_BACKDATE)
        .not_valid_after(min(now + LEAF_VALIDITY, CA_NOT_AFTER))
        .add_extension(x509.SubjectAlternativeName([_san(n) for n in names]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(signs_certificates=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()), critical=False)
        .sign(ca.key, hashes.SHA256())
    )
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return Leaf(key_pem, cert.public_bytes(serialization.Encoding.PEM))
