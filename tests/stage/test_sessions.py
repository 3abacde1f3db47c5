"""ringd.stage.sessions: requests' caches merged into a group for batched decode, and given back whole.

Real mlx-lm KVCaches holding random keys and values of different lengths: a
group is kept while the same requests come in the same order, rebuilt for any
other, and a request that leaves it (released, kept as a prefix, stepping alone,
expired) takes exactly its own positions back.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache

from ringd.stage.sessions import Sessions

LAYERS, HEADS, DIM = 2, 2, 4


def filled(n: int, seed: int) -> tuple[list[KVCache], list[mx.array]]:
    caches, keys = [], []
    for layer in range(LAYERS):
        c = KVCache()
        k = mx.random.normal((1, HEADS, n, DIM), key=mx.random.key(seed * 10 + layer))
        c.update_and_fetch(k, -k)
        caches.append(c)
        keys.append(k)
    return caches, keys


def open_three(sessions: Sessions) -> dict[int, list[mx.array]]:
    keys = {}
    for rid, n in ((1, 3), (2, 7), (3, 5)):
        cache, keys[rid] = filled(n, rid)
        sessions.open(rid, cache, None, tokens=list(range(n)))
    return keys


def positions(c: KVCache) -> mx.array:
    """The keys of the positions a cache holds (its buffer grows in steps past them)."""
    return c.keys[..., : c.offset, :]


def own_keys(sessions: Sessions, rid: int) -> list[mx.array]:
    return [positions(c) for c in sessions.solo(rid).cache]


def test_the_same_rows_in_the_same_order_keep_their_group():
    sessions = Sessions()
    open_three(sessions)
    first = sessions.batched((1, 2, 3))
    assert first is not None and sessions.batched((1, 2, 3)) is first
    assert sessions.batched((2, 1, 3)) is not first  # another order: regrouped
    assert sessions.batched((2, 3)) is not None


def test_a_request_leaving_its_group_takes_its_own_positions_back():
    sessions = Sessions()
    keys = open_three(sessions)
    sessions.batched((1, 2, 3))
    for rid in (2, 1):  # out of a group of three, then the last two part
        for got, want in zip(own_keys(sessions, rid), keys[rid]):
            assert mx.array_equal(got, want), rid
    for got, want in zip(own_keys(sessions, 3), keys[3]):
        assert mx.array_equal(got, want)


def test_release_keep_and_expiry_of_a_grouped_request():
    sessions = Sessions(idle_timeout_s=10)
    keys = open_three(sessions)
    group = sessions.batched((1, 2, 3))
    assert sessions.kv_bytes == sum(c.nbytes for c in group)  # the group's bytes, counted once
    sessions.release(2)
    assert sessions.batched((1, 3)) is group  # filtered in place: the others stay batched
    assert sessions.keep(1)  # kept as a prefix: its own caches, trimmed to a prefix later
    stored = sessions.take(1, 2)
    assert mx.array_equal(positions(stored.cache[0]), keys[1][0][:, :, :2])
    assert [s.request_id for s in sessions.expire(now=sessions.get(3).last_used + 11)] == [3]
    assert len(sessions) == 0 and sessions.kv_bytes == 0


def rotating(keep: int = 0) -> RotatingKVCache:
    cache = RotatingKVCache(max_size=8, keep=keep)
    cache.update_and_fetch(mx.zeros((1, HEADS, 2, DIM)), mx.zeros((1, HEADS, 2, DIM)))
    return cache


def test_caches_of_other_kinds_are_not_merged():
    sessions = Sessions()
    open_three(sessions)
    sessions.open(4, [rotating(), rotating()], None, tokens=[0, 0])
    sessions.open(5, [rotating(), rotating()], None, tokens=[0, 0])
    # max_kv_size's rotating cache keeps its first positions: BatchRotatingKVCache does not.
    sessions.open(6, [rotating(keep=4), rotating(keep=4)], None, tokens=[0, 0])
    assert sessions.batched((1, 4)) is None
    assert sessions.batched((4, 6)) is None
    assert sessions.batched((1, 2)) is not None
    assert sessions.batched((4, 5)) is not None  # sliding windows merge among themselves


def test_requests_whose_caches_are_quantized_later_are_not_merged():
    from ringd.ring.steps import KvOptions

    sessions = Sessions()
    open_three(sessions)
    cache, _ = filled(4, 9)
    sessions.open(4, cache, None, tokens=[0] * 4, kv=KvOptions(bits=4, start=100))
    assert sessions.batched((1, 4)) is None
