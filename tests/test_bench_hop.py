"""tools/bench-hop: each way of building a node passes the message round a ring, and the figures
come from every process of it (CPU and context switches), not from the timing process alone."""

import pytest
from devkit.toolscript import load

bench_hop = load("bench-hop")


@pytest.mark.parametrize("design", bench_hop.DESIGNS)
def test_a_message_goes_round_a_ring_of_three_in_each_design(design):
    cpu_us, wall_us, switches = bench_hop.ring(design, 3, 50, 64)
    # Three processes each wait for the message once per trip: at least that many switches.
    assert cpu_us > 0 and wall_us > 0 and switches >= 3, (cpu_us, wall_us, switches)


def test_the_slope_is_least_squares():
    assert bench_hop.slope([2, 3, 4], [10.0, 13.0, 16.0]) == pytest.approx(3.0)
    assert bench_hop.slope([2, 4], [5.0, 5.0]) == 0
