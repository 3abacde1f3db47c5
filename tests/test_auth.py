"""ringd.auth: API keys and requests signed with the cluster secret, as pure functions.

(The same rules on real daemons, with the openai client and ringctl, are in
tests/test_api_auth.py.)
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ringd.auth import (
    NONCE_HEADER,
    REPLAY_WINDOW_S,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    AuthError,
    ControlAuth,
    check_api_key,
    sign,
)

SECRET = b"s" * 32
NOW = 1_800_000_000.0


def test_a_signed_request_passes_once_and_only_for_its_node_path_body_and_secret():
    auth = ControlAuth(SECRET, "node1")
    headers = sign(SECRET, "POST", "/cluster/drain", "node1", b'{"node": "node2"}', NOW)
    auth.verify("POST", "/cluster/drain", headers, b'{"node": "node2"}', NOW + 1)
    with pytest.raises(AuthError, match="already used") as e:
        auth.verify("POST", "/cluster/drain", headers, b'{"node": "node2"}', NOW + 2)
    assert e.value.status == 401
    for method, path, node, body, secret in [
        ("POST", "/cluster/leader", "node1", b'{"node": "node2"}', SECRET),  # another route
        ("POST", "/cluster/drain", "node1", b'{"node": "node3"}', SECRET),  # another body
        ("POST", "/cluster/drain", "node1", b'{"node": "node2"}', b"t" * 32),  # another secret
    ]:
        fresh = sign(secret, method, path, node, body, NOW)
        with pytest.raises(AuthError) as e:
            auth.verify("POST", "/cluster/drain", fresh, b'{"node": "node2"}', NOW)
        assert e.value.status == 403
    other = sign(SECRET, "POST", "/cluster/drain", "node2", b"{}", NOW)
    with pytest.raises(AuthError, match="signed for node 'node2'"):
        auth.verify("POST", "/cluster/drain", other, b"{}", NOW)


def test_stale_missing_and_malformed_signatures():
    auth = ControlAuth(SECRET, "node1")
    old = sign(SECRET, "POST", "/cluster/leader", "node1", b"{}", NOW - REPLAY_WINDOW_S - 5)
    with pytest.raises(AuthError, match="clock") as e:
        auth.verify("POST", "/cluster/leader", old, b"{}", NOW)
    assert e.value.status == 401
    with pytest.raises(AuthError, match="ringctl --secret-file") as e:
        auth.verify("POST", "/cluster/leader", {}, b"{}", NOW)
    assert e.value.status == 401
    bad = {**sign(SECRET, "POST", "/cluster/leader", "node1", b"{}", NOW), NONCE_HEADER: "zz"}
    with pytest.raises(AuthError, match="malformed"):
        auth.verify("POST", "/cluster/leader", bad, b"{}", NOW)


def test_replays_are_remembered_for_the_window_then_forgotten():
    auth = ControlAuth(SECRET, "n")
    first = sign(SECRET, "POST", "/p", "n", b"", NOW)
    auth.verify("POST", "/p", first, b"", NOW)
    for i in range(1, 50):
        t = NOW + 10 * i
        auth.verify("POST", "/p", sign(SECRET, "POST", "/p", "n", b"", t), b"", t)
    assert len(auth._seen) <= REPLAY_WINDOW_S / 10 + 1  # nonces older than the window are dropped


@given(st.dictionaries(st.sampled_from([TIMESTAMP_HEADER, NONCE_HEADER, SIGNATURE_HEADER, "X-Ringd-Node"]), st.text(max_size=80)), st.binary(max_size=64))
def test_arbitrary_headers_raise_only_auth_errors(headers, body):
    try:
        ControlAuth(SECRET, "n").verify("POST", "/cluster/drain", headers, body, NOW)
    except AuthError as e:
        assert e.status in (401, 403)
    else:
        raise AssertionError("arbitrary headers must not pass")


def test_api_keys():
    keys = frozenset({"k" * 20, "another-key-0123456789"})
    check_api_key(None, frozenset())  # no keys configured: open
    check_api_key("Bearer " + "k" * 20, keys)
    check_api_key("Bearer another-key-0123456789", keys)
    for header in (None, "", "Basic abc", "Bearer", "Bearer " + "k" * 19, "Bearer kkkk"):
        with pytest.raises(AuthError) as e:
            check_api_key(header, keys)
        assert e.value.status == 401 and "k" * 10 not in str(e.value)
    assert SIGNATURE_HEADER.startswith("X-Ringd-")
