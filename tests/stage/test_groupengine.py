"""ringd.stage.groupengine: which collective a group runs, from its members' offers.

RDMA cannot exist on Linux, so jaccl is chosen here only from offers that say a Mac has it;
what a Mac offers comes from MLX's own availability check (asserted below against this
machine's MLX), and the device file the choice writes is the one MLX's jaccl parses.
"""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ringd.stage.groupproc import backend_env, jaccl_available
from ringd.stage.groupengine import ENGINES, JACCL, MLX_RING, OFFER_BYTES, RINGD, EngineError, Offer, choose


def rdma_pair(wanted: str = "auto") -> list[Offer]:
    return [
        Offer("mini1", wanted, True, {"mini2": "rdma_en3"}, "10.0.0.1:5001"),
        Offer("mini2", "auto", True, {"mini1": "rdma_en5"}, "10.0.0.2:5002"),
    ]


def test_rdma_on_every_member_runs_jaccl_with_its_device_file(tmp_path):
    choice = choose(rdma_pair())
    assert choice.engine == JACCL and choice.in_process
    assert choice.devices == ((None, "rdma_en3"), ("rdma_en5", None))
    env, files = backend_env(choice, 1)
    # What MLX's jaccl reads (mlx/distributed/jaccl: rank, devices[rank][peer], rank 0's listener).
    assert env["MLX_RANK"] == "1" and env["MLX_JACCL_COORDINATOR"] == "10.0.0.1:5001"
    assert json.loads(open(env["MLX_IBV_DEVICES"]).read()) == [[None, "rdma_en3"], ["rdma_en5", None]]
    for f in files:
        f.unlink()


def test_without_rdma_auto_runs_ringd_and_says_which_mac_lacks_what():
    a, b = rdma_pair()
    c = choose([a, Offer("mini2", "auto", False, {"mini1": "rdma_en5"})])
    assert c.engine == RINGD and not c.in_process and "mini2 has no RDMA" in c.why
    c = choose([a, Offer("mini2", "auto", True, {})])
    assert c.engine == RINGD and "mini2 names no RDMA device toward mini1" in c.why
    with pytest.raises(EngineError, match="tensor_engine is jaccl, but mini2 has no RDMA"):
        choose([Offer("mini1", JACCL, True, {"mini2": "rdma_en3"}), Offer("mini2", "auto", False)])
    # A first member with no address its process could listen on (an advertised name not its own).
    c = choose([Offer("mini1", "auto", True, {"mini2": "rdma_en3"}), b])
    assert c.engine == RINGD and "mini1 has no address" in c.why
    with pytest.raises(EngineError, match="mini1 has no address a group process can listen on"):
        choose([Offer("mini1", MLX_RING), b])


def test_the_first_members_setting_is_the_groups():
    a, b = rdma_pair()
    for wanted in (RINGD, MLX_RING):
        offers = [Offer(a.node, wanted, a.jaccl, a.rdma, a.addr), Offer(b.node, "jaccl", b.jaccl, b.rdma, b.addr)]
        assert choose(offers).engine == wanted
    env, files = backend_env(choose([Offer(a.node, MLX_RING, addr=a.addr), Offer(b.node, addr=b.addr)]), 0)
    assert json.loads(open(env["MLX_HOSTFILE"]).read()) == [["10.0.0.1:5001"], ["10.0.0.2:5002"]] and env["MLX_RANK"] == "0"
    for f in files:
        f.unlink()


def test_this_macs_offer_is_mlx_s_own_check():
    assert jaccl_available() is mx.distributed.is_available("jaccl")
    assert jaccl_available() is False, "Linux has no RDMA: a group here never chooses jaccl by itself"


offers = st.builds(
    Offer,
    st.from_regex(r"[a-z][a-z0-9-]{0,20}", fullmatch=True),
    st.sampled_from(ENGINES),
    st.booleans(),
    st.dictionaries(st.from_regex(r"[a-z][a-z0-9]{0,10}", fullmatch=True), st.from_regex(r"rdma_en[0-9]{1,2}", fullmatch=True), max_size=15),
    st.from_regex(r"10\.0\.0\.[0-9]{1,3}:[0-9]{4,5}", fullmatch=True),
)


@given(offers)
def test_an_offer_travels_as_it_was_made(offer):
    raw = offer.to_bytes()
    assert len(raw) == OFFER_BYTES and Offer.from_bytes(raw, offer.node) == offer


@given(st.binary(max_size=OFFER_BYTES))
def test_an_offer_that_does_not_parse_is_an_error_naming_its_member(raw):
    try:
        offer = Offer.from_bytes(raw, "mini2")
    except EngineError as e:
        assert "mini2" in str(e)
    else:
        assert offer.node == "mini2"


def test_an_offer_that_lies_about_its_member_or_its_devices_is_refused():
    with pytest.raises(EngineError, match="not mini2's"):
        Offer.from_bytes(Offer("mini1").to_bytes(), "mini2")
    with pytest.raises(EngineError, match="not device names"):
        Offer.from_bytes(Offer("mini2", rdma={"mini1": "../../etc/passwd"}).to_bytes(), "mini2")
    with pytest.raises(EngineError, match="over 4096"):
        Offer("mini2", rdma={f"peer{i}": "rdma_en1" for i in range(300)}).to_bytes()
