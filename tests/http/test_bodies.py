"""Request bodies' budget, pace and inflating (ringd/http/bodies.py), in-process.

The real-process evidence (16 slow uploads beside a normal request, a gzip bomb through a ring)
is in test_guard.py; here the rules themselves, with Hypothesis over any order of bookings.
"""

from __future__ import annotations

import gzip
import struct
import time
import zlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ringd.http.bodies import (
    MAX_BODY_BYTES,
    MIN_UPLOAD_BYTES_PER_S,
    SMALL_BODY_BYTES,
    UPLOAD_GRACE_S,
    BODY_READ_TIMEOUT_S,
    BodyBudget,
    deadline_for,
    inflate,
)
from ringd.http.errors import ApiError

LIMIT, RESERVE, PER_CLIENT = 1000, 200, 400
SMALL = SMALL_BODY_BYTES  # the reserve takes bodies up to this size

# A step: (client, bytes to hold in all) for a new or grown booking, or None to release the oldest.
steps = st.lists(
    st.one_of(st.tuples(st.sampled_from("abc"), st.integers(1, 600)), st.none()),
    max_size=40,
)


@given(steps)
def test_no_pool_and_no_client_share_is_ever_exceeded_and_all_returns(script):
    budget = BodyBudget(limit=LIMIT, reserve=RESERVE, per_client=PER_CLIENT)
    held = []
    for step in script:
        if step is None:
            if held:
                held.pop(0).release()
        else:
            client, nbytes = step
            booking = budget.booking(client)
            try:
                booking.hold(nbytes)
                held.append(booking)
            except ApiError as e:
                assert e.status in (429, 503) and booking.held == 0
        assert budget.shared.held <= LIMIT and budget.reserve.held <= RESERVE
        assert all(v <= PER_CLIENT for v in budget.shared.clients.values())
        assert all(v <= RESERVE // 4 for v in budget.reserve.clients.values())
        assert budget.in_flight == sum(b.held for b in held)
    for b in held:
        b.release()
    assert budget.in_flight == 0 and budget.shared.clients == {} and budget.reserve.clients == {}


def test_small_bodies_have_room_whatever_large_ones_hold():
    budget = BodyBudget(limit=4 * MAX_BODY_BYTES, reserve=16 * SMALL, per_client=4 * MAX_BODY_BYTES)
    large = [budget.booking(f"10.0.0.{i}") for i in range(4)]
    for b in large:
        b.hold(MAX_BODY_BYTES)
    with pytest.raises(ApiError) as full:
        budget.booking("10.0.0.9").hold(MAX_BODY_BYTES)
    assert full.value.status == 503
    small = budget.booking("10.0.0.9")
    small.hold(200)  # the reserve's
    assert small.reserved == 200 and small.shared == 0


def test_one_address_gets_a_429_past_its_share_and_others_go_on():
    budget = BodyBudget(limit=10 * MAX_BODY_BYTES, reserve=16 * SMALL, per_client=2 * MAX_BODY_BYTES)
    for _ in range(2):
        budget.booking("10.0.0.1").hold(MAX_BODY_BYTES)
    with pytest.raises(ApiError) as mine:
        budget.booking("10.0.0.1").hold(MAX_BODY_BYTES)
    assert mine.value.status == 429 and mine.value.retry_after
    budget.booking("10.0.0.2").hold(MAX_BODY_BYTES)
    budget.booking("10.0.0.1").hold(200)  # its small requests still have the reserve


def test_a_body_grows_from_the_reserve_into_the_pool():
    budget = BodyBudget(limit=LIMIT * SMALL, reserve=8 * SMALL, per_client=LIMIT * SMALL)
    b = budget.booking("a")
    b.hold(SMALL)
    b.hold(3 * SMALL)  # a chunked body that turned out large
    assert (b.reserved, b.shared) == (SMALL, 2 * SMALL) and budget.in_flight == 3 * SMALL
    b.release()
    assert budget.in_flight == 0


@given(st.integers(0, MAX_BODY_BYTES))
def test_the_pace_gives_a_grace_then_a_second_per_minimum_rate_within_the_whole_deadline(received):
    started = 100.0
    deadline = deadline_for(received, started)
    assert started + UPLOAD_GRACE_S <= deadline <= started + BODY_READ_TIMEOUT_S
    assert deadline == min(started + UPLOAD_GRACE_S + received / MIN_UPLOAD_BYTES_PER_S, started + BODY_READ_TIMEOUT_S)


# --- inflating ---------------------------------------------------------------------------


def test_gzip_and_both_deflates_inflate():
    body = b'{"model": "m", "messages": []}' * 100
    assert inflate(gzip.compress(body)) == body
    assert inflate(zlib.compress(body)) == body
    raw = zlib.compressobj(6, zlib.DEFLATED, -15)
    assert inflate(raw.compress(body) + raw.flush()) == body


def gzip_bomb(inflated_mib: int) -> bytes:
    """``inflated_mib`` MiB of zeros as one valid gzip member, about a thousandth of that on the
    wire, made in a fraction of a second: after a full flush each MiB of zeros deflates to the
    same bytes, so one is repeated; only the trailer's CRC needs every byte."""
    zeros = bytes(1 << 20)
    z = zlib.compressobj(9, zlib.DEFLATED, 16 + 15)
    first = z.compress(zeros) + z.flush(zlib.Z_FULL_FLUSH)
    again = z.compress(zeros) + z.flush(zlib.Z_FULL_FLUSH)
    end = z.flush()[:-8]  # the last (empty) block; the trailer is the whole body's
    crc = 0
    for _ in range(inflated_mib):
        crc = zlib.crc32(zeros, crc)
    return first + again * (inflated_mib - 1) + end + struct.pack("<II", crc, (inflated_mib << 20) & 0xFFFFFFFF)


def test_the_bomb_is_a_valid_gzip_of_what_it_says():
    bomb = gzip_bomb(64)
    assert zlib.decompress(bomb, 16 + 15) == bytes(64 << 20)


def test_a_bomb_stops_at_the_cap_cheaply():
    bomb = gzip_bomb(1024)  # 1 GiB of zeros
    assert len(bomb) < 2 * 2**20
    t0 = time.process_time()
    with pytest.raises(ApiError) as e:
        inflate(bomb)
    # The CPU it took is a figure (inflating 16 MiB: tens of milliseconds), not a bound.
    print(f"\na {len(bomb)}-byte gzip bomb refused after {time.process_time() - t0:.3f} s of CPU")
    assert e.value.status == 413 and str(MAX_BODY_BYTES) in e.value.message


@pytest.mark.parametrize("bad, words", [(b"not gzip at all", "not valid gzip"), (gzip.compress(b"{}" * 1000, mtime=0)[:-20], "cut short")], ids=["not-gzip", "cut"])
def test_bad_or_cut_codings_are_a_400(bad, words):
    with pytest.raises(ApiError) as e:
        inflate(bad)
    assert e.value.status == 400 and words in e.value.message
