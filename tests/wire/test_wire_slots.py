"""wire.slots: who holds a listener's handshake slots, as pure functions.

The same over real sockets is in test_wire_stream.py.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wire.slots import HandshakeSlots, SlotLimits, canonical_host

LIMITS = SlotLimits(strangers=4, per_stranger_host=2, known=3)


def test_strangers_are_refused_over_the_caps_and_let_in_as_slots_free():
    slots = HandshakeSlots(LIMITS)
    assert slots.admit("a1", "10.0.0.1", False).admitted
    assert slots.admit("a2", "10.0.0.1", False).admitted
    assert not slots.admit("a3", "10.0.0.1", False).admitted  # per address
    assert slots.admit("b1", "10.0.0.2", False).admitted
    assert slots.admit("c1", "10.0.0.3", False).admitted
    assert not slots.admit("d1", "10.0.0.4", False).admitted  # in total
    slots.release("b1")
    assert slots.admit("d1", "10.0.0.4", False).admitted
    assert slots.held(known=False) == 4


def test_a_known_address_is_never_refused_however_full_the_strangers_pool_is():
    slots = HandshakeSlots(LIMITS)
    for i in range(4):
        slots.admit(f"s{i}", f"10.0.0.{i}", False)
    assert not slots.admit("late stranger", "10.0.0.9", False).admitted
    admission = slots.admit("member", "10.0.1.1", True)
    assert admission.admitted and admission.evict is None
    assert slots.held(known=True) == 1 and slots.held(known=False) == 4


def test_a_full_known_pool_evicts_the_oldest_of_the_address_holding_the_most():
    slots = HandshakeSlots(LIMITS)
    # An attacker on a member's address (one NAT) fills the pool with stalled HELLOs.
    for i in range(3):
        assert slots.admit(f"flood{i}", "10.0.1.1", True).evict is None
    # The member behind the same address dials: the attacker's oldest makes room.
    assert slots.admit("member dial", "10.0.1.1", True).evict == "flood0"
    # Another member arrives: the address holding the most (the attacker's) pays again.
    assert slots.admit("other member", "10.0.1.2", True).evict == "flood1"
    # The flood goes on: its own connections go first, never the other address's one.
    assert slots.admit("flood3", "10.0.1.1", True).evict == "flood2"
    assert slots.admit("flood4", "10.0.1.1", True).evict == "member dial"  # its oldest by now
    assert slots.held_from("10.0.1.2") == 1
    slots.release("flood0")  # evicted already: nothing happens
    assert slots.held(known=True) == 3


def test_among_addresses_holding_equally_many_the_arriving_one_pays_first_then_the_oldest():
    slots = HandshakeSlots(SlotLimits(strangers=1, per_stranger_host=1, known=4))
    for key in ["a1", "b1", "a2", "b2"]:
        slots.admit(key, {"a": "10.0.0.1", "b": "10.0.0.2"}[key[0]], True)
    assert slots.admit("b3", "10.0.0.2", True).evict == "b1"  # its own address, though a1 is older
    assert slots.admit("c1", "10.0.0.3", True).evict == "a1"  # a and b hold 2 each: a's is oldest


def test_canonical_host_spells_one_address_one_way():
    assert canonical_host("::ffff:192.168.1.20") == "192.168.1.20"  # a dual-stack listener's view
    assert canonical_host("2001:DB8:0:0::1") == "2001:db8::1"
    assert canonical_host("fe80::1%en0") == "fe80::1%en0"
    assert canonical_host("10.0.0.1") == "10.0.0.1"
    assert canonical_host("Mac-Mini.local") == "mac-mini.local"


@pytest.mark.parametrize("limits", [(0, 0, 1), (4, 5, 1), (4, 2, 0)])
def test_impossible_limits_are_refused(limits):
    with pytest.raises(ValueError, match="slot limits"):
        SlotLimits(*limits)


# Arrivals from a few addresses, known or not as each arrives (trust can change
# while connections wait), and handshakes ending in any order.
HOSTS = [f"10.0.0.{i}" for i in range(4)]
ops = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), st.sampled_from(HOSTS), st.booleans()),
        st.tuples(st.just("release"), st.integers(0, 60), st.none()),
    ),
    max_size=60,
)
limits = st.builds(
    lambda strangers, per_host, known: SlotLimits(strangers, min(per_host, strangers), known),
    st.integers(1, 5),
    st.integers(1, 5),
    st.integers(1, 5),
)


@settings(max_examples=500)  # a millisecond each
@given(limits, ops)
def test_the_slots_stay_bounded_and_evict_only_from_the_address_holding_the_most(limits, ops):
    slots = HandshakeSlots(limits)
    held: dict[int, tuple[str, bool]] = {}  # key -> (host, known): a reference model
    next_key = 0
    for op, arg, known in ops:
        if op == "release":
            slots.release(arg)  # held, evicted, refused or never seen: all fine
            held.pop(arg, None)
        else:
            host, key = arg, next_key
            next_key += 1
            strangers = [h for h, k in held.values() if not k]
            known_hosts = [h for h, k in held.values() if k]
            admission = slots.admit(key, host, known)
            if not known:
                fits = (
                    len(strangers) < limits.strangers
                    and strangers.count(host) < limits.per_stranger_host
                )
                assert admission.admitted == fits and admission.evict is None
            else:
                assert admission.admitted  # a member's address is never refused
                full = len(known_hosts) >= limits.known
                assert (admission.evict is not None) == full
                if full:
                    victim_host, victim_known = held[admission.evict]
                    assert victim_known
                    # Only from an address holding at least as many as the arriving one,
                    assert known_hosts.count(victim_host) >= known_hosts.count(host)
                    # and the arriving one's own when it holds as many,
                    if known_hosts.count(host) == max(map(known_hosts.count, known_hosts)):
                        assert victim_host == host
                    # and that address's oldest (keys grow with arrival).
                    ages = [k for k, (h, kn) in held.items() if kn and h == victim_host]
                    assert admission.evict == min(ages)
                    del held[admission.evict]
            if admission.admitted:
                held[key] = (host, known)
        from_strangers = [h for h, k in held.values() if not k]
        assert slots.held(known=False) == len(from_strangers) <= limits.strangers
        assert slots.held(known=True) == len(held) - len(from_strangers) <= limits.known
        for host in HOSTS:
            assert from_strangers.count(host) <= limits.per_stranger_host
            assert slots.held_from(host) == sum(1 for h, _ in held.values() if h == host)
