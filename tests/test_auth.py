"""ringd.security.auth: API keys and requests signed with the cluster secret, as pure functions.

(The same rules on real daemons, with the openai client and ringctl, are in
tests/http/test_api_auth.py.)
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ringd.security.auth import (
    FORWARD_NONCE_HEADER,
    FORWARD_SIGNATURE_HEADER,
    FORWARD_TIMESTAMP_HEADER,
    FORWARDED_BY_HEADER,
    FORWARDED_TO_HEADER,
    MAX_REMEMBERED_NONCES,
    NODE_HEADER,
    NONCE_HEADER,
    REPLAY_WINDOW_S,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    AuthError,
    ControlAuth,
    ForwardAuth,
    body_sha256,
    check_api_key,
    sign,
    sign_forward,
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


def test_a_request_signed_ahead_of_time_is_refused_when_replayed_after_the_window():
    """Signed 55 s in the future, sent at once, replayed 62 s later: its nonce is remembered until
    its own timestamp leaves the window, not for a window from when it was first seen."""
    auth = ControlAuth(SECRET, "n")
    body = b'{"node": "b"}'
    ahead = sign(SECRET, "POST", "/cluster/leader", "n", body, NOW + 55)
    auth.verify("POST", "/cluster/leader", ahead, body, NOW)
    for later in (NOW + 30, NOW + 62, NOW + 55 + REPLAY_WINDOW_S):
        with pytest.raises(AuthError, match="already used") as e:
            auth.verify("POST", "/cluster/leader", ahead, body, later)
        assert e.value.status == 401
    # Once the nonce is forgotten, the timestamp is out of the window: stale, and said so.
    with pytest.raises(AuthError, match=r"is 61 s behind this node's clock; the window is 60 s") as e:
        auth.verify("POST", "/cluster/leader", ahead, body, NOW + 55 + REPLAY_WINDOW_S + 1)


@pytest.mark.parametrize("signed_at, now, said", [(75, 0, "75 s ahead of"), (-75, 0, "75 s behind"), (61, 0.5, "61 s ahead of")])
def test_a_timestamp_outside_the_window_is_refused_with_the_offset_seen(signed_at, now, said):
    auth = ControlAuth(SECRET, "n")
    headers = sign(SECRET, "POST", "/p", "n", b"", NOW + signed_at)
    with pytest.raises(AuthError) as e:
        auth.verify("POST", "/p", headers, b"", NOW + now)
    assert e.value.status == 401
    assert str(e.value) == f"the request's timestamp is {said} this node's clock; the window is 60 s: check the clocks (NTP)"
    assert not auth._seen  # refused before its nonce is remembered
    auth.verify("POST", "/p", sign(SECRET, "POST", "/p", "n", b"", NOW + REPLAY_WINDOW_S), b"", NOW)  # the edge passes


def test_remembered_nonces_stay_bounded_and_the_first_due_go_first():
    auth = ControlAuth(SECRET, "n", max_nonces=3)
    for i, t in enumerate([NOW + 50, NOW - 50, NOW, NOW + 10]):
        auth.verify("POST", "/p", sign(SECRET, "POST", "/p", "n", b"", t), b"", NOW)
    assert sorted(auth._seen.values()) == [NOW + REPLAY_WINDOW_S, NOW + 10 + REPLAY_WINDOW_S, NOW + 50 + REPLAY_WINDOW_S]
    assert MAX_REMEMBERED_NONCES >= 1000


def test_a_forward_is_proven_for_its_leader_by_its_follower_once():
    body = b'{"model": "tiny", "stream": true}'
    leader = ForwardAuth(SECRET, "node0")
    headers = sign_forward(SECRET, "POST", "/v1/chat/completions", "node1", "node0", body_sha256(body), NOW)
    assert headers[FORWARDED_BY_HEADER] == "node1" and headers[FORWARDED_TO_HEADER] == "node0"
    assert leader.verify("POST", "/v1/chat/completions", headers, body, NOW + 1) == "node1"
    with pytest.raises(AuthError, match="already used"):
        leader.verify("POST", "/v1/chat/completions", headers, body, NOW + 2)
    # Another body (a client's own ringd_resume), another follower's name, another secret: 403.
    fresh = sign_forward(SECRET, "POST", "/v1/chat/completions", "node1", "node0", body_sha256(body), NOW)
    for changed in (
        {**fresh, FORWARDED_BY_HEADER: "node2"},
        sign_forward(b"t" * 32, "POST", "/v1/chat/completions", "node1", "node0", body_sha256(body), NOW),
    ):
        with pytest.raises(AuthError, match="forwarding proof does not match") as e:
            leader.verify("POST", "/v1/chat/completions", changed, body, NOW)
        assert e.value.status == 403
    with pytest.raises(AuthError, match="does not match"):
        leader.verify("POST", "/v1/chat/completions", fresh, body + b" ", NOW)
    # Meant for another leader (a follower whose view is behind): refused here, saying so.
    other = sign_forward(SECRET, "POST", "/v1/chat/completions", "node1", "node2", body_sha256(body), NOW)
    with pytest.raises(AuthError, match="forwarded to node 'node2', but this is node0") as e:
        leader.verify("POST", "/v1/chat/completions", other, body, NOW)
    assert e.value.status == 403
    # A client that sends the header alone is told it is not for clients.
    with pytest.raises(AuthError, match="a client must not send it") as e:
        leader.verify("POST", "/v1/chat/completions", {FORWARDED_BY_HEADER: "node1"}, body, NOW)
    assert e.value.status == 401


def test_a_forwarding_proof_is_never_a_control_signature_nor_the_other_way_round():
    body = b'{"node": "node1"}'
    forward = sign_forward(SECRET, "POST", "/cluster/drain", "node1", "node0", body_sha256(body), NOW)
    control = sign(SECRET, "POST", "/cluster/drain", "node0", body, NOW)
    # The same values under the other scheme's headers.
    as_control = {
        NODE_HEADER: forward[FORWARDED_TO_HEADER], TIMESTAMP_HEADER: forward[FORWARD_TIMESTAMP_HEADER],
        NONCE_HEADER: forward[FORWARD_NONCE_HEADER], SIGNATURE_HEADER: forward[FORWARD_SIGNATURE_HEADER],
    }  # fmt: skip
    as_forward = {
        FORWARDED_BY_HEADER: "node1", FORWARDED_TO_HEADER: control[NODE_HEADER], FORWARD_TIMESTAMP_HEADER: control[TIMESTAMP_HEADER],
        FORWARD_NONCE_HEADER: control[NONCE_HEADER], FORWARD_SIGNATURE_HEADER: control[SIGNATURE_HEADER],
    }  # fmt: skip
    with pytest.raises(AuthError) as e:
        ControlAuth(SECRET, "node0").verify("POST", "/cluster/drain", as_control, body, NOW)
    assert e.value.status == 403
    with pytest.raises(AuthError) as e:
        ForwardAuth(SECRET, "node0").verify("POST", "/cluster/drain", as_forward, body, NOW)
    assert e.value.status == 403
    # Both headers sets on one request: each verifier reads its own.
    both = {**forward, **control}
    ControlAuth(SECRET, "node0").verify("POST", "/cluster/drain", both, body, NOW)
    assert ForwardAuth(SECRET, "node0").verify("POST", "/cluster/drain", both, body, NOW) == "node1"


@given(
    st.dictionaries(
        st.sampled_from([FORWARD_TIMESTAMP_HEADER, FORWARD_NONCE_HEADER, FORWARD_SIGNATURE_HEADER, FORWARDED_BY_HEADER, FORWARDED_TO_HEADER]),
        st.text(max_size=80),
    ),
    st.binary(max_size=64),
)
def test_arbitrary_forwarding_headers_raise_only_auth_errors(headers, body):
    try:
        ForwardAuth(SECRET, "n").verify("POST", "/v1/chat/completions", headers, body, NOW)
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


def test_the_bearer_scheme_is_any_case_and_odd_bytes_are_refused_never_raised():
    """RFC 7235 section 2.1: the scheme is case-insensitive. A byte aiohttp could not decode
    arrives as a lone surrogate; it once raised UnicodeEncodeError here (a 500 on /health)."""
    keys = frozenset({"k" * 20})
    for header in ("bearer " + "k" * 20, "BEARER " + "k" * 20, "  Bearer   " + "k" * 20 + "  "):
        check_api_key(header, keys)
    for header in ("Bearer \udcff", "Bearer " + "k" * 20 + "\udcff", "\udcff" * 3, "bearer", "Bearerkkkkkkkkkkkkkkkkkkkk"):
        with pytest.raises(AuthError) as e:
            check_api_key(header, keys)
        assert e.value.status == 401 and "k" * 10 not in str(e.value)
