"""The cluster CA (tlsca.py) and the contexts made from it (tls.py): pure, no sockets but loopback."""

from __future__ import annotations

import asyncio
import logging
import datetime
import ipaddress
import ssl
import tempfile
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.verification import PolicyBuilder, Store, VerificationError
from hypothesis import given, settings, strategies as st

from ringd.security import tls
from ringd.security import tlsca

NOW = datetime.datetime(2026, 6, 1, tzinfo=datetime.timezone.utc)
secrets = st.binary(min_size=16, max_size=64)
clusters = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,20}", fullmatch=True)


def _verify(ca: tlsca.ClusterCA, leaf_pem: bytes, name: str) -> None:
    leaf = x509.load_pem_x509_certificate(leaf_pem)
    try:
        subject = x509.verification.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        subject = x509.verification.DNSName(name)
    PolicyBuilder().store(Store([ca.cert])).time(NOW).build_server_verifier(subject).verify(leaf, [])


@settings(max_examples=15, deadline=None)
@given(secrets, clusters)
def test_same_secret_and_cluster_derive_the_same_ca_byte_for_byte(secret, cluster):
    a, b = tlsca.derive_ca(secret, cluster), tlsca.derive_ca(secret, cluster)
    assert a.pem == b.pem
    cn = a.cert.subject.get_attributes_for_oid(x509.oid.NameOID.COMMON_NAME)[0].value
    assert cn == f"ringd cluster CA {cluster}"


@settings(max_examples=10, deadline=None)
@given(secrets, secrets, clusters)
def test_a_leaf_of_another_secrets_ca_does_not_verify(s1, s2, cluster):
    if s1 == s2:
        return
    mine, theirs = tlsca.derive_ca(s1, cluster), tlsca.derive_ca(s2, cluster)
    assert mine.pem != theirs.pem
    leaf = tlsca.issue(theirs, "n1", ["n1", "127.0.0.1"], NOW)
    with pytest.raises(VerificationError):
        _verify(mine, leaf.cert_pem, "127.0.0.1")


def test_another_cluster_name_gives_another_ca():
    assert tlsca.derive_ca(b"s" * 32, "a").pem != tlsca.derive_ca(b"s" * 32, "b").pem


def test_a_leaf_verifies_under_the_ca_for_each_of_its_names():
    ca = tlsca.derive_ca(b"x" * 32, "ringd")
    names, left_out = tlsca.san_names("mini1", "mini1.lan", ["192.168.1.20", "fe80::1", "0.0.0.0", "203.0.113.7"])
    assert names == ["mini1.lan", "mini1.local", "192.168.1.20", "fe80::1", "localhost", "127.0.0.1", "::1"]
    assert left_out == ["mini1", "203.0.113.7"]  # a bare name, a public address: outside the CA's constraints
    leaf = tlsca.issue(ca, "mini1", names, NOW)
    for name in names:
        _verify(ca, leaf.cert_pem, name)
    with pytest.raises(VerificationError):
        _verify(ca, leaf.cert_pem, "other.local")
    cert = x509.load_pem_x509_certificate(leaf.cert_pem)
    assert cert.not_valid_after_utc - cert.not_valid_before_utc <= datetime.timedelta(days=398)


def test_whoever_holds_the_secret_cannot_mint_a_certificate_a_client_takes_for_a_public_site():
    """The CA a user may add to a system's trust store vouches for LAN names and private addresses
    only (critical name constraints): a certificate its key signs for a public name or address
    (as anyone with the secret could sign) fails, in cryptography's verifier and in OpenSSL's."""
    ca = tlsca.derive_ca(b"x" * 32, "ringd")
    (constraints,) = [e for e in ca.cert.extensions if isinstance(e.value, x509.NameConstraints)]
    assert constraints.critical
    for name in ("www.example.com", "8.8.8.8", "2001:db8::1", "evil.local.example.com", "localhost.com"):
        forged = tlsca.issue(ca, "x", [name], NOW)
        with pytest.raises(VerificationError):
            _verify(ca, forged.cert_pem, name)
    for name in ("mini1.local", "nas.home.arpa", "10.1.2.3", "100.101.102.103", "fd00::5"):
        _verify(ca, tlsca.issue(ca, "x", [name], NOW).cert_pem, name)
    # OpenSSL, as Python's ssl and aiohttp check a server: the forged certificate is refused.
    forged = tlsca.issue(ca, "x", ["www.example.com"], NOW)
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "c.pem").write_bytes(forged.cert_pem)
        (Path(d) / "k.pem").write_bytes(forged.key_pem)
        server.load_cert_chain(Path(d) / "c.pem", Path(d) / "k.pem")
    with pytest.raises(ssl.SSLCertVerificationError, match="constraint|permitted"):
        asyncio.run(_handshake(server, tls.trusting(ca.pem), "www.example.com"))
    # The CA lives ten years (a node warns in its last).
    assert ca.cert.not_valid_after_utc - ca.cert.not_valid_before_utc <= datetime.timedelta(days=3653)


async def _handshake(server: ssl.SSLContext, client: ssl.SSLContext, host: str) -> None:
    srv = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0, ssl=server)
    port = srv.sockets[0].getsockname()[1]
    try:
        _, w = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port, ssl=client, server_hostname=host), 10)
        w.close()
    finally:
        srv.close()


def test_contexts_shake_hands_only_with_the_same_secret():
    s = tls.TlsSettings("auto", "ringd", b"k" * 32)
    server = tls.server_context(s, "n1", "box", ["10.0.0.5"])
    asyncio.run(_handshake(server, tls.client_context(s), "127.0.0.1"))
    asyncio.run(_handshake(server, tls.trusting(tls.cluster_ca_pem(b"k" * 32, "ringd")), "box.local"))
    with pytest.raises(ssl.SSLCertVerificationError):
        asyncio.run(_handshake(server, tls.client_context(tls.TlsSettings("auto", "ringd", b"j" * 32)), "127.0.0.1"))


def test_users_files_that_cannot_be_used_are_named(tmp_path):
    a = tlsca.issue(tlsca.derive_ca(b"a" * 32, "x"), "n", ["localhost"], NOW)
    b = tlsca.issue(tlsca.derive_ca(b"a" * 32, "x"), "n", ["localhost"], NOW)
    (tmp_path / "cert.pem").write_bytes(a.cert_pem)
    (tmp_path / "key.pem").write_bytes(b.key_pem)
    (tmp_path / "junk.pem").write_bytes(b"not pem")
    def settings_(cert, key, ca=None):
        return tls.TlsSettings("cert", "x", b"a" * 32, str(tmp_path / cert), str(tmp_path / key), ca and str(tmp_path / ca))
    with pytest.raises(tls.TlsError, match="tls_cert and tls_key do not match"):
        tls.server_context(settings_("cert.pem", "key.pem"), "n", "h", [])
    with pytest.raises(tls.TlsError, match="tls_key: cannot read .*missing.pem"):
        tls.server_context(settings_("cert.pem", "missing.pem"), "n", "h", [])
    with pytest.raises(tls.TlsError, match="tls_cert / tls_key: cannot use"):
        tls.server_context(settings_("junk.pem", "key.pem"), "n", "h", [])
    with pytest.raises(tls.TlsError, match="tls_ca: .*junk.pem holds no PEM certificate"):
        tls.client_context(settings_("cert.pem", "key.pem", "junk.pem"))


def test_config_keys_choose_the_mode_and_refuse_what_contradicts(tmp_path):
    from ringd.node.config import ConfigError, load
    import argparse

    def cfg(**kw):
        return load(argparse.Namespace(**kw), environ={})

    assert cfg().tls_settings(b"s" * 16).mode == "off"
    assert cfg(tls="auto").tls_settings(b"s" * 16).scheme == "https"
    assert cfg(tls_cert="c.pem", tls_key="k.pem").tls_settings(b"s" * 16).mode == "cert"
    with pytest.raises(ConfigError, match="tls_cert is set but tls_key is not"):
        cfg(tls_cert="c.pem")
    with pytest.raises(ConfigError, match="tls: auto and tls_cert/tls_key"):
        cfg(tls="auto", tls_cert="c.pem", tls_key="k.pem")
    with pytest.raises(ConfigError, match="tls .*must be one of off, auto"):
        cfg(tls="on")


@settings(deadline=None)  # the first example imports aiohttp
@given(st.binary(max_size=300), st.sampled_from([b"Host", b"host", b"HOST"]), st.binary(max_size=80))
def test_the_400_echoes_a_host_only_when_it_is_a_plain_host_and_port(before, name, value):
    from ringd.http.tlslisten import asked_host, refusal

    host = asked_host(before + b"\r\n" + name + b": " + value + b"\r\n\r\n")
    assert host is None or (host.isascii() and all(c.isalnum() or c in ".:[]%-" for c in host) and 0 < len(host) <= 262)
    answer = refusal(host or "10.0.0.5:8100", "trust the cluster CA")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ") and int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0]) == len(body)


def test_the_host_a_client_asked_for_is_what_the_400_names():
    from ringd.http.tlslisten import asked_host

    assert asked_host(b"GET / HTTP/1.1\r\nHost: mini1.local:8100\r\nAccept: */*\r\n\r\n") == "mini1.local:8100"
    assert asked_host(b"GET / HTTP/1.1\r\nHost: <script>\r\n\r\n") is None


def test_the_https_listener_caps_connections_being_opened_with_those_served():
    """In one process on uvloop (the daemon's loop): one connection served, the next closed
    unanswered, a plain one answered with the 400 once there is room again."""
    import socket

    import uvloop
    from aiohttp import web

    from ringd.http.guard import ConnectionCap
    from ringd.http.tlslisten import TlsListener, bind

    s = tls.TlsSettings("auto", "ringd", b"k" * 32)

    async def until(condition) -> None:
        async def poll():
            while not condition():
                await asyncio.sleep(0.01)

        await asyncio.wait_for(poll(), 10)

    async def main():
        runner = web.AppRunner(web.Application())
        await runner.setup()
        listener = TlsListener(bind("127.0.0.1", 0), tls.server_context(s, "n1", "box", []), ConnectionCap(runner.server, cap=1), "trust it")
        task = asyncio.get_running_loop().create_task(listener.accept_loop())
        port = listener.sockets[0].getsockname()[1]
        try:
            r1, w1 = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port, ssl=tls.client_context(s)), 10)
            await until(lambda: len(runner.server.connections) == 1)  # served once the handshake is done
            r2, w2 = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 10)
            assert await asyncio.wait_for(r2.read(), 10) == b""  # closed without a word
            assert listener.guard.refused == 1
            w1.close()
            await until(lambda: not runner.server.connections)
            r3, w3 = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 10)
            w3.write(b"GET /health HTTP/1.1\r\nHost: box.local:8100\r\n\r\n")
            answer = await asyncio.wait_for(r3.read(), 10)
            assert answer.startswith(b"HTTP/1.1 400 ") and b"use https://box.local:8100/ (trust it)" in answer
            for w in (w2, w3):
                w.close()
        finally:
            task.cancel()
            listener.close()
            await runner.cleanup()

    uvloop.run(main())


def test_a_bare_name_left_out_of_the_certificate_is_said_quietly_a_public_address_loudly(caplog):
    s = tls.TlsSettings("auto", "ringd", b"k" * 32)
    with caplog.at_level(logging.INFO, logger=tls.log.name):
        tls.server_context(s, "mini1", "mini1", ["192.168.1.5", "8.8.8.8"])
    said = {(r.levelno, r.getMessage().split(" leaves out ")[1].split(":")[0]) for r in caplog.records if "leaves out" in r.getMessage()}
    assert said == {(logging.INFO, "mini1"), (logging.WARNING, "8.8.8.8")}, said
