"""ringd.base.names: one rule for names and addresses, wherever they come from."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ringd.base.names import check_host, check_name, check_port, natural_key, parse_hostport


def test_node_names_sort_as_people_count():
    assert sorted(["node10", "node2", "node1"], key=natural_key) == ["node1", "node2", "node10"]
    assert sorted(["mini-b", "mini-a2", "mini-a10"], key=natural_key) == ["mini-a2", "mini-a10", "mini-b"]


def test_addresses_parse_or_say_what_is_wrong():
    assert parse_hostport("192.168.1.20:50051") == ("192.168.1.20", 50051)
    assert parse_hostport("[fe80::1]:8100") == ("fe80::1", 8100)
    for bad, says in [("mini.local:50051", "IP address"), ("10.0.0.1", "IP:PORT"), ("10.0.0.1:http", "port"), ("10.0.0.1:70000", "port"), (7, "IP:PORT")]:
        with pytest.raises(ValueError, match=says):
            parse_hostport(bad)
    assert check_port(0) == 0 and check_host("::1") == "::1"
    with pytest.raises(ValueError):
        check_port(True)


@given(st.text(max_size=80))
def test_a_name_is_taken_whole_or_refused(v):
    try:
        assert check_name(v) == v
    except ValueError:
        return
    assert 1 <= len(v) <= 63 and v[0].isascii() and v[0].isalnum()
